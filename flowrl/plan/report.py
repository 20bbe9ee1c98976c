"""What `flowrl plan` prints: measured, simulated and predicted figures side by side, or JSON."""

from __future__ import annotations

from typing import Any

from flowrl.plan.curve import INTERVAL

COLUMNS = ("measured", "simulated", "predicted")


def text(result: dict[str, Any]) -> str:
    lines = [f"flowrl plan {result['run']}: {result['name']}, fitted on its steps {result['steps'][0]}.."
             f"{result['steps'][1]}"]
    lines += [f"  {note}" for note in result["model"]["notes"]]
    lines.append(f"  machine: {result['model']['cores']:g} cores, one interpreter lock per process (docs/plan.md)")
    columns = [c for c in COLUMNS if c in result]
    if result["changes"]:
        lines.append(f"predicted with: {' '.join(result['changes'])}")
    lines.append(f"{'':22}" + "".join(f"{c:>12}" for c in columns))
    lines.append(_line("s/step", [result[c]["step_seconds"] for c in columns], "{:.4f}"))
    lines.append(_line("samples/s", [result[c]["samples_per_s"] for c in columns], "{:.4g}"))
    for node in result["measured"]["idle"]:
        lines.append(_line(f"idle {node}", [result[c]["idle"].get(node) for c in columns], "{:.3f}"))
    lines.append(_line("staleness", [_histogram(result[c]["staleness"]) for c in columns], "{}"))
    if "search" in result:
        lines += search_lines(result["search"])
    if "target" in result:
        lines += target_lines(result["target"])
    return "\n".join(lines) + "\n"


def search_lines(found: dict[str, Any], top: int = 5) -> list[str]:
    (kind, budget), = found["budget"].items()
    rows = found["configurations"]
    out = [f"search: engine replicas {found['space']['replicas'][0]}..{found['space']['replicas'][1]} x "
           f"max_staleness {found['space']['max_staleness'][0]}..{found['space']['max_staleness'][1]}, "
           f"budget {budget if budget is not None else 'none'} {kind}: {len(rows)} fit; best first"]
    out.append(f"{'replicas':>10}{'staleness':>11}{kind:>8}{'s/step':>10}{'samples/s':>11}  idle")
    for r in rows[:top]:
        idle = " ".join(f"{n} {v:.2f}" for n, v in r["idle"].items())
        out.append(f"{r['replicas']:>10}{r['max_staleness']:>11}{r[kind]:>8g}{r['step_seconds']:>10.4f}"
                   f"{r['samples_per_s']:>11.4g}  {idle}")
    return out


def target_lines(t: dict[str, Any]) -> list[str]:
    """The time-to-target table, soonest first, with what the prediction cannot know above it."""
    c = t["curve"]
    head = f"time to {t['metric']} >= {t['value']:g}: {c['form']}, {c['points']} points"
    if "a" in c:
        head += (f"; R0 {c['r0']:.3f}, A {c['a']:.3f} [{c['a_interval'][0]:.3f}..{c['a_interval'][1]:.3f}], "
                 f"C_mid {c['c_mid']:g} samples, B {c['b']:.2f}")
    out = [head] + [f"  {note}" for note in t["notes"]]
    unit = t["unit"]
    price = f"cost (${t['price']:g}/{unit[:-1]})" if t["price"] is not None else ""
    out.append(f"{'configuration':34}{'samples/s':>10}{'lag':>6}  {'samples':24} {'wall time':28} {unit:24} {price}".rstrip())
    for r in t["configurations"]:
        name = r["configuration"]
        if len(name) > 33:  # a long list of changes gets a line of its own, the figures aligned below it
            out.append(name)
            name = ""
        line = f"{name:34}{r['samples_per_s']:>10.4g}{r['mean_lag']:>6.2f}  "
        if "samples" in r:
            line += (f"{_interval(r['samples'], '{:.0f}'):24} {_interval(r['seconds'], None):28} "
                     f"{_interval(r['device_hours'], '{:.3g}'):24} ")
            line += _interval(r["cost"], "${:.3g}") if "cost" in r else ""
        else:
            line += "-"
        out.append(line.rstrip())
    out.append(f"  intervals: {'-'.join(str(int(p)) for p in INTERVAL)} percentiles; {unit}: the devices a "
               "configuration holds x its wall time")
    return out


def _interval(three: list[float | None], fmt: str | None) -> str:
    shown = [("never" if x is None else (duration(x) if fmt is None else fmt.format(x))) for x in three]
    return f"{shown[1]} [{shown[0]}..{shown[2]}]"


def duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else (f"{seconds / 60:.1f} min" if seconds < 7200
                                                     else f"{seconds / 3600:.1f} h")


def _line(label: str, values: list[Any], fmt: str) -> str:
    return f"{label:22}" + "".join(f"{'-' if v is None else fmt.format(v):>12}" for v in values)


def _histogram(staleness: dict[Any, int]) -> str:
    total = sum(staleness.values()) or 1
    return " ".join(f"{k}:{v / total:.0%}" for k, v in sorted(staleness.items(), key=lambda kv: int(kv[0])))
