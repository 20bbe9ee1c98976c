"""The factory of every engine: `make_engine` builds the one a generate node's `EngineConfig` asks for."""

from __future__ import annotations

from typing import Any

from flowrl_operators.engine.sglang.adapter import SGLangEngine
from flowrl_operators.engine.sglang.launch import launch_servers


def make_engine(config: Any, model_path: str, *, dtype: str = "float32", seed: int = 0) -> Any:
    """The engine an `EngineConfig` (or "embedded" / "sglang") asks for.

    embedded: flowrl's in-process torch engine. sglang with `url`: attach to running servers.
    sglang without `url`: launch `config.engines` servers (needs Ray and GPUs) and attach to them.
    """
    from flowrl_operators.config import EngineConfig

    if isinstance(config, str):
        config = EngineConfig(kind=config)
    if config.kind == "embedded" and not config.url:
        if config.engines != 1:
            raise ValueError(f"engine.engines: the embedded engine runs one engine per generate replica, got "
                             f"{config.engines}; raise the node's resources.replicas instead")
        import torch

        from flowrl_operators.engine.embedded.engine import EmbeddedEngine

        device = config.device if config.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        return EmbeddedEngine(model_path, max_slots=config.max_batch, max_context=config.max_context,
                              device=device, threads=config.threads, dtype=dtype, seed=seed)
    sync = config.weight_sync
    if config.url is not None:  # an empty url is the adapter's clear error, not a launch
        return SGLangEngine(config.url, weight_sync=sync, model_path=model_path)
    from flowrl_operators.models import resolve_model

    launched = launch_servers(str(resolve_model(model_path)), config.engines, config.server_args,
                              timeout_s=config.launch_timeout_s)
    return SGLangEngine([u for u, _ in launched], weight_sync=sync, model_path=model_path,
                        owned=[h for _, h in launched])
