"""The embedded engine as a test module's fixture builds it."""

from __future__ import annotations


def embedded_engine(loop, model: str, slots: int):
    """A module's embedded engine on one torch thread, closed on that module's loop."""
    import torch

    from flowrl_operators.engine.embedded import EmbeddedEngine

    torch.set_num_threads(1)
    engine = EmbeddedEngine(model, max_slots=slots, threads=1, seed=0)
    yield engine
    loop.run_until_complete(engine.close())
