"""Data sources: where generate stages get their samples.

The pipeline's `data` section names a source and a batch size:

    data: {source: "my_pkg.tasks:Arithmetic", batch_size: 16, options: {max_digits: 4}}

`source` is `module:attr`, or `builtin:<name>` for `flowrl_operators.tasks:<name>`. The attribute
is called once as `attr(seed=<run seed>, **options)` (any keys of `data` other than `source`,
`batch_size`, `options` and `eval` are passed too) and must return an object with

    sample(step: int, index: int) -> dict      # a plain, msgpack-able dict

A finite source may also define `__len__` (how many distinct samples it holds); `flowrl validate`
then refuses a `batch_size` larger than that, as no step could be filled.

Step `s` of a run consists of samples `(s, 0) .. (s, batch_size - 1)`. `sample` must be a pure
function of `(seed, options, step, index)`: the runtime re-issues a sample after a generate actor
dies or a run resumes, and the result must be the same sample, so resume and re-issue are exact.
"""

from __future__ import annotations

from collections.abc import Sized
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


def problems(data: dict[str, Any], seed: int = 0) -> list[tuple[tuple[str, ...], str]]:
    """(key path, problem) of a pipeline's `data` section, found by building its source (and the
    eval source) as a run would, without generating anything."""
    built, out = _build(data, ("data", "source"), seed)
    size = data.get("batch_size", 16)
    if isinstance(built, Sized) and len(built) < size:
        out.append((("data", "batch_size"), f"batch_size {size} is larger than the source, which holds "
                                            f"{len(built)} samples: no step could be filled"))
    spec = data.get("eval")
    if isinstance(spec, dict):
        options = {**(data.get("options") or {}), **(spec.get("options") or {})}
        reward = options.pop("reward", None)
        if isinstance(reward, str) and not reward.startswith("builtin:"):
            from flowrl.spec.refs import callable_path

            problem = callable_path(reward)
            out += [(("data", "eval", "options", "reward"), problem)] if problem else []
        if spec.get("source"):
            out += _build({**data, "source": spec["source"], "options": options}, ("data", "eval", "source"), seed)[1]
    return out


def _build(data: dict[str, Any], path: tuple[str, ...], seed: int) -> tuple[Source | None, list[tuple[tuple[str, ...], str]]]:
    name = data["source"]
    if name.startswith("builtin:"):
        from flowrl_operators.tasks import TASKS

        if name.removeprefix("builtin:") not in TASKS:
            known = ", ".join(f"builtin:{t}" for t in TASKS)
            return None, [(path, f"unknown built-in source '{name}'; known: {known}")]
    try:
        return load_source(data, seed), []
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the user's factory may raise anything; report it at the key
        message = str(e) if isinstance(e, ValueError) else f"building the source failed: {type(e).__name__}: {e}"
        return None, [(path, message)]
