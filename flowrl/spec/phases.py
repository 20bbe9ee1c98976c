"""Phases: one file declares several runs of the same graph, one after another.

    phases:
      - {name: warmup, seconds: 45, set: {data.source: builtin:copy_digits, nodes.learner.loss: {kind: sft}}}
      - {name: rl, steps: 60}

Each phase is the spec with the phase's dotted `set` keys changed, `run.steps` / `run.max_seconds`
taken from the phase, and — from the second phase on — `model.path` pointing at the policy the
previous phase exported, unless the phase sets `model.path` itself (a fresh model, e.g. a student
after its teacher's phases). A phase is thus an ordinary run with its own run directory
(`RUN_DIR/phases/<i>-<name>`), and validating a file validates every phase's graph.

A model path may name an earlier phase's exported policy as `phase:<name>`: in `model.path`, a
node's `model` (reference, critic) or a node's `model.path` (teacher). Validation checks that the
name is an earlier phase's; the run substitutes the folder that phase exported.

    phases:
      - {name: teacher, steps: 400, set: {model.path: builtin:tiny-qwen2-large}}
      - {name: distill, seconds: 150, set: {model.path: builtin:tiny-qwen2,
                                            nodes.teach: {op: teacher, model: {path: "phase:teacher"}}}}

An edge is set by its text, its value the edge's options as under `edges:`:

    set: {"edges.score -> learner": {mode: async, max_staleness: 4}}
"""

from __future__ import annotations

import copy
import difflib
from pathlib import Path
from typing import Any

import msgspec

from flowrl.spec.errors import SpecError, did_you_mean
from flowrl.spec.load import LoadedSpec, Locator, check_names, validation_diagnostic
from flowrl.spec.schema import PhaseSpec, PipelineSpec

Path_ = tuple[str | int, ...]

# Steps of a phase bounded only by `seconds`: large enough never to be the limit.
UNBOUNDED_STEPS = 10**9
PHASE_PREFIX = "phase:"


def phase_dir(run_dir: Path, index: int, phase: PhaseSpec) -> Path:
    return run_dir / "phases" / f"{index}-{phase.name}"


def expand(loaded: LoadedSpec, model_path: str | None = None, index: int | None = None,
           exports: dict[str, str | None] | None = None) -> list[tuple[PhaseSpec, LoadedSpec]]:
    """The spec of each phase (or of `index` only); a spec without phases is one phase, 'main'.
    `model_path` is the policy the phases before `index` left (the start of a phase that sets no
    `model.path`), `exports` each finished phase's exported folder by name (for `phase:<name>`;
    None while validating: the references are checked, not substituted)."""
    spec = loaded.spec
    if not spec.phases:
        _resolve_phase_paths(loaded.data, [], 0, None, loaded.locator)  # rejects any
        return [(PhaseSpec(name="main"), loaded)]
    if "steps" in (loaded.data.get("run") or {}):  # every phase's length replaces it
        raise SpecError([loaded.locator.diagnostic(("run", "steps"), "with phases, each phase's steps or seconds set "
                                                   "its length: set phases.<i>.steps instead of run.steps")])
    out = []
    for i, phase in enumerate(spec.phases):
        if phase.steps is None and phase.seconds is None:
            raise SpecError([loaded.locator.diagnostic(
                ("phases", i), f"phase '{phase.name}' has neither steps nor seconds; give it one or both")])
        _check_set_keys(phase, i, loaded.locator)
        if index is not None and i != index:
            continue
        data = copy.deepcopy(loaded.data)
        base = loaded.locator
        locator = Locator(base.file, dict(base.keys), dict(base.values), dict(base.overrides))
        for key, value in phase.set.items():
            _apply_set(data, key, value, ("phases", i, "set", key), base, locator)
        data["phases"] = []
        run = data.setdefault("run", {})
        if isinstance(run, dict):  # after `set`, so that setting all of `run` keeps the phase's length
            run["steps"] = phase.steps or UNBOUNDED_STEPS
            if phase.seconds is not None:
                run["max_seconds"] = phase.seconds
        model_set = phase.set.get("model")
        own_model = "model.path" in phase.set or (isinstance(model_set, dict) and "path" in model_set)
        if model_path is not None and i > 0 and not own_model:
            data["model"]["path"] = model_path
        _resolve_phase_paths(data, spec.phases, i, exports, locator)
        try:
            phase_spec = msgspec.convert(data, PipelineSpec)
        except msgspec.ValidationError as e:
            raise SpecError([validation_diagnostic(e, data, (), locator, PipelineSpec)]) from None
        check_names(phase_spec, locator)  # a name the phase sets
        out.append((phase, LoadedSpec(phase_spec, data, locator, loaded.file, loaded.environment)))
    return out


# Keys a phase's `set` cannot change: its length is its own steps / seconds, its folder
# RUN_DIR/phases/<i>-<name>, and phases do not nest.
_FIXED = {"phases": "phases do not nest", "run.steps": "a phase's length is its steps: set the phase's steps",
          "run.max_seconds": "a phase's length is its seconds: set the phase's seconds",
          "run.run_dir": "a phase runs in RUN_DIR/phases/<i>-<name>; set run.run_dir outside the phases"}


def _check_set_keys(phase: PhaseSpec, i: int, locator: Locator) -> None:
    for key, value in phase.set.items():
        written = [key] + ([f"{key}.{k}" for k in value] if isinstance(value, dict) else [])
        fixed = [k for k in written if k in _FIXED or k.startswith("phases.")]
        if fixed:
            why = _FIXED.get(fixed[0], _FIXED["phases"])
            raise SpecError([locator.diagnostic(("phases", i, "set", key), f"a phase cannot set {fixed[0]}: {why}",
                                                at_key=True)])


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


def _apply_set(data: dict[str, Any], key: str, value: Any, where: Path_, base: Locator, locator: Locator) -> None:
    """Set one dotted key of a phase's `set` in `data`; problems are located at the phase's key."""
    if key.startswith("edges.") and "->" in key:
        path, value = _edge_entry(data, key.removeprefix("edges."), value, base, where)
    else:
        path = tuple(int(p) if p.isdigit() else p for p in key.split("."))
    fresh = _assign(data, path, value, key, lambda message: base.diagnostic(where, message, at_key=True))
    # Errors in a value a phase set point at where the phase sets it; a key the phase added
    # (a typo included) at the phase's key.
    for table in (locator.keys, locator.values):
        for old in [p for p in table if p[: len(path)] == path]:
            del table[old]
    at_key, at_value = base.keys.get(where), base.values.get(where)
    for prefix in fresh:
        if at_key:
            locator.keys[prefix] = locator.values[prefix] = at_key
    if at_key:
        locator.keys[path] = at_key  # an unknown key: the phase's key
    if at_value:
        locator.values[path] = at_value  # a wrong value: the phase's value


def _assign(data: dict[str, Any], path: Path_, value: Any, key: str, error: Any) -> list[Path_]:
    """Set `path` in `data`; returns the prefixes of `path` it had to create."""
    if any(part == "" for part in path):
        raise SpecError([error(f"'{key}' is not a dotted key (an empty part)")])
    node: Any = data
    fresh: list[Path_] = []
    for depth, part in enumerate(path):
        here, last = path[: depth + 1], depth == len(path) - 1
        if isinstance(node, dict):
            if part not in node:
                if here[:1] == ("nodes",) and depth == 1 and not last:  # `nodes.<new>: {op: ...}` adds a node
                    raise SpecError([error(f"no node '{part}' to set" + did_you_mean(str(part), map(str, node)))])
                fresh.append(here)
                if not last:
                    node[part] = {}
            if last:
                node[part] = value
            else:
                node = node[part]
        elif isinstance(node, list):
            if not isinstance(part, int) or part >= len(node):
                shown = ".".join(map(str, here[:-1]))
                raise SpecError([error(f"'{shown}' is a list of {len(node)} items; '{part}' is no index in it")])
            if last:
                node[part] = value
            else:
                node = node[part]
        else:
            shown = ".".join(map(str, here[:-1]))
            raise SpecError([error(f"'{shown}' is a value ({node!r:.40}), not a mapping; it has no key '{part}'")])
    return fresh


def _model_paths(data: dict[str, Any]) -> list[tuple[tuple[str, ...], str]]:
    """(key path, value) of every model path in a spec: `model.path`, and a node's `model` when it
    is a path or a mapping with `path`."""
    model = data.get("model")
    out = [(("model", "path"), model["path"])] if isinstance(model, dict) and isinstance(model.get("path"), str) else []
    for name, node in (data.get("nodes") or {}).items():
        own = node.get("model") if isinstance(node, dict) else None
        if isinstance(own, str):
            out.append((("nodes", name, "model"), own))
        elif isinstance(own, dict) and isinstance(own.get("path"), str):
            out.append((("nodes", name, "model", "path"), own["path"]))
    return out


def _resolve_phase_paths(data: dict[str, Any], phases: list[PhaseSpec], index: int,
                         exports: dict[str, str | None] | None, locator: Locator) -> None:
    """Check each `phase:<name>` model path of phase `index` names one earlier phase; with
    `exports`, replace it by the folder that phase exported."""
    earlier = [p.name for p in phases[:index]]
    for path, value in _model_paths(data):
        if not value.startswith(PHASE_PREFIX):
            continue
        name = value[len(PHASE_PREFIX):]
        if earlier.count(name) != 1:
            close = difflib.get_close_matches(name, earlier, n=1)
            why = (f"two earlier phases are named '{name}'; rename one" if name in earlier else
                   f"did you mean 'phase:{close[0]}'?" if close else
                   f"no earlier phase is named '{name}' (earlier phases: {', '.join(earlier) or 'none'})")
            raise SpecError([locator.diagnostic(path, f"'{value}': {why}")])
        if exports is None:
            continue
        if exports.get(name) is None:
            raise SpecError([locator.diagnostic(path, f"'{value}': phase {name} exported no policy "
                                                      "(it needs a train node)")])
        node = data
        for part in path[:-1]:
            node = node[part]
        node[path[-1]] = exports[name]
