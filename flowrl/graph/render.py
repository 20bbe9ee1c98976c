"""Renderers for `flowrl inspect FILE`: text, mermaid, dot, html (self-contained SVG), json."""

from __future__ import annotations

import html
import io

import msgspec
import networkx as nx
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from flowrl.graph.plan import EdgePlan, NodePlan, Plan

FORMATS = ("text", "mermaid", "dot", "html", "json")


def render(plan: Plan, fmt: str, color: bool = False) -> str:
    return {"text": lambda p: render_text(p, color), "mermaid": render_mermaid, "dot": render_dot,
            "html": render_html, "json": render_json}[fmt](plan)


def resources_label(node: NodePlan) -> str:
    r = node.resources
    parts = [f"{r.cpus:g} CPU"] + ([f"{r.gpus:g} GPU"] if r.gpus else []) + [f"{v:g} {k}" for k, v in r.custom.items()]
    where = [f"{k}={v}" for k, v in r.labels.items()] + ([r.placement] if r.placement != "pack" else [])
    return (" + ".join(parts) + (f" x{r.replicas}" if r.replicas > 1 else "")
            + (f" on {', '.join(where)}" if where else ""))


def edge_label(edge: EdgePlan) -> str:
    if edge.kind == "weights":
        return "weights (back edge)"
    if edge.mode == "async":
        return f"{edge.port_type} · async max_staleness={edge.max_staleness} capacity={edge.capacity} on_stale={edge.on_stale}"
    return f"{edge.port_type} · sync"


def data_label(plan: Plan) -> str:
    return f"data: {plan.data.get('source')} ({plan.data.get('batch_size')} per step)"


def render_text(plan: Plan, color: bool = False) -> str:
    buf = io.StringIO()
    console = Console(file=buf, width=110, color_system="standard" if color else None, force_terminal=color)
    console.print(f"[bold]{plan.name}[/bold]  {len(plan.nodes)} nodes, {len(plan.edges)} edges;"
                  f" cluster {plan.cluster.get('cpus', 0):g} CPUs, {plan.cluster.get('gpus', 0):g} GPUs;"
                  f" model {plan.model.get('path')}")
    console.print()
    # The flow, one line per node in topological order; the weights edge is drawn as ⇠.
    console.print(f"  ({escape(data_label(plan))})")
    for name in plan.order:
        node = plan.nodes[name]
        console.print(f"  [bold]{escape(f'[{name}]')}[/bold] {node.kind} · op {node.op} · {resources_label(node)}")
        for edge in plan.outputs_of(name):
            if edge.kind == "weights":
                console.print(f"      ┈┈⇠ [magenta]weights[/magenta] ┈┈ back to {escape(f'[{edge.dst}]')}")
            elif edge.mode == "async":
                console.print(f"      ══▶ {escape(f'[{edge.dst}]')}  [yellow]async ≤{edge.max_staleness}[/yellow] {edge.port_type}")
            else:
                console.print(f"      ──▶ {escape(f'[{edge.dst}]')}  sync {edge.port_type}")
    console.print()
    nodes = Table(title="nodes", title_justify="left")
    for col in ("node", "kind", "op", "resources", "inputs", "outputs"):
        nodes.add_column(col)
    for name in plan.order:
        n = plan.nodes[name]
        nodes.add_row(name, n.kind, n.op, resources_label(n),
                      ", ".join(f"{p}:{t}" for p, t in n.inputs.items()),
                      ", ".join(f"{p}:{t}" for p, t in n.outputs.items()))
    console.print(nodes)
    edges = Table(title="edges", title_justify="left")
    for col in ("edge", "type", "mode", "max_staleness", "capacity", "on_stale"):
        edges.add_column(col)
    for e in plan.edges:
        if e.kind == "weights":
            edges.add_row(f"{e.src} ┈┈⇠ {e.dst}", "weights", "back edge", "-", "-", "-", style="magenta")
        else:
            stale = str(e.max_staleness) if e.mode == "async" else "-"
            edges.add_row(f"{e.src} ──▶ {e.dst}", e.port_type, e.mode, stale, str(e.capacity),
                          e.on_stale if e.mode == "async" else "-")
    console.print(edges)
    return buf.getvalue()


def _mermaid_id(name: str) -> str:
    return "n_" + name.replace("-", "_")


def render_mermaid(plan: Plan) -> str:
    lines = ["flowchart LR", f'  data[("{data_label(plan)}")]']
    for name in plan.order:
        n = plan.nodes[name]
        lines.append(f'  {_mermaid_id(name)}["<b>{name}</b><br/>{n.kind} · op {n.op}<br/>{resources_label(n)}"]')
    for name, n in plan.nodes.items():
        if "prompts" in n.inputs.values():
            lines.append(f'  data -->|"prompts"| {_mermaid_id(name)}')
    for e in plan.edges:
        arrow = "-.->" if e.kind == "weights" else ("==>" if e.mode == "async" else "-->")
        lines.append(f'  {_mermaid_id(e.src)} {arrow}|"{edge_label(e)}"| {_mermaid_id(e.dst)}')
    return "\n".join(lines) + "\n"


def _dot_quote(text: str) -> str:
    # Backslashes are kept: `\n` in a label is dot's line break.
    return '"' + text.replace('"', '\\"') + '"'


def render_dot(plan: Plan) -> str:
    lines = [f"digraph {_dot_quote(plan.name)} {{", "  rankdir=LR;", "  node [shape=box, fontname=Helvetica];",
             f"  data [shape=cylinder, label={_dot_quote(data_label(plan))}];"]
    for name in plan.order:
        n = plan.nodes[name]
        label = "\\n".join([name, f"{n.kind} · op {n.op}", resources_label(n)])
        lines.append(f"  {_dot_quote(name)} [label={_dot_quote(label)}];")
    for name, n in plan.nodes.items():
        if "prompts" in n.inputs.values():
            lines.append(f'  data -> {_dot_quote(name)} [label="prompts"];')
    for e in plan.edges:
        style = {"weights": 'style=dashed, color=purple, constraint=false'}.get(e.kind, "style=bold, color=orange" if e.mode == "async" else "style=solid")
        lines.append(f"  {_dot_quote(e.src)} -> {_dot_quote(e.dst)} [label={_dot_quote(edge_label(e))}, {style}];")
    lines.append("}")
    return "\n".join(lines) + "\n"


def render_json(plan: Plan) -> str:
    return msgspec.json.format(plan.record(), indent=2).decode() + "\n"


def layout(plan: Plan) -> dict[str, tuple[int, int]]:
    """Layer by longest path over data edges; returns (layer, row) per node."""
    graph = nx.DiGraph([(e.src, e.dst) for e in plan.edges if e.kind == "data"])
    graph.add_nodes_from(plan.nodes)
    layer: dict[str, int] = {}
    for name in nx.topological_sort(graph):
        layer[name] = max((layer[p] + 1 for p in graph.predecessors(name)), default=0)
    rows: dict[int, int] = {}
    out = {}
    for name in plan.order:
        out[name] = (layer[name], rows.get(layer[name], 0))
        rows[layer[name]] = rows.get(layer[name], 0) + 1
    return out


def render_svg(plan: Plan) -> str:
    w, h, gap_x, gap_y, top = 180, 64, 120, 50, 70
    pos = layout(plan)
    xy = {n: (30 + layer * (w + gap_x), top + row * (h + gap_y)) for n, (layer, row) in pos.items()}
    width = max(x for x, _ in xy.values()) + w + 40
    height = max(y for _, y in xy.values()) + h + 110
    # viewBox + width 100%: the drawing scales to the window instead of scrolling off it.
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" width="100%" style="max-width:{width}px" font-family="Helvetica, Arial, sans-serif" font-size="12">',
           '<defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" markerHeight="7" orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="#444"/></marker>'
           '<marker id="arrow-w" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" markerHeight="7" orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="#8e44ad"/></marker></defs>',
           f'<text x="30" y="30" font-size="13" fill="#333">{html.escape(data_label(plan))} → prompts to every generate node</text>']
    for e in plan.edges:
        (x1, y1), (x2, y2) = xy[e.src], xy[e.dst]
        label = html.escape(edge_label(e))
        if e.kind == "weights":
            bottom = height - 40
            path = f"M{x1 + w / 2},{y1 + h} C{x1 + w / 2},{bottom} {x2 + w / 2},{bottom} {x2 + w / 2},{y2 + h}"
            out.append(f'<path class="edge weights" d="{path}" fill="none" stroke="#8e44ad" stroke-width="2" stroke-dasharray="6 4" marker-end="url(#arrow-w)"/>')
            out.append(f'<text x="{(x1 + x2 + w) / 2}" y="{bottom - 4}" text-anchor="middle" fill="#8e44ad">{label}</text>')
        else:
            color, dash = ("#d35400", ' stroke-dasharray="2 0"') if e.mode == "async" else ("#444", "")
            sx, sy, tx, ty = x1 + w, y1 + h / 2, x2, y2 + h / 2
            out.append(f'<path class="edge {e.mode}" d="M{sx},{sy} L{tx},{ty}" stroke="{color}" stroke-width="{3 if e.mode == "async" else 1.5}"{dash} marker-end="url(#arrow)"/>')
            short = f"async ≤{e.max_staleness}" if e.mode == "async" else "sync"
            mx, my = (sx + tx) / 2, (sy + ty) / 2
            out.append(f'<text x="{mx}" y="{my - 6}" text-anchor="middle" fill="{color}">{short}</text>'
                       f'<text x="{mx}" y="{my + 14}" text-anchor="middle" fill="#777" font-size="10">{html.escape(e.port_type)}</text>')
    for name, (x, y) in xy.items():
        n = plan.nodes[name]
        out.append(f'<g class="node" id="node-{html.escape(name)}"><rect x="{x}" y="{y}" width="{w}" height="{h}" rx="8" fill="#eef4fb" stroke="#2c3e50"/>'
                   f'<text x="{x + w / 2}" y="{y + 20}" text-anchor="middle" font-weight="bold" font-size="14">{html.escape(name)}</text>'
                   f'<text x="{x + w / 2}" y="{y + 38}" text-anchor="middle">{html.escape(n.kind)} · op {html.escape(n.op)}</text>'
                   f'<text x="{x + w / 2}" y="{y + 54}" text-anchor="middle" fill="#555">{html.escape(resources_label(n))}</text></g>')
    out.append("</svg>")
    return "\n".join(out)


def render_html(plan: Plan) -> str:
    rows = "".join(
        f"<tr><td>{html.escape(n)}</td><td>{html.escape(p.kind)}</td><td>{html.escape(p.op)}</td><td>{html.escape(resources_label(p))}</td></tr>"
        for n, p in ((n, plan.nodes[n]) for n in plan.order))
    erows = "".join(f"<tr><td>{html.escape(e.src)} → {html.escape(e.dst)}</td><td>{html.escape(edge_label(e))}</td></tr>" for e in plan.edges)
    return page(f"flowrl · {plan.name}", f"<h1>{html.escape(plan.name)}</h1>{render_svg(plan)}"
                f"<h2>Nodes</h2><table><tr><th>node</th><th>kind</th><th>op</th><th>resources</th></tr>{rows}</table>"
                f"<h2>Edges</h2><table><tr><th>edge</th><th>mode</th></tr>{erows}</table>")


def page(title: str, body: str, style: str = "") -> str:
    """A self-contained HTML page: inline style (plus `style`), no scripts, no network."""
    return (f"<!doctype html><html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title><style>"
            "body{font-family:Helvetica,Arial,sans-serif;margin:24px;color:#222}table{border-collapse:collapse;margin:8px 0}"
            f"td,th{{border:1px solid #ccc;padding:4px 10px;text-align:left}}th{{background:#f3f3f3}}{style}</style></head>"
            f"<body>{body}</body></html>\n")
