"""Ratio-based policy losses (registry `flowrl.losses`): PPO's clip and its relatives. Per token,
with A the advantage, old the logprob the ratio is taken against (behaviour, or proximal under a
correction / decoupled PPO), m the loss mask and r = exp(clamp(logp - old, +-max_log_ratio)).
Each returns (per-token loss, 1.0 where the objective was clipped).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

import torch
from msgspec import Meta

from flowrl_operators.config import LossConfig
from flowrl_operators.training.registry import Algorithm

RL = frozenset({"advantages"})
ClipRange = Annotated[float, Meta(ge=0)]
Bound = Annotated[float, Meta(gt=0)]


class ClipConfig(LossConfig):
    clip_low: Annotated[float, Meta(ge=0, lt=1)] = 0.2  # the ratio's lower clip is 1 - clip_low
    clip_high: ClipRange = 0.2  # the upper clip is 1 + clip_high; > clip_low is DAPO's clip-higher (0.28)
    # log(ratio) is clamped to +-this before exp (verl's safety bound, 20); None: no clamp.
    max_log_ratio: Bound | None = 20.0


class PPOClip(ClipConfig):
    """l = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)); dual clip (Ye et al. 2019,
    arXiv 1912.09729): l = min(l, -A c) where A < 0 (PPO, Schulman et al. 2017; verl vanilla with
    clip_ratio_c = dual_clip, which verl always applies with 3.0; AReaL ppo_actor_loss_fn c_clip)."""

    dual_clip: Annotated[float, Meta(gt=1)] | None = None  # c > 1, e.g. 3.0; None: off


class GSPO(ClipConfig):
    """Sequence ratio s_i = exp(sum_t m (logp - old) / n_i), used per token as
    exp(sg(log s_i) + logp - sg(logp)) (value of s_i, gradient of the token's own logprob), clamped
    to at most exp(max_log_ratio), then clipped like ppo_clip (GSPO, arXiv 2507.18071; verl gspo,
    whose clip ranges are about 3e-4 / 4e-4 and which aggregates seq_mean_token_mean)."""

    max_log_ratio: Bound | None = 10.0  # verl clamps log s at 10 (above only)


class SAPO(LossConfig):
    """Soft gate instead of a clip: l = -A f(r), f(r) = sigmoid(tau (r - 1)) 4 / tau, tau = tau_pos
    where A > 0 else tau_neg. level sequence: r is the sequence's geometric-mean ratio
    s_i = exp(sum_t m (logp - old) / max(n_i, 1)) (gradient through every token's logprob) and A the
    sequence's mean advantage, on each of its tokens (SAPO, arXiv 2511.20347; token: verl sapo with
    its +-20 log-ratio clamp, which aggregates seq_mean_token_mean, and AReaL sapo_loss_fn
    token-mean without the clamp; sequence: AReaL sapo_loss_fn importance_sampling_level sequence)."""

    tau_pos: Bound = 1.0
    tau_neg: Bound = 1.05
    level: Literal["token", "sequence"] = "token"
    # log(ratio) clamped to +-this before exp (token: each log ratio; sequence: the mean); None: no clamp
    max_log_ratio: Bound | None = 20.0


class CISPO(ClipConfig):
    """Clipped IS weight times the REINFORCE term: l = -sg(clip(r, 1 - clip_low, 1 + clip_high)) A logp
    (CISPO, MiniMax-M1, arXiv 2506.13585; verl cispo)."""


class GMPO(ClipConfig):
    """Geometric-mean policy optimisation: per sequence, with d_t = logp - old clipped in log space
    (clip_low / clip_high bound d_t itself here, as verl's geo_mean; GMPO's paper uses 0.4),
    d'_t = sgn(A) min(sgn(A) d_t, sgn(A) clamp(d_t, -clip_low, clip_high)),
    R_i = exp(sum_t m d'_t / (n_i + 1e-8)) and A_i the mean of A over the sequence: l_i = -A_i R_i,
    placed on each token of the sequence; with the default seq_mean_token_mean the loss is mean_i l_i.
    A behaviour weight w_t (correction / decoupled) scales l_i by the geometric mean of the
    sequence's weights, exp(sum_t m log(w_t + 1e-10) / (n_i + 1e-8)); a sequence a correction
    rejects whole counts in the mean as 0 (GMPO, arXiv 2507.20673; verl geo_mean, which applies no
    log-ratio clamp)."""

    aggregation: str | dict[str, Any] = "seq_mean_token_mean"
    max_log_ratio: Bound | None = None
    # How a per-token behaviour weight enters the loss: "geometric" = one weight per sequence, the
    # geometric mean of its tokens' weights (read by policy_loss; other losses: per token).
    weighting: ClassVar[str] = "geometric"
    # A sequence a correction rejects whole still counts in the mean over sequences (verl's geo_mean
    # takes torch.mean over every row), also under `normalise: kept` (read by policy_loss).
    counts_rejected_sequences: ClassVar[bool] = True


class SFT(LossConfig):
    """Supervised: l = -logp (advantages unused, no behaviour weight)."""

    supervised = True


def log_ratio(logprobs: torch.Tensor, old: torch.Tensor, bound: float | None) -> torch.Tensor:
    d = logprobs - old
    return d if bound is None else d.clamp(-bound, bound)


def clipped_objective(ratio, advantages, config: ClipConfig, dual_clip: float | None = None):
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - config.clip_low, 1 + config.clip_high)
    loss = torch.maximum(unclipped, clipped)
    was_clipped = clipped > unclipped
    if dual_clip is not None:
        lower_bound = -advantages * dual_clip
        dual = (advantages < 0) & (loss > lower_bound)
        loss = torch.where(dual, lower_bound, loss)
        was_clipped = was_clipped | dual
    return loss, was_clipped.float()


def ppo_clip(logprobs, old, advantages, mask, config: PPOClip):
    ratio = torch.exp(log_ratio(logprobs, old, config.max_log_ratio))
    return clipped_objective(ratio, advantages, config, config.dual_clip)


def gspo(logprobs, old, advantages, mask, config: GSPO):
    lengths = mask.sum(dim=1, keepdim=True).clamp(min=1)
    log_seq_ratio = ((logprobs - old) * mask).sum(dim=1, keepdim=True) / lengths
    # Value of the sequence ratio on every token, gradient of each token's own logprob.
    log_s = log_seq_ratio.detach() + logprobs - logprobs.detach()
    if config.max_log_ratio is not None:
        log_s = log_s.clamp(max=config.max_log_ratio)
    return clipped_objective(torch.exp(log_s), advantages, config)


def sequence_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's mean of x over its loss tokens (count clamped to 1), on every column."""
    on = mask > 0
    return (torch.where(on, x, 0.0).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1)).expand_as(x)


def sapo(logprobs, old, advantages, mask, config: SAPO):
    if config.level == "sequence":
        log_s = sequence_mean(logprobs - old, mask)
        if config.max_log_ratio is not None:
            log_s = log_s.clamp(-config.max_log_ratio, config.max_log_ratio)
        ratio, advantages = torch.exp(log_s), sequence_mean(advantages, mask)
    else:
        ratio = torch.exp(log_ratio(logprobs, old, config.max_log_ratio))
    tau = torch.where(advantages > 0, config.tau_pos, config.tau_neg)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    return -gate * advantages, torch.zeros_like(logprobs)


def cispo(logprobs, old, advantages, mask, config: CISPO):
    ratio = torch.exp(log_ratio(logprobs, old, config.max_log_ratio))
    weight = ratio.clamp(1 - config.clip_low, 1 + config.clip_high)
    return -weight.detach() * advantages * logprobs, (weight != ratio).float()


def gmpo(logprobs, old, advantages, mask, config: GMPO):
    d = log_ratio(logprobs, old, config.max_log_ratio)
    sign = torch.sign(advantages)
    bounded = d.clamp(-config.clip_low, config.clip_high)
    d_min = sign * torch.minimum(sign * d, sign * bounded)
    lengths = mask.sum(dim=1, keepdim=True)
    on = mask > 0
    ratio = torch.exp(torch.where(on, d_min, 0.0).sum(dim=1, keepdim=True) / (lengths + 1e-8))
    advantage = torch.where(on, advantages, 0.0).sum(dim=1, keepdim=True) / (lengths + 1e-8)
    per_sequence = (-advantage * ratio).expand_as(logprobs)
    return per_sequence, (d != bounded).float()


def sft(logprobs, old, advantages, mask, config: SFT):
    return -logprobs, torch.zeros_like(logprobs)


PPO_CLIP = Algorithm("ppo_clip", PPOClip, ppo_clip, RL)
GSPO_LOSS = Algorithm("gspo", GSPO, gspo, RL)
SAPO_LOSS = Algorithm("sapo", SAPO, sapo, RL)
CISPO_LOSS = Algorithm("cispo", CISPO, cispo, RL)
GMPO_LOSS = Algorithm("geo_mean", GMPO, gmpo, RL)
SFT_LOSS = Algorithm("sft", SFT, sft)
