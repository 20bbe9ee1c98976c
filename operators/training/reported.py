"""The names a built-in train node's step reports (`Train.reported_metrics`), for `run.stop_when`'s
`train.<key>`: `flowrl validate` refuses a key no step would report. Any metric of a step comes from
one of these places: the loss (losses/__init__.py: its own and `token_metrics`), the trainer's
forward/backward (token and sequence counts) and optimizer step (grad norm, lr, skipped steps,
gradient alignment), and the train operator (reward means, trajectories, policy KL, tied groups,
thread count). A loss or training engine a plugin registers may report others: then nothing is
declared (None), and validate checks nothing. tests/test_reported_metrics.py holds a run's
reports to this list. ROLES says which of them plays which part in the learning health
(`Train.metric_roles`, flowrl/health.py).
"""

from __future__ import annotations

from typing import Any

from flowrl.operator import MetricRoles

LOSS = ("policy_loss", "loss", "kl", "clip_fraction", "entropy", "mismatch_logprob_mean", "mismatch_logprob_max",
        "mismatch_out_of_clip", "behaviour_weight", "masked_by_correction", "entropy_coef")
TRAINER = ("tokens", "sequences", "skipped", "skipped_steps", "grad_norm", "lr", "grad_cos_prev", "gac_projected")
OPERATOR = ("reward_mean", "greedy_reward_mean", "trajectories", "policy_kl", "tied_group_fraction", "torch_threads")
TRAIN_METRICS = frozenset(LOSS + TRAINER + OPERATOR)
BUILTIN = "flowrl_operators."
# Which of them plays which part in the learning health (flowrl/health.py; `Train.metric_roles`).
# `mismatch_logprob_mean` marks a policy-gradient step: a supervised loss has no behaviour policy.
ROLES = MetricRoles(entropy="entropy", clip_fraction="clip_fraction", mismatch="mismatch_logprob_mean",
                    tied_groups="tied_group_fraction", policy_kl="policy_kl", grad_norm="grad_norm",
                    policy_gradient="mismatch_logprob_mean")


def train_metrics(config: Any) -> frozenset[str] | None:
    """What a step of the built-in train node may report with `config`; None where a plugin's loss
    or training engine takes part (its metrics are its own)."""
    from flowrl_operators.training.registry import LOSSES

    if getattr(config, "engine", "fsdp2") != "fsdp2":
        return None
    loss = config.loss
    kind = loss if isinstance(loss, str) else (loss or {}).get("kind", "ppo_clip") if isinstance(loss, dict) else None
    if not isinstance(kind, str):
        return None
    try:
        entry = LOSSES.get(kind)
    except ValueError:  # an unknown loss: reported at its key by the train node's own checks
        return None
    return TRAIN_METRICS if getattr(entry.fn, "__module__", "").startswith(BUILTIN) else None
