"""tools/bench_longtail.py: its summary over seeds and the pipelines' GRPO phase alone."""

import json
import sys
from pathlib import Path

import pytest
from tool_module import tool

from flowrl.spec.load import load

ROOT = Path(__file__).resolve().parents[1]


def bench():
    sys.path.insert(0, str(ROOT / "tools"))
    return tool("bench_longtail")


def run(s, samples):
    return {"s_to_target": s, "samples_to_target": samples, "steps": 10}


def test_summary_ratios_medians_and_wins():
    """wall_speedup: sync's median seconds over async's; sample_ratio: async's median samples over
    sync's; a miss ranks after every hit."""
    b = bench()
    runs = {"sync": [run(100, 320), run(90, 320), run(None, None), run(120, 400), run(80, 288)],
            "async": [run(40, 352), run(60, 320), run(50, 336), run(130, 480), run(None, None)]}
    out = b.summarise(runs)
    assert out["sync_median_s_to_target"] == 100 and out["async_median_s_to_target"] == 60
    assert out["wall_speedup"] == pytest.approx(100 / 60, abs=1e-3)
    assert out["sample_ratio"] == pytest.approx(352 / 320, abs=1e-3)
    assert out["async_wins"] == 3  # seeds 0, 1, 2 (sync missed on 2); async slower on 3, missed on 4
    assert out["sync_s_to_target_by_seed"] == [100, 90, None, 120, 80]


def test_episode_tail_from_the_trace(tmp_path):
    b = bench()
    spans = [{"name": "generate", "dur": 1000 * (10 if i == 99 else 1)} for i in range(100)]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": spans + [{"name": "train", "dur": 5}]}))
    assert b.episode_tail(trace) == 10.0
    trace.write_text('{"traceEvents": [')  # cut off: no figure
    assert b.episode_tail(trace) is None
    assert b.episode_tail(tmp_path / "missing.json") is None


@pytest.mark.parametrize("name", ["sync", "async"])
def test_grpo_phase_alone_with_a_tail_setting(name):
    b = bench()
    pipeline = b.PIPELINES[name]
    loaded = load(ROOT / pipeline, [f"phases={b.grpo_phase(pipeline, 42.0)}", "model.path=builtin:tiny-qwen2",
                                    "data.options.tail=0.0"])
    [phase] = loaded.spec.phases
    assert (phase.name, phase.seconds) == ("grpo", 42.0) and loaded.spec.data.options["tail"] == 0.0


def test_runs_folder_kept_and_refused_unless_empty(tmp_path):
    """`--runs DIR` keeps the run folders for tools/bench_plan_target.py; a folder holding runs is
    refused (its runs would be resumed, not run afresh)."""
    b = bench()
    with b.run_root(str(tmp_path / "new")) as root:
        (Path(root) / "sync-1.0-1000").mkdir()
    assert (tmp_path / "new/sync-1.0-1000").is_dir()  # kept after the block
    with pytest.raises(SystemExit, match="not empty"):
        b.run_root(str(tmp_path / "new"))
    with b.run_root(None) as temporary:
        assert Path(temporary).is_dir()
    assert not Path(temporary).exists()
