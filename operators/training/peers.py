"""Where a registered definition intentionally differs from the verl / AReaL one it names, and how to
get the peer's (tests/test_peer_definitions.py checks each peer definition against flowrl's, on the
settings given here). Keys are "concept:name" as `flowrl algorithms` lists them; docs/algorithms.md
links here.
"""

from __future__ import annotations

DIFFERENCES: dict[str, str] = {
    "loss:ppo_clip": "no dual clip unless dual_clip is set (verl always applies clip_ratio_c 3.0); log ratio "
                     "clamped to +-20 as verl (AReaL: none, max_log_ratio: null)",
    "loss:gspo": "aggregates token_mean unless told (verl forces seq_mean_token_mean)",
    "loss:sapo": "aggregates token_mean unless told (verl forces seq_mean_token_mean); the +-20 log-ratio "
                 "clamp is verl's (AReaL: none, max_log_ratio: null; level sequence clamps the mean)",
    "loss:geo_mean": "the mean over sequences counts those with a loss token, rejected or not (verl's "
                     "torch.mean also counts a row that had no loss token at all, as 0)",
    "loss:reinforce_bypass": "verl bypass_mode's rollout_rs is a correction (tis with reject checks, "
                             "normalise: kept); its weights and rejection come from a no-grad pass of the "
                             "current policy before every epoch (verl: inside the forward pass), the same "
                             "values with one optimizer step per epoch",
    "loss:dppo_tv": "surrogate ratio with kl_coef 1e-3 and max_log_ratio null is prime-rl's loss (verl's "
                    "is log_prob); the Top-K approximation is dppo_tv_topk",
    "loss:dppo_kl": "as dppo_tv (Top-K: dppo_kl_topk)",
    "loss:dppo_tv_topk": "the divergence is of softmax(logits / temperature) before top-k / top-p (TRL: "
                         "whatever its vLLM logprobs report); no correction (only the behaviour "
                         "policy's top-K is recorded); a ratio truncated at truncation (TRL: clip_ratio_c "
                         "on the log ratio, the same value)",
    "loss:dppo_kl_topk": "as dppo_tv_topk",
    "correction:tis": "masked tokens count in N and S unless normalise: kept (verl's rejection shrinks "
                      "the mask the aggregation reads)",
    "correction:mis": "as tis (AReaL's convention by default); level sequence is the product of the "
                      "token weights (AReaL's sequence ratio is the geometric mean: `geometric`)",
    "correction:geometric": "as tis",
    "correction:reject": "as tis; checks take verl's sign of r unless sign: areal (AReaL's kl_k1 / kl_k3 "
                         "metrics, r unclamped); sequence means divide by max(n, 1) (verl: n + 1e-8); "
                         "weight 1 on kept tokens (AReaL's mask mode keeps the raw ratio: tis with a large "
                         "threshold and these checks as its reject gives that)",
    "kl:k3": "clamps of verl's low_var_kl (d to +-20, estimate at most 10); AReaL clamps every estimator "
             "to +-10 and d not at all",
    "aggregation:seq_mean_token_sum_norm": "norm_length is required (verl defaults to the padded "
                                           "response width, which packed rows do not have)",
    "advantage:grpo": "normalises each defined reward (per turn / token too); returns are the raw "
                      "reward-to-go (verl returns the advantages)",
    "advantage:rloo": "a group of one keeps its raw reward (verl rloo; rloo_vectorized gives 0)",
}
