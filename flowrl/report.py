"""`flowrl inspect RUN_DIR`: what a run did — reward curves, the timeline of every stage, the
staleness histogram — as text, a self-contained html page (SVG), json, or png (the html
screenshotted by headless Chromium).

A run directory is either one run (metrics.jsonl, trace.json, ...) or a phased run whose phases
are runs under `phases/<i>-<name>/`; phases are drawn one after another.
"""

from __future__ import annotations

import html
import json
import math
import shutil
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flowrl.graph.render import page

COLORS = {"generate": "#2e86de", "process": "#27ae60", "train": "#c0392b", "sync": "#8e44ad",
          "update_weights": "#e67e22", "drain": "#95a5a6", "wait": "#ecf0f1", "step": None}


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


def last_samples(path: Path) -> list[dict[str, Any]]:
    """The rows of samples.jsonl's last step (a long run's file is read line by line, not kept)."""
    if not path.exists():
        return []
    rows: list[dict[str, Any]] = []
    with path.open() as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                if rows and rows[-1]["step"] != row["step"]:
                    rows = []
                rows.append(row)
    return rows


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:  # a damaged or foreign record: say which file
        raise ValueError(f"{path}:{e.lineno}: not JSON ({e.msg})") from None


def _jsonl(path: Path) -> list[Any]:
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        try:
            rows += [json.loads(line)] if line.strip() else []
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number}: not a JSON line ({e.msg})") from None
    return rows


def load_run(run_dir: Path) -> list[Phase]:
    dirs = sorted((run_dir / "phases").glob("*"), key=lambda p: int(p.name.split("-")[0])) \
        if (run_dir / "phases").is_dir() else [run_dir]
    phases = []
    for d in dirs:
        if not (d / "meta.json").exists():
            continue
        rows = _jsonl(d / "metrics.jsonl") if (d / "metrics.jsonl").exists() else []
        trace = _json(d / "trace.json") if (d / "trace.json").exists() else {}
        events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
        evals = _jsonl(d / "eval.jsonl") if (d / "eval.jsonl").exists() else []
        name = d.name.split("-", 1)[1] if d != run_dir else "main"
        placement = _json(d / "placement.json") if (d / "placement.json").exists() else {}
        phases.append(Phase(name, d, _json(d / "meta.json"), rows, events, evals,
                            last_samples(d / "samples.jsonl"), placement))
    if not phases:
        raise FileNotFoundError(f"{run_dir} is not a run directory (no meta.json, nor phases/*/meta.json)")
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
        return json.dumps([summary(p) | {"metrics": p.rows, "evals": p.evals, "samples": p.samples} for p in phases],
                          indent=1) + "\n"
    if fmt == "html":
        return render_html(phases)
    if fmt == "png":
        return render_png(render_html(phases))
    if fmt == "text":
        return render_text(phases)
    raise ValueError(f"format '{fmt}' is for pipeline files; a run directory renders as text, html, json or png")


def _fmt(value: Any) -> str:
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
        lines.append(f"    reward {_fmt(row.get('reward'))} v{row.get('version')}: {_clip(prompt)} -> {_clip(response)}")
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
        best = f", best {_fmt(s['best_eval_reward'])} at v{s['best_eval_version']}" if s["best_eval_version"] else ""
        lines.append(f"  reward {_fmt(s['first_reward'])} -> {_fmt(s['last_reward'])}; "
                     f"eval reward last {_fmt(s['last_eval_reward'])}{best}")
        lines.append("  staleness (lag: groups): " + (", ".join(f"{k}: {v}" for k, v in s["staleness"].items()) or "-"))
        lines.append("  " + time_line(p))
        lines += placement_lines(p.placement)
        lines += curve_table(p, spans)
        lines += health_lines(p)
        lines += samples_text(p)
    return "\n".join(lines) + "\n"


TABLE_ROWS = 10  # spans of steps in a phase's table (5 when a run has more than two phases)
HEALTH_LINES = 6  # findings listed per phase; the rest are counted
CURVES = (  # (column, width, metric: a row key or train.<key>, format)
    ("reward", 7, "reward", ".3f"), ("entropy", 8, "train.entropy", ".3g"),
    ("tied", 5, "train.tied_group_fraction", ".2f"), ("clip", 6, "train.clip_fraction", ".3f"),
    ("kl", 8, "train.policy_kl", ".2g"), ("grad", 8, "train.grad_norm", ".3g"),
    ("mismatch", 8, "train.mismatch_logprob_mean", ".2g"),
)


def metric(row: dict[str, Any], key: str) -> float | None:
    """A number of a metrics row: `reward`, or `train.<name>` for the train operator's."""
    value = (row.get("train") or {}).get(key[6:]) if key.startswith("train.") else row.get(key)
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


def spans_of(rows: list[dict[str, Any]], count: int) -> list[list[dict[str, Any]]]:
    """The rows cut into at most `count` consecutive spans of (nearly) equal length."""
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
    shown = [c for c in CURVES if any(metric(r, c[2]) is not None for r in p.rows)]
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
    from flowrl.health import recorded, replay

    return recorded(p.rows) if p.meta.get("health") else replay(p.rows)


def health_lines(p: Phase) -> list[str]:
    from flowrl.health import CONDITIONS

    began = [e for e in health_events(p) if e["event"] == "began"]
    if not began:
        return ["  health: nothing found (" + ", ".join(c.replace("_", " ") for c in CONDITIONS) + ")"]
    ends = {}  # (node, condition, began step) -> the step it ended
    for e in health_events(p):
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
    return {key: _union(spans) for key, spans in intervals.items()}, wall


def _union(spans: list[tuple[float, float]]) -> float:
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


def _polyline(points: list[tuple[float, float]], x0: float, x1: float, y0: float, y1: float,
              w: int, h: int, color: str, pad: int = 40) -> str:
    if not points:
        return ""
    sx = (w - 2 * pad) / max(x1 - x0, 1e-9)
    sy = (h - 2 * pad) / max(y1 - y0, 1e-9)
    coords = " ".join(f"{pad + (x - x0) * sx:.1f},{h - pad - (y - y0) * sy:.1f}" for x, y in points)
    dots = "".join(f'<circle cx="{pad + (x - x0) * sx:.1f}" cy="{h - pad - (y - y0) * sy:.1f}" r="2.5" fill="{color}"/>'
                   for x, y in points)
    return f'<polyline points="{coords}" fill="none" stroke="{color}" stroke-width="2"/>{dots}'


def reward_chart(phases: list[Phase], w: int = 900, h: int = 300) -> str:
    """Reward (training batches) and eval reward against wall time, phases end to end."""
    train, evals, bounds, offset = [], [], [], 0.0
    for p in phases:
        for r in p.rows:
            t = offset + r.get("time", 0.0)
            if r.get("reward") is not None:
                train.append((t, r["reward"]))
        evals.extend((offset + e["time"], e["eval_reward"]) for e in p.evals)
        offset += p.rows[-1].get("time", 0.0) if p.rows else 0.0
        bounds.append((offset, p.name))
    x1 = max(offset, 1.0)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {w} {h}" width="100%" style="max-width:{w}px" font-size="11" font-family="Helvetica, Arial">',
           f'<rect x="40" y="40" width="{w - 80}" height="{h - 80}" fill="#fafafa" stroke="#ccc"/>']
    for frac in (0.0, 0.5, 1.0):
        y = h - 40 - frac * (h - 80)
        out.append(f'<text x="34" y="{y + 4}" text-anchor="end">{frac:.1f}</text>')
    for end, name in bounds:
        x = 40 + end / x1 * (w - 80)
        out.append(f'<line x1="{x:.1f}" y1="40" x2="{x:.1f}" y2="{h - 40}" stroke="#bbb" stroke-dasharray="4 3"/>'
                   f'<text x="{x - 4:.1f}" y="52" text-anchor="end" fill="#777">{html.escape(name)}</text>')
    out.append(_polyline(train, 0, x1, 0, 1, w, h, "#2e86de"))
    out.append(_polyline(evals, 0, x1, 0, 1, w, h, "#c0392b"))
    out.append(f'<text x="{w / 2}" y="{h - 10}" text-anchor="middle">seconds since start</text>'
               f'<text x="50" y="30" fill="#2e86de">reward (training batches)</text>'
               f'<text x="260" y="30" fill="#c0392b">eval reward (greedy, held out)</text></svg>')
    return "".join(out)


def timeline_chart(phase: Phase, w: int = 900) -> str:
    """One lane per stage: busy spans coloured by kind, waits pale, weight updates marked."""
    names = {e["pid"]: e["args"]["name"] for e in phase.events if e.get("ph") == "M"}
    spans = [e for e in phase.events if e.get("ph") == "X" and COLORS.get(e["name"], "#7f8c8d")]
    instants = [e for e in phase.events if e.get("ph") == "i"]
    end = max((e["ts"] + e.get("dur", 0) for e in spans + instants), default=1.0) or 1.0
    lane, label_w = 34, 90
    h = lane * len(names) + 40
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {w} {h}" width="100%" style="max-width:{w}px" font-size="11" font-family="Helvetica, Arial">']
    scale = (w - label_w - 10) / end
    for i, (pid, name) in enumerate(sorted(names.items())):
        y = 10 + i * lane
        out.append(f'<text x="4" y="{y + lane / 2 + 4}">{html.escape(name)}</text>'
                   f'<rect x="{label_w}" y="{y}" width="{w - label_w - 10}" height="{lane - 6}" fill="#fff" stroke="#eee"/>')
        for e in (s for s in spans if s["pid"] == pid):
            x, width = label_w + e["ts"] * scale, max(e.get("dur", 0) * scale, 0.5)
            out.append(f'<rect class="span {e["name"]}" x="{x:.1f}" y="{y + 2}" width="{width:.1f}" height="{lane - 10}" '
                       f'fill="{COLORS.get(e["name"], "#7f8c8d")}" opacity="0.8"><title>{html.escape(e["name"])}</title></rect>')
        for e in (s for s in instants if s["pid"] == pid):
            x = label_w + e["ts"] * scale
            out.append(f'<line x1="{x:.1f}" y1="{y}" x2="{x:.1f}" y2="{y + lane - 6}" stroke="#e67e22" stroke-width="1.5">'
                       f'<title>{html.escape(e["name"])}</title></line>')
    legend = " ".join(f'<tspan fill="{c}">■ {k}</tspan>' for k, c in COLORS.items() if c)
    out.append(f'<text x="{label_w}" y="{h - 8}">{legend}  <tspan fill="#e67e22">| publish / weights</tspan> · {end / 1e6:.1f} s</text></svg>')
    return "".join(out)


def staleness_chart(phase: Phase, w: int = 420, h: int = 200) -> str:
    counts = summary(phase)["staleness"]
    if not counts:
        return "<p>no staleness recorded</p>"
    top = max(counts.values())
    bar = (w - 60) / max(len(counts), 1)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {w} {h}" width="{w}" font-size="11" font-family="Helvetica, Arial">']
    for i, (lag, n) in enumerate(counts.items()):
        bh = (h - 50) * n / top
        x = 40 + i * bar
        out.append(f'<rect x="{x + 4:.1f}" y="{h - 30 - bh:.1f}" width="{bar - 8:.1f}" height="{bh:.1f}" fill="#d35400"/>'
                   f'<text x="{x + bar / 2:.1f}" y="{h - 16}" text-anchor="middle">{lag}</text>'
                   f'<text x="{x + bar / 2:.1f}" y="{h - 34 - bh:.1f}" text-anchor="middle">{n}</text>')
    out.append(f'<text x="{w / 2}" y="{h - 2}" text-anchor="middle">lag = train version − record version (groups)</text></svg>')
    return "".join(out)


def render_html(phases: list[Phase]) -> str:
    title = phases[0].meta.get("name", "run")
    body = [f"<h1>{html.escape(title)}</h1><h2>Reward</h2>{reward_chart(phases)}"]
    for p in phases:
        s = summary(p)
        body.append(f"<h2>Phase {html.escape(p.name)}: {s['steps']} steps, {s['seconds']} s</h2>"
                    f"<p>reward {_fmt(s['first_reward'])} → {_fmt(s['last_reward'])}; eval reward best "
                    f"{_fmt(s['best_eval_reward'])}; {s['samples_per_s']} samples/s; dropped {s['dropped_total']}</p>"
                    f"<h3>Timeline</h3>{timeline_chart(p)}<h3>Staleness</h3>{staleness_chart(p)}")
    return page(f"flowrl run · {title}", "".join(body))


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
