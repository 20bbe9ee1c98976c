"""The embedded engine's counters of its own steps (`EmbeddedEngine.stats()`, and the generate node's
`engine/` metrics), which `flowrl plan` fits a prefill's and a request's cost on (flowrl/plan/fit.py)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class StepStats:
    """Counters of the engine's steps since it started (`EmbeddedEngine.stats()`, and the generate
    node's `engine/` metrics): how many, how many prefilled, the requests they admitted, and their
    wall time as the scheduler waited for them. `flowrl plan` takes what a prefilling step and a
    request cost beside a decoding step from them."""

    steps: int = 0
    prefill_steps: int = 0  # steps that prefilled (newly admitted requests, or retracted ones at resume)
    admitted: int = 0  # requests given a slot
    step_seconds: float = 0.0
    prefill_step_seconds: float = 0.0  # of step_seconds, in the steps that prefilled

    def add(self, seconds: float, prefilled: bool) -> None:
        self.steps += 1
        self.step_seconds += seconds
        if prefilled:
            self.prefill_steps += 1
            self.prefill_step_seconds += seconds

    def as_dict(self) -> dict[str, float]:
        return asdict(self)
