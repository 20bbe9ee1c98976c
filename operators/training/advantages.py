"""Advantage estimators (registry `flowrl.advantages`) over packed per-token tensors: the group,
return and critic estimators here, the outcome-only ones (grpo_passk, opo, gpg, remax) in
advantages_outcome.py. Every estimator is called as

    fn(inputs: AdvantageInputs, config) -> tuple[advantages, returns]

with all tensors shaped (B, T) (target-aligned, see batch.py) and zero outside `mask`; each
config's docstring gives its formula.

Rewards may be defined per sequence, per turn or per token: `inputs.rewards` holds them on the
tokens where they are defined (`inputs.reward_mask`). The group estimators here follow
DeepSeekMath's process-supervision form, which reduces to the familiar outcome form for one reward
per sequence: each defined reward is normalised against the rewards of its group, then every model
token gets the sum of the normalised rewards at or after it (reward-to-go). A turn's reward is
therefore credited to the tokens of that turn (and, as part of the return, to the turns before it).
A group with a single reward uses mean 0 and std 1 (as verl does).
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Literal

import torch
from msgspec import Meta

from flowrl_operators.config import AdvantageConfig, Probability
from flowrl_operators.training.batch import Batch
from flowrl_operators.training.registry import ADVANTAGES, Algorithm

Whiten = Annotated[float, Meta(ge=0)]
Tied = Literal["zero", "batch"]


class GRPO(AdvantageConfig):
    """r~ = (r - mean_g r) / (std_g r + eps) per defined reward, then reward-to-go (GRPO,
    DeepSeekMath arXiv 2402.03300; verl grpo with norm_adv_by_std_in_grpo). AReaL normalises over
    tokens instead: advantage token_norm."""

    std_normalize: bool = True  # false: r - mean_g r (verl norm_adv_by_std_in_grpo: false)
    unbiased_std: bool = True  # false: the biased (population) std
    eps: Whiten = 1e-6  # added to the std
    gamma: Probability = 1.0  # discount of the reward-to-go, per model token
    # position: each defined reward against the group's rewards at the same position, the k-th
    # defined reward of every row (mean and std per k), so per-token or per-turn credit is compared
    # like with like; the same as group for one reward per sequence. Why: pooled over a mostly-right
    # group, the rare right token at a position every other sample gets wrong scores no higher than
    # any right token elsewhere (docs/benchmarks.md, the quickstart).
    baseline: Literal["group", "position"] = "group"
    # tied: what a reward tied across its group gets (the same at that position in every row, or
    # one value for the whole group: no signal inside it). zero: advantage 0, as GRPO. batch: it is
    # normalised against the batch's rewards at that position (or all of them) instead, the baseline
    # REINFORCE++ gives every reward, so an answer every sample of a group repeats is still pushed
    # up or down by how it compares with the rest of the batch (docs/benchmarks.md, the quickstart).
    tied: Tied = "zero"


class DrGRPO(AdvantageConfig):
    """r~ = r - mean_g r, no std and no length normalisation (Dr.GRPO, arXiv 2503.20783)."""

    gamma: Probability = 1.0


class RLOO(AdvantageConfig):
    """r~ = r - mean of the other trajectories' rewards in the group; a group of one keeps r
    (RLOO, arXiv 2402.14740; verl rloo; verl rloo_vectorized gives 0 to a group of one)."""

    gamma: Probability = 1.0


class ReinforcePP(AdvantageConfig):
    """G_t = sum_{s>=t} gamma^(s-t) r_s; A = (G - mean_B G) / sqrt(var_B G + eps), unbiased variance
    over all model tokens of the batch (REINFORCE++, arXiv 2501.03262; verl reinforce_plus_plus and
    masked_whiten)."""

    gamma: Probability = 1.0
    eps: Whiten = 1e-8  # inside the square root, as verl's masked_whiten


class ReinforcePPBaseline(AdvantageConfig):
    """reinforce_pp on the returns of r - mean_g r (group mean baseline), whitened over the batch
    (REINFORCE++-baseline, arXiv 2501.03262; verl reinforce_plus_plus_baseline)."""

    gamma: Probability = 1.0
    eps: Whiten = 1e-8  # inside the square root of the whitening


class GAE(AdvantageConfig):
    """delta_t = r_t + gamma V_{t+1} - V_t, A_t = sum_l (gamma lam)^l delta_{t+l}, returns = A + V;
    steps are the model tokens (environment tokens are not actions, their rewards join the preceding
    model token); A whitened over the batch unless `whiten: false` (GAE, arXiv 1506.02438; verl gae)."""

    gamma: Probability = 1.0
    lam: Probability = 1.0
    whiten: bool = True
    eps: Whiten = 1e-8  # inside the square root of the whitening


Level = Literal["group", "batch", "none"]


class TokenNorm(AdvantageConfig):
    """AReaL's PPO actor without a critic: G_t = reward-to-go (discount gamma per model token: GAE
    with V = 0, AReaL's discount x gae_lambda), then A = (G - mean) / (std + eps) with mean and std
    over the model *tokens* of the group (or the batch), so a longer sequence weighs more (AReaL
    adv_norm: mean_level, std_level, mean_leave1out, std_unbiased, eps; a group of one row has mean 0
    with leave_one_out and std 1 with unbiased_std, as AReaL's group_size 1)."""

    mean_level: Level = "group"
    std_level: Level = "group"  # none: no division (and no eps)
    unbiased_std: bool = True
    leave_one_out: bool = False  # each token's mean leaves that token out (AReaL mean_leave1out)
    eps: Whiten = 1e-5
    gamma: Probability = 1.0


@dataclasses.dataclass
class AdvantageInputs:
    rewards: torch.Tensor  # (B, T)
    reward_mask: torch.Tensor  # (B, T) 1 where a reward is defined
    mask: torch.Tensor  # (B, T) 1 on model tokens
    group_index: torch.Tensor  # (B,)
    values: torch.Tensor | None = None  # (B, T) critic values, gae only
    baseline: torch.Tensor | None = None  # (B,) 1 on greedy baseline rows (generate greedy_baseline)

    @staticmethod
    def of(batch: Batch) -> AdvantageInputs:
        return AdvantageInputs(batch.rewards, batch.reward_mask, batch.loss_mask, batch.group_index, batch.values,
                               batch.baseline)


def reward_to_go(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma * G_next, discounting once per model token; zero outside `mask`."""
    out = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype)
    for t in reversed(range(rewards.shape[1])):
        discount = torch.where(mask[:, t] > 0, gamma, 1.0)
        running = rewards[:, t] + discount * running
        out[:, t] = running
    return out * mask


def _group_normalised(x: AdvantageInputs, mode: Literal["std", "mean", "loo"], eps: float,
                      unbiased: bool = True, tied: Tied = "zero") -> torch.Tensor:
    """Each defined reward normalised against the defined rewards of its group (`tied: batch`: a
    group whose defined rewards are all equal against the batch's instead)."""
    out = torch.zeros_like(x.rewards)
    every = x.rewards[x.reward_mask > 0] if tied == "batch" else None
    for g in x.group_index.unique():
        rows = (x.group_index == g).nonzero().squeeze(1)
        defined = x.reward_mask[rows] > 0
        r = x.rewards[rows]
        values = r[defined]
        if mode == "loo":
            # Leave-one-out: the baseline of a row is the mean of the other rows' rewards.
            total, count = values.sum(), values.numel()
            own_sum = (r * defined).sum(dim=1, keepdim=True)
            own_count = defined.sum(dim=1, keepdim=True)
            others = (count - own_count).clamp(min=1)
            baseline = torch.where(count - own_count > 0, (total - own_sum) / others, 0.0)
            out[rows] = torch.where(defined, r - baseline, 0.0)
            continue
        if values.numel() > 1:
            mean, std = values.mean(), values.std(unbiased=unbiased)
            if every is not None and std == 0 and every.numel() > 1:
                mean, std = every.mean(), every.std(unbiased=unbiased)
        else:
            mean, std = torch.tensor(0.0), torch.tensor(1.0)
        normalised = (r - mean) / (std + eps) if mode == "std" else r - mean
        out[rows] = torch.where(defined, normalised, 0.0)
    return out


def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the masked values, unbiased variance (verl masked_whiten)."""
    values = x[mask > 0]
    if values.numel() < 2:
        return x * mask
    return (x - values.mean()) / torch.sqrt(values.var() + eps) * mask


def _by_index(k: torch.Tensor, values: torch.Tensor, unbiased: bool) -> tuple[torch.Tensor, ...]:
    """Count, mean and std of `values` per index `k` (std 0 where an index has one value)."""
    count = torch.zeros(int(k.max()) + 1 if k.numel() else 0, dtype=values.dtype)
    count.index_add_(0, k, torch.ones_like(values))
    mean = torch.zeros_like(count).index_add_(0, k, values) / count.clamp(min=1)
    squares = torch.zeros_like(count).index_add_(0, k, (values - mean[k]) ** 2)
    return count, mean, (squares / (count - 1 if unbiased else count).clamp(min=1)).sqrt()


def _defined_index(defined: torch.Tensor) -> torch.Tensor:
    """The index k of each defined reward within its row (the k-th defined reward of the row)."""
    return (defined.long().cumsum(dim=1) - 1).clamp(min=0)[defined]


def _position_normalised(x: AdvantageInputs, std: bool, eps: float, unbiased: bool,
                         tied: Tied = "zero") -> torch.Tensor:
    """Each defined reward normalised against its group's defined rewards of the same index k (the
    k-th defined reward of each row); an index only one row reaches uses mean 0 and std 1. With
    `tied: batch` an index whose group rewards are all equal uses the batch's rewards at k."""
    out = torch.zeros_like(x.rewards)
    batch = None  # with tied: batch, the batch's count, mean and std per index, for the tied ones
    if tied == "batch":
        all_defined = x.reward_mask > 0
        batch = _by_index(_defined_index(all_defined), x.rewards[all_defined], unbiased)
    for g in x.group_index.unique():
        rows = (x.group_index == g).nonzero().squeeze(1)
        defined = x.reward_mask[rows] > 0
        values = x.rewards[rows][defined]
        k = _defined_index(defined)
        count, mean, spread = _by_index(k, values, unbiased)
        many = count[k] > 1
        if batch is not None:  # no signal inside the group at k: take the batch's mean and spread there
            use_batch = many & (spread[k] == 0) & (batch[0][k] > 1)
            mean, spread = torch.where(use_batch, batch[1][k], mean[k]), torch.where(use_batch, batch[2][k], spread[k])
        else:
            mean, spread = mean[k], spread[k]
        centred = torch.where(many, values - mean, values)
        normalised = torch.where(many, centred / (spread + eps), centred) if std else centred
        out[rows] = out[rows].masked_scatter(defined, normalised)
    return out


def grpo(x: AdvantageInputs, config: GRPO) -> tuple[torch.Tensor, torch.Tensor]:
    mode = "std" if config.std_normalize else "mean"
    if config.baseline == "position":
        normalised = _position_normalised(x, config.std_normalize, config.eps, config.unbiased_std, config.tied)
    else:
        normalised = _group_normalised(x, mode, config.eps, config.unbiased_std, config.tied)
    advantages = reward_to_go(normalised, x.mask, config.gamma)
    return advantages, reward_to_go(x.rewards, x.mask, config.gamma)


def dr_grpo(x: AdvantageInputs, config: DrGRPO) -> tuple[torch.Tensor, torch.Tensor]:
    advantages = reward_to_go(_group_normalised(x, "mean", 0.0), x.mask, config.gamma)
    return advantages, reward_to_go(x.rewards, x.mask, config.gamma)


def rloo(x: AdvantageInputs, config: RLOO) -> tuple[torch.Tensor, torch.Tensor]:
    advantages = reward_to_go(_group_normalised(x, "loo", 0.0), x.mask, config.gamma)
    return advantages, reward_to_go(x.rewards, x.mask, config.gamma)


def reinforce_pp(x: AdvantageInputs, config: ReinforcePP) -> tuple[torch.Tensor, torch.Tensor]:
    returns = reward_to_go(x.rewards, x.mask, config.gamma)
    return whiten(returns, x.mask, config.eps), returns


def reinforce_pp_baseline(x: AdvantageInputs, config: ReinforcePPBaseline) -> tuple[torch.Tensor, torch.Tensor]:
    centred = reward_to_go(_group_normalised(x, "mean", 0.0), x.mask, config.gamma)
    return whiten(centred, x.mask, config.eps), reward_to_go(x.rewards, x.mask, config.gamma)


def gae(x: AdvantageInputs, config: GAE) -> tuple[torch.Tensor, torch.Tensor]:
    if x.values is None:
        raise ValueError("advantage 'gae' needs critic values: add a critic node before the trainer")
    rows, steps = x.rewards.shape
    advantages = torch.zeros_like(x.rewards)
    running = torch.zeros(rows)
    next_value = torch.zeros(rows)
    pending = torch.zeros(rows)  # rewards on environment tokens after the current model token
    for t in reversed(range(steps)):
        is_step = x.mask[:, t] > 0
        reward = x.rewards[:, t] + pending
        delta = reward + config.gamma * next_value - x.values[:, t]
        running = torch.where(is_step, delta + config.gamma * config.lam * running, running)
        advantages[:, t] = torch.where(is_step, running, 0.0)
        next_value = torch.where(is_step, x.values[:, t], next_value)
        pending = torch.where(is_step, 0.0, pending + x.rewards[:, t])
    returns = (advantages + x.values) * x.mask
    if config.whiten:
        advantages = whiten(advantages, x.mask, config.eps)
    return advantages, returns


def _token_mean(g: torch.Tensor, m: torch.Tensor, leave_one_out: bool, one_row: bool) -> torch.Tensor:
    """AReaL Normalization's mean over the masked tokens, per token (leave-one-out: without it)."""
    total, count = (g * m).sum(), m.sum()
    if leave_one_out:
        if count <= 1 or one_row:
            return torch.zeros_like(g)
        return torch.where(m > 0, (total - g * m) / (count - m).clamp(min=1.0), total / count)
    return (total / count if count > 0 else torch.tensor(0.0)).expand_as(g)


def _token_std(g: torch.Tensor, m: torch.Tensor, mean: torch.Tensor, unbiased: bool, one_row: bool) -> torch.Tensor:
    squares, count = ((g * m - mean * m) ** 2).sum(), m.sum()
    if unbiased:
        return torch.sqrt(squares / (count - 1)) if count > 1 and not one_row else torch.tensor(1.0)
    return torch.sqrt(squares / count) if count > 0 else torch.tensor(1.0)


def token_norm(x: AdvantageInputs, config: TokenNorm) -> tuple[torch.Tensor, torch.Tensor]:
    returns = reward_to_go(x.rewards, x.mask, config.gamma)
    groups = [(x.group_index == g).nonzero().squeeze(1) for g in x.group_index.unique()]
    everything = [torch.arange(x.rewards.shape[0])]
    mean, std = torch.zeros_like(returns), torch.ones_like(returns)
    if config.mean_level != "none":
        for rows in groups if config.mean_level == "group" else everything:
            one_row = config.mean_level == "group" and rows.numel() == 1
            mean[rows] = _token_mean(returns[rows], x.mask[rows], config.leave_one_out, one_row)
    if config.std_level != "none":
        for rows in groups if config.std_level == "group" else everything:
            one_row = config.std_level == "group" and rows.numel() == 1
            std[rows] = _token_std(returns[rows], x.mask[rows], mean[rows], config.unbiased_std, one_row)
    eps = config.eps if config.std_level != "none" else 0.0
    return (returns - mean) * x.mask / (std + eps), returns


def compute_advantages(batch: Batch, config: AdvantageConfig) -> Batch:
    """Fill `batch.advantages` and `batch.returns` with the configured estimator (in place)."""
    config = ADVANTAGES.config(config)
    entry = ADVANTAGES.of(config)
    if batch.baseline is not None and batch.baseline.any() and "baseline" not in entry.needs:
        raise ValueError(f"the batch has greedy baseline rows (generate greedy_baseline: true), which advantage "
                         f"{config.estimator!r} would count as samples; use advantage remax, or drop the option")
    batch.advantages, batch.returns = entry.fn(AdvantageInputs.of(batch), config)
    return batch


def tied_group_fraction(batch: Batch) -> float | None:
    """The share of groups (of at least two sampled trajectories) whose trajectories all got the same
    rewards: zero reward variance across the group, no sample did better than another, so the group
    carries no comparison to learn from (a group-relative estimator gives a sequence reward's group
    zero advantage). With turn or token rewards: the same rewards, in the same order. Greedy
    baseline rows are no samples and are left out. None: no such group."""
    sampled = torch.ones(batch.size, dtype=torch.bool) if batch.baseline is None else batch.baseline == 0
    tied = groups = 0
    for g in batch.group_index[sampled].unique():
        rows = ((batch.group_index == g) & sampled).nonzero().squeeze(1).tolist()
        if len(rows) < 2:
            continue
        values = [batch.rewards[r][batch.reward_mask[r] > 0] for r in rows]
        groups += 1
        tied += all(v.shape == values[0].shape and bool(torch.allclose(v, values[0], rtol=0.0, atol=1e-6))
                    for v in values[1:])
    return tied / groups if groups else None


TOKEN_REWARDS = frozenset({"token_rewards"})
GRPO_ESTIMATOR = Algorithm("grpo", GRPO, grpo)
DR_GRPO_ESTIMATOR = Algorithm("dr_grpo", DrGRPO, dr_grpo)
RLOO_ESTIMATOR = Algorithm("rloo", RLOO, rloo)
REINFORCE_PP_ESTIMATOR = Algorithm("reinforce_pp", ReinforcePP, reinforce_pp, TOKEN_REWARDS)
REINFORCE_PP_BASELINE_ESTIMATOR = Algorithm("reinforce_pp_baseline", ReinforcePPBaseline, reinforce_pp_baseline,
                                            TOKEN_REWARDS)
GAE_ESTIMATOR = Algorithm("gae", GAE, gae, TOKEN_REWARDS | {"values"})
TOKEN_NORM_ESTIMATOR = Algorithm("token_norm", TokenNorm, token_norm, TOKEN_REWARDS)
