"""How many samples of a step a generate node issues, when a filter downstream (DAPO's dynamic
sampling, `Operator.oversampling`) drops groups and asks for more to keep the train batch full.

With (initial, maximum) = (o, m) declared and B = data.batch_size:
- every step starts with `per_step` = ceil(o x B) samples (ids `t:0` .. `t:per_step-1`);
- no step issues more than `cap` = max(per_step, floor(m x B)) samples: m is the bound, a factor of
  the batch size (DAPO's max_num_gen_batches with a generation batch of B);
- over a sync train input (no admission credit), a sample of step t that will not reach the train
  node (rejected, filtered, dropped) is replaced by an extra sample of the same step, `t:<n>` for
  the step's n-th sample, until the step holds B samples that reached the train node or `cap` were
  issued. The step ends for the generate node only when every sample it issued has arrived or been
  lost and no more are wanted, so the train node's step t waits for its replacements;
- over async train inputs a lost sample credits admission one more sample (a later step's), as
  without a filter, but at most (cap - per_step) per step admitted;
- a train step that would get no group at all waits for more instead (an empty batch must not
  publish a version with no update): over a sync input its replacements go on past the cap, over
  an async one the credit grows by another cap's worth (`starved`). A task whose groups always tie
  thus generates until run.max_seconds or Ctrl-C, with `oversampled` growing in the live view.
Without a declaration per_step is B and there is no cap (the credit is unbounded, as before).
"""

from __future__ import annotations

import math


class Quota:
    def __init__(self, batch_size: int, oversampling: tuple[float, float] | None, refills: bool,
                 filter_node: str | None = None) -> None:
        self.batch_size = batch_size
        self.filter = filter_node
        initial, maximum = oversampling or (1.0, math.inf)
        self.per_step = max(batch_size, math.ceil(initial * batch_size - 1e-9))
        self.cap = None if oversampling is None else max(self.per_step, math.floor(maximum * batch_size + 1e-9))
        self.refills = refills and oversampling is not None
        # Per step, for refills: [samples issued, arrived at the train node, lost on the way].
        self.fate: dict[int, list[int]] = {}
        self.bonus = 0  # credit granted past the cap to async batches that found nothing (starved)

    @property
    def declared(self) -> bool:
        return self.cap is not None

    def credit(self, lost: int, steps: int) -> int:
        """Admission credit for `lost` samples over `steps` admitted steps."""
        return lost if self.cap is None else min(lost, steps * (self.cap - self.per_step) + self.bonus)

    def issue(self, step: int) -> int:
        """Count a sample of `step` as issued; returns its index within the step."""
        fate = self.fate.setdefault(step, [0, 0, 0])
        fate[0] += 1
        return fate[0] - 1

    def arrived(self, step: int) -> None:
        if self.refills:
            self.fate.setdefault(step, [0, 0, 0])[1] += 1

    def lost(self, step: int) -> None:
        if self.refills:
            self.fate.setdefault(step, [0, 0, 0])[2] += 1

    def wants(self, step: int) -> bool:
        """Whether `step` (all of whose first per_step samples were issued) needs a replacement."""
        issued, _, lost = self.fate.get(step, [0, 0, 0])
        # Past the cap only while nothing of the step has arrived or may still arrive.
        return self.refills and issued - lost < self.batch_size and (issued < self.cap or issued == lost)

    def refill_step(self, cursor_step: int, ended: set[int]) -> int | None:
        """The earliest open step, all of whose first per_step samples were issued (it is before the
        cursor's step), that wants a replacement sample."""
        if not self.refills:
            return None
        return next((s for s in sorted(self.fate) if s < cursor_step and s not in ended and self.wants(s)), None)

    def settled(self, step: int) -> bool:
        """Whether the generate node may end `step`: nothing of it in flight, nothing more wanted."""
        if not self.refills:
            return True
        issued, arrived, lost = self.fate.get(step, [0, 0, 0])
        return issued == arrived + lost and not self.wants(step)

    def forget(self, step: int) -> None:
        self.fate.pop(step, None)

    def starved(self) -> None:
        """An async batch found nothing and nothing more may come: admit another cap's worth."""
        self.bonus += self.cap - self.per_step + self.batch_size

