"""Data sources: where generate stages get their samples.

The pipeline's `data` section names a source and a batch size:

    data: {source: "my_pkg.tasks:Arithmetic", batch_size: 16, options: {max_digits: 4}}

`source` is `module:attr`, or `builtin:<name>` for `flowrl_operators.tasks:<name>`. The attribute
is called once as `attr(seed=<run seed>, **options)` (any keys of `data` other than `source`,
`batch_size`, `options` and `eval` are passed too) and must return an object with

    sample(step: int, index: int) -> dict      # a plain, msgpack-able dict

Step `s` of a run consists of samples `(s, 0) .. (s, batch_size - 1)`. `sample` must be a pure
function of `(seed, options, step, index)`: the runtime re-issues a sample after a generate actor
dies or a run resumes, and the result must be the same sample, so resume and re-issue are exact.
"""

from __future__ import annotations

from typing import Any, Protocol

from flowrl.registry import OperatorError, import_path

BUILTIN_MODULE = "flowrl_operators.tasks"
_RESERVED = ("source", "batch_size", "options", "eval")


class Source(Protocol):
    def sample(self, step: int, index: int) -> dict[str, Any]: ...


def source_path(name: str) -> str:
    """`builtin:<name>` -> `flowrl_operators.tasks:<name>`; `module:attr` unchanged."""
    if name.startswith("builtin:"):
        return f"{BUILTIN_MODULE}:{name.removeprefix('builtin:')}"
    return name


def load_source(data: dict[str, Any], seed: int = 0) -> Source:
    """Build the source named by a pipeline's `data` section."""
    name = data.get("source")
    if not isinstance(name, str):
        raise ValueError("data.source is missing: name a source as module:attr or builtin:<name>")
    options = dict(data.get("options") or {})
    options.update({k: v for k, v in data.items() if k not in _RESERVED})
    try:
        factory = import_path(source_path(name))
    except OperatorError as e:
        raise ValueError(f"data.source '{name}': {e}") from None
    if not callable(factory):
        raise ValueError(f"data.source '{name}' is not callable; it must build an object with sample(step, index)")
    source = factory(seed=seed, **options)
    if not callable(getattr(source, "sample", None)):
        raise ValueError(f"data.source '{name}' returned {type(source).__name__}, which has no sample(step, index) method")
    return source


def batch_size(data: dict[str, Any]) -> int:
    size = data.get("batch_size")
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"data.batch_size must be a positive integer, got {size!r}")
    return size
