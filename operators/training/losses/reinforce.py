"""Policy-gradient losses without a ratio (registry `flowrl.losses`): the REINFORCE term -A logp,
per token, with A the advantage and old the behaviour logprobs (or the proximal ones under a
correction). Each returns (per-token loss, 1.0 where a weight was truncated).
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

import torch
from msgspec import Meta

from flowrl_operators.config import LossConfig
from flowrl_operators.training.registry import Algorithm

RL = frozenset({"advantages"})


class Reinforce(LossConfig):
    """Vanilla REINFORCE: l = -A logp (Williams 1992; verl's reinforce loss without IS weights)."""

    reads_behaviour: ClassVar[bool] = False  # -A logp: stale tokens need a correction


class GPG(LossConfig):
    """Group policy gradient: l = -A logp, the REINFORCE term, with GPG's advantage (advantage
    `gpg`) (GPG, arXiv 2504.02546; verl gpg)."""

    reads_behaviour: ClassVar[bool] = False


class ReinforceBypass(LossConfig):
    """REINFORCE with the behaviour ratio taken from the current policy, without a proximal pass:
    l = -sg(w) A logp, w = min(exp(clamp(sg(logp) - old, +-20)), threshold) per token, or per sequence
    with the sum of the sequence's log ratios (verl bypass_mode with loss_type reinforce and
    rollout_is token / sequence). With a correction (e.g. tis with reject checks and normalise:
    kept, for verl's rollout_rs), a no-grad pass before every epoch computes the current policy's
    logprobs as the proximal ones: w is then 1 and the correction's weights and rejection, from the
    current policy, apply, the kept tokens counted before the forward pass."""

    level: Literal["token", "sequence"] = "token"
    threshold: Annotated[float, Meta(gt=0)] = 2.0

    # The proximal pass runs before every epoch (not once per step): bypass mode's weights are
    # always the current policy's (operators/train.py).
    proximal_each_epoch: ClassVar[bool] = True


def reinforce(logprobs, old, advantages, mask, config: LossConfig):
    return -advantages * logprobs, torch.zeros_like(logprobs)


def reinforce_bypass(logprobs, old, advantages, mask, config: ReinforceBypass):
    log_w = torch.where(mask > 0, logprobs.detach() - old, 0.0)
    if config.level == "sequence":
        log_w = log_w.sum(dim=1, keepdim=True).expand_as(logprobs)
    w = torch.exp(log_w.clamp(-20.0, 20.0))
    truncated = w.clamp(max=config.threshold)
    return -truncated * advantages * logprobs, (truncated != w).float()


REINFORCE = Algorithm("reinforce", Reinforce, reinforce, RL)
GPG_LOSS = Algorithm("gpg", GPG, reinforce, RL)
REINFORCE_BYPASS = Algorithm("reinforce_bypass", ReinforceBypass, reinforce_bypass, RL)
