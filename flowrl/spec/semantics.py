"""Semantic checks: a spec that compiles and would run, but would train nothing or measure the wrong
thing. Run by `flowrl validate` and `flowrl run` on every phase's compiled plan, after the graph
checks and before any weight loads; each finding is located at its key of the spec file.

Here, the engine's own: held-out rows of a dataset file that also occur in its training rows (the
evaluation would measure recall of the training data). The checks that need the operator library's
knowledge (losses, schedules, tokenizers, the reward probe of `flowrl validate --probe`) are
registered in the entry-point group `flowrl.checks`, as `fn(plan, probe) -> [(key path, message)]`
(flowrl_operators/semantics.py), so that flowrl/ imports none of it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flowrl import plugins
from flowrl.spec.errors import Diagnostic, SpecError

if TYPE_CHECKING:
    from flowrl.graph.compile import Compiled
    from flowrl.graph.plan import Plan
    from flowrl.spec.schema import PhaseSpec

GROUP = "flowrl.checks"
Found = list[tuple[tuple[str | int, ...], str]]
SHOWN_LEAKS = 3  # example rows a leak message names


def check(phases: list[tuple[PhaseSpec, Compiled]], probe: bool = False) -> None:
    """Raise SpecError with every finding of every phase (a phase's name prefixes its messages when
    the file has several)."""
    diagnostics: list[Diagnostic] = []
    seen: set[str] = set()
    for phase, compiled in phases:
        found = leaks(compiled.plan) + registered(compiled.plan, probe)
        prefix = f"phase '{phase.name}': " if len(phases) > 1 else ""
        for path, message in found:
            if (path, message) in seen:  # a key every phase inherits: said once
                continue
            seen.add((path, message))  # type: ignore[arg-type]
            diagnostics.append(compiled.loaded.locator.diagnostic(path, prefix + message))
    if diagnostics:
        raise SpecError(diagnostics)


def registered(plan: Plan, probe: bool) -> Found:
    """The findings of every check in the entry-point group; a check that fails says whose it is."""
    found: Found = []
    for name, fn in sorted(plugins.load(GROUP).items()):
        try:
            found += fn(plan, probe)
        except Exception as e:  # noqa: BLE001 - a check's own bug: name it, never a traceback
            found.append(((), f"the semantic check '{name}' ({plugins.targets(GROUP)[name]}) failed: "
                              f"{type(e).__name__}: {e}"))
    for why in plugins.broken(GROUP).values():
        found.append(((), f"a semantic check cannot be loaded: {why}"))
    return found


def leaks(plan: Plan) -> Found:
    """Held-out rows of a file source whose prompt (normalised) is also a training row's."""
    source, evaluation = plan.data.get("source"), plan.data.get("eval")
    if not isinstance(source, dict) or evaluation is None or evaluation.get("source") is not None:
        return []
    from flowrl.data.files import FileSource

    try:
        built = FileSource(seed=plan.seed, batch_size=int(plan.data.get("batch_size") or 1), **source)
    except Exception:  # noqa: BLE001 - a file that does not load is reported by the data checks
        return []
    train: dict[str, int] = {}
    for i, row in enumerate(built.train):
        train.setdefault(normalised(row.get(built.column)), i)
    both = [(j, train[key]) for j, row in enumerate(built.eval) if (key := normalised(row.get(built.column))) in train]
    if not both:
        return []
    held = next((k for k in ("eval_file", "eval_split", "eval_rows", "eval_fraction") if source.get(k) is not None),
                "file")
    examples = "; ".join(f"held-out row {j} = training row {i} ({_text(built.eval[j].get(built.column))!r:.60})"
                         for j, i in both[:SHOWN_LEAKS])
    return [(("data", "source", held), f"{len(both)} of {len(built.eval)} held-out rows also occur in the training "
             f"rows (the same {built.key} text, case and spacing aside): {examples}. The evaluation would "
             "score answers the policy was trained on; remove them from one of the two")]


def normalised(value: Any) -> str:
    """A prompt's text for comparison: case folded, whitespace collapsed."""
    return " ".join(_text(value).casefold().split())


def _text(value: Any) -> str:
    """The text of a prompt cell: a string, or a chat list's message contents (text parts) joined."""
    if isinstance(value, str):
        return value
    if isinstance(value, list | tuple):
        return "\n".join(_text(m.get("content") if isinstance(m, dict) and "role" in m else
                               m.get("text", "") if isinstance(m, dict) else m) for m in value)
    return "" if value is None else str(value)
