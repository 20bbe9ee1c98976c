"""Outcome-only advantage estimators (registry `flowrl.advantages`): each row's score R_i is the sum of
its rewards (a KL penalty in the reward included, as verl), and its advantage, one number, is
placed on every model token of the row. Groups are the rows of one sample (`group_index`).
"""

from __future__ import annotations

from typing import Annotated

import torch
from msgspec import Meta

from flowrl_operators.config import AdvantageConfig, Probability
from flowrl_operators.training.advantages import AdvantageInputs, reward_to_go
from flowrl_operators.training.registry import Algorithm


class GRPOPassK(AdvantageConfig):
    """Pass@k: only the best row of each group gets an advantage, R_max - R_second, divided by
    (std_g R + eps) (unbiased) when std_normalize; ties go to the first row (arXiv 2503.19595;
    verl grpo_passk). Needs at least two rows per group."""

    std_normalize: bool = True
    eps: Annotated[float, Meta(ge=0)] = 1e-6


class OPO(AdvantageConfig):
    """Optimal baseline: A_i = R_i - sum_j n_j R_j / sum_j n_j, n_j the row's model tokens; a group of
    one uses baseline 0 (OPO, arXiv 2505.23585; verl opo)."""


class GPGAdvantage(AdvantageConfig):
    """A_i = alpha (R_i - mean_g R) / f_norm, alpha = B / (rows with R != 0, at least 1) over the batch;
    a group of one uses mean 0 (GPG, arXiv 2504.02546; verl gpg)."""

    f_norm: Annotated[float, Meta(gt=0)] = 1.0


class ReMax(AdvantageConfig):
    """A_t = G_t - b, G_t the reward-to-go (discount gamma per model token) and b the reward of the
    group's greedy sample, which generates with `greedy_baseline: true` and which carries no loss
    (ReMax, arXiv 2310.10505; verl remax, whose returns are G)."""

    gamma: Probability = 1.0


def _scores(x: AdvantageInputs) -> torch.Tensor:
    return x.rewards.sum(dim=1)


def _groups(x: AdvantageInputs) -> list[torch.Tensor]:
    return [(x.group_index == g).nonzero().squeeze(1) for g in x.group_index.unique()]


def _on_tokens(per_row: torch.Tensor, x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    advantages = per_row[:, None] * x.mask
    return advantages, advantages


def grpo_passk(x: AdvantageInputs, config: GRPOPassK) -> tuple[torch.Tensor, torch.Tensor]:
    scores, out = _scores(x), torch.zeros(x.rewards.shape[0])
    for rows in _groups(x):
        r = scores[rows]
        if r.numel() < 2:
            raise ValueError(f"advantage grpo_passk needs at least 2 trajectories per group, got {r.numel()}")
        top, index = torch.topk(r, 2)
        advantage = top[0] - top[1]
        if config.std_normalize:
            advantage = advantage / (r.std() + config.eps)
        out[rows[index[0]]] = advantage
    return _on_tokens(out, x)


def opo(x: AdvantageInputs, config: OPO) -> tuple[torch.Tensor, torch.Tensor]:
    scores, lengths, out = _scores(x), x.mask.sum(dim=1), torch.zeros(x.rewards.shape[0])
    for rows in _groups(x):
        baseline = (lengths[rows] * scores[rows]).sum() / lengths[rows].sum() if rows.numel() > 1 else 0.0
        out[rows] = scores[rows] - baseline
    return _on_tokens(out, x)


def gpg(x: AdvantageInputs, config: GPGAdvantage) -> tuple[torch.Tensor, torch.Tensor]:
    scores, out = _scores(x), torch.zeros(x.rewards.shape[0])
    alpha = scores.numel() / max(int(torch.count_nonzero(scores)), 1)
    for rows in _groups(x):
        mean = scores[rows].mean() if rows.numel() > 1 else 0.0
        out[rows] = alpha * (scores[rows] - mean) / config.f_norm
    return _on_tokens(out, x)


def remax(x: AdvantageInputs, config: ReMax) -> tuple[torch.Tensor, torch.Tensor]:
    if x.baseline is None:
        raise ValueError("advantage remax needs a greedy baseline per group: set greedy_baseline: true on "
                         "the generate node")
    scores, baseline = _scores(x), torch.zeros(x.rewards.shape[0])
    for rows in _groups(x):
        greedy = rows[x.baseline[rows] > 0]
        if greedy.numel() != 1:
            raise ValueError(f"advantage remax needs exactly one greedy baseline per group, found {greedy.numel()}")
        baseline[rows] = scores[greedy[0]]
    returns = reward_to_go(x.rewards, x.mask, config.gamma)
    return (returns - baseline[:, None]) * x.mask, returns


RL = frozenset({"token_rewards"})
GRPO_PASSK_ESTIMATOR = Algorithm("grpo_passk", GRPOPassK, grpo_passk, RL)
OPO_ESTIMATOR = Algorithm("opo", OPO, opo, RL)
GPG_ESTIMATOR = Algorithm("gpg", GPGAdvantage, gpg, RL)
REMAX_ESTIMATOR = Algorithm("remax", ReMax, remax, RL | {"baseline"})
