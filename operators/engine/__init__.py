"""Generate engines: the interface (`base`), flowrl's embedded torch engine, and its HTTP server."""

from flowrl_operators.engine.base import (
    GenerateRequest,
    GenerateResult,
    InferenceEngine,
    SamplingParams,
)

__all__ = ["GenerateRequest", "GenerateResult", "InferenceEngine", "SamplingParams", "EmbeddedEngine"]


def __getattr__(name: str):
    # Importing the engine pulls in torch; keep `from flowrl_operators.engine import SamplingParams` light.
    if name == "EmbeddedEngine":
        from flowrl_operators.engine.embedded import EmbeddedEngine

        return EmbeddedEngine
    raise AttributeError(name)
