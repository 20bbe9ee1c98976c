"""The embedded engine as a test module's fixture builds it."""

from __future__ import annotations


def embedded_engine(loop, model: str, slots: int):
    """A module's embedded engine on one torch thread, closed on that module's loop."""
    import torch

    from flowrl_operators.engine.embedded.engine import EmbeddedEngine

    torch.set_num_threads(1)
    engine = EmbeddedEngine(model, max_slots=slots, threads=1, seed=0)
    yield engine
    loop.run_until_complete(engine.close())


def tap(engine) -> list:
    """Every (request, result) the engine is given from now on, in call order (`del
    engine.generate` stops it)."""
    seen: list = []
    generate = engine.generate

    async def tapped(request):
        result = await generate(request)
        seen.append((request, result))
        return result

    engine.generate = tapped
    return seen
