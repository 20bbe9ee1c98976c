"""`flowrl inspect RUN_DIR` of a long run stays a screenful, and its html small and readable.

The run directory is written by the real writer (the coordinator's Observer, under a simulated
clock): a quickstart-shaped run of 650 supervised warm-up steps and 1,000 GRPO steps whose policy
collapses, with a trace of the spans a real step has (a generate and a reward span per group, the
train step, the weight sync and update). The health findings are the live detector's, as the
writer recorded them in metrics.jsonl.
"""

from __future__ import annotations

import html
import json
import math
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from flowrl.cli import main
from flowrl.data.trajectory import Group, Trajectory
from flowrl.graph.compile import compile_file
from flowrl.runtime import observe
from flowrl.runtime.channel import Work
from flowrl.runtime.clock import VirtualClock
from flowrl.runtime.run import _prepare

ROOT = Path(__file__).resolve().parents[1]
GROUPS, STEP_S = 16, 0.25


def grpo_metrics(step: int) -> dict[str, float]:
    """A GRPO phase that learns for 400 steps, then collapses (entropy 0.02 -> 0.003) and ties."""
    late = min(1.0, max(0.0, (step - 380) / 60))
    out = {"entropy": 0.02 * (1 - 0.85 * late), "tied_group_fraction": 0.1 + 0.55 * late, "clip_fraction": 0.001,
           "mismatch_logprob_mean": 3e-7, "grad_norm": 2.0 - late, "loss": 0.0}
    return out | ({"policy_kl": 0.01 * (1 - late) + 1e-4} if step % 10 == 0 else {})


def reward(step: int, supervised: bool) -> float:
    return 1.0 if supervised else 0.2 + 0.6 * min(1.0, step / 400) + 0.01 * math.sin(step)


def write_phase(directory: Path, steps: int, supervised: bool) -> None:
    plan = compile_file(str(ROOT / "pipelines/grpo_sync.yaml"), ["run.trackers=[]"]).plan
    clock = VirtualClock(1_000_000.0)  # set by hand below: no loop runs
    _prepare(plan, directory, "inprocess", steps, False, clock.now())
    writer = observe.Observer(plan, directory, clock.now(), clock)
    pid = writer.pids
    # A group's two samples score 0.4 apart (real ones differ): its best is above the batch mean, so a
    # run stuck at 0.8 is not "solved" (flowrl/health.py SOLVED_SHARE).
    spread = (0.0, 0.0) if supervised else (-0.2, 0.2)
    for step in range(steps):
        start = clock.now()
        groups = [Group(id=f"{step}:{g}", step=step, trajectories=[Trajectory(
            id=f"{step}:{g}:{i}", group_id=f"{step}:{g}", sample_id=f"{step}:{g}", prompt_ids=[1, 2], response_ids=[3],
            loss_mask=[1], behaviour_logprobs=[-0.1], versions=[step], reward=reward(step, supervised) + spread[i],
            metadata={"text": "4321", "sample": {"prompt": "<1234>"}}) for i in range(2)]) for g in range(GROUPS)]
        for g in range(GROUPS):  # what a real step's stages record
            writer.events.append(observe.span(pid["rollout"], 100 + g, "generate", start, start + 0.1, writer.origin))
            writer.events.append(observe.span(pid["score"], 100 + g, "process", start + 0.1, start + 0.11, writer.origin))
        writer.events.append(observe.span(pid["learner"], 0, "wait", start, start + 0.11, writer.origin))
        writer.events.append(observe.span(pid["learner"], 0, "train", start + 0.11, start + 0.22, writer.origin))
        writer.events.append(observe.span(pid["publish"], 0, "sync", start + 0.22, start + 0.23, writer.origin))
        writer.events.append(observe.span(pid["rollout"], 0, "update_weights", start + 0.23, start + 0.25, writer.origin))
        clock.time = start + STEP_S
        metrics = {"entropy": 2.0 / (1 + step), "loss": 1.0} if supervised else grpo_metrics(step)
        work = Work(id=f"b{step}", kind="batch", step=step, version=step,
                    value=[{"trajectories": g} for g in groups], lags=[0] * GROUPS)
        writer.train_step("learner", step, step + 1, work, metrics, {}, {k: 0 for k in (
            "dropped", "stale_kept", "rejected", "filtered", "oversampled")})
        writer.instant("learner", 0, f"publish v{step + 1}")
    writer.close()


@pytest.fixture(scope="module")
def long_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("long") / "run"
    write_phase(run_dir / "phases/0-warmup", 650, True)
    write_phase(run_dir / "phases/1-grpo", 1000, False)
    return run_dir


def test_the_writer_recorded_the_collapse_as_it_happened(long_run: Path) -> None:
    rows = [json.loads(line) for line in (long_run / "phases/1-grpo/metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1000
    found = {e["condition"]: (e["step"], r["step"]) for r in rows for e in r.get("health", [])}
    # Entropy reaches 0.2x its start (0.02) once late >= 0.94: step 437; tied share 0.5 once late >= 0.73: 424.
    assert found["entropy_collapse"] == (437, 437 + 9) and found["tied_groups"] == (424, 424 + 9)
    assert found["reward_plateau"][0] == 400  # the block of steps 375-399 was the last to rise
    warmup = (long_run / "phases/0-warmup/metrics.jsonl").read_text()
    assert '"health"' not in warmup  # supervised steps are not judged


def test_inspect_of_a_1000_step_run_is_a_screenful(long_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(long_run)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert len(lines) <= 60, out
    assert "quickstart" not in out and "grpo-sync · phase grpo: 1000 steps in 250.0 s" in out
    assert "entropy collapse from step 437" in out and "tied groups from step 424" in out
    assert "reward plateau from step 400" in out
    table = [line for line in lines if re.match(r"\s+\d+-\d+\s", line)]
    assert len(table) == 20  # ten spans of steps per phase
    # Where the time went: the spans' union per stage and kind, against the phase's 250 s.
    assert re.search(r"time \(250\.0 s, setup 0\.0 s\): learner train 44%; rollout generate 40%, update_weights 8%; "
                     r"score process 4%; publish sync 4%", out), out


def test_html_of_a_1000_step_run_is_small(long_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(long_run), "--format", "html"]) == 0
    out = capsys.readouterr().out
    assert len(out.encode()) < 600_000, len(out)
    assert "<script" not in out and not re.search(r"(src|href)=\"(https?:)?//", out)
    for points in re.findall(r'<polyline points="([^"]*)"', out):
        assert len(points.split()) <= 200  # every curve downsampled
    assert out.count('class="tl"') == 2 and "spans in 1000 bins" in out


# Appended to the page under test: the charts have a size, the findings are shown, and the 16x zoom
# widens the timeline inside a box that then scrolls.
CHECK = """<script>
const out = {};
const charts = [...document.querySelectorAll('svg.chart')];
out.charts = charts.length;
out.sized = charts.every(s => { const r = s.getBoundingClientRect(); return r.width > 100 && r.height > 50; });
out.findings = [...document.querySelectorAll('ul.health li.began')].filter(li => li.getBoundingClientRect().height > 0)
  .map(li => li.textContent.split(':')[0]);
const inner = document.querySelectorAll('.tl .inner')[1], scroll = document.querySelectorAll('.tl .scroll')[1];
out.before = inner.getBoundingClientRect().width;
document.querySelectorAll('.tl .z16')[1].checked = true;
out.after = inner.getBoundingClientRect().width;
out.scrolls = scroll.scrollWidth > scroll.clientWidth * 10;
out.lanes = document.querySelectorAll('.tl')[1].querySelectorAll('.names div').length;
document.body.setAttribute('data-check', JSON.stringify(out));
</script>"""


@pytest.mark.skipif(shutil.which("chromium") is None, reason="chromium is not installed")
def test_html_renders_in_headless_chromium(long_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(long_run), "--format", "html"]) == 0
    target = tmp_path / "run.html"
    target.write_text(capsys.readouterr().out.replace("</body>", CHECK + "</body>"))
    proc = subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                           "--window-size=1200,900", "--dump-dom", target.as_uri()],
                          capture_output=True, text=True, timeout=120)
    match = re.search(r'data-check="([^"]*)"', proc.stdout)
    assert match, f"chromium produced no result: {proc.stderr[-2000:]}"
    seen = json.loads(html.unescape(match.group(1)))
    assert seen["charts"] >= 1 + 3 + 5 and seen["sized"]  # reward, warm-up curves, GRPO curves (+ staleness)
    assert seen["findings"] == ["entropy collapse from step 437", "tied groups from step 424",
                                "reward plateau from step 400"] or sorted(seen["findings"]) == sorted(
        ["entropy collapse from step 437", "tied groups from step 424", "reward plateau from step 400"])
    assert seen["after"] == pytest.approx(16 * seen["before"], rel=0.02) and seen["scrolls"]
    assert seen["lanes"] == 5  # runtime, rollout, score, learner, publish


def test_a_run_from_before_health_was_recorded_is_judged_afresh(long_run: Path, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    old = tmp_path / "old"
    shutil.copytree(long_run, old)
    for phase in (old / "phases").iterdir():
        meta = json.loads((phase / "meta.json").read_text())
        (phase / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "health"}))
        rows = [json.loads(line) for line in (phase / "metrics.jsonl").read_text().splitlines()]
        (phase / "metrics.jsonl").write_text("".join(json.dumps({k: v for k, v in r.items() if k != "health"}) + "\n"
                                                    for r in rows))
    assert main(["inspect", str(old), "--format", "json"]) == 0
    replayed = json.loads(capsys.readouterr().out)[1]["health"]
    assert main(["inspect", str(long_run), "--format", "json"]) == 0
    recorded = json.loads(capsys.readouterr().out)[1]["health"]
    assert [{k: e[k] for k in ("condition", "event", "step", "at")} for e in replayed] == \
        [{k: e[k] for k in ("condition", "event", "step", "at")} for e in recorded] and len(recorded) == 3
