"""KL estimators (registry `flowrl.kl`), per token, of KL(pi || pi_ref) from d = logp - ref
(J. Schulman, "Approximating KL divergence", 2020; the names are verl's `kl_penalty` /
`kl_loss_type`s).

Every estimator takes `straight_through: true`: the value of the estimator with the gradient of k2,
value = sg(k) + k2 - sg(k2), as verl's `k1+`, `k3+`, `low_var_kl+` (k1 and k3 are unbiased values
of KL but their gradients are not the gradient of KL; k2's is).
"""

from __future__ import annotations

from typing import Annotated

import torch
from msgspec import Meta

from flowrl_operators.config import KLConfig
from flowrl_operators.training.registry import Algorithm

Positive = Annotated[float, Meta(gt=0)]


class K1(KLConfig):
    """k1 = d (verl k1 / kl)."""

    straight_through: bool = False  # the gradient of k2 under this value (verl's k1+)


class K2(KLConfig):
    """k2 = d^2 / 2 (verl k2 / mse); its gradient is the gradient of KL already."""


class K3(KLConfig):
    """k3 = exp(-d') - 1 + d', d' = clamp(d, -max_log_ratio, max_log_ratio), then clamped to at most
    max_value (verl k3 / low_var_kl, with its bounds 20 and 10; AReaL k3 clamps at 10 only)."""

    straight_through: bool = False  # the gradient of k2 under this value (verl's k3+)
    max_log_ratio: Positive | None = 20.0  # None: no clamp of d
    max_value: Positive | None = 10.0  # None: no clamp of the estimate


class Abs(KLConfig):
    """|d| (verl abs)."""

    straight_through: bool = False  # the gradient of k2 under this value


def _straight_through(value: torch.Tensor, d: torch.Tensor, on: bool) -> torch.Tensor:
    if not on:
        return value
    k2 = 0.5 * d * d
    return k2 - k2.detach() + value.detach()


def k1(logprobs, reference, config: K1) -> torch.Tensor:
    d = logprobs - reference
    return _straight_through(d, d, config.straight_through)


def k2(logprobs, reference, config: K2) -> torch.Tensor:
    d = logprobs - reference
    return 0.5 * d * d


def k3(logprobs, reference, config: K3) -> torch.Tensor:
    d = logprobs - reference
    bounded = d if config.max_log_ratio is None else d.clamp(-config.max_log_ratio, config.max_log_ratio)
    value = torch.exp(-bounded) - 1 + bounded
    if config.max_value is not None:
        value = value.clamp(max=config.max_value)
    return _straight_through(value, d, config.straight_through)


def absolute(logprobs, reference, config: Abs) -> torch.Tensor:
    d = logprobs - reference
    return _straight_through(d.abs(), d, config.straight_through)


K1_ESTIMATOR = Algorithm("k1", K1, k1)
K2_ESTIMATOR = Algorithm("k2", K2, k2)
K3_ESTIMATOR = Algorithm("k3", K3, k3)
ABS_ESTIMATOR = Algorithm("abs", Abs, absolute)
