"""Every registered entry that names a verl or AReaL counterpart, against that counterpart's
definition written out here (from verl's core_algos / rollout_corr_helper and AReaL's
functional.py, read, not imported, and not calling flowrl), on small fixed tensors, to 1e-6 in the
loss and its gradient. Where flowrl's default differs on purpose, the test sets the keys that give
the peer's definition; `flowrl_operators.training.peers.DIFFERENCES` lists those differences.

Advantage estimators are checked against hand-computed values in tests/test_advantages.py
(`ADVANTAGE_TESTS` below names the test of each).
"""

from __future__ import annotations

import ast
import math
import re
from pathlib import Path

import pytest
import torch

from flowrl_operators.training.batch import Batch, Normaliser
from flowrl_operators.training.losses import loss_config, policy_loss, set_behaviour_weights
from flowrl_operators.training.peers import DIFFERENCES
from flowrl_operators.training.registry import ADVANTAGES, AGGREGATIONS, CORRECTIONS, KL, LOSSES

torch.set_num_threads(1)
T = torch.tensor

# 3 rows of 4 tokens; row 1 ends one token early, row 2 two tokens early.
LOGP = [[-1.0, -0.5, -2.0, -0.3], [-0.3, -1.2, -0.7, -5.0], [-0.05, -2.5, -0.9, -0.4]]
OLD = [[-1.1, -0.2, -2.25, -0.9], [-2.0, -0.95, -0.75, -4.0], [-0.4, -2.4, -1.5, -0.4]]
BEHAV = [[-1.5, -0.3, -2.0, -0.95], [-2.2, -0.1, -0.7, -3.0], [-0.45, -2.3, -1.45, -1.0]]
REF = [[-0.9, -0.6, -1.5, -0.2], [-0.4, -1.0, -0.2, -1.0], [-0.1, -3.0, -0.8, -0.5]]
ADV = [[1.0, 1.0, 1.0, 1.0], [-2.0, -2.0, -2.0, 0.0], [0.5, -1.5, 0.5, 0.0]]
MASK = [[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0]]


def batch_of(old=OLD, proximal=None, mask=MASK, adv=ADV):
    b, t = len(mask), len(mask[0])
    zeros = torch.zeros(b, t)
    return Batch(
        input_ids=torch.zeros(b, t + 1, dtype=torch.long), attention_mask=torch.ones(b, t + 1, dtype=torch.long),
        position_ids=torch.zeros(b, t + 1, dtype=torch.long), loss_mask=T(mask, dtype=torch.float32),
        behaviour_logprobs=T(old), rewards=zeros, reward_mask=zeros, versions=zeros.long(),
        group_index=torch.arange(b), lengths=torch.full((b,), t + 1), reference_logprobs=T(REF),
        proximal_logprobs=None if proximal is None else T(proximal), advantages=T(adv),
    )


def flowrl(keys: dict, batch: Batch | None = None) -> tuple[float, torch.Tensor]:
    """(loss, d loss / d logp) of flowrl's loss these YAML keys select."""
    config = loss_config(keys)
    batch = batch or batch_of()
    if batch.proximal_logprobs is not None:
        set_behaviour_weights(batch, config)
    x = T(LOGP, requires_grad=True)
    loss, _ = policy_loss(config)({"logprobs": x, "entropy": torch.zeros_like(x)}, batch, Normaliser.of(batch))
    loss.backward()
    return loss.item(), x.grad


def peer(fn) -> tuple[float, torch.Tensor]:
    """(loss, gradient) of a peer definition fn(logp) -> loss, with its own autograd."""
    x = T(LOGP, dtype=torch.float64, requires_grad=True)
    loss = fn(x)
    loss.backward()
    return loss.item(), x.grad.float()


def same(actual, expected):
    assert actual[0] == pytest.approx(expected[0], abs=1e-6)
    torch.testing.assert_close(actual[1], expected[1], atol=1e-6, rtol=0)


# ---- the peers' definitions (float64) ----

def f64(x):
    return T(x, dtype=torch.float64)


M, A, OLD64, BEHAV64, REF64 = f64(MASK), f64(ADV), f64(OLD), f64(BEHAV), f64(REF)


def verl_agg(loss, mask, mode, scale=None):
    """verl agg_loss (one rank, global counts = the batch's)."""
    if mode == "token-mean":
        return (loss * mask).sum() / mask.sum()
    rows = (mask.sum(-1) > 0).double()
    if mode == "seq-mean-token-mean":
        per_seq = (loss * mask).sum(-1) / (mask.sum(-1) + 1e-8)
        return (per_seq * rows).sum() / rows.sum()
    per_seq = (loss * mask).sum(-1)
    out = (per_seq * rows).sum() / rows.sum()
    return out / scale if mode == "seq-mean-token-sum-norm" else out


def areal_mean(loss, mask):
    """AReaL: sum over the loss mask / its count (the original count, before any rejection)."""
    return torch.where(mask > 0, loss, 0.0).sum() / max(int(mask.count_nonzero()), 1)


def verl_vanilla(x, old=OLD64, mask=M, low=0.2, high=0.2, c=3.0, mode="token-mean", is_w=None):
    ratio = torch.exp((x - old).clamp(-20, 20))
    l1, l2 = -A * ratio, -A * ratio.clamp(1 - low, 1 + high)
    clipped = torch.maximum(l1, l2)
    loss = torch.where(A < 0, torch.minimum(-A * c, clipped), clipped)
    return verl_agg(loss if is_w is None else loss * is_w, mask, mode)


def areal_ppo(x, low=0.2, high=0.28, c=None):
    ratio = torch.exp(x - OLD64)
    loss = torch.maximum(-A * ratio, -A * ratio.clamp(1 - low, 1 + high))
    if c is not None:
        loss = torch.minimum(loss, torch.sign(A) * c * A)
    return areal_mean(loss, M)


def verl_gspo(x, low=3e-4, high=4e-4):
    log_s = ((x - OLD64) * M).sum(-1, keepdim=True) / M.sum(-1, keepdim=True).clamp(min=1)
    log_st = (x - x.detach() + log_s.detach()).clamp(max=10.0)
    s = torch.exp(log_st)
    loss = torch.maximum(-A * s, -A * s.clamp(1 - low, 1 + high))
    return verl_agg(loss, M, "seq-mean-token-mean")


def sapo_gate(ratio, adv, tau_pos=1.0, tau_neg=1.05):
    tau = torch.where(adv > 0, tau_pos, tau_neg)
    return torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)


def verl_sapo(x):
    ratio = torch.exp((x - OLD64).clamp(-20, 20))
    return verl_agg(-sapo_gate(ratio, A) * A, M, "seq-mean-token-mean")


def areal_sapo(x, level="token"):
    log_ratio, adv = x - OLD64, A
    if level == "sequence":
        count = M.sum(-1, keepdim=True).clamp(min=1)
        ratio = torch.exp(torch.where(M > 0, log_ratio, 0.0).sum(-1, keepdim=True) / count).expand_as(x)
        adv = (torch.where(M > 0, A, 0.0).sum(-1, keepdim=True) / count).expand_as(x)
    else:
        ratio = torch.exp(log_ratio)
    return areal_mean(-sapo_gate(ratio, adv) * adv, M)


def verl_cispo(x, low=0.2, high=0.2):
    ratio = torch.exp((x - OLD64).clamp(-20, 20))
    return verl_agg(-ratio.clamp(1 - low, 1 + high).detach() * A * x, M, "token-mean")


def verl_geo_mean(x, old=OLD64, low=0.2, high=0.2, is_w=None, mask=M):
    d = x - old
    sign = torch.sign(A)
    d_min = sign * torch.min(sign * d, sign * d.clamp(-low, high))
    n = mask.sum(-1)
    ratio = torch.exp((d_min * mask).sum(-1) / (n + 1e-8))
    loss = -(A * mask).sum(-1) / (n + 1e-8) * ratio
    if is_w is not None:
        loss = loss * torch.exp((torch.log(is_w + 1e-10) * mask).sum(-1) / (n + 1e-8))
    return loss.mean()


def verl_bypass_reinforce(x, level, threshold, mode="token-mean", reject=None):
    """verl bypass mode, loss_type reinforce: IS weights from the current policy; with rollout_rs
    (`reject`: (option, low, high)) the rejection mask, also from the current policy, is the mask the
    aggregation reads."""
    log_ratio = (x.detach() - BEHAV64) * M
    mask = M if reject is None else M * verl_rs_mask(x.detach() - BEHAV64, *reject)
    if level == "sequence":
        log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(x)
    w = torch.exp(log_ratio.clamp(-20, 20)) * M
    return verl_agg(-A * x * w.clamp(max=threshold), mask, mode)


def current_batch():
    """The proximal pass reinforce_bypass runs before each epoch: the current policy's logprobs."""
    return batch_of(old=BEHAV, proximal=LOGP)


def verl_dppo(x, kind, low, high, c=3.0):
    ratio = torch.exp((x - OLD64).clamp(-20, 20))
    w = ratio.clamp(max=c).detach()
    p, q = torch.exp(x.detach()), torch.exp(OLD64)
    if kind == "tv":
        valid = torch.where(A > 0, (p - q) <= high, (p - q) >= -low)
    else:
        kl = q * (OLD64 - x.detach()) + (1 - q) * torch.log((1.0 - q + 1e-8) / (1.0 - p + 1e-8))
        valid = torch.where(A > 0, (kl <= high) | (p <= q), (kl <= low) | (p >= q))
    return verl_agg(-A * w * x * valid.double(), M, "token-mean")


def prime_rl_default(x, low=0.2, high=0.2, kl_tau=1e-3):
    """prime-rl default_loss_fn summed over the loss tokens, over their count (its rl_scale)."""
    log_ratio = x - OLD64
    diff = torch.exp(x) - torch.exp(OLD64)
    masked = torch.where(A > 0, diff > high, diff < -low)
    keep = (M > 0) & ~masked
    per_token = -(keep * A * torch.exp(log_ratio)) + kl_tau * (M * log_ratio**2)
    return per_token.sum() / M.sum()


def verl_kl(x, mode):
    """verl kl_penalty: forward value, with the gradient of k2 for the '+' modes."""
    base = mode.rstrip("+")
    if base == "k1":
        value = x - REF64
    elif base == "k2":
        value = 0.5 * (x - REF64) ** 2
    elif base == "abs":
        value = (x - REF64).abs()
    else:
        kl = (REF64 - x).clamp(-20, 20)
        value = (torch.exp(kl) - kl - 1).clamp(-10, 10)
    if mode.endswith("+"):
        k2 = 0.5 * (x - REF64) ** 2
        value = k2 - k2.detach() + value.detach()
    return verl_agg(value, M, "token-mean")


def verl_is_weights(log_ratio, level, threshold, batch_normalize=False):
    """verl compute_rollout_correction_weights (truncate), r = prox - behav."""
    if level == "sequence":
        log_ratio = (log_ratio * M).sum(-1, keepdim=True).expand_as(log_ratio)
    w = (torch.exp(log_ratio.clamp(-20, 20)) * M).clamp(max=threshold)
    if batch_normalize:
        if level == "token":
            mean = (w * M).sum() / (M.sum() + 1e-8)
        else:
            per_seq = (w * M).sum(-1) / (M.sum(-1) + 1e-8)
            rows = (M.sum(-1) > 0).double()
            mean = (per_seq * rows).sum() / rows.sum().clamp(min=1e-8)
        w = w / mean
    return w


def verl_rs_mask(log_ratio, option, low, high):
    """verl compute_rollout_rejection_mask for one option: 1 keep, 0 reject."""
    r = log_ratio.clamp(-20, 20)
    stat = {"k1": -r, "k2": 0.5 * r**2, "k3": torch.exp(r) - 1.0 - r}[option[-2:]]
    level = option[:-3]
    if level == "token":
        value = stat
    elif level == "seq_sum":
        value = (stat * M).sum(-1, keepdim=True)
    elif level == "seq_mean":
        value = (stat * M).sum(-1, keepdim=True) / (M.sum(-1, keepdim=True) + 1e-8)
    else:
        value = stat.masked_fill(M == 0, -math.inf).amax(-1, keepdim=True)
    if option.endswith("k1"):
        keep = (value >= math.log(low)) & (value <= math.log(high))
    else:
        keep = value <= high
    return keep.expand_as(log_ratio).double() * M


def areal_rs(kind, level, agg, upper, lower=None, action="mask"):
    """AReaL apply_rejection_sampling (2D): (updated loss mask, behave_imp_weight)."""
    prox, behav = OLD64, BEHAV64
    log_ratio = prox - behav
    if kind == "ratio":
        metric = torch.exp(log_ratio)
    else:
        d = prox - behav
        metric = {"kl_k1": d, "kl_k2": d**2 / 2.0, "kl_k3": torch.exp(-d) - 1 + d}[kind]
    weight = torch.exp(log_ratio)

    def bounds(v):
        return (v >= lower) & (v <= upper) if lower is not None else v <= upper

    if level == "sequence":
        values = log_ratio if kind == "ratio" else metric
        masked = torch.where(M > 0, values, 0.0)
        count = M.sum(-1, keepdim=True).clamp(min=1)
        if kind == "ratio":
            weight = torch.exp(masked.sum(-1, keepdim=True) / count).expand_as(log_ratio)
        seq = {"sum": masked.sum(-1, keepdim=True), "mean": masked.sum(-1, keepdim=True) / count}[agg]
        in_bounds = bounds(torch.exp(seq) if kind == "ratio" else seq).expand_as(M)
    else:
        in_bounds = bounds(metric)
    if action == "mask":
        mask = M * in_bounds.double()
    else:
        mask = M
        weight = torch.where(in_bounds, weight, weight.clamp(min=lower or 0.0, max=upper))
    return mask, torch.where(mask > 0, weight, 0.0)


def areal_k3_rejection(x):
    return areal_mean(ppo_against(x, OLD64, 0.2, 0.2) * areal_rs("kl_k3", "sequence", "mean", 0.12)[1], M)


# ---- the comparisons: "concept:name" -> test cases (flowrl keys, batch maker, peer loss) ----

def decoupled(**correction):
    return {"correction": correction} if correction else {"decoupled": True, "allow_unbounded_weight": True}


def prox_batch():
    return batch_of(old=BEHAV, proximal=OLD)


CASES: dict[str, list[tuple[dict, object, object]]] = {
    "loss:ppo_clip": [
        ({"dual_clip": 3.0}, batch_of, verl_vanilla),
        ({"dual_clip": 3.0, "clip_low": 0.1, "clip_high": 0.28, "aggregation": "seq_mean_token_mean"}, batch_of,
         lambda x: verl_vanilla(x, low=0.1, high=0.28, mode="seq-mean-token-mean")),
        ({"clip_high": 0.28, "max_log_ratio": None}, batch_of, areal_ppo),
        ({"clip_high": 0.28, "max_log_ratio": None, "dual_clip": 2.0}, batch_of, lambda x: areal_ppo(x, c=2.0)),
    ],
    "loss:gspo": [({"clip_low": 3e-4, "clip_high": 4e-4, "aggregation": "seq_mean_token_mean"}, batch_of, verl_gspo)],
    "loss:sapo": [
        ({"aggregation": "seq_mean_token_mean"}, batch_of, verl_sapo),
        ({"max_log_ratio": None}, batch_of, areal_sapo),
        ({"level": "sequence", "max_log_ratio": None}, batch_of, lambda x: areal_sapo(x, "sequence")),
    ],
    "loss:cispo": [({}, batch_of, verl_cispo)],
    "loss:geo_mean": [
        ({}, batch_of, verl_geo_mean),
        ({**decoupled()}, prox_batch, lambda x: verl_geo_mean(x, is_w=torch.exp(OLD64 - BEHAV64) * M)),
        ({"correction": {"kind": "tis", "threshold": 1.2}}, prox_batch,
         lambda x: verl_geo_mean(x, is_w=verl_is_weights(OLD64 - BEHAV64, "token", 1.2))),
        # verl's rollout_rs rejects row 1 whole and one token of row 0: the mean still counts 3 rows.
        ({"correction": {"kind": "tis", "threshold": 1.2, "normalise": "kept", "reject": [
            {"check": "seq_mean_k3", "threshold": 0.05}, {"check": "token_k1", "threshold": 1.4, "floor": 0.7}]}},
         prox_batch, lambda x: verl_geo_mean(x, is_w=verl_is_weights(OLD64 - BEHAV64, "token", 1.2), mask=(
             verl_rs_mask(OLD64 - BEHAV64, "seq_mean_k3", None, 0.05)
             * verl_rs_mask(OLD64 - BEHAV64, "token_k1", 0.7, 1.4)))),
    ],
    "loss:reinforce": [({}, batch_of, lambda x: verl_agg(-A * x, M, "token-mean"))],
    "loss:gpg": [({}, batch_of, lambda x: verl_agg(-x * A, M, "token-mean"))],
    "loss:reinforce_bypass": [
        ({"level": "token", "threshold": 1.5}, lambda: batch_of(old=BEHAV), lambda x: verl_bypass_reinforce(x, "token", 1.5)),
        ({"level": "sequence", "threshold": 2.0, "aggregation": "seq_mean_token_sum"}, lambda: batch_of(old=BEHAV),
         lambda x: verl_bypass_reinforce(x, "sequence", 2.0, "seq-mean-token-sum")),
        # With rollout_rs: a correction, whose pass before the epoch is the current policy.
        ({"correction": {"kind": "tis", "threshold": 1.5, "normalise": "kept", "reject": [
            {"check": "token_k1", "threshold": 1.4, "floor": 0.7}]}}, current_batch,
         lambda x: verl_bypass_reinforce(x, "token", 1.5, reject=("token_k1", 0.7, 1.4))),
        ({"correction": {"kind": "tis", "level": "sequence", "threshold": 2.0, "normalise": "kept", "reject": [
            {"check": "seq_mean_k3", "threshold": 0.2}]}, "aggregation": "seq_mean_token_mean"}, current_batch,
         lambda x: verl_bypass_reinforce(x, "sequence", 2.0, "seq-mean-token-mean", ("seq_mean_k3", None, 0.2))),
    ],
    "loss:dppo_tv": [
        ({}, batch_of, lambda x: verl_dppo(x, "tv", 0.2, 0.2)),
        ({"delta_low": 0.05, "delta_high": 0.1, "truncation": 1.3}, batch_of, lambda x: verl_dppo(x, "tv", 0.05, 0.1, 1.3)),
        ({"surrogate": "ratio", "kl_coef": 1e-3, "max_log_ratio": None}, batch_of, prime_rl_default),
        ({"surrogate": "ratio", "kl_coef": 1e-3, "delta_low": 0.05, "delta_high": 0.1}, batch_of,
         lambda x: prime_rl_default(x, 0.05, 0.1)),
    ],
    "loss:dppo_kl": [
        ({}, batch_of, lambda x: verl_dppo(x, "kl", 0.2, 0.2)),
        ({"delta_low": 0.01, "delta_high": 0.02, "truncation": 1.3}, batch_of, lambda x: verl_dppo(x, "kl", 0.01, 0.02, 1.3)),
    ],
    "kl:k1": [({"kl": {"coef": 1.0, "estimator": "k1"}}, batch_of, lambda x: verl_kl(x, "k1")),
              ({"kl": {"coef": 1.0, "estimator": "k1", "straight_through": True}}, batch_of, lambda x: verl_kl(x, "k1+"))],
    "kl:k2": [({"kl": {"coef": 1.0, "estimator": "k2"}}, batch_of, lambda x: verl_kl(x, "k2"))],
    "kl:k3": [({"kl": {"coef": 1.0, "estimator": "k3"}}, batch_of, lambda x: verl_kl(x, "k3")),
              ({"kl": {"coef": 1.0, "estimator": "k3", "straight_through": True}}, batch_of, lambda x: verl_kl(x, "k3+"))],
    "kl:abs": [({"kl": {"coef": 1.0, "estimator": "abs"}}, batch_of, lambda x: verl_kl(x, "abs"))],
    "correction:tis": [
        ({"dual_clip": 3.0, "correction": {"kind": "tis", "level": level, "threshold": 1.5, "batch_normalize": norm}},
         prox_batch,
         lambda x, level=level, norm=norm: verl_vanilla(x, is_w=verl_is_weights(OLD64 - BEHAV64, level, 1.5, norm)))
        for level in ("token", "sequence") for norm in (False, True)
    ] + [
        ({"dual_clip": 3.0, "correction": {"kind": "tis", "threshold": 2.0, "normalise": "kept",
                         "reject": [{"check": "seq_mean_k3", "threshold": 0.05}]}}, prox_batch,
         lambda x: verl_vanilla(x, mask=verl_rs_mask(OLD64 - BEHAV64, "seq_mean_k3", None, 0.05),
                                is_w=verl_is_weights(OLD64 - BEHAV64, "token", 2.0))),
        # AReaL decoupled PPO with rejection (mask, kl_k3 per sequence): the raw weight on kept tokens,
        # divided by the original loss-token count.
        ({"max_log_ratio": None, "correction": {"kind": "tis", "threshold": 1e9, "reject": [
            {"check": "seq_mean_k3", "threshold": 0.12, "sign": "areal"}]}}, prox_batch, areal_k3_rejection),
    ],
    "correction:mis": [
        ({"max_log_ratio": None, "correction": {"kind": "mis", "threshold": 1.5, "floor": 0.8}}, prox_batch,
         lambda x: areal_mean(ppo_against(x, OLD64, 0.2, 0.2) * areal_rs("ratio", "token", None, 1.5, 0.8)[1], M)),
    ],
    "correction:geometric": [
        ({"max_log_ratio": None, "correction": {"kind": "geometric", "action": action, "threshold": 1.05,
                                                 "floor": 0.9}}, prox_batch,
         lambda x, action=action: areal_mean(
             ppo_against(x, OLD64, 0.2, 0.2) * areal_rs("ratio", "sequence", "mean", 1.05, 0.9, action)[1], M))
        for action in ("mask", "truncate")
    ],
    "correction:reject": [
        ({"dual_clip": 3.0, "correction": {"kind": "reject", "normalise": "kept", "checks": [
            {"check": option, "threshold": high, **({"floor": low} if low else {})}]}}, prox_batch,
         lambda x, option=option, low=low, high=high: verl_vanilla(
             x, mask=verl_rs_mask(OLD64 - BEHAV64, option, low, high)))
        for option, low, high in (("token_k1", 0.7, 1.5), ("seq_sum_k2", None, 0.3), ("seq_mean_k3", None, 0.05),
                                  ("seq_max_k3", None, 0.2), ("token_k3", None, 0.1))
    ],
    "aggregation:token_mean": [({"dual_clip": 3.0}, batch_of, lambda x: verl_vanilla(x))],
    "aggregation:seq_mean_token_mean": [
        ({"dual_clip": 3.0, "aggregation": "seq_mean_token_mean"}, batch_of,
         lambda x: verl_vanilla(x, mode="seq-mean-token-mean"))],
    "aggregation:seq_mean_token_sum": [
        ({"dual_clip": 3.0, "aggregation": "seq_mean_token_sum"}, batch_of,
         lambda x: verl_vanilla(x, mode="seq-mean-token-sum"))],
    "aggregation:seq_mean_token_sum_norm": [
        ({"dual_clip": 3.0, "aggregation": {"kind": "seq_mean_token_sum_norm", "norm_length": 4}}, batch_of,
         lambda x: verl_agg(ppo_against(x, OLD64, 0.2, 0.2, dual=3.0), M, "seq-mean-token-sum-norm", 4))],
}


def ppo_against(x, old, low, high, dual=None):
    """Per-token clipped PPO loss (AReaL ppo_actor_loss_fn before its mean; verl vanilla with dual)."""
    ratio = torch.exp(x - old)
    loss = torch.maximum(-A * ratio, -A * ratio.clamp(1 - low, 1 + high))
    return loss if dual is None else torch.where(A < 0, torch.minimum(-A * dual, loss), loss)


PARAMS = [(entry, i) for entry, cases in CASES.items() for i in range(len(cases))]


@pytest.mark.parametrize("entry,case", PARAMS, ids=[f"{e}#{i}" for e, i in PARAMS])
def test_matches_the_peer_definition(entry, case):
    keys, make_batch, reference = CASES[entry][case]
    batch = make_batch()
    if entry.startswith("kl:"):
        batch.advantages = torch.zeros_like(batch.advantages)
        same(flowrl(keys, batch), peer(reference))
        return
    kind = {"kind": entry.split(":", 1)[1]} if entry.startswith("loss:") else {}
    same(flowrl({**kind, **keys}, batch), peer(reference))


def test_the_minimal_seq_mean_token_sum_norm_case():
    """The issue's case: per-token loss ones(2, 2), mask ones(2, 2), loss_scale_factor 2 -> 1.0."""
    ones = torch.ones(2, 2, dtype=torch.float64)
    fn = AGGREGATIONS.get("seq_mean_token_sum_norm").fn
    config = AGGREGATIONS.config({"kind": "seq_mean_token_sum_norm", "norm_length": 2})
    ours = fn(ones, ones, Normaliser(tokens=4.0, sequences=2.0, weighted_tokens=4.0), config)
    assert ours.item() == pytest.approx(verl_agg(ones, ones, "seq-mean-token-sum-norm", 2).item(), abs=1e-12) == 1.0


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_aggregations_with_an_all_masked_row(mode):
    """verl skips a row without loss tokens in its sequence count; so does flowrl's S."""
    loss = f64([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = f64([[1, 1, 0], [0, 0, 0], [1, 1, 1]])
    name = mode.replace("-", "_")
    config = AGGREGATIONS.config({"kind": name, "norm_length": 3} if mode.endswith("norm") else name)
    per_row = mask.sum(1)
    normaliser = Normaliser(tokens=float(per_row.sum()), sequences=float((per_row > 0).sum()), weighted_tokens=0.0)
    ours = AGGREGATIONS.get(name).fn(loss, mask, normaliser, config)
    assert ours.item() == pytest.approx(verl_agg(loss, mask, mode, 3).item(), abs=1e-6)


# The estimators' hand-computed checks (tests/test_advantages.py), one named test per verl / AReaL entry.
ADVANTAGE_TESTS = {
    "grpo": "test_grpo_outcome_with_std", "dr_grpo": "test_grpo_without_std_and_dr_grpo", "rloo": "test_rloo",
    "grpo_passk": "test_grpo_passk", "opo": "test_opo_length_weighted_baseline", "gpg": "test_gpg_advantage",
    "remax": "test_remax_greedy_baseline", "reinforce_pp": "test_reinforce_pp_discounted_and_batch_whitened",
    "reinforce_pp_baseline": "test_reinforce_pp_baseline", "gae": "test_gae_skips_environment_tokens",
    "token_norm": "test_token_norm_weighs_tokens",
}


def names_a_peer(doc: str) -> bool:
    return bool(re.search(r"\b(verl|AReaL|TRL)\b", doc))


# Entries whose check needs more than CASES' inputs (the top-K losses read top logprobs): their tests.
SEPARATE_CHECKS = {"loss:dppo_tv_topk": "test_top_k_entries_match_trls_definition",
                   "loss:dppo_kl_topk": "test_top_k_entries_match_trls_definition"}


CONCEPTS = {LOSSES.group: "loss", KL.group: "kl", CORRECTIONS.group: "correction",
            AGGREGATIONS.group: "aggregation", ADVANTAGES.group: "advantage"}


@pytest.mark.parametrize("registry", [LOSSES, KL, CORRECTIONS, AGGREGATIONS, ADVANTAGES], ids=lambda r: r.group)
def test_every_entry_that_names_a_peer_is_checked_here(registry):
    concept = CONCEPTS[registry.group]
    tests = {node.name for node in ast.parse(Path(__file__).with_name("test_advantages.py").read_text()).body
             if isinstance(node, ast.FunctionDef)}
    for name, entry in registry.entries().items():
        if not names_a_peer(entry.doc):
            continue
        if registry is ADVANTAGES:
            assert ADVANTAGE_TESTS.get(name) in tests, f"advantage {name!r} names a peer but has no check"
        elif f"{concept}:{name}" in SEPARATE_CHECKS:
            assert SEPARATE_CHECKS[f"{concept}:{name}"] in globals(), name
        else:
            assert f"{concept}:{name}" in CASES, f"{concept} {name!r} names a peer but has no check here"


def test_every_listed_difference_is_a_registered_entry():
    registries = {concept: registry for registry in (LOSSES, KL, CORRECTIONS, AGGREGATIONS, ADVANTAGES)
                  for group, concept in CONCEPTS.items() if registry.group == group}
    for key in DIFFERENCES:
        concept, name = key.split(":")
        assert name in registries[concept].names(), key


def test_the_k3_sign_is_what_separates_verl_and_areal_here():
    """Row 1's mean k3 is 0.100 with verl's sign and 0.170 with AReaL's: a 0.12 bound keeps it under
    verl's sign only, so the default (verl) sign does not give AReaL's loss."""
    keys = {"max_log_ratio": None, "correction": {"kind": "tis", "threshold": 1e9, "reject": [
        {"check": "seq_mean_k3", "threshold": 0.12}]}}
    assert abs(flowrl(keys, prox_batch())[0] - peer(areal_k3_rejection)[0]) > 1e-3


# ---- DPPO's top-K approximation, against TRL's DPPOTrainer (topk_tv / topk_kl) ----
# The behaviour policy's top-3 tokens at every position (probabilities q) and the current policy's
# probabilities of the same ids (p); what the engine records and the trainer gathers.
TOP_Q = [[[0.5, 0.2, 0.1], [0.7, 0.1, 0.05], [0.3, 0.3, 0.2], [0.4, 0.35, 0.1]],
         [[0.6, 0.2, 0.1], [0.45, 0.4, 0.05], [0.5, 0.25, 0.2], [0.9, 0.05, 0.01]],
         [[0.95, 0.03, 0.01], [0.3, 0.1, 0.08], [0.25, 0.25, 0.2], [0.6, 0.3, 0.05]]]
TOP_P = [[[0.6, 0.15, 0.1], [0.5, 0.2, 0.1], [0.3, 0.32, 0.2], [0.2, 0.5, 0.1]],
         [[0.55, 0.2, 0.12], [0.2, 0.6, 0.05], [0.5, 0.25, 0.18], [0.85, 0.05, 0.02]],
         [[0.9, 0.05, 0.02], [0.3, 0.12, 0.08], [0.4, 0.2, 0.1], [0.6, 0.3, 0.05]]]


def flowrl_top(keys: dict, q=TOP_Q, p=TOP_P, batch: Batch | None = None, logp=LOGP) -> tuple[float, torch.Tensor]:
    """(loss, d loss / d logp) of a top-K loss, the current top logprobs given as the trainer's output."""
    config = loss_config(keys)
    batch = batch or batch_of()
    batch.top_logprobs = torch.log(T(q))
    x = T(logp, requires_grad=True)
    output = {"logprobs": x, "entropy": torch.zeros_like(x), "top_logprobs": torch.log(T(p))}
    loss, _ = policy_loss(config)(output, batch, Normaliser.of(batch))
    loss.backward()
    return loss.item(), x.grad


def trl_dppo_topk(x, kind, low, high, c=3.0, q=TOP_Q, p=TOP_P, old=OLD64, adv=A, mask=M):
    """TRL DPPOTrainer._compute_divergence_mask (topk_*) and _compute_loss, over the loss tokens' count."""
    q, p = f64(q), f64(p)
    q_rest, p_rest = (1.0 - q.sum(-1)).clamp(min=1e-12), (1.0 - p.sum(-1)).clamp(min=1e-12)
    if kind == "tv":
        divergence = ((p - q).abs().sum(-1) + (p_rest - q_rest).abs()) / 2.0
    else:
        divergence = (q * (q.log() - p.log())).sum(-1) + q_rest * (q_rest.log() - p_rest.log())
    prob, old_prob = torch.exp(x.detach()), torch.exp(old)
    invalid_pos = (divergence > high) & (prob > old_prob)
    invalid_neg = (divergence > low) & (prob < old_prob)
    keep = torch.where(adv > 0, ~invalid_pos, ~invalid_neg).double() * mask
    ratio = torch.exp((x - old).clamp(max=math.log(c))).detach()
    return (-adv * ratio * keep * x * mask).sum() / mask.sum()


@pytest.mark.parametrize("kind,keys,low,high", [
    ("tv", {}, 0.2, 0.2), ("tv", {"delta_low": 0.05, "delta_high": 0.1}, 0.05, 0.1),
    ("tv", {"delta_low": 0.12, "delta_high": 0.02, "truncation": 1.3}, 0.12, 0.02),
    ("kl", {}, 0.2, 0.2), ("kl", {"delta_low": 0.01, "delta_high": 0.02}, 0.01, 0.02),
    ("kl", {"delta_low": 0.05, "delta_high": 0.005, "truncation": 1.3}, 0.05, 0.005),
])
def test_top_k_entries_match_trls_definition(kind, keys, low, high):
    c = keys.get("truncation", 3.0)
    same(flowrl_top({"kind": f"dppo_{kind}_topk", **keys}), peer(lambda x: trl_dppo_topk(x, kind, low, high, c)))


def test_the_top_k_cases_mask_some_tokens_and_keep_others():
    """The fixed tensors straddle the trust regions: each parametrised case above masks some of the
    nine loss tokens and keeps others, so a wrong divergence would show."""
    for kind, low, high in (("tv", 0.05, 0.1), ("kl", 0.01, 0.02)):
        q, p = f64(TOP_Q), f64(TOP_P)
        qr, pr = 1 - q.sum(-1), 1 - p.sum(-1)
        d = ((p - q).abs().sum(-1) + (pr - qr).abs()) / 2 if kind == "tv" else \
            (q * (q / p).log()).sum(-1) + qr * (qr / pr).log()
        outside = (d > torch.where(A > 0, high, low)) & (M > 0)
        assert 0 < int(outside.sum()) < int(M.sum())


def test_the_minimal_top_k_case():
    """One token, K = 2: q = (0.5, 0.3), p = (0.6, 0.2), the sampled token the first (p_old 0.5,
    p 0.6), A = 1. TV = (0.1 + 0.1 + |0.2 - 0.2|) / 2 = 0.1; KL = 0.5 ln(0.5/0.6) + 0.3 ln(0.3/0.2)
    + 0.2 ln(0.2/0.2) = 0.030479. With delta 0.05 TV masks it (loss 0, no gradient); KL keeps it:
    loss -A min(r, 3) logp = -1.2 ln 0.6 = 0.612991, gradient -1.2."""
    one = {"old": [[math.log(0.5)]], "mask": [[1]], "adv": [[1.0]]}
    args = {"q": [[[0.5, 0.3]]], "p": [[[0.6, 0.2]]], "logp": [[math.log(0.6)]]}
    kl = 0.5 * math.log(0.5 / 0.6) + 0.3 * math.log(0.3 / 0.2)
    assert kl == pytest.approx(0.030479, abs=1e-6)
    tv_loss, tv_grad = flowrl_top({"kind": "dppo_tv_topk", "delta_high": 0.05}, batch=batch_of(**one), **args)
    assert tv_loss == 0.0 and tv_grad.item() == 0.0
    kl_loss, kl_grad = flowrl_top({"kind": "dppo_kl_topk", "delta_high": 0.05}, batch=batch_of(**one), **args)
    assert kl_loss == pytest.approx(-1.2 * math.log(0.6), abs=1e-6) and kl_loss == pytest.approx(0.612991, abs=1e-6)
    assert kl_grad.item() == pytest.approx(-1.2, abs=1e-6)
    # A wider region (delta_high 0.11 > 0.1) keeps the TV token too.
    assert flowrl_top({"kind": "dppo_tv_topk", "delta_high": 0.11}, batch=batch_of(**one), **args)[0] == \
        pytest.approx(0.612991, abs=1e-6)


def test_an_unrecorded_top_k_entry_counts_no_mass():
    """A padded entry (-inf, as pack writes for a shorter record) adds nothing to either side: K = 3
    with the last entry padded gives what K = 2 gives."""
    one = {"old": [[math.log(0.5)]], "mask": [[1]], "adv": [[1.0]]}
    two = flowrl_top({"kind": "dppo_kl_topk", "delta_high": 0.02}, q=[[[0.5, 0.3]]], p=[[[0.6, 0.2]]],
                     batch=batch_of(**one), logp=[[math.log(0.6)]])
    padded = flowrl_top({"kind": "dppo_kl_topk", "delta_high": 0.02}, q=[[[0.5, 0.3, 0.0]]], p=[[[0.6, 0.2, 0.7]]],
                        batch=batch_of(**one), logp=[[math.log(0.6)]])
    assert two[0] == padded[0] == 0.0 and torch.equal(two[1], padded[1])  # KL 0.0305 > 0.02 with p > p_old: masked both ways


def test_a_top_k_loss_refuses_a_proximal_policy_and_missing_records():
    with pytest.raises(Exception, match="behaviour policy"):
        loss_config({"kind": "dppo_tv_topk", "correction": {"kind": "tis"}})
    with pytest.raises(ValueError, match="sampling.top_logprobs"):
        flowrl({"kind": "dppo_kl_topk"})  # the batch has no top logprobs
    with pytest.raises(ValueError, match="no recorded top logprobs"):
        flowrl_top({"kind": "dppo_tv_topk"}, q=[[[0.0] * 3] * 4] * 3)  # every entry -inf
