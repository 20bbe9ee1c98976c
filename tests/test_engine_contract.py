"""Runs the engine contract (tests/engine_contract.py) over every engine this machine can run:

- embedded: flowrl's torch engine, in-process;
- sglang-adapter: the SGLang adapter driving flowrl's SGLang-compatible server over loopback HTTP;
- url: the SGLang adapter driving any running server, when FLOWRL_CONTRACT_URL is set (a real
  SGLang server on a GPU machine). FLOWRL_CONTRACT_MODEL is then the checkpoint it serves (local
  path) and FLOWRL_CONTRACT_SYNC how weights reach it (distributed | disk | tensor; default auto).

FLOWRL_CONTRACT_DEVICE (cpu | cuda) and FLOWRL_CONTRACT_DTYPE (float32 | bfloat16) pick where the
embedded engines run (tools/gpu_check.sh sets cuda).
"""

from __future__ import annotations

import asyncio
import os

import pytest
import torch
from engine_contract import CHECKS, Target

from flowrl_operators.models import load_hf_model, resolve_model

torch.set_num_threads(1)
DEVICE = os.environ.get("FLOWRL_CONTRACT_DEVICE", "cpu")
DTYPE = os.environ.get("FLOWRL_CONTRACT_DTYPE", "float32")
MODEL = os.environ.get("FLOWRL_CONTRACT_MODEL", "builtin:tiny-qwen2")
URL = os.environ.get("FLOWRL_CONTRACT_URL")
ENGINES = ["embedded", "sglang-adapter"] + (["url"] if URL else [])


@pytest.fixture(scope="module")
def weights():
    """The served weights, perturbed weights of the same shapes, and a reference model."""
    folder = resolve_model(MODEL)
    reference = load_hf_model(folder).to(DEVICE).eval()
    old = [(n, p.detach().clone()) for n, p in reference.named_parameters()]
    generator = torch.Generator().manual_seed(0)
    new = [(n, p + 0.05 * torch.randn(p.shape, generator=generator).to(p)) for n, p in old]
    return folder, reference, old, new


async def open_engine(kind: str, folder):
    """(engine, cleanup coroutine function) for one engine kind, inside the running loop."""
    from flowrl_operators.engine.embedded.engine import EmbeddedEngine
    from flowrl_operators.engine.sglang.adapter import SGLangEngine

    if kind == "url":
        engine = SGLangEngine(URL, weight_sync=os.environ.get("FLOWRL_CONTRACT_SYNC", "auto"), model_path=folder)
        return engine, engine.close
    embedded = EmbeddedEngine(folder, max_slots=8, device=DEVICE, dtype=DTYPE)
    if kind == "embedded":
        return embedded, embedded.close
    from flowrl_operators.engine.server.server import start_server

    runner, port = await start_server(embedded)
    adapter = SGLangEngine(f"http://127.0.0.1:{port}", weight_sync="tensor")

    async def cleanup():
        await adapter.close()
        await runner.cleanup()
        await embedded.close()

    return adapter, cleanup


@pytest.mark.parametrize("check", CHECKS, ids=[c.__name__.removeprefix("check_") for c in CHECKS])
@pytest.mark.parametrize("kind", ENGINES)
def test_contract(kind, check, weights):
    folder, reference, old, new = weights

    async def body():
        engine, cleanup = await open_engine(kind, folder)
        try:
            target = Target(engine=engine, reference=reference, old=old, new=new,
                            vocab=reference.config.vocab_size, check_vocab=kind != "url",
                            max_context=reference.config.max_position_embeddings,
                            tolerance=2e-3 if DTYPE == "float32" and kind != "url" else 5e-2,
                            retract_exact=os.environ.get("FLOWRL_CONTRACT_RETRACT_EXACT", "1") == "1")
            await asyncio.wait_for(check(target), timeout=120)
        finally:
            await cleanup()

    asyncio.run(body())
