"""What `flowrl plan` prints: measured, simulated and predicted figures side by side, or JSON."""

from __future__ import annotations

from typing import Any

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
    lines.append(_line("samples/s", [result[c]["samples_per_s"] for c in columns], "{:.2f}"))
    for node in result["measured"]["idle"]:
        lines.append(_line(f"idle {node}", [result[c]["idle"].get(node) for c in columns], "{:.3f}"))
    lines.append(_line("staleness", [_histogram(result[c]["staleness"]) for c in columns], "{}"))
    if "search" in result:
        lines += search_lines(result["search"])
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
                   f"{r['samples_per_s']:>11.2f}  {idle}")
    return out


def _line(label: str, values: list[Any], fmt: str) -> str:
    return f"{label:22}" + "".join(f"{'-' if v is None else fmt.format(v):>12}" for v in values)


def _histogram(staleness: dict[Any, int]) -> str:
    total = sum(staleness.values()) or 1
    return " ".join(f"{k}:{v / total:.0%}" for k, v in sorted(staleness.items(), key=lambda kv: int(kv[0])))
