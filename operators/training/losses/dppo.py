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

The paper's Top-K approximation needs the old policy's K most likely tokens and their
probabilities at every position, which a trajectory does not record: not offered.
"""

from __future__ import annotations

from typing import Annotated, Literal

import torch
from msgspec import Meta

from flowrl_operators.config import LossConfig
from flowrl_operators.training.registry import Algorithm

RL = frozenset({"advantages"})
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
