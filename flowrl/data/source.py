"""Data sources: where generate stages get their samples.

The pipeline's `data` section names a source and a batch size:

    data: {source: "my_pkg.tasks:Arithmetic", batch_size: 16, options: {max_digits: 4}}
    data: {source: {file: train.parquet, messages: chat, eval_rows: 64}, batch_size: 16}

`source` is a dataset file (a mapping with `file`: flowrl/data/files.py), `module:attr`, or
`builtin:<name>`, a task registered in the entry-point group `flowrl.tasks` (the operator
library's own, or a plugin's). The attribute is called once as
`attr(seed=<run seed>, **options)`, plus `tokenizer=<the pipeline model's tokenizer>` and
`batch_size=<data.batch_size>` if its signature names those parameters, and must return an
object with

    sample(step: int, index: int) -> dict      # a plain, msgpack-able dict

and, for `data.eval`, `eval_sample(index) -> dict` (held-out samples). A finite source may define
`__len__` (its samples per epoch); `flowrl validate` then refuses a `batch_size` larger than that,
as no step could be filled. A source whose samples or episodes show the model images says so with a
truthy `images` attribute (a file source's image column, `builtin:grid_nav`); `flowrl validate`
then refuses a text-only `model.path`.

Step `s` of a run consists of samples `(s, 0) .. (s, batch_size - 1)`. `sample` must be a pure
function of `(seed, options, step, index)`: the runtime re-issues a sample after a generate actor
dies or a run resumes, and the result must be the same sample, so resume and re-issue are exact.
"""

from __future__ import annotations

import inspect
from collections.abc import Sized
from typing import Any, Protocol

from flowrl import plugins
from flowrl.registry import OperatorError, import_path

TASKS_GROUP = "flowrl.tasks"  # the entry-point group of `builtin:` tasks
_RESERVED = ("source", "batch_size", "options", "eval")


class Source(Protocol):
    def sample(self, step: int, index: int) -> dict[str, Any]: ...


def builtin_tasks() -> dict[str, Any]:
    """Every task `builtin:<name>` names (a source, and to the operators a reward or workflow),
    loaded: the entry-point group flowrl.tasks."""
    return plugins.load(TASKS_GROUP)


def source_path(name: str) -> str:
    """`builtin:<name>` -> the `module:attr` its entry point names; `module:attr` unchanged."""
    if name.startswith("builtin:"):
        tasks = plugins.targets(TASKS_GROUP)
        target = tasks.get(name.removeprefix("builtin:"))
        if target is None:
            known = ", ".join(f"builtin:{t}" for t in tasks)
            raise ValueError(f"unknown built-in source '{name}'; known: {known}")
        return target
    return name


def load_source(data: dict[str, Any], seed: int = 0, model: dict[str, Any] | None = None,
                tokenizer: Any = None) -> Source:
    """Build the source named by a pipeline's `data` section. A factory that asks for a tokenizer
    gets `tokenizer`, or else the one of `model["path"]` (the pipeline's `model` section)."""
    name = data.get("source")
    options = dict(data.get("options") or {})
    options.update({k: v for k, v in data.items() if k not in _RESERVED})
    if isinstance(name, dict):
        from flowrl.data.files import FileSource

        if options:
            raise ValueError(f"data.options {sorted(options)} apply to a module:attr source; a file source "
                             "takes its keys under data.source")
        return FileSource(seed=seed, batch_size=batch_size(data), **name)
    if not isinstance(name, str):
        raise ValueError("data.source is missing: name a file ({file: PATH}), module:attr or builtin:<name>")
    try:
        factory = import_path(source_path(name))
    except OperatorError as e:
        raise ValueError(f"data.source '{name}': {e}") from None
    if not callable(factory):
        raise ValueError(f"data.source '{name}' is not callable; it must build an object with sample(step, index)")
    source = factory(seed=seed, **options, **_asked(factory, data, model, tokenizer))
    if not callable(getattr(source, "sample", None)):
        raise ValueError(f"data.source '{name}' returned {type(source).__name__}, which has no sample(step, index) method")
    return source


def _asked(factory: Any, data: dict[str, Any], model: dict[str, Any] | None, tokenizer: Any) -> dict[str, Any]:
    """The optional factory parameters (`tokenizer`, `batch_size`) its signature names."""
    try:
        names = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin or C callable without a signature
        return {}
    extra: dict[str, Any] = {}
    if "batch_size" in names:
        extra["batch_size"] = batch_size(data)
    if "tokenizer" in names:
        if tokenizer is None:
            if not (model or {}).get("path"):
                raise ValueError(f"data.source '{data['source']}' asks for a tokenizer; the pipeline's model.path is needed")
            from flowrl.data.models import load_tokenizer

            tokenizer = load_tokenizer(model["path"])
        extra["tokenizer"] = tokenizer
    return extra


def batch_size(data: dict[str, Any]) -> int:
    size = data.get("batch_size")
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"data.batch_size must be a positive integer, got {size!r}")
    return size


PROMPT_KEYS = ("prompt_ids", "messages", "prompt")  # what the single_turn workflow makes a prompt of


def problems(data: dict[str, Any], seed: int = 0, model: dict[str, Any] | None = None,
             prompted: bool = False) -> list[tuple[tuple[str, ...], str]]:
    """(key path, problem) of a pipeline's `data` section: `check` without the source."""
    return check(data, seed, model, prompted)[1]


def check(data: dict[str, Any], seed: int = 0, model: dict[str, Any] | None = None,
          prompted: bool = False) -> tuple[Source | None, list[tuple[tuple[str, ...], str]]]:
    """(the source, or None if it cannot be built; (key path, problem) of a pipeline's `data`
    section), found by building its source as a run would and drawing its first sample, without
    generating anything. `prompted`: a generate node's workflow (single_turn) needs each sample's
    prompt. What the operators make of the data (its eval, images for the model) they check
    themselves (`Operator.check_data`)."""
    built, out = _build(data, ("data", "source"), seed, model)
    if built is not None:
        out += _first_sample_problems(built, prompted)
    size = data.get("batch_size", 16)
    if isinstance(built, Sized) and len(built) < size:
        out.append((("data", "batch_size"), f"batch_size {size} is larger than the source, which holds "
                                            f"{len(built)} samples: no step could be filled"))
    return built, out


def _first_sample_problems(built: Source, prompted: bool) -> list[tuple[tuple[str, ...], str]]:
    """Sample (0, 0), drawn as the first step draws it: a source that fails there, returns no dict,
    or (for single_turn) no prompt would otherwise fail, or reject every sample, only in the run."""
    try:
        sample = built.sample(0, 0)
    except Exception as e:  # noqa: BLE001 - the user's source may raise anything; report it at the key
        return [(("data", "source"), f"sample(0, 0) failed: {type(e).__name__}: {e}")]
    if not isinstance(sample, dict):
        return [(("data", "source"), f"sample(0, 0) returned {type(sample).__name__}; a sample is a dict")]
    if prompted and not any(key in sample for key in PROMPT_KEYS):
        return [(("data", "source"), f"sample(0, 0) has no prompt (keys: {', '.join(map(str, sample)) or 'none'}); "
                                     "the single_turn workflow reads prompt_ids, messages or prompt")]
    return []


def _build(data: dict[str, Any], path: tuple[str, ...], seed: int,
           model: dict[str, Any] | None) -> tuple[Source | None, list[tuple[tuple[str, ...], str]]]:
    from flowrl.data.readers import SourceError

    try:
        return load_source(data, seed, model), []
    except SourceError as e:  # a file source: located at its own key
        return None, [((*path, e.key), e.detail)]
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the user's factory may raise anything; report it at the key
        message = str(e) if isinstance(e, ValueError) else f"building the source failed: {type(e).__name__}: {e}"
        return None, [(path, message)]
