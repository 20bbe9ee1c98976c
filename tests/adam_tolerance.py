"""How close two runs of the same optimizer steps must land when only float summation order differs
(e.g. one rank against two, sequences packed differently).

Adam moves each weight by lr * m / (sqrt(v) + eps): about lr whatever the gradient's size. Where a
gradient is itself near eps, a rounding-level difference in it (1e-10) changes that weight's update by
a few percent of lr (more where the gradients are small, e.g. a vision tower that saw one image), while
most weights agree to 1e-6. A real fault (a gradient not reduced, a row lost, a wrong shard) moves most
weights by about lr a step.
"""

from __future__ import annotations

import torch

TIGHT = 1e-6  # what most (the median) weights of every tensor must agree to
LOOSE_SHARE = 0.05  # at most this fraction of the steps' total update, for any weight


def assert_adam_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], lr: float, steps: int) -> None:
    assert got.keys() == want.keys()
    loose = LOOSE_SHARE * lr * steps
    for name, expected in want.items():
        diff = (got[name].float() - expected.float()).abs()
        worst = diff.max().item()
        assert worst <= loose, f"{name}: differs by {worst:.3g} > {loose:.3g} ({LOOSE_SHARE:.0%} of {steps} steps at lr {lr})"
        median = diff.flatten().median().item()
        assert median <= TIGHT, f"{name}: half its weights differ by {median:.3g} or more (> {TIGHT})"
