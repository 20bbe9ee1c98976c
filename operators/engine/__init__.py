"""Generate engines, in three wings: `embedded/` (flowrl's torch engine), `server/` (its HTTP
server, SGLang's routes plus OpenAI chat) and `sglang/` (the adapter to SGLang servers); `factory`
makes the one a generate node's config names. What an engine is (the protocol and its request and
result types) is `flowrl_operators.inference`, below every wing."""

__all__ = ["EmbeddedEngine"]


def __getattr__(name: str):
    # Importing the engine pulls in torch: only when it is asked for.
    if name == "EmbeddedEngine":
        from flowrl_operators.engine.embedded.engine import EmbeddedEngine

        return EmbeddedEngine
    raise AttributeError(name)
