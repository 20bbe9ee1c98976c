"""Phases: one file declares several runs of the same graph, one after another.

    phases:
      - {name: warmup, seconds: 45, set: {data.source: builtin:copy_digits, nodes.learner.loss: {kind: sft}}}
      - {name: rl, steps: 60}

Each phase is the spec with the phase's dotted `set` keys changed, `run.steps` / `run.max_seconds`
taken from the phase, and — from the second phase on — `model.path` pointing at the policy the
previous phase exported. A phase is thus an ordinary run with its own run directory
(`RUN_DIR/phases/<i>-<name>`), and validating a file validates every phase's graph.

An edge is set by its text, its value the edge's options as under `edges:`:

    set: {"edges.score -> learner": {mode: async, max_staleness: 4}}
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import msgspec

from flowrl.spec.errors import SpecError
from flowrl.spec.load import LoadedSpec, Locator, validation_diagnostic
from flowrl.spec.schema import PhaseSpec, PipelineSpec

# Steps of a phase bounded only by `seconds`: large enough never to be the limit.
UNBOUNDED_STEPS = 10**9


def phase_dir(run_dir: Path, index: int, phase: PhaseSpec) -> Path:
    return run_dir / "phases" / f"{index}-{phase.name}"


def expand(loaded: LoadedSpec, model_path: str | None = None, index: int | None = None) -> list[tuple[PhaseSpec, LoadedSpec]]:
    """The spec of each phase (or of `index` only); a spec without phases is one phase, 'main'."""
    spec = loaded.spec
    if not spec.phases:
        return [(PhaseSpec(name="main"), loaded)]
    out = []
    for i, phase in enumerate(spec.phases):
        if index is not None and i != index:
            continue
        data = copy.deepcopy(loaded.data)
        data["phases"] = []
        run = data.setdefault("run", {})
        run["steps"] = phase.steps or UNBOUNDED_STEPS
        if phase.seconds is not None:
            run["max_seconds"] = phase.seconds
        base = loaded.locator
        locator = Locator(base.file, dict(base.keys), dict(base.values), dict(base.overrides))
        for key, value in phase.set.items():
            if key.startswith("edges.") and "->" in key:
                path, value = _edge_entry(data, key.removeprefix("edges."), value, base, ("phases", i, "set", key))
            else:
                path = tuple(int(p) if p.isdigit() else p for p in key.split("."))
            _assign(data, path, value)
            # Errors in a value a phase set point at where the phase sets it.
            for table in (locator.keys, locator.values):
                for old in [p for p in table if p[: len(path)] == path]:
                    del table[old]
            where = base.values.get(("phases", i, "set", key))
            if where:
                locator.keys[path] = locator.values[path] = where
        if model_path is not None and i > 0:
            data["model"]["path"] = model_path
        try:
            phase_spec = msgspec.convert(data, PipelineSpec)
        except msgspec.ValidationError as e:
            raise SpecError([validation_diagnostic(e, data, (), locator, PipelineSpec)]) from None
        out.append((phase, LoadedSpec(phase_spec, data, locator, loaded.file)))
    return out


def _edge_entry(data: dict[str, Any], text: str, options: Any, locator: Locator,
                where: tuple[Any, ...]) -> tuple[tuple[str | int, ...], Any]:
    """The path of the `edges` entry written `text` (spacing aside) and its new entry."""
    def squeeze(edge: str) -> str:
        return "".join(edge.split())

    entries = data.get("edges") or []
    texts = [e if isinstance(e, str) else next(iter(e), "") if isinstance(e, dict) else "" for e in entries]
    for index, existing in enumerate(texts):
        if squeeze(existing) == squeeze(text):
            return ("edges", index), existing if options is None else {existing: options}
    known = ", ".join(f"'{t}'" for t in texts) or "none"
    raise SpecError([locator.diagnostic(where, f"no edge '{text}' to set; the graph's edges: {known}", at_key=True)])


def _assign(data: dict[str, Any], path: tuple[str | int, ...], value: Any) -> None:
    node: Any = data
    for part in path[:-1]:
        node = node.setdefault(part, {}) if isinstance(node, dict) else node[part]
    node[path[-1]] = value
