"""`flowrl inspect RUN_DIR --format html`: one self-contained page (inline SVG and CSS, no script, no
network) that stays small and readable however long the run.

- Reward: the training batches' reward and the greedy eval against wall time, phases end to end,
  each curve at most MAX_POINTS points (means over spans of steps); where a health condition began,
  a marker.
- Per phase: the health findings (flowrl/health.py), the learning curves (entropy, tied groups, clip
  fraction, policy KL, gradient norm, mismatch) as small charts against the step, the timeline and
  the staleness histogram.
- Timeline: one lane per stage. Up to EXACT_SPANS spans each is drawn as it was (its name as a
  tooltip); beyond that the phase is cut into TIMELINE_BINS bins and each lane shows, per bin, the
  kind of work it spent most of the bin on, its opacity the busy share. Radio buttons widen it 4x
  or 16x inside a scrolling box (CSS only): zooming in on a long run.
"""

from __future__ import annotations

import html
from typing import Any

from flowrl.graph.render import page
from flowrl.report import Phase, curves, format_value, health_events, metric, role_metric, spans_of, summary

COLORS = {"generate": "#2e86de", "process": "#27ae60", "train": "#c0392b", "sync": "#8e44ad",
          "update_weights": "#e67e22", "drain": "#95a5a6", "setup": "#bdc3c7", "checkpoint": "#16a085",
          "flush": "#7f8c8d"}
CONDITION_CURVE = {"entropy_collapse": "role:entropy", "tied_groups": "role:tied_groups",  # role_metric keys
                   "high_clip": "role:clip_fraction", "mismatch_growth": "role:mismatch"}
HIDDEN = {"wait", "step"}  # a wait is idle time; a train node's step span covers its work
MAX_POINTS = 200  # points of a curve: beyond, means over spans of steps
EXACT_SPANS = 2000  # a phase with more trace spans draws its timeline binned
TIMELINE_BINS = 1000  # at 16x on a 900 px page, a bin is about 14 px wide
ZOOMS = (1, 4, 16)
STYLE = (".tl .scroll{overflow-x:auto;border:1px solid #eee}.tl .inner{width:100%}"
         + "".join(f".tl .z{z}:checked~.lanes .inner{{width:{z * 100}%}}" for z in ZOOMS[1:])
         + ".tl .lanes{display:flex;max-width:900px}.tl .names{flex:none;width:90px;font-size:11px}"
         ".tl .names div{height:28px;line-height:28px}.tl .scroll{flex:1}.tl .axis{position:relative;height:14px;"
         "font-size:10px;color:#777}.tl .axis span{position:absolute;transform:translateX(-50%)}"
         ".charts{display:flex;flex-wrap:wrap;gap:8px;max-width:920px}.health li{margin:2px 0}"
         ".health .began{color:#b03a2e}")


def render_html(phases: list[Phase]) -> str:
    title = phases[0].meta.get("name", "run")
    body = [f"<h1>{html.escape(title)}</h1><h2>Reward</h2>{reward_chart(phases)}"]
    for i, p in enumerate(phases):
        s = summary(p)
        best = f" at v{s['best_eval_version']}" if s["best_eval_version"] else ""
        body.append(f"<h2>Phase {html.escape(p.name)}: {s['steps']} steps, {s['seconds']} s</h2>"
                    f"<p>reward {format_value(s['first_reward'])} → {format_value(s['last_reward'])}; eval reward best "
                    f"{format_value(s['best_eval_reward'])}{best}; {s['samples_per_s']} samples/s; dropped {s['dropped_total']}</p>"
                    f"<h3>Health</h3>{health_list(p)}<h3>Learning curves</h3>{curve_charts(p)}"
                    f"<h3>Timeline</h3>{timeline(p, i)}<h3>Staleness</h3>{staleness_chart(p)}")
    return page(f"flowrl run · {title}", "".join(body), STYLE)


def health_list(p: Phase) -> str:
    events = health_events(p)
    if not events:
        return '<p class="health">nothing found</p>'
    items = "".join(f'<li class="{e["event"]}">{html.escape(e["message"])}</li>' for e in events)
    return f'<ul class="health">{items}</ul>'


def _points(rows: list[dict[str, Any]], key: str, x: str, count: int = MAX_POINTS) -> list[tuple[float, float]]:
    """(x, mean of `key`) over at most `count` spans of the rows that report `key`."""
    have = [r for r in rows if metric(r, key) is not None and r.get(x) is not None]
    out = []
    for span in spans_of(have, count):
        values = [metric(r, key) for r in span]
        out.append((float(span[-1][x]), sum(values) / len(values)))  # type: ignore[arg-type]
    return out if have else []


def _polyline(points: list[tuple[float, float]], box: tuple[float, float, float, float],
              w: int, h: int, color: str, pad: int = 40) -> str:
    if not points:
        return ""
    x0, x1, y0, y1 = box
    sx, sy = (w - 2 * pad) / max(x1 - x0, 1e-9), (h - 2 * pad) / max(y1 - y0, 1e-9)
    xy = [(pad + (x - x0) * sx, h - pad - (y - y0) * sy) for x, y in points]
    coords = " ".join(f"{x:.1f},{y:.1f}" for x, y in xy)
    dots = "".join(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.5" fill="{color}"/>' for x, y in xy) if len(xy) <= 60 else ""
    return f'<polyline points="{coords}" fill="none" stroke="{color}" stroke-width="2"/>{dots}'


def _svg(w: int, h: int, inner: str, cls: str = "chart") -> str:
    return (f'<svg class="{cls}" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {w} {h}" width="100%" '
            f'style="max-width:{w}px" font-size="11" font-family="Helvetica, Arial">{inner}</svg>')


def reward_chart(phases: list[Phase], w: int = 900, h: int = 300) -> str:
    """Reward (training batches) and eval reward against wall time, phases end to end."""
    train, evals, bounds, marks, offset = [], [], [], [], 0.0
    share = MAX_POINTS // len(phases)  # each curve at most MAX_POINTS points, the phases' together
    for p in phases:
        train += [(offset + t, v) for t, v in _points(p.rows, "reward", "time", share)]
        picked = spans_of(p.evals, share)
        evals += [(offset + span[-1]["time"], span[-1]["eval_reward"]) for span in picked]
        times = {r["step"]: r.get("time", 0.0) for r in p.rows}
        marks += [(offset + times.get(e["step"], 0.0), e["condition"]) for e in health_events(p) if e["event"] == "began"]
        offset += p.rows[-1].get("time", 0.0) if p.rows else 0.0
        bounds.append((offset, p.name))
    values = [v for _, v in train + evals]
    y0, y1 = min(0.0, *values) if values else 0.0, max(1.0, *values) if values else 1.0
    x1 = max(offset, 1.0)
    out = [f'<rect x="40" y="40" width="{w - 80}" height="{h - 80}" fill="#fafafa" stroke="#ccc"/>']
    for frac in (0.0, 0.5, 1.0):
        out.append(f'<text x="34" y="{h - 40 - frac * (h - 80) + 4}" text-anchor="end">{y0 + frac * (y1 - y0):.2g}</text>')
    for end, name in bounds:
        x = 40 + end / x1 * (w - 80)
        out.append(f'<line x1="{x:.1f}" y1="40" x2="{x:.1f}" y2="{h - 40}" stroke="#bbb" stroke-dasharray="4 3"/>'
                   f'<text x="{x - 4:.1f}" y="52" text-anchor="end" fill="#777">{html.escape(name)}</text>')
    for i, (t, condition) in enumerate(sorted(marks)):
        x, y = 40 + t / x1 * (w - 80), h - 46 - 13 * (i % 6)  # labels stacked: findings may be close
        out.append(f'<line x1="{x:.1f}" y1="40" x2="{x:.1f}" y2="{h - 40}" stroke="#b03a2e" stroke-width="1.5">'
                   f'<title>{html.escape(condition)}</title></line><text x="{x + 3:.1f}" y="{y}" fill="#b03a2e" '
                   f'font-size="10">{html.escape(condition.replace("_", " "))}</text>')
    out.append(_polyline(train, (0, x1, y0, y1), w, h, "#2e86de"))
    out.append(_polyline(evals, (0, x1, y0, y1), w, h, "#c0392b"))
    out.append(f'<text x="{w / 2}" y="{h - 10}" text-anchor="middle">seconds since start</text>'
               f'<text x="50" y="30" fill="#2e86de">reward (training batches)</text>'
               f'<text x="260" y="30" fill="#c0392b">eval reward (greedy, held out)</text>')
    return _svg(w, h, "".join(out))


def curve_charts(p: Phase) -> str:
    """One small chart per learning curve the phase reports, against the step; health markers at the
    step a condition began."""
    began = [e for e in health_events(p) if e["event"] == "began"]
    charts = []
    for name, _, key, _ in curves(p)[1:]:
        points = _points(p.rows, key, "step")
        if points:
            marks = [e["step"] for e in began if role_metric(p, CONDITION_CURVE.get(e["condition"], "")) == key]
            charts.append(small_chart(name, points, marks))
    return f'<div class="charts">{"".join(charts)}</div>' if charts else "<p>no learning curves recorded</p>"


def small_chart(name: str, points: list[tuple[float, float]], marks: list[int], w: int = 300, h: int = 140) -> str:
    xs, ys = [x for x, _ in points], [y for _, y in points]
    x0, x1, y0, y1 = min(xs), max(max(xs), min(xs) + 1), min(ys), max(ys)
    if y1 - y0 < 1e-12:
        y0, y1 = y0 - 0.5 * (abs(y0) or 1), y1 + 0.5 * (abs(y1) or 1)
    left, right, top, bottom = 46, w - 10, 24, h - 20  # the plot's box; value labels left of it

    def at(x: float, y: float) -> tuple[float, float]:
        return left + (x - x0) / (x1 - x0) * (right - left), bottom - (y - y0) / (y1 - y0) * (bottom - top)

    out = [f'<rect x="{left}" y="{top}" width="{right - left}" height="{bottom - top}" fill="#fafafa" stroke="#ccc"/>',
           f'<text x="{left}" y="16">{html.escape(name)}</text>',
           f'<text x="{left - 3}" y="{top + 8}" text-anchor="end" font-size="9">{y1:.3g}</text>',
           f'<text x="{left - 3}" y="{bottom}" text-anchor="end" font-size="9">{y0:.3g}</text>',
           f'<text x="{left}" y="{h - 6}" font-size="9">step {x0:g}</text>',
           f'<text x="{right}" y="{h - 6}" text-anchor="end" font-size="9">{x1:g}</text>']
    for step in marks:
        if x0 <= step <= x1:
            x = at(step, y0)[0]
            out.append(f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{bottom}" stroke="#b03a2e" stroke-dasharray="3 2"/>'
                       f'<text x="{x + 2:.1f}" y="{top + 10}" fill="#b03a2e" font-size="9">step {step}</text>')
    xy = [at(x, y) for x, y in points]
    out.append(f'<polyline points="{" ".join(f"{x:.1f},{y:.1f}" for x, y in xy)}" fill="none" stroke="#34495e" '
               'stroke-width="1.5"/>')
    return _svg(w, h, "".join(out))


def timeline(p: Phase, index: int, w: int = 800, lane: int = 28) -> str:
    """The phase's stages as lanes, exact or binned (module docs), with CSS-only zoom."""
    names = dict(sorted({e["pid"]: e["args"]["name"] for e in p.events if e.get("ph") == "M"}.items()))
    spans = [e for e in p.events if e.get("ph") == "X" and e["name"] not in HIDDEN]
    end = max((e["ts"] + e.get("dur", 0) for e in spans), default=0.0) or 1.0
    rows = {pid: i for i, pid in enumerate(names)}
    h = lane * len(names)
    drawn = _exact(spans, rows, w / end, lane, p.events) if len(spans) <= EXACT_SPANS \
        else _binned(spans, rows, end, w, lane)
    grid = "".join(f'<rect x="0" y="{i * lane}" width="{w}" height="{lane - 4}" fill="#fff" stroke="#eee" '
                   f'vector-effect="non-scaling-stroke"/>' for i in range(len(names)))
    svg = (f'<svg class="timeline" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {w} {h}" preserveAspectRatio="none" '
           f'style="width:100%;height:{h}px;display:block">{grid}{drawn}</svg>')
    ticks = "".join(f'<span style="left:{f * 100:.0f}%">{end / 1e6 * f:.1f} s</span>' for f in (0.1, 0.3, 0.5, 0.7, 0.9))
    radios = "".join(f'<input type="radio" class="z{z}" name="zoom-{index}" id="zoom-{index}-{z}"'
                     f'{" checked" if z == 1 else ""}><label for="zoom-{index}-{z}">{z}x </label>' for z in ZOOMS)
    labels = "".join(f"<div>{html.escape(n)}</div>" for n in names.values())
    mode = "each span as recorded" if len(spans) <= EXACT_SPANS else \
        f"{len(spans)} spans in {TIMELINE_BINS} bins: per bin the main kind of work, opacity its busy share"
    legend = " ".join(f'<span style="color:{c}">■ {k}</span>' for k, c in COLORS.items())
    return (f'<div class="tl">zoom: {radios}<div class="lanes"><div class="names">{labels}</div><div class="scroll">'
            f'<div class="inner">{svg}<div class="axis">{ticks}</div></div></div></div>'
            f'<p style="font-size:11px">{legend} · {mode}</p></div>')


def _exact(spans: list[dict[str, Any]], rows: dict[int, int], scale: float, lane: int,
           events: list[dict[str, Any]]) -> str:
    out = []
    for e in spans:
        if e["pid"] in rows:
            y = rows[e["pid"]] * lane
            out.append(f'<rect class="span {e["name"]}" x="{e["ts"] * scale:.2f}" y="{y + 2}" '
                       f'width="{max(e.get("dur", 0) * scale, 0.3):.2f}" height="{lane - 8}" '
                       f'fill="{COLORS.get(e["name"], "#7f8c8d")}" opacity="0.8"><title>{html.escape(e["name"])}</title></rect>')
    for e in (e for e in events if e.get("ph") == "i" and e["pid"] in rows):
        x, y = e["ts"] * scale, rows[e["pid"]] * lane
        out.append(f'<line x1="{x:.2f}" y1="{y}" x2="{x:.2f}" y2="{y + lane - 4}" stroke="#e67e22" '
                   f'vector-effect="non-scaling-stroke"><title>{html.escape(e["name"])}</title></line>')
    return "".join(out)


def _binned(spans: list[dict[str, Any]], rows: dict[int, int], end: float, w: int, lane: int) -> str:
    """Per lane and bin, the kind of work that filled most of it, drawn with its busy share as opacity;
    neighbouring bins alike merge into one rect."""
    width = end / TIMELINE_BINS
    busy: dict[tuple[int, int], dict[str, float]] = {}
    for (pid, kind), intervals in _merged(spans).items():  # concurrent calls of a stage count once
        if pid not in rows:
            continue
        for start, stop in intervals:
            for b in range(int(start // width), min(int(stop // width), TIMELINE_BINS - 1) + 1):
                overlap = min(stop, (b + 1) * width) - max(start, b * width)
                if overlap > 0:
                    kinds = busy.setdefault((rows[pid], b), {})
                    kinds[kind] = kinds.get(kind, 0.0) + overlap
    cells: dict[int, list[tuple[int, str, float]]] = {}
    for (row, b), kinds in sorted(busy.items()):
        kind = max(kinds, key=kinds.__getitem__)
        # Opacity in fifths, a fifth at least: a short span (a reward call) stays visible.
        cells.setdefault(row, []).append((b, kind, max(0.2, round(min(1.0, sum(kinds.values()) / width) * 5) / 5)))
    out, scale = [], w / TIMELINE_BINS
    for row, items in cells.items():
        run: list[Any] = []  # [first bin, last bin, kind, opacity]
        for b, kind, share in items + [(-2, "", 0.0)]:
            if run and b == run[1] + 1 and (kind, share) == (run[2], run[3]):
                run[1] = b
                continue
            if run:
                out.append(f'<rect x="{run[0] * scale:.1f}" y="{row * lane + 2}" width="{(run[1] - run[0] + 1) * scale:.1f}" '
                           f'height="{lane - 8}" fill="{COLORS.get(run[2], "#7f8c8d")}" opacity="{run[3]:.1f}"/>')
            run = [b, b, kind, share]
    return "".join(out)


def _merged(spans: list[dict[str, Any]]) -> dict[tuple[int, str], list[tuple[float, float]]]:
    """Each (stage, kind)'s spans as disjoint intervals (overlapping ones joined)."""
    by: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for e in spans:
        by.setdefault((e["pid"], e["name"]), []).append((e["ts"], e["ts"] + e.get("dur", 0.0)))
    out = {}
    for key, intervals in by.items():
        joined: list[list[float]] = []
        for start, stop in sorted(intervals):
            if joined and start <= joined[-1][1]:
                joined[-1][1] = max(joined[-1][1], stop)
            else:
                joined.append([start, stop])
        out[key] = [(a, b) for a, b in joined]
    return out


def staleness_chart(phase: Phase, w: int = 420, h: int = 200) -> str:
    counts = summary(phase)["staleness"]
    if not counts:
        return "<p>no staleness recorded</p>"
    top = max(counts.values())
    bar = (w - 60) / max(len(counts), 1)
    out = []
    for i, (lag, n) in enumerate(counts.items()):
        bh = (h - 50) * n / top
        x = 40 + i * bar
        out.append(f'<rect x="{x + 4:.1f}" y="{h - 30 - bh:.1f}" width="{bar - 8:.1f}" height="{bh:.1f}" fill="#d35400"/>'
                   f'<text x="{x + bar / 2:.1f}" y="{h - 16}" text-anchor="middle">{lag}</text>'
                   f'<text x="{x + bar / 2:.1f}" y="{h - 34 - bh:.1f}" text-anchor="middle">{n}</text>')
    out.append(f'<text x="{w / 2}" y="{h - 2}" text-anchor="middle">lag = train version − record version (groups)</text>')
    return _svg(w, h, "".join(out))
