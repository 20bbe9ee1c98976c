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

With `max_cos` set, the previous gradient is kept as one copy of this rank's gradient shard (the
projection needs all of it; after projecting, that buffer is turned into g_t in place, so there is
never a second copy). Off, only the cosine is reported, and it is measured on a fixed sample of the
coordinates: tensors of up to `WHOLE` elements whole, larger ones every `STRIDE`-th element. A full
copy there cost a model's worth of memory for one diagnostic (430 MB for SmolLM2-135M, and twice that
while it was replaced), which put pipelines/smollm2_code.yaml over its 4 GB bar; a sample of millions
of coordinates of a dense gradient gives the same cosine to a few thousandths. Dot products are
summed over the ranks (`all_reduce`), so the cosine is the global one whether a rank holds a shard
or a replica. A skipped (non-finite) step neither reports nor replaces the previous gradient.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

WHOLE = 1 << 16  # with gac off, tensors up to this many elements enter the cosine whole ...
STRIDE = 16  # ... larger ones by every STRIDE-th element (module docs)


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
        seen = grads if self.max_cos is not None else [_sample(g) for g in grads]
        previous = self.previous
        if previous is None or len(previous) != len(seen):
            self.previous = [g.detach().clone() for g in seen]
            return {}
        dot, norm2, prev2 = all_reduce([
            float(sum((g.double() * q.double()).sum() for g, q in zip(seen, previous, strict=True))),
            float(sum(g.double().pow(2).sum() for g in seen)),
            float(sum(q.double().pow(2).sum() for q in previous))])
        coef = 0.0
        if self.max_cos is not None and norm2 > 0.0 and prev2 > 0.0:
            excess = dot / math.sqrt(prev2) - self.max_cos * math.sqrt(norm2)  # along u, beyond the cap
            coef = max(0.0, excess) / math.sqrt(prev2)
        for g, q in zip(seen, previous, strict=True):
            if coef > 0.0:
                g.sub_(q.to(g.dtype), alpha=coef)
                q.mul_(coef).add_(g)  # q <- g_t as computed (the projected g plus what was taken out)
            else:
                q.copy_(g)
        out = {"grad_cos_prev": dot / math.sqrt(norm2 * prev2) if norm2 > 0.0 and prev2 > 0.0 else 0.0}
        if self.max_cos is not None:
            out["gac_projected"] = float(coef > 0.0)
        return out


def _sample(grad: torch.Tensor) -> torch.Tensor:
    """The coordinates of a gradient the cosine reads with gac off (module docs): a view, not a copy."""
    flat = grad.reshape(-1)
    return flat if flat.numel() <= WHOLE else flat[::STRIDE]
