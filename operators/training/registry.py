"""Algorithm registries: losses, advantage estimators, KL estimators, corrections, aggregations.

Each concept is one entry-point group, and each entry one `Algorithm`: its name, its config (a
msgspec Struct subclassing the concept's config class in flowrl_operators.config, whose docstring
gives the formula and its source, and whose fields are the YAML keys the entry reads) and the
function that computes it. The built-ins register through pyproject.toml as a plugin would:

    [project.entry-points."flowrl.losses"]
    my_loss = "my_pkg.losses:MY_LOSS"        # MY_LOSS = Algorithm("my_loss", MyLossConfig, my_loss)

YAML names an entry with the concept's key and writes the entry's keys alongside it:

    loss: {kind: cispo, clip_high: 4.0, aggregation: token_mean, kl: {coef: 0.01, estimator: k3}}
    advantage: {estimator: grpo, unbiased_std: false}

The function of each concept is called as (tensors (B, T), target-aligned, see batch.py):
    losses        fn(logprobs, old, advantages, mask, config) -> (per-token loss, clipped 0/1);
                  an entry that needs "top_logprobs" is also given top=TopLogprobs (losses/dppo.py)
    advantages    fn(AdvantageInputs, config) -> (advantages, returns)
    kl            fn(logprobs, reference, config) -> per-token estimate
    corrections   fn(proximal, behaviour, mask, config, reduce) -> per-token weight, 0 = masked
                  (`reduce` sums a list of floats over the ranks, for batch statistics)
    aggregations  fn(per_token, mask, normaliser, config) -> the loss
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from flowrl import plugins
from flowrl.spec.load import validation_problem
from flowrl_operators.config import (
    AdvantageConfig,
    AggregationConfig,
    CorrectionConfig,
    KLConfig,
    LossConfig,
)


class AlgorithmError(ValueError):
    """An algorithm name that is not registered, or an entry that breaks its registry's contract."""


@dataclass(frozen=True)
class Algorithm:
    name: str
    config: type[msgspec.Struct]  # its YAML keys: a subclass of the concept's config class
    fn: Callable[..., Any]  # the computation, called as its registry documents
    # What it reads beyond the basics: losses "advantages" (every RL loss), "top_logprobs" (the
    # behaviour policy's top-K tokens: generate sampling.top_logprobs); advantages "values"
    # (a critic), "baseline" (greedy baseline rows), "token_rewards" (every token's reward, so a
    # KL penalty in the reward reaches it).
    needs: frozenset[str] = field(default_factory=frozenset)

    @property
    def doc(self) -> str:
        return " ".join((self.config.__doc__ or "").split())


@dataclass(frozen=True)
class Registry:
    concept: str  # how errors name an entry: "loss", "advantage estimator", ...
    group: str  # the entry-point group
    base: type[msgspec.Struct]  # the concept's config class; every entry's config subclasses it
    key: str  # the YAML key that names the entry
    default: str

    def entries(self) -> dict[str, Algorithm]:
        try:
            return plugins.load(self.group, self._check)
        except AlgorithmError:
            raise
        except Exception as e:  # a plugin that does not import: a located error, not a traceback
            raise AlgorithmError(f"loading the {self.group} entry points failed: {type(e).__name__}: {e}") from e

    def _check(self, name: str, target: str, value: Any) -> None:
        if not isinstance(value, Algorithm) or value.name != name:
            raise AlgorithmError(f"entry point {name} = {target} ({self.group}) is not an Algorithm named {name!r}")
        if not (isinstance(value.config, type) and issubclass(value.config, self.base)):
            raise AlgorithmError(f"{self.concept} {name!r}: its config must subclass {self.base.__name__}")

    def names(self) -> list[str]:
        return sorted(self.entries())

    def get(self, name: str) -> Algorithm:
        found = self.entries().get(name)
        if found is None and not self.entries():  # an install made before the entry points existed
            raise AlgorithmError(f"no {self.concept} is registered (entry points {self.group}): reinstall "
                                 "flowrl (pip install -e .) so that its pyproject.toml entry points are seen")
        if found is None:
            raise AlgorithmError(plugins.missing(self.concept, name, self.group, self.names()))
        return found

    def of(self, config: msgspec.Struct) -> Algorithm:
        """The entry a config (made by `config`) selects."""
        return self.get(getattr(config, self.key))

    def config(self, value: str | Mapping[str, Any] | msgspec.Struct | None) -> Any:
        """The typed config of the entry that YAML names: NAME, or {key: NAME, ...its keys}, or the
        concept's default entry when the name is left out."""
        if isinstance(value, self.base) and type(value) is self.get(getattr(value, self.key)).config:
            return value
        if isinstance(value, msgspec.Struct):  # e.g. the concept's base class: convert to the entry's
            value = msgspec.to_builtins(value)
        data = {self.key: value} if isinstance(value, str) else dict(value or {})
        name = data.setdefault(self.key, self.default)
        if not isinstance(name, str):
            raise AlgorithmError(f"{self.key} must be a {self.concept} name, got {name!r}")
        return msgspec.convert(data, self.get(name).config)

    def problems(self, value: Any, path: tuple[str, ...]) -> tuple[Any, list[tuple[tuple[Any, ...], str]]]:
        """(the typed config or None, [(key path, message)]) for a YAML value at `path`."""
        try:
            return self.config(value), []
        except AlgorithmError as e:
            return None, [((*path, self.key) if isinstance(value, Mapping) else path, str(e))]
        except msgspec.ValidationError as e:
            data = {self.key: value} if isinstance(value, str) else value
            name = (data or {}).get(self.key, self.default)
            where, message, _ = validation_problem(e, data, self.get(name).config)
            return None, [((*path, *where), message)]


LOSSES = Registry("loss", "flowrl.losses", LossConfig, "kind", "ppo_clip")
ADVANTAGES = Registry("advantage estimator", "flowrl.advantages", AdvantageConfig, "estimator", "grpo")
KL = Registry("KL estimator", "flowrl.kl", KLConfig, "estimator", "k3")
CORRECTIONS = Registry("correction", "flowrl.corrections", CorrectionConfig, "kind", "tis")
AGGREGATIONS = Registry("aggregation", "flowrl.aggregations", AggregationConfig, "kind", "token_mean")
REGISTRIES = (LOSSES, ADVANTAGES, KL, CORRECTIONS, AGGREGATIONS)
