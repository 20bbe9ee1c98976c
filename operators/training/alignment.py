"""How one step's gradient lines up with the previous one, and gradient alignment control.

`GradientAlignment.apply(params, all_reduce)` runs between the gradient's clip and the optimizer
step. It reports `grad_cos_prev`, the cosine between this step's flattened gradient g_t and the
previous applied step's g_{t-1} (both as computed, before any projection), and, with `max_cos` set,
caps g_t's component along g_{t-1}:

    u = g_{t-1} / |g_{t-1}|,   g_t <- g_t - max(0, g_t . u - max_cos |g_t|) u

so at most `max_cos |g_t|` of the update goes on along the previous step's direction (max_cos 0:
all of the aligned component is projected out; anti-aligned components are kept). Why: GAC
(Xu et al., arXiv 2603.01501) reports that under asynchronous training consecutive policy gradients
stay highly aligned (near-orthogonal when synchronous), so a stale gradient keeps pushing the same
way the previous update already went and overshoots; projecting that stale-aligned component out
of the update recovered synchronous GRPO's dynamics at high staleness. This is our reading of the
idea (a cap on the aligned component), not the paper's code.

The previous gradient is kept as one copy of this rank's gradient shard; dot products are summed
over the ranks (`all_reduce`), so the cosine is the global one whether a rank holds a shard or a
replica. A skipped (non-finite) step neither reports nor replaces it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch


def _local(grad: torch.Tensor) -> torch.Tensor:
    """This rank's part of a gradient (an FSDP2 DTensor's shard, a plain tensor as it is)."""
    return grad.to_local() if hasattr(grad, "to_local") else grad


class GradientAlignment:
    """Tracks g_{t-1}; reports cos(g_t, g_{t-1}) and caps the aligned component (module docs)."""

    def __init__(self, max_cos: float | None = None) -> None:
        if max_cos is not None and not -1.0 <= max_cos < 1.0:
            raise ValueError(f"gac max_cos must be in [-1, 1), got {max_cos}")
        self.max_cos = max_cos
        self.previous: list[torch.Tensor] | None = None

    @torch.no_grad()
    def apply(self, params: Iterable[torch.nn.Parameter],
              all_reduce: Callable[[list[float]], list[float]]) -> dict[str, float]:
        grads = [_local(p.grad) for p in params if p.grad is not None]
        previous, self.previous = self.previous, [g.detach().clone() for g in grads]
        if previous is None or len(previous) != len(grads):
            return {}
        dot, norm2, prev2 = all_reduce([
            float(sum((g.double() * q.double()).sum() for g, q in zip(grads, previous, strict=True))),
            float(sum(g.double().pow(2).sum() for g in grads)),
            float(sum(q.double().pow(2).sum() for q in previous))])
        if norm2 <= 0.0 or prev2 <= 0.0:
            return {"grad_cos_prev": 0.0}
        out = {"grad_cos_prev": dot / math.sqrt(norm2 * prev2)}
        if self.max_cos is not None:
            excess = dot / math.sqrt(prev2) - self.max_cos * math.sqrt(norm2)  # along u, beyond the cap
            coef = max(0.0, excess) / math.sqrt(prev2)
            if coef > 0.0:
                for g, q in zip(grads, previous, strict=True):
                    g.sub_(q.to(g.dtype), alpha=coef)
            out["gac_projected"] = float(coef > 0.0)
        return out
