"""`flowrl inspect FILE` in all five formats, and the html rendered by headless Chromium."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from flowrl.cli import main
from flowrl.graph.compile import compile_file

ROOT = Path(__file__).resolve().parents[1]
ASYNC = ROOT / "pipelines/grpo_async.yaml"
PPO = ROOT / "pipelines/ppo_critic.yaml"


def inspect(file: Path, fmt: str, capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["inspect", str(file), "--format", fmt]) == 0
    return capsys.readouterr().out


def test_text_shows_nodes_edges_modes_and_weights_edge(capsys: pytest.CaptureFixture[str]) -> None:
    out = inspect(ASYNC, "text", capsys)
    for name, kind in [("rollout", "generate"), ("score", "reward"), ("learner", "train"), ("publish", "sync")]:
        assert re.search(rf"\[{name}\] {kind} · op {kind} · [\d.]+ CPU", out), out
    assert "══▶ [learner]  async ≤2 trajectories" in out  # the async edge and its staleness limit
    assert "──▶ [score]  sync trajectories" in out
    assert "┈┈⇠ weights ┈┈ back to [rollout]" in out  # the back edge is drawn differently
    assert re.search(r"publish ┈┈⇠ rollout\s+│ weights\s+│ back edge", out)


def test_mermaid(capsys: pytest.CaptureFixture[str]) -> None:
    out = inspect(ASYNC, "mermaid", capsys)
    assert out.startswith("flowchart LR")
    assert 'n_score ==>|"trajectories · async max_staleness=2' in out
    assert 'n_publish -.->|"weights (back edge)"| n_rollout' in out
    assert 'n_rollout -->|"trajectories · sync"| n_score' in out


def test_dot(capsys: pytest.CaptureFixture[str]) -> None:
    out = inspect(ASYNC, "dot", capsys)
    assert out.startswith('digraph "grpo-async" {') and out.rstrip().endswith("}")
    assert re.search(r'"publish" -> "rollout" \[label="weights \(back edge\)", style=dashed', out)
    assert re.search(r'"score" -> "learner" \[label="trajectories · async max_staleness=2.*style=bold', out)
    if shutil.which("dot"):  # graphviz, when installed, must accept it
        subprocess.run(["dot", "-Tsvg"], input=out, text=True, check=True, capture_output=True)


def test_json_round_trips_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    data = json.loads(inspect(PPO, "json", capsys))
    plan = compile_file(str(PPO)).plan
    assert data["order"] == plan.order == ["rollout", "score", "ref", "value", "learner", "publish"]
    assert {e["dst"] for e in data["edges"] if e["kind"] == "weights"} == {"rollout"}
    assert data["nodes"]["learner"]["config"]["advantage"]["estimator"] == "gae"


def test_html_is_self_contained(capsys: pytest.CaptureFixture[str]) -> None:
    out = inspect(PPO, "html", capsys)
    assert out.startswith("<!doctype html>") and "<svg" in out
    assert not re.search(r"(src|href)=\"(https?:)?//", out), "html must not load anything from the network"
    assert "<script" not in out
    for name in compile_file(str(PPO)).plan.nodes:
        assert f'id="node-{name}"' in out


# Appended to the page under test: checks that each node's name is drawn, has a size, lies
# inside the window, and is the topmost element at its centre (not hidden under something).
CHECK = """<script>
const out = [];
for (const g of document.querySelectorAll('g.node')) {
  const t = g.querySelector('text'); const r = t.getBoundingClientRect();
  const top = document.elementFromPoint(r.x + r.width / 2, r.y + r.height / 2);
  const ok = r.width > 0 && r.height > 0 && r.right <= window.innerWidth && r.bottom <= window.innerHeight
             && top === t;
  out.push(t.textContent + '=' + (ok ? 'visible' : 'hidden'));
}
document.body.setAttribute('data-check', out.join(','));
</script>"""


@pytest.mark.skipif(shutil.which("chromium") is None, reason="chromium is not installed")
@pytest.mark.parametrize("file", [ASYNC, PPO], ids=lambda f: f.stem)
def test_html_renders_in_headless_chromium(file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    page = inspect(file, "html", capsys).replace("</body>", CHECK + "</body>")
    target = tmp_path / "graph.html"
    target.write_text(page)
    proc = subprocess.run(
        ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--window-size=1400,900", "--dump-dom", target.as_uri()],
        capture_output=True, text=True, timeout=120,
    )
    match = re.search(r'data-check="([^"]*)"', proc.stdout)
    assert match, f"chromium produced no result: {proc.stderr[-2000:]}"
    seen = dict(item.split("=") for item in match.group(1).split(","))
    names = set(compile_file(str(file)).plan.nodes)
    assert set(seen) == names
    assert all(v == "visible" for v in seen.values()), seen
