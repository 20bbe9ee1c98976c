"""tools/bench_plan.py: which runs each baseline and `--only` make, the medians over repeats with
their spread and worst, the bars on the medians, the command line's refusals, and a tiny real
invocation (a recorded configuration and a what-if from an async baseline) end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tool_module import tool

ROOT = Path(__file__).resolve().parents[1]


def bench():
    return tool("bench_plan")


def row(config: str, baseline: str, repeat: int, step: float, idle: float, recorded: bool = False) -> dict:
    return {"config": config, "baseline": baseline, "repeat": repeat, "step_time_error": step, "idle_error": idle,
            "recorded": recorded, "measured_step_s": 0.2, "predicted_step_s": 0.2 * (1 + step)}


def test_what_each_baseline_and_only_run():
    b = bench()
    assert b.selected("grpo", ["sync"], ["batch_size_32"]) == ["sync", "batch_size_32"]  # the baseline's own too
    assert b.selected("grpo", ["sync", "async"], ["group_size_4"]) == ["sync", "async_staleness_2", "group_size_4"]
    assert b.selected("grpo", ["async"], None) == list(b.GRPO)
    assert b.selected("longtail", ["async"], ["longtail_sync"]) == ["longtail_sync", "longtail_async"]
    args = b.parse_args(["--only", "sync"])
    assert b.families(args) == ["grpo"]
    assert b.families(b.parse_args([])) == ["grpo", "longtail"]
    assert b.families(b.parse_args(["--no-longtail"])) == ["grpo"]
    assert b.families(b.parse_args(["--only", "longtail_async,sync", "--no-longtail"])) == ["grpo"]


def test_every_what_if_plans_the_configuration_it_runs():
    """A configuration's plan overrides say what its run overrides do: the edge's staleness is in both."""
    b = bench()
    for name, (run, plan) in {**b.GRPO, **b.LONGTAIL}.items():
        staleness = next(int(p.split("=")[1]) for p in plan if p.startswith("max_staleness="))
        assert (f"max_staleness: {staleness}" in " ".join(run)) == (staleness > 0), name
        # the rest is the same key=value in both (a plan override to the spec's default `false` aside)
        assert [p for p in plan if not p.startswith("max_staleness") and not p.endswith("=false")] == \
            [r for r in run if not r.startswith("edges.")], name


def test_medians_over_repeats_with_spread_and_worst():
    b = bench()
    rows = [row("sync", "sync", 0, 0.02, 0.01, True), row("async_staleness_1", "sync", 0, 0.20, 0.03),
            row("batch_size_32", "sync", 0, 0.05, 0.09),
            row("sync", "sync", 1, 0.06, 0.02, True), row("async_staleness_1", "sync", 1, 0.08, 0.04),
            row("batch_size_32", "sync", 1, 0.03, 0.05),
            row("sync", "sync", 2, 0.04, 0.00, True), row("async_staleness_1", "sync", 2, 0.09, 0.02),
            row("batch_size_32", "sync", 2, 0.01, 0.06),
            row("sync", "async", 0, 0.5, 0.5),  # another baseline's row: not in sync's figures
            {**row("sync", "sync", 0, 0.01, 0.003, True), "replay": True},  # the baseline against itself
            {**row("sync", "sync", 1, 0.03, 0.001, True), "replay": True}]
    s = b.summarise(rows, ["sync"])["sync"]
    assert s["replay_step_error"]["median"] == 0.02 and s["replay_idle_error"]["worst"] == 0.003
    assert s["recorded_step_error"] == {"median": 0.04, "spread": [0.02, 0.06], "worst": 0.06,
                                        "values": [0.02, 0.06, 0.04]}
    assert s["max_step_time_error"]["values"] == [0.20, 0.08, 0.09]  # each repeat's largest what-if
    assert (s["max_step_time_error"]["median"], s["max_step_time_error"]["worst"]) == (0.09, 0.20)
    assert s["max_idle_error"]["values"] == [0.09, 0.05, 0.06] and s["max_idle_error"]["median"] == 0.06
    assert s["configs"]["async_staleness_1"]["step_time_error"]["median"] == 0.09
    assert s["configs"]["sync"]["recorded"] and not s["configs"]["batch_size_32"]["recorded"]
    assert s["bars"] == {"recorded_step_error": {"bar": 0.05, "median": 0.04, "pass": True},
                         "max_step_time_error": {"bar": 0.10, "median": 0.09, "pass": True},
                         "max_idle_error": {"bar": 0.07, "median": 0.06, "pass": True}}
    rows[4]["step_time_error"] = 0.15  # repeat 1's what-if now past the bar: the median moves to 0.15
    assert not b.summarise(rows, ["sync"])["sync"]["bars"]["max_step_time_error"]["pass"]


def test_a_bar_without_runs_is_not_measured():
    s = bench().summarise([row("sync", "sync", 0, 0.02, 0.01, True)], ["sync"])["sync"]
    assert s["max_step_time_error"] is None and s["bars"]["max_idle_error"]["pass"] is None
    assert s["bars"]["recorded_step_error"]["pass"] is True


@pytest.mark.parametrize("args, words", [(["--baseline", "sync,fast"], "unknown baseline: fast"),
                                         (["--only", "sync,nothing"], "unknown configuration: nothing"),
                                         (["--repeats", "0"], "--repeats at least 1"),
                                         (["--steps", "3"], "at least 4")])
def test_the_command_line_refuses_what_it_cannot_run(args, words, capsys):
    with pytest.raises(SystemExit):
        bench().parse_args(args)
    assert words in capsys.readouterr().err


def test_out_refuses_a_folder_that_holds_files(tmp_path, capsys):
    """Old run folders under --out would be read back with the new ones: an empty or new folder only."""
    assert bench().parse_args(["--out", str(tmp_path)]).out == str(tmp_path)
    assert bench().parse_args(["--out", str(tmp_path / "new")]).out == str(tmp_path / "new")
    (tmp_path / "sync-0").mkdir()
    with pytest.raises(SystemExit):
        bench().parse_args(["--out", str(tmp_path)])
    assert "holds files already" in capsys.readouterr().err


def test_a_tiny_real_invocation(tmp_path, capsys, monkeypatch):
    """The async baseline: its own configuration re-run (recorded) and sync (a what-if), 5 steps once."""
    b = bench()
    saved = []
    monkeypatch.setattr(b.results_file, "save", lambda name, result, bench: saved.append((name, bench)) or ROOT)
    b.main(["--baseline", "async", "--only", "sync", "--steps", "5", "--repeats", "1", "--longtail-steps", "4",
            "--out", str(tmp_path), "--record", "plan-test"])
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    assert saved == [("plan-test", "bench_plan")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["async_staleness_2-0", "grpo-async-baseline-0", "sync-0"]
    assert [(r["config"], r["recorded"], r["replay"]) for r in result["rows"]] == [
        ("async_staleness_2", True, True), ("sync", False, False), ("async_staleness_2", True, False)]
    s = result["baselines"]["async"]
    replay, recorded = result["rows"][0], result["rows"][2]
    assert recorded["predicted_step_s"] == replay["predicted_step_s"]  # one prediction, two runs to compare with
    assert any("interpreter lock" in n for n in replay["notes"]) and "notes" not in recorded
    assert s["replay_step_error"]["median"] == replay["step_time_error"] == pytest.approx(
        abs(replay["predicted_step_s"] / replay["measured_step_s"] - 1), abs=1e-4)
    assert s["recorded_step_error"]["median"] == recorded["step_time_error"] == pytest.approx(
        abs(recorded["predicted_step_s"] / recorded["measured_step_s"] - 1), abs=1e-4)
    assert set(recorded["predicted_staleness"]) <= {"0", "1", "2"}
    assert set(result["rows"][1]["predicted_staleness"]) == {"0"}  # sync: every sample fresh
    assert result["bars"]["async/max_step_time_error"] == (s["max_step_time_error"]["median"] <= 0.10)
    assert result["longtail_steps"] == 4 and result["only"] == ["sync"]
    assert "from the async baseline" in out and "sync (recorded)" not in out
