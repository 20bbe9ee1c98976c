"""`flowrl inspect RUN_DIR`: what a run did — reward and learning curves, where the time went, the
health findings (flowrl/health.py), the timeline of every stage, the staleness histogram — as a
screenful of text, a self-contained html page (SVG; flowrl/report/html.py), json, or png (the html
screenshotted by headless Chromium).

A run directory is either one run (metrics.jsonl, trace.json, ...) or a phased run whose phases
are runs under `phases/<i>-<name>/`; phases are drawn one after another.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from flowrl.records import NotARun, RunDir, as_dicts


@dataclass
class Phase:
    name: str
    directory: Path
    meta: dict[str, Any]
    rows: list[dict[str, Any]]
    events: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)  # eval.jsonl: version, eval_reward, time
    samples: list[dict[str, Any]] = field(default_factory=list)  # samples.jsonl rows of the last step
    placement: dict[str, Any] = field(default_factory=dict)  # placement.json (Ray executor)


def last_samples(run: RunDir) -> list[dict[str, Any]]:
    """The rows of samples.jsonl's last step (a long run's file is read line by line, not kept)."""
    rows: list[dict[str, Any]] = []
    for row in run.samples():
        if rows and rows[-1]["step"] != row.step:
            rows = []
        rows.append(row.as_dict())
    return rows


def load_run(run_dir: Path) -> list[Phase]:
    """Each phase of the run in `run_dir`, read by RunDir (flowrl/records), as the plain rows the
    text, html and json views and the health detector take."""
    phases = []
    for run in RunDir(run_dir).phases():
        if not run.has("meta.json"):
            continue
        phases.append(Phase(run.name, run.path, msgspec.to_builtins(run.meta()), as_dicts(run.metrics()),
                            as_dicts(run.trace()), as_dicts(run.evals()), last_samples(run), run.placement()))
    if not phases:
        raise NotARun(f"{run_dir} is not a run directory (no meta.json, nor phases/*/meta.json)")
    return phases


def summary(phase: Phase) -> dict[str, Any]:
    rows = phase.rows
    rewards = [r["reward"] for r in rows if r.get("reward") is not None]
    evals = [(e["version"], e["eval_reward"]) for e in phase.evals]
    staleness: Counter[str] = Counter()
    for r in rows:
        staleness.update({k: int(v) for k, v in (r.get("staleness") or {}).items()})
    last = rows[-1] if rows else {}
    best = max(evals, key=lambda e: e[1], default=None)
    return {
        "phase": phase.name, "name": phase.meta.get("name"), "steps": len(rows),
        "seconds": round(last.get("time", 0.0), 1), "first_reward": rewards[0] if rewards else None,
        "last_reward": rewards[-1] if rewards else None, "best_eval_reward": best[1] if best else None,
        "best_eval_version": best[0] if best else None,
        "last_eval_reward": evals[-1][1] if evals else None,
        "samples_per_s": round(sum(r.get("samples_per_s", 0) for r in rows) / max(len(rows), 1), 2),
        "dropped_total": last.get("dropped_total", 0), "staleness": dict(sorted(staleness.items(), key=lambda kv: int(kv[0]))),
        "idle": last.get("idle", {}), "placement": phase.placement,
    }


def render_run(run_dir: Path, fmt: str = "text") -> str | bytes:
    phases = load_run(Path(run_dir))
    if fmt == "json":
        return json.dumps([summary(p) | {"health": health_events(p), "metrics": p.rows, "evals": p.evals,
                                         "samples": p.samples} for p in phases],
                          indent=1) + "\n"
    if fmt in ("html", "png"):
        from flowrl.report.html import render_html

        return render_html(phases) if fmt == "html" else render_png(render_html(phases))
    if fmt == "text":
        return render_text(phases)
    raise ValueError(f"format '{fmt}' is for pipeline files; a run directory renders as text, html, json or png")


def format_value(value: Any) -> str:
    """A figure as the tables show it: 3 decimals, "-" for none."""
    return "-" if value is None else (f"{value:.3f}" if isinstance(value, float) else str(value))


def _clip(text: Any, width: int = 60) -> str:
    """One line of a prompt or response: escaped, cut to `width` characters."""
    text = json.dumps(text, ensure_ascii=False)[1:-1] if isinstance(text, str) else str(text)
    return text if len(text) <= width else text[: width - 3] + "..."


def samples_text(phase: Phase) -> list[str]:
    if not phase.samples:
        return []
    lines = [f"  samples of step {phase.samples[0]['step']} (samples.jsonl):"]
    for row in phase.samples:
        prompt, response = row.get("prompt", row.get("prompt_ids")), row.get("response", row.get("response_ids"))
        lines.append(f"    reward {format_value(row.get('reward'))} v{row.get('version')}: {_clip(prompt)} -> {_clip(response)}")
    return lines


def render_text(phases: list[Phase]) -> str:
    """A screenful per run: each phase's totals, where its time went, its curves downsampled to at most
    TABLE_ROWS spans of steps, its health findings with the step each began, and the last step's samples."""
    lines = []
    spans = TABLE_ROWS if len(phases) <= 2 else TABLE_ROWS // 2
    for p in phases:
        s = summary(p)
        lines.append(f"{s['name']} · phase {p.name}: {s['steps']} steps in {s['seconds']} s, "
                     f"{s['samples_per_s']} samples/s, dropped {s['dropped_total']}")
        failed = p.directory / "error.txt"  # what stopped a failed run (flowrl/runtime/run.py)
        if failed.is_file():
            lines.append(f"  failed: {_clip(failed.read_text(errors='replace').strip(), 200)} (all of it in {failed})")
        best = f", best {format_value(s['best_eval_reward'])} at v{s['best_eval_version']}" if s["best_eval_version"] else ""
        lines.append(f"  reward {format_value(s['first_reward'])} -> {format_value(s['last_reward'])}; "
                     f"eval reward last {format_value(s['last_eval_reward'])}{best}")
        lines.append("  staleness (lag: groups): " + (", ".join(f"{k}: {v}" for k, v in s["staleness"].items()) or "-"))
        lines.append("  " + time_line(p))
        lines += placement_lines(p.placement)
        lines += curve_table(p, spans)
        lines += health_lines(p)
        lines += samples_text(p)
    return "\n".join(lines) + "\n"


TABLE_ROWS = 10  # spans of steps in a phase's table (5 when a run has more than two phases)
HEALTH_LINES = 6  # findings listed per phase; the rest are counted
CURVES = (  # (column, width, metric: a row key, or role:<role> of flowrl.operator.MetricRoles, format)
    ("reward", 7, "reward", ".3f"), ("entropy", 8, "role:entropy", ".3g"),
    ("tied", 5, "role:tied_groups", ".2f"), ("clip", 6, "role:clip_fraction", ".3f"),
    ("kl", 8, "role:policy_kl", ".2g"), ("grad", 8, "role:grad_norm", ".3g"),
    ("mismatch", 8, "role:mismatch", ".2g"),
)


def role_metric(p: Phase, key: str) -> str:
    """A CURVES metric as a key of the phase's rows: a role as `train.<the metric>` its train nodes
    declared for it (meta.json), else the built-in train operator's (flowrl/health.py)."""
    from flowrl.health import BUILTIN_ROLES, recorded_roles

    if not key.startswith("role:"):
        return key
    names = BUILTIN_ROLES.names()
    for roles in (recorded_roles(p.meta.get("metric_roles")) or {}).values():
        names |= roles.names()
    return f"train.{names.get(key[5:], key[5:])}"


def curves(p: Phase) -> list[tuple[str, int, str, str]]:
    """CURVES with each metric as a key of the phase's rows (`role_metric`)."""
    return [(column, width, role_metric(p, key), fmt) for column, width, key, fmt in CURVES]


def metric(row: dict[str, Any], key: str) -> float | None:
    """A number of a metrics row: `reward`, or `train.<name>` for the train operator's."""
    value = (row.get("train") or {}).get(key[6:]) if key.startswith("train.") else row.get(key)
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


def spans_of(rows: list[dict[str, Any]], count: int) -> list[list[dict[str, Any]]]:
    """The rows cut into at most `count` consecutive spans of (nearly) equal length."""
    if not rows:
        return []
    count = max(1, min(count, len(rows)))
    return [rows[len(rows) * i // count: len(rows) * (i + 1) // count] for i in range(count)]


def mean_of(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [v for v in (metric(r, key) for r in rows) if v is not None]
    return sum(values) / len(values) if values else None


def curve_table(p: Phase, count: int) -> list[str]:
    """The phase's curves, each row the mean over a span of steps (eval: the last in the span)."""
    if not p.rows:
        return []
    evals = {e["version"]: e["eval_reward"] for e in p.evals}
    shown = [c for c in curves(p) if any(metric(r, c[2]) is not None for r in p.rows)]
    head = f"  {'steps':>9} {'time_s':>7} " + " ".join(f"{c[0]:>{c[1]}}" for c in shown) + (" eval" if evals else "")
    lines = [head + ("   (means over each span of steps)" if len(p.rows) > count else "")]
    for span in spans_of(p.rows, count):
        first, last = span[0]["step"], span[-1]["step"]
        label = str(first) if first == last else f"{first}-{last}"
        inside = [evals[v] for v in range(first + 1, last + 2) if v in evals]
        cells = " ".join(f"{_number(mean_of(span, key), fmt):>{width}}" for _, width, key, fmt in shown)
        shown_eval = f" {_number(inside[-1] if inside else None, '.3f'):>5}" if evals else ""
        lines.append(f"  {label:>9} {span[-1].get('time', 0):>7.1f} {cells}{shown_eval}")
    return lines


def _number(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def health_events(p: Phase) -> list[dict[str, Any]]:
    """The phase's health events: as the run recorded them, or found afresh in a run from before
    flowrl recorded them (flowrl/health.py)."""
    from flowrl.health import recorded, recorded_roles, replay

    return recorded(p.rows) if p.meta.get("health") else replay(p.rows, recorded_roles(p.meta.get("metric_roles")))


def health_lines(p: Phase) -> list[str]:
    from flowrl.health import CONDITIONS

    events = health_events(p)
    began = [e for e in events if e["event"] == "began"]
    if not began:
        return ["  health: nothing found (" + ", ".join(c.replace("_", " ") for c in CONDITIONS) + ")"]
    ends = {}  # (node, condition, began step) -> the step it ended
    for e in events:
        if e["event"] == "ended":
            match = [b for b in began if b["condition"] == e["condition"] and b.get("node") == e.get("node")
                     and b["step"] <= e["step"] and (b.get("node"), b["condition"], b["step"]) not in ends]
            if match:
                ends[(match[-1].get("node"), e["condition"], match[-1]["step"])] = e["step"]
    lines = [f"  health: {len(began)} finding{'s' if len(began) > 1 else ''}"]
    for e in began[:HEALTH_LINES]:
        end = ends.get((e.get("node"), e["condition"], e["step"]))
        lines.append(f"    ! {e['message']}" + (f" (ended at step {end})" if end is not None else ""))
    if len(began) > HEALTH_LINES:
        lines.append(f"    ... and {len(began) - HEALTH_LINES} more (the `health` entries of metrics.jsonl)")
    return lines


def time_line(p: Phase) -> str:
    """Where the phase's wall time went: each stage's busy share by kind of work (overlapping spans
    merged), and the longest setup."""
    busy, wall = busy_time(p.events)
    if not busy or wall <= 0:
        return "time: - (no trace)"
    setup = max((t for (_, kind), t in busy.items() if kind == "setup"), default=0.0)
    parts: dict[str, list[str]] = {}
    for (lane, kind), t in sorted(busy.items(), key=lambda kv: -kv[1]):
        if kind not in ("setup", "wait", "step") and t / wall >= 0.005:
            parts.setdefault(lane, []).append(f"{kind} {t / wall:.0%}")
    stages = "; ".join(f"{lane} {', '.join(kinds)}" for lane, kinds in parts.items())
    return f"time ({wall:.1f} s, setup {setup:.1f} s): {stages or '-'}"


def busy_time(events: list[dict[str, Any]]) -> tuple[dict[tuple[str, str], float], float]:
    """Seconds each (stage, kind of span) was busy, overlapping spans counted once, and the trace's span."""
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M"}
    intervals: dict[tuple[str, str], list[tuple[float, float]]] = {}
    wall = 0.0
    for e in events:
        if e.get("ph") == "X":
            start, end = e["ts"] / 1e6, (e["ts"] + e.get("dur", 0.0)) / 1e6
            intervals.setdefault((names.get(e["pid"], str(e["pid"])), e["name"]), []).append((start, end))
            wall = max(wall, end)
    return {key: union(spans) for key, spans in intervals.items()}, wall


def union(spans: list[tuple[float, float]]) -> float:
    """Seconds covered by `spans` ((start, end) pairs), overlaps counted once."""
    total, reach = 0.0, -math.inf
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def placement_lines(placement: dict[str, Any]) -> list[str]:
    """Where each stage ran under Ray (placement.json), one line per replica."""
    if not placement:
        return []
    cluster = "attached to a running cluster" if placement.get("attached") else "a cluster of its own"
    lines = [f"  ray placement ({cluster}, {placement.get('ray_nodes', '?')} nodes):"]
    for node, replicas in placement.get("nodes", {}).items():
        for r in replicas:
            tags = ", ".join(r["custom"] + [f"{k}={v}" for k, v in r["labels"].items()]) or "-"
            lines.append(f"    {node} r{r['replica']}: ray node {r['ray_node'][:12]} at {r['ip']} ({tags}), pid {r['pid']}")
    return lines


def render_png(page_html: str) -> bytes:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("flowrl inspect --format png needs headless Chromium (Debian: apt-get install chromium); "
                         "use --format html instead")
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "run.html", Path(tmp) / "run.png"
        src.write_text(page_html)
        subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                        "--window-size=1000,1400", f"--screenshot={out}", src.as_uri()],
                       check=True, capture_output=True, timeout=120)
        return out.read_bytes()
