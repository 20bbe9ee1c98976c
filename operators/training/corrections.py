"""Train/inference mismatch corrections (registry `flowrl.corrections`): a weight per token from the
proximal policy (recomputed by the trainer before the update) and the behaviour policy (the
engine's logprobs), without gradient; 0 masks a token out of the loss. With
log w = proximal - behaviour per token (clamped to +-20 before exp, verl's safety bound):

    tis         min(w, threshold); per sequence w = exp(sum_t log w)           (truncated IS)
    mis         w if floor <= w <= threshold else 0                            (masked IS)
    geometric   w_i = exp(mean_t log w) per sequence, truncated or masked      (AReaL ratio / sequence)
    reject      1, or 0 where a divergence check fails                         (verl rollout_rs)

By default the masked tokens still count in the aggregation's N and S (AReaL's convention: masking
must not scale up the tokens that stay); `normalise: kept` hands the kept tokens alone to the loss
and its aggregation (verl's: its rejection modifies the response mask every later step reads).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Annotated, Literal

import msgspec
import torch
from msgspec import Meta

from flowrl_operators.config import CorrectionConfig
from flowrl_operators.training.registry import Algorithm

SAFETY_BOUND = 20.0
Reduce = Callable[[list[float]], list[float]]
Positive = Annotated[float, Meta(gt=0)]
NonNegative = Annotated[float, Meta(ge=0)]
# What the loss and its aggregation count once a correction masks tokens: "all" loss tokens (AReaL),
# or the "kept" ones (verl: the rejection-modified response mask).
Normalise = Literal["all", "kept"]
Check = Literal["token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
                "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3"]


class RejectCheck(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One divergence check of verl's rollout_rs, with r = log(pi_proximal / pi_behaviour) clamped to
    +-20: k1 = -r, k2 = r^2 / 2, k3 = exp(r) - 1 - r, per token or their sum, mean or max over the
    sequence. k1 keeps log(floor) <= k1 <= log(threshold) (floor defaults to 1 / threshold); k2 and k3
    keep values <= threshold. `sign: areal` takes AReaL's rejection_sampling metrics kl_k1 / kl_k3
    instead: r unclamped, k1 = r, k3 = exp(-r) - 1 + r (its KLEstimator of pi_proximal against
    pi_behaviour); AReaL's kl_k1 bounds [lower, upper] are floor = e^lower, threshold = e^upper."""

    check: Check
    threshold: Positive
    floor: Positive | None = None  # k1 checks only
    sign: Literal["verl", "areal"] = "verl"  # whose sign of r the k1 / k3 statistics take


class TIS(CorrectionConfig):
    """Truncated importance sampling: min(w, threshold), w per token or per sequence (the product of
    the sequence's token weights); batch_normalize divides by the mean weight over the batch's loss
    tokens (token) or sequences (sequence) (verl rollout_is + rollout_is_batch_normalize, with
    rollout_rs as `reject`; Yao et al., "Your efficient RL framework secretly brings you off-policy
    RL training", 2025)."""

    level: Literal["token", "sequence"] = "token"
    threshold: Positive = 2.0
    batch_normalize: bool = False  # weights / their batch mean, so that they average 1
    reject: list[RejectCheck] = []  # also mask tokens (or sequences) that fail any of these checks
    normalise: Normalise = "all"  # kept: the loss and aggregation count only the tokens kept (verl)


class MIS(CorrectionConfig):
    """Masked importance sampling: w if floor <= w <= threshold else 0, w per token or per sequence
    (the product) (AReaL rejection_sampling with metric ratio, action mask; IcePop-style bands)."""

    level: Literal["token", "sequence"] = "token"
    threshold: Positive = 2.0
    floor: NonNegative = 0.0  # weights below it are masked too
    normalise: Normalise = "all"  # kept: the loss and aggregation count only the tokens kept (verl)

    def __post_init__(self) -> None:
        if self.floor >= self.threshold:
            raise ValueError("correction needs floor < threshold")


class Geometric(CorrectionConfig):
    """The sequence's geometric-mean weight w_i = exp(mean_t log w), on every token of it, truncated
    to [floor, threshold] or masked outside it (AReaL rejection_sampling with metric ratio, level
    sequence, action clamp / mask; the ratio of GSPO / GMPO)."""

    action: Literal["truncate", "mask"] = "truncate"
    threshold: Positive = 2.0
    floor: NonNegative = 0.0
    normalise: Normalise = "all"  # kept: the loss and aggregation count only the tokens kept (verl)

    def __post_init__(self) -> None:
        if self.floor >= self.threshold:
            raise ValueError("correction needs floor < threshold")


class Reject(CorrectionConfig, kw_only=True):
    """Rejection only, no weighting: 1 on the tokens that pass every check, 0 elsewhere (verl
    rollout_rs with rollout_is off; several checks combine as verl's comma-separated list)."""

    checks: list[RejectCheck]
    normalise: Normalise = "all"  # kept: the loss and aggregation count only the tokens kept (verl)


def _log_w(proximal: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask > 0, (proximal - behaviour).detach(), 0.0)


def _sequence_log_w(log_w: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return log_w.sum(dim=1, keepdim=True).expand_as(mask)


def _weights(proximal, behaviour, mask, level: str) -> torch.Tensor:
    log_w = _log_w(proximal, behaviour, mask)
    if level == "sequence":
        log_w = _sequence_log_w(log_w, mask)
    return torch.exp(log_w.clamp(-SAFETY_BOUND, SAFETY_BOUND)) * mask


def _statistics(log_w: torch.Tensor, sign: str) -> dict[str, torch.Tensor]:
    if sign == "areal":  # AReaL: k of pi_proximal against pi_behaviour, r unclamped
        return {"k1": log_w, "k2": 0.5 * log_w * log_w, "k3": torch.exp(-log_w) - 1 + log_w}
    r = log_w.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {"k1": -r, "k2": 0.5 * r * r, "k3": torch.exp(r) - 1 - r}


def keep_mask(proximal, behaviour, mask, checks: list[RejectCheck]) -> torch.Tensor:
    """1.0 where every check passes (per token, or for the whole sequence), else 0."""
    log_w = _log_w(proximal, behaviour, mask)
    on = mask > 0
    keep = torch.ones_like(mask, dtype=torch.bool)
    for check in checks:
        level, estimator = check.check.rsplit("_", 1)
        value = torch.where(on, _statistics(log_w, check.sign)[estimator], 0.0)
        if level == "seq_sum":
            value = value.sum(dim=1, keepdim=True)
        elif level == "seq_mean":
            value = value.sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1)
        elif level == "seq_max":
            value = torch.where(on, value, -math.inf).amax(dim=1, keepdim=True)
        if estimator == "k1":
            floor = check.floor if check.floor is not None else 1.0 / check.threshold
            passed = (value >= math.log(floor)) & (value <= math.log(check.threshold))
        else:
            passed = value <= check.threshold
        keep = keep & (passed | ~on) if level == "token" else keep & (passed | ~on.any(dim=1, keepdim=True))
    return keep.float()


def tis(proximal, behaviour, mask, config: TIS, reduce: Reduce) -> torch.Tensor:
    w = _weights(proximal, behaviour, mask, config.level).clamp(max=config.threshold)
    if config.batch_normalize:
        if config.level == "token":
            total, count = reduce([float(w.sum()), float(mask.sum())])
        else:  # one weight per sequence with a loss token
            rows = mask.sum(dim=1) > 0
            per_row = (w.sum(dim=1) / mask.sum(dim=1).clamp(min=1))[rows]
            total, count = reduce([float(per_row.sum()), float(rows.sum())])
        mean = total / max(count, 1e-8)
        if mean > 1e-8:
            w = w / mean
    if config.reject:
        w = w * keep_mask(proximal, behaviour, mask, config.reject)
    return w


def mis(proximal, behaviour, mask, config: MIS, reduce: Reduce) -> torch.Tensor:
    w = _weights(proximal, behaviour, mask, config.level)
    return torch.where((w >= config.floor) & (w <= config.threshold), w, 0.0)


def geometric(proximal, behaviour, mask, config: Geometric, reduce: Reduce) -> torch.Tensor:
    log_w = _log_w(proximal, behaviour, mask)
    mean = log_w.sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1)
    w = torch.exp(mean).expand_as(mask) * mask
    if config.action == "truncate":
        return w.clamp(min=config.floor, max=config.threshold) * mask
    return torch.where((w >= config.floor) & (w <= config.threshold), w, 0.0)


def reject(proximal, behaviour, mask, config: Reject, reduce: Reduce) -> torch.Tensor:
    return keep_mask(proximal, behaviour, mask, config.checks) * mask


TIS_CORRECTION = Algorithm("tis", TIS, tis)
MIS_CORRECTION = Algorithm("mis", MIS, mis)
GEOMETRIC_CORRECTION = Algorithm("geometric", Geometric, geometric)
REJECT_CORRECTION = Algorithm("reject", Reject, reject)
