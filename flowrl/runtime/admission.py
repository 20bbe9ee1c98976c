"""Admission: which sample a generate node is handed next, and whether it may be handed one now.

One `Admission` per generate node (in the spirit of AReaL's StalenessManager: a few callbacks, one
formula). Its facts come from the plan (flowrl/graph/facts.py): `budget` and `credited`.

The rule. A generate replica that has loaded policy version `v` (the clock for a generate node
without a weights input; the lower of the two otherwise) is handed a new sample only while

    issued < (v + budget + 1) * per_step + credit     and     issued < steps * per_step + run credit

`issued` counts the samples handed out so far (`cursor`: sample `index` of data step `step` is
number step * per_step + index); `per_step` is data.batch_size, or the step's initial sample
count when a filter over-samples (quota.py). `credit` counts this node's samples that will never
reach a train node (rejected, filtered, dropped: `lose`) and is kept only where the node is
`credited` (budget > 0 and every train node it feeds has an async input): an async train step
fills its batch from later steps, so without the credit one lost sample keeps every later batch
one sample short of what was admitted, and with budget 1 the trainer waits each step for a sample
that only its next version admits (AReaL's StalenessManager counts accepted samples for the same
reason). A filter that over-samples caps the credit (quota.py); over a sync input a lost sample
is replaced by an extra sample of the same step instead (a refill, handed out before new samples
and outside the formula). A node whose budget is None reaches no train node: only `steps` bound it.
"""

from __future__ import annotations

from typing import Any

from flowrl.runtime.quota import Quota


class Admission:
    def __init__(self, batch_size: int, steps: int, budget: int | None, credited: bool, quota: Quota) -> None:
        self.batch_size = batch_size
        self.steps = steps
        self.budget = budget
        self.credited = credited
        self.quota = quota
        self.cursor = [0, 0]  # the next new sample: [step, index]
        self.lost: set[str] = set()  # ids of samples lost on their way (kept only where credited)

    # ---- the formula -------------------------------------------------------------------------

    @property
    def issued(self) -> int:
        """Samples handed out so far (replacements of lost ones aside)."""
        return self.cursor[0] * self.quota.per_step + self.cursor[1]

    @property
    def credit(self) -> int:
        return len(self.lost)

    def admitted(self, version: int) -> int:
        """Samples that may have been handed out at `version` (the rule above; needs a budget)."""
        steps = version + self.budget + 1
        return steps * self.quota.per_step + self.quota.credit(self.credit, steps)

    def limit(self) -> int:
        """Samples that may be handed out in the whole run (replacements aside)."""
        extra = self.quota.credit(self.credit, self.steps) if self.quota.declared else 0
        return self.steps * self.quota.per_step + extra

    def may_issue(self, version: int) -> bool:
        """Whether a new sample may be handed out at `version`."""
        if self.issued >= self.limit():
            return False
        return self.budget is None or self.issued < self.admitted(version)

    def more_may_come(self, version: int) -> bool:
        """Whether this node may still be handed new samples before train step `version` ends."""
        if self.budget is None:
            return self.issued < self.limit()
        return self.issued < min(self.limit(), self.admitted(version))

    # ---- callbacks ---------------------------------------------------------------------------

    def issue(self, version: int, ended: set[int]) -> tuple[int, int, bool] | None:
        """Hand out the next sample: (step, index, beyond) or None if none may be. A replacement
        for a lost sample of an earlier, still open step (not in `ended`) goes first. `beyond`:
        past the step's batch_size, or admitted by credit (the run's `oversampled` counter)."""
        refill = self.quota.refill_step(self.cursor[0], ended)
        if refill is not None:
            index = self.quota.issue(refill)
            return refill, index, index >= self.batch_size
        if not self.may_issue(version):
            return None
        issued = self.issued
        step, index = self.cursor
        self.cursor = [step, index + 1] if index + 1 < self.quota.per_step else [step + 1, 0]
        if self.quota.refills:
            self.quota.issue(step)
        by_credit = self.credited and issued >= (version + self.budget + 1) * self.quota.per_step
        return step, index, index >= self.batch_size or by_credit

    def lose(self, sample_id: str, arrived: bool) -> None:
        """Sample `sample_id` will never reach a train node. `arrived`: it was dropped from a train
        node's own input (it arrived there first, so a refill's count already has it)."""
        if self.credited:
            self.lost.add(sample_id)
        elif not arrived:
            self.quota.lost(int(sample_id.split(":")[0]))

    def arrived(self, step: int) -> None:
        """A record of `step` was put on the input of a train node this node feeds."""
        self.quota.arrived(step)

    def settle(self, step: int) -> bool:
        """Whether the node may end `step` (nothing of it in flight, no replacement wanted); if so
        its refill count is forgotten."""
        if not self.quota.settled(step):
            return False
        self.quota.forget(step)
        return True

    # ---- checkpoint --------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """Copies of what a checkpoint keeps; `restore` takes the same."""
        return {"cursor": list(self.cursor), "lost": set(self.lost),
                "quota": ({s: list(f) for s, f in self.quota.fate.items()}, self.quota.bonus)}

    def restore(self, state: dict[str, Any]) -> None:
        self.cursor, self.lost = list(state["cursor"]), set(state["lost"])
        self.quota.fate, self.quota.bonus = state["quota"]
