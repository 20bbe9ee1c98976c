"""Divergence PPO (registry `flowrl.losses`): a trust region on the divergence between the policy
the ratio is taken against (old: behaviour, or proximal under a correction) and the current one,
instead of PPO's ratio clip (DPPO, Qi et al., "Rethinking the Trust Region in LLM Reinforcement
Learning", arXiv 2602.04879). The divergence of the whole next-token distribution is approximated
from the sampled token alone ("binary": the token vs. everything else), with p = exp(logp),
p_old = exp(old), r = exp(clamp(logp - old, +-max_log_ratio)):

    TV   D = p - p_old                      (signed: how far the token's probability moved)
    KL   D = p_old log(p_old / p) + (1 - p_old) log((1 - p_old + 1e-8) / (1 - p + 1e-8))

A token is kept unless it left the trust region in the direction its advantage pushes:
    TV   A > 0: D <= delta_high;           A <= 0: D >= -delta_low
    KL   A > 0: D <= delta_high or p <= p_old;   A <= 0: D <= delta_low or p >= p_old
The kept tokens carry the importance-weighted policy gradient (keep is 0/1, without gradient):
    surrogate log_prob   l = -keep A sg(min(r, truncation)) logp     (verl dppo_tv / dppo_kl)
    surrogate ratio      l = -keep A r                               (prime-rl's default loss)
and every loss token adds kl_coef (logp - old)^2 (prime-rl's kl_tau; 0 by default). Both
surrogates have the gradient -keep A r grad(logp) wherever r <= truncation.

Top-K approximation (dppo_tv_topk, dppo_kl_topk): the divergence of the whole distribution is
approximated over the behaviour policy's K most likely tokens at the position plus one bucket for
the rest of the vocabulary. The generate node records the K ids and their logprobs q_k under
softmax(logits / temperature) (`sampling.top_logprobs: K`), the trainer computes the current
policy's p_k of the same ids under the same temperature, and with q_rest = max(1 - sum q_k, 1e-12),
p_rest = max(1 - sum p_k, 1e-12):

    TV   D = (sum_k |p_k - q_k| + |p_rest - q_rest|) / 2
    KL   D = sum_k q_k log(q_k / p_k) + q_rest log(q_rest / p_rest)

and a token is kept unless D > delta_high with p > p_old (A > 0) or D > delta_low with p < p_old
(A <= 0), p and p_old the sampled token's; the loss on kept tokens as the binary entries (TRL's
DPPOTrainer `topk_tv` / `topk_kl`; the paper's DPPO-TopK). The divergence is measured against the
behaviour policy (whose top-K the engine records), so these entries take no correction or
decoupled (a proximal policy's top-K is not recorded).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

import torch
from msgspec import Meta

from flowrl_operators.config import LossConfig
from flowrl_operators.training.registry import Algorithm

RL = frozenset({"advantages"})
TOP_K = frozenset({"advantages", "top_logprobs"})  # the loss takes `top=TopLogprobs` (registry.py)
Delta = Annotated[float, Meta(ge=0)]
Bound = Annotated[float, Meta(gt=0)]


class DPPO(LossConfig):
    delta_low: Delta = 0.2  # the trust region where A <= 0 (verl clip_ratio_low, prime-rl dppo_mask_low)
    delta_high: Delta = 0.2  # the trust region where A > 0 (verl clip_ratio_high, prime-rl dppo_mask_high)
    surrogate: Literal["log_prob", "ratio"] = "log_prob"  # log_prob: verl's; ratio: prime-rl's
    # log_prob surrogate: the detached ratio is truncated to at most this (verl's clip_ratio_c, 3.0 in
    # its actor config; the paper advises a large one); None: not truncated.
    truncation: Bound | None = 3.0
    max_log_ratio: Bound | None = 20.0  # log(r) clamped to +-this before exp (verl); None: no clamp
    kl_coef: Annotated[float, Meta(ge=0)] = 0.0  # + kl_coef (logp - old)^2 on every loss token (prime-rl 1e-3)


class DPPOTV(DPPO):
    """DPPO-Binary-TV: keep a token unless p - p_old > delta_high (A > 0) or p - p_old < -delta_low
    (A <= 0), p = exp(logp), p_old = exp(old); kept tokens give l = -A sg(min(r, truncation)) logp
    (surrogate log_prob) or -A r (surrogate ratio); + kl_coef (logp - old)^2 on every token
    (DPPO, arXiv 2602.04879; verl dppo_tv; prime-rl's default loss with surrogate ratio and
    kl_coef 1e-3)."""


class DPPOKL(DPPO):
    """DPPO-Binary-KL: D = p_old log(p_old / p) + (1 - p_old) log((1 - p_old + 1e-8) / (1 - p + 1e-8));
    keep a token unless D > delta_high with p > p_old (A > 0) or D > delta_low with p < p_old
    (A <= 0); the loss on kept tokens as dppo_tv (DPPO, arXiv 2602.04879; verl dppo_kl)."""


class DPPOTopK(DPPO):
    def __post_init__(self) -> None:
        super().__post_init__()
        if self.decoupled or self.correction is not None:
            raise ValueError(f"loss {self.kind}: the top-K divergence is measured against the behaviour policy "
                             "(whose top-K tokens the engine records), not a proximal one: remove "
                             "decoupled / correction, or use the binary approximation (dppo_tv, dppo_kl)")


class DPPOTVTopK(DPPOTopK):
    """DPPO-TopK-TV: D = (sum_k |p_k - q_k| + |p_rest - q_rest|) / 2 over the behaviour policy's top-K
    tokens q_k (generate sampling.top_logprobs: K) and the current policy's p_k of the same ids, the
    rest of the vocabulary one bucket (1 - sum, at least 1e-12); keep a token unless D > delta_high
    with p > p_old (A > 0) or D > delta_low with p < p_old (A <= 0); kept tokens' loss as dppo_tv
    (DPPO, arXiv 2602.04879; TRL DPPOTrainer topk_tv)."""


class DPPOKLTopK(DPPOTopK):
    """DPPO-TopK-KL: D = sum_k q_k log(q_k / p_k) + q_rest log(q_rest / p_rest) over the behaviour
    policy's top-K tokens and one rest bucket (as dppo_tv_topk); the mask and the loss as
    dppo_tv_topk (DPPO, arXiv 2602.04879; TRL DPPOTrainer topk_kl)."""


@dataclass(frozen=True)
class TopLogprobs:
    """What a top-K loss reads beside the sampled token's logprobs, (B, T, K) each: the current
    policy's logprobs of the behaviour policy's top-K ids, and the behaviour policy's (-inf where an
    entry was not recorded)."""

    current: torch.Tensor
    behaviour: torch.Tensor


def top_k_divergence(top: TopLogprobs, kind: str) -> torch.Tensor:
    """The top-K-plus-rest TV or KL divergence per token (B, T) (see the module docs)."""
    recorded = torch.isfinite(top.behaviour)
    q_log = torch.where(recorded, top.behaviour, 0.0)
    p_log = torch.where(recorded, top.current, 0.0)
    q, p = torch.where(recorded, q_log.exp(), 0.0), torch.where(recorded, p_log.exp(), 0.0)
    q_rest = (1.0 - q.sum(-1)).clamp(min=1e-12)
    p_rest = (1.0 - p.sum(-1)).clamp(min=1e-12)
    if kind == "tv":
        return ((p - q).abs().sum(-1) + (p_rest - q_rest).abs()) / 2
    return (q * (q_log - p_log)).sum(-1) + q_rest * (q_rest.log() - p_rest.log())


def top_k_keep(kind: str, top: TopLogprobs):
    def keep(logprobs: torch.Tensor, old: torch.Tensor, positive: torch.Tensor, config: DPPO) -> torch.Tensor:
        divergence = top_k_divergence(top, kind)
        moved_up, moved_down = logprobs > old, logprobs < old
        return torch.where(positive, ~((divergence > config.delta_high) & moved_up),
                           ~((divergence > config.delta_low) & moved_down))

    return keep


def tv_keep(logprobs: torch.Tensor, old: torch.Tensor, positive: torch.Tensor, config: DPPO) -> torch.Tensor:
    moved = torch.exp(logprobs) - torch.exp(old)
    return torch.where(positive, moved <= config.delta_high, moved >= -config.delta_low)


def kl_keep(logprobs: torch.Tensor, old: torch.Tensor, positive: torch.Tensor, config: DPPO) -> torch.Tensor:
    prob, old_prob = torch.exp(logprobs), torch.exp(old)
    divergence = old_prob * (old - logprobs) + (1 - old_prob) * torch.log(
        (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
    up = (divergence <= config.delta_high) | (prob <= old_prob)
    down = (divergence <= config.delta_low) | (prob >= old_prob)
    return torch.where(positive, up, down)


def dppo(logprobs, old, advantages, mask, config: DPPO, keep_fn) -> tuple[torch.Tensor, torch.Tensor]:
    d = logprobs - old
    bounded = d if config.max_log_ratio is None else d.clamp(-config.max_log_ratio, config.max_log_ratio)
    ratio = torch.exp(bounded)
    with torch.no_grad():
        keep = keep_fn(logprobs.detach(), old, advantages > 0, config).float()
    if config.surrogate == "ratio":
        per_token = -keep * advantages * ratio
    else:
        weight = ratio if config.truncation is None else ratio.clamp(max=config.truncation)
        per_token = -keep * advantages * weight.detach() * logprobs
    if config.kl_coef:
        per_token = per_token + config.kl_coef * d * d
    return per_token, 1.0 - keep


def dppo_tv(logprobs, old, advantages, mask, config: DPPOTV):
    return dppo(logprobs, old, advantages, mask, config, tv_keep)


def dppo_kl(logprobs, old, advantages, mask, config: DPPOKL):
    return dppo(logprobs, old, advantages, mask, config, kl_keep)


DPPO_TV = Algorithm("dppo_tv", DPPOTV, dppo_tv, RL)
DPPO_KL = Algorithm("dppo_kl", DPPOKL, dppo_kl, RL)


def checked(top: TopLogprobs | None, mask: torch.Tensor, kind: str) -> TopLogprobs:
    if top is None:
        raise ValueError(f"loss dppo_{kind}_topk needs the behaviour policy's top logprobs: set "
                         "sampling.top_logprobs: K on the generate node")
    if bool(((mask > 0) & ~torch.isfinite(top.behaviour).any(-1)).any()):
        raise ValueError(f"loss dppo_{kind}_topk: a loss token has no recorded top logprobs (a workflow "
                         "that builds its trajectories by hand must fill top_ids / top_logprobs)")
    return top


def dppo_tv_topk(logprobs, old, advantages, mask, config: DPPOTVTopK, top: TopLogprobs | None = None):
    return dppo(logprobs, old, advantages, mask, config, top_k_keep("tv", checked(top, mask, "tv")))


def dppo_kl_topk(logprobs, old, advantages, mask, config: DPPOKLTopK, top: TopLogprobs | None = None):
    return dppo(logprobs, old, advantages, mask, config, top_k_keep("kl", checked(top, mask, "kl")))


DPPO_TV_TOPK = Algorithm("dppo_tv_topk", DPPOTVTopK, dppo_tv_topk, TOP_K)
DPPO_KL_TOPK = Algorithm("dppo_kl_topk", DPPOKLTopK, dppo_kl_topk, TOP_K)
