"""The train node's objective, resolved through the registries (flowrl_operators.training.registry):
the loss with its correction, KL estimator and aggregation, and the advantage estimator.

`problems(loss, advantage)` is what `flowrl validate` reports (key paths under the train node);
the other functions answer what a step must compute before the loss.
"""

from __future__ import annotations

from typing import Any

from flowrl_operators.config import UNBOUNDED_WEIGHT, AdvantageConfig, KLConfig, LossConfig
from flowrl_operators.training.registry import ADVANTAGES, AGGREGATIONS, CORRECTIONS, KL, LOSSES

Problems = list[tuple[tuple[Any, ...], str]]


def loss_config(value: Any) -> LossConfig:
    """The typed config of the loss YAML names (NAME or {kind: NAME, ...}); nested selections
    (correction, kl, aggregation) are checked too."""
    config = LOSSES.config(value)
    for nested in (kl_config, aggregation_config, correction_config):
        nested(config)  # raises on an unknown name or key
    return config


def advantage_config(value: Any) -> AdvantageConfig:
    return ADVANTAGES.config(value)


def kl_config(loss: LossConfig) -> KLConfig:
    return KL.config(loss.kl)


def aggregation_config(loss: LossConfig) -> Any:
    return AGGREGATIONS.config(loss.aggregation)


def correction_config(loss: LossConfig) -> Any:
    return None if loss.correction is None else CORRECTIONS.config(loss.correction)


def problems(loss: Any, advantage: Any) -> Problems:
    """Every problem of a train node's `loss` and `advantage` keys, as (key path, message)."""
    typed, found = LOSSES.problems(loss, ("loss",))
    found = [(("loss", "decoupled") if message == UNBOUNDED_WEIGHT else path, message) for path, message in found]
    if typed is not None:
        nested = ((KL, typed.kl, "kl"), (AGGREGATIONS, typed.aggregation, "aggregation"),
                  (CORRECTIONS, typed.correction, "correction"))
        for registry, value, key in nested:
            if value is not None:
                found += registry.problems(value, ("loss", key))[1]
    estimator, more = ADVANTAGES.problems(advantage, ("advantage",))
    found += more
    if not found:
        try:
            check_compatible(typed, estimator)
        except ValueError as e:
            found.append((("loss", "kl", "apply_as"), str(e)))
    return found


def supervised(loss: LossConfig) -> bool:
    return loss.supervised


def needs_proximal(loss: LossConfig) -> bool:
    """Whether the trainer must recompute proximal logprobs (`Trainer.compute_logprobs`) first."""
    # Supervised targets have no behaviour policy: decoupled / correction keys set for the RL phase
    # of a pipeline must not weight an `sft` loss (exp(proximal - 0) would sharpen it).
    return not loss.supervised and (loss.decoupled or loss.correction is not None)


def step_passes(loss: LossConfig, epochs: int, gradient_checkpointing: bool) -> float:
    """A train step's passes over its tokens in forward-pass units (`CostShape.passes`): each epoch a
    forward and a backward (3), one more forward with gradient checkpointing (it recomputes the
    activations), and the proximal policy's forward a decoupled loss or a correction needs, once or
    each epoch."""
    proximal = (epochs if loss.proximal_each_epoch else 1) if needs_proximal(loss) else 0
    return float(epochs * (3 + gradient_checkpointing) + proximal)


def needs_reference(loss: LossConfig) -> bool:
    """Whether the loss needs reference logprobs (a reference node before the trainer)."""
    return kl_config(loss).coef > 0


def needs_top_logprobs(loss: LossConfig) -> bool:
    """Whether the loss reads the behaviour policy's top-K tokens (generate sampling.top_logprobs)."""
    return "top_logprobs" in LOSSES.of(loss).needs


def needs_values(advantage: AdvantageConfig) -> bool:
    """Whether the estimator needs critic values (a critic node before the trainer)."""
    return "values" in ADVANTAGES.of(advantage).needs


def needs_baseline(advantage: AdvantageConfig) -> bool:
    """Whether the estimator needs a greedy baseline row per group (generate greedy_baseline: true);
    any other estimator would count such rows as samples."""
    return "baseline" in ADVANTAGES.of(advantage).needs


def check_compatible(loss: LossConfig, advantage: AdvantageConfig) -> None:
    """Reject a KL reward penalty that the chosen estimator would silently ignore."""
    kl = kl_config(loss)
    if kl.apply_as == "reward" and kl.coef > 0 and "token_rewards" not in ADVANTAGES.of(advantage).needs:
        raise ValueError(
            f"kl apply_as 'reward' has no effect with advantage {advantage.estimator!r} (it normalises "
            "the defined rewards only); use kl apply_as 'loss', or an estimator that reads every token's "
            "reward (e.g. reinforce_pp or gae)"
        )
