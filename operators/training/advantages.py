"""Advantage estimators: a registry of name -> function over packed per-token tensors.

Every estimator has the signature

    fn(inputs: AdvantageInputs, config: AdvantageConfig) -> tuple[advantages, returns]

with all tensors shaped (B, T) (target-aligned, see batch.py) and zero outside `mask`.

Rewards may be defined per sequence, per turn or per token: `inputs.rewards` holds them on the
tokens where they are defined (`inputs.reward_mask`). The group estimators follow DeepSeekMath's
process-supervision form, which reduces to the familiar outcome form for one reward per sequence:
each defined reward is normalised against the rewards of its group, then every model token gets
the sum of the normalised rewards at or after it (reward-to-go). A turn's reward is therefore
credited to the tokens of that turn (and, as part of the return, to the turns before it).

    grpo        r~ = (r - mean_g r) / (std_g r + eps)   (std_g unbiased; `std_normalize: false` drops it)
    dr_grpo     r~ = r - mean_g r                        (Dr.GRPO: no std, no length normalisation)
    rloo        r~ = r - mean of the rewards of the *other* trajectories of the group
    reinforce_pp  G_t = sum_{s>=t} gamma^(s-t) r_s; A = (G - mean_B G) / (std_B G + eps) over all
                  model tokens of the batch (REINFORCE++, batch-normalised)
    reinforce_pp_baseline  as reinforce_pp, on the returns of r - mean_g r (group mean baseline)
    gae         delta_t = r_t + gamma V_{t+1} - V_t, A_t = sum_l (gamma lam)^l delta_{t+l},
                returns = A + V; steps are the model tokens (environment tokens are not actions,
                their rewards join the preceding model token); A whitened over the batch
                unless `whiten: false`.

A group with a single reward uses mean 0 and std 1 (as verl does).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Literal

import msgspec
import torch

from flowrl_operators.training.batch import Batch


class AdvantageConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The train node schema's `advantage` keys (flowrl_operators.config), plus `whiten` and `eps`."""

    estimator: str = "grpo"
    std_normalize: bool = True  # grpo only
    gamma: float = 1.0
    lam: float = 1.0  # gae only
    whiten: bool = True  # gae only
    eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.estimator not in ADVANTAGES:
            raise ValueError(f"unknown advantage estimator {self.estimator!r}; choose one of {sorted(ADVANTAGES)}")
        if not 0.0 <= self.gamma <= 1.0 or not 0.0 <= self.lam <= 1.0:
            raise ValueError("advantage gamma and lam must lie in [0, 1]")


def advantage_config(value: str | dict | msgspec.Struct) -> AdvantageConfig:
    """An AdvantageConfig from YAML (an estimator name or a mapping) or from the node schema's."""
    if isinstance(value, AdvantageConfig):
        return value
    if isinstance(value, msgspec.Struct):
        value = msgspec.to_builtins(value)
    return msgspec.convert({"estimator": value} if isinstance(value, str) else value, AdvantageConfig)


def needs_values(config: AdvantageConfig) -> bool:
    """Whether the estimator needs critic values (a critic node before the trainer)."""
    return config.estimator == "gae"


@dataclasses.dataclass
class AdvantageInputs:
    rewards: torch.Tensor  # (B, T)
    reward_mask: torch.Tensor  # (B, T) 1 where a reward is defined
    mask: torch.Tensor  # (B, T) 1 on model tokens
    group_index: torch.Tensor  # (B,)
    values: torch.Tensor | None = None  # (B, T) critic values, gae only

    @staticmethod
    def of(batch: Batch) -> AdvantageInputs:
        return AdvantageInputs(batch.rewards, batch.reward_mask, batch.loss_mask, batch.group_index, batch.values)


Estimator = Callable[[AdvantageInputs, AdvantageConfig], tuple[torch.Tensor, torch.Tensor]]
ADVANTAGES: dict[str, Estimator] = {}


def register(name: str) -> Callable[[Estimator], Estimator]:
    def wrap(fn: Estimator) -> Estimator:
        ADVANTAGES[name] = fn
        return fn

    return wrap


def reward_to_go(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma * G_next, discounting once per model token; zero outside `mask`."""
    out = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype)
    for t in reversed(range(rewards.shape[1])):
        discount = torch.where(mask[:, t] > 0, gamma, 1.0)
        running = rewards[:, t] + discount * running
        out[:, t] = running
    return out * mask


def _group_normalised(x: AdvantageInputs, mode: Literal["std", "mean", "loo"], eps: float) -> torch.Tensor:
    """Each defined reward normalised against the defined rewards of its group."""
    out = torch.zeros_like(x.rewards)
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
            mean, std = values.mean(), values.std()
        else:
            mean, std = torch.tensor(0.0), torch.tensor(1.0)
        normalised = (r - mean) / (std + eps) if mode == "std" else r - mean
        out[rows] = torch.where(defined, normalised, 0.0)
    return out


def _whiten(x: torch.Tensor, mask: torch.Tensor, eps: float) -> torch.Tensor:
    values = x[mask > 0]
    if values.numel() < 2:
        return x * mask
    return (x - values.mean()) / (values.std() + eps) * mask


@register("grpo")
def grpo(x: AdvantageInputs, config: AdvantageConfig) -> tuple[torch.Tensor, torch.Tensor]:
    mode = "std" if config.std_normalize else "mean"
    advantages = reward_to_go(_group_normalised(x, mode, config.eps), x.mask, config.gamma)
    return advantages, reward_to_go(x.rewards, x.mask, config.gamma)


@register("dr_grpo")
def dr_grpo(x: AdvantageInputs, config: AdvantageConfig) -> tuple[torch.Tensor, torch.Tensor]:
    advantages = reward_to_go(_group_normalised(x, "mean", config.eps), x.mask, config.gamma)
    return advantages, reward_to_go(x.rewards, x.mask, config.gamma)


@register("rloo")
def rloo(x: AdvantageInputs, config: AdvantageConfig) -> tuple[torch.Tensor, torch.Tensor]:
    advantages = reward_to_go(_group_normalised(x, "loo", config.eps), x.mask, config.gamma)
    return advantages, reward_to_go(x.rewards, x.mask, config.gamma)


@register("reinforce_pp")
def reinforce_pp(x: AdvantageInputs, config: AdvantageConfig) -> tuple[torch.Tensor, torch.Tensor]:
    returns = reward_to_go(x.rewards, x.mask, config.gamma)
    return _whiten(returns, x.mask, config.eps), returns


@register("reinforce_pp_baseline")
def reinforce_pp_baseline(x: AdvantageInputs, config: AdvantageConfig) -> tuple[torch.Tensor, torch.Tensor]:
    centred = reward_to_go(_group_normalised(x, "mean", config.eps), x.mask, config.gamma)
    return _whiten(centred, x.mask, config.eps), reward_to_go(x.rewards, x.mask, config.gamma)


@register("gae")
def gae(x: AdvantageInputs, config: AdvantageConfig) -> tuple[torch.Tensor, torch.Tensor]:
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
        advantages = _whiten(advantages, x.mask, config.eps)
    return advantages, returns


def compute_advantages(batch: Batch, config: AdvantageConfig) -> Batch:
    """Fill `batch.advantages` and `batch.returns` with the configured estimator (in place)."""
    batch.advantages, batch.returns = ADVANTAGES[config.estimator](AdvantageInputs.of(batch), config)
    return batch
