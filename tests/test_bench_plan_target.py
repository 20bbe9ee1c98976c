"""tools/bench_plan_target.py: the changes between a pair's plans as plan's overrides (from the
shipped pipelines), the error and coverage arithmetic over pairs, the folder's pairs and the
measured time to target, and a tiny real pair end to end through its command line.

The tiny runs learn nothing in 10 steps: their eval records are rewritten from a known curve at
each policy version's samples and the time the run reached that version (`curve_at`), so the
measured time to a target is known; the system records plan fits on are the runs' own.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
from test_plan_target import KNOWN, real_run
from tool_module import tool

from flowrl.graph.compile import compile_spec
from flowrl.plan import curve
from flowrl.records import RunDir
from flowrl.spec.load import load
from flowrl.spec.phases import expand

ROOT = Path(__file__).resolve().parents[1]


def bench():
    return tool("bench_plan_target")


def last_phase(pipeline: str, *overrides: str):
    """The compiled plan of the pipeline's last phase (the GRPO phase a pair's runs train in)."""
    return compile_spec(expand(load(ROOT / "pipelines" / pipeline, list(overrides)))[-1][1]).plan


# ---- the overrides -------------------------------------------------------------------------------------

def test_the_quickstart_pair_s_changes_as_plan_overrides_both_ways():
    b = bench()
    sync, stale = last_phase("quickstart.yaml"), last_phase("quickstart_async.yaml")
    overrides, refused = b.derive(sync, stale)
    assert sorted(overrides) == ["max_staleness=1", 'nodes.learner.own_process={"threads": 1}',
                                 "nodes.rollout.engine.threads=1", "nodes.rollout.partial_rollout=true"]
    assert refused == []  # the engine's threads 2 -> 1 are in the shape plan simulates
    back, refused_back = b.derive(stale, sync)
    assert sorted(back) == ["max_staleness=0", "nodes.learner.own_process=null", "nodes.rollout.engine.threads=2",
                            "nodes.rollout.partial_rollout=false"]
    assert refused_back == []


def test_the_longtail_pair_s_changes_both_ways_its_loss_as_one_key():
    b = bench()
    sync, stale = last_phase("longtail_sync.yaml"), last_phase("longtail_async.yaml")
    overrides, refused = b.derive(sync, stale)
    # The loss's decoupled and correction differ together: set as the whole loss (each alone is
    # refused by the config); the correction adds the proximal policy's forward (CostShape.passes).
    loss = [o for o in overrides if o.startswith("nodes.learner.loss=")]
    assert len(loss) == 1 and '"decoupled": true' in loss[0] and '"correction": {"kind": "tis"' in loss[0]
    assert sorted(o for o in overrides if o not in loss) == [
        "max_staleness=1", 'nodes.learner.own_process={"threads": 1}', "nodes.rollout.engine.threads=1",
        "nodes.rollout.partial_rollout=true", 'on_stale="keep"']
    assert refused == []
    back, refused_back = b.derive(stale, sync)
    assert 'on_stale="drop"' in back and "max_staleness=0" in back and refused_back == []
    assert any(o.startswith("nodes.learner.loss=") and "decoupled" not in o for o in back)


def test_batch_size_and_replicas_are_overrides_and_identical_plans_have_none():
    b = bench()
    base = last_phase("grpo_sync.yaml")
    other = last_phase("grpo_sync.yaml", "data.batch_size=32", "nodes.rollout.resources.replicas=2",
                       "data.eval={every: 3, samples: 8}")
    overrides, refused = b.derive(base, other)
    assert sorted(overrides) == ["data.batch_size=32", "nodes.rollout.resources.replicas=2"]
    # the compiler shares the node's CPUs among its replicas: a difference plan does not simulate either
    assert [r.split(" ")[0] for r in refused] == ["data.eval", "nodes.rollout.resources.cpus"]
    assert b.derive(base, last_phase("grpo_sync.yaml", "run.seed=7", "run.steps=99")) == ([], [])


# ---- the arithmetic -----------------------------------------------------------------------------------

def test_error_coverage_and_median_count_never_as_slower_than_any_time():
    b = bench()
    assert b.relative_error(45.0, 30.0) == 0.5 and b.relative_error(24.0, 30.0) == -0.2
    assert b.relative_error(None, None) == 0.0 and b.relative_error(10.0, None) is None
    assert b.relative_error(None, 10.0) is None
    assert b.covers([8.0, 10.0, 12.0], 12.0) and not b.covers([8.0, 10.0, 12.0], 12.5)
    assert b.covers([8.0, 10.0, None], 1e9) and b.covers([8.0, 10.0, None], None)
    assert not b.covers([8.0, 10.0, 12.0], None)
    assert b.median([3.0, None, 1.0]) == 3.0 and b.median([None, None, 1.0]) is None
    assert b.median([1.0, 2.0, 4.0, 10.0]) == 3.0 and b.median([]) is None


def test_a_direction_s_summary_over_pairs():
    def pair(seconds, measured_s, samples, measured_samples, as_run, source_s):
        return {"seconds": seconds, "measured_s": measured_s, "samples": [0.0, samples, 0.0],
                "measured_samples": measured_samples, "as_run_seconds": as_run, "source_measured_s": source_s,
                "error": 0.0, "covered": b.covers(seconds, measured_s)}

    b = bench()
    rows = {"1": pair([8.0, 10.0, 12.0], 11.0, 100.0, 80.0, 12.0, 10.0),
            "2": pair([16.0, 20.0, 30.0], 40.0, 300.0, 200.0, 30.0, 20.0),
            "3": pair([25.0, 30.0, None], 24.0, 200.0, 400.0, None, 30.0),
            "4": {"impossible": "the run has not left its plateau", "measured_s": 50.0}}
    s = b.summarise(rows)
    assert (s["pairs"], s["predicted"], s["pairs_covered"]) == (4, 3, 1)
    assert s["median_samples_error"] == 0.0  # median 200 predicted against median 200 measured
    assert s["median_as_run_error"] == 0.5  # median 30 (never counts as slower) against median 20
    assert s["median_predicted_s"] == 20.0 and s["median_interval_s"] == [16.0, 30.0]
    assert s["median_measured_s"] == 24.0  # over the pairs predicted: 11, 40, 24
    assert s["median_measured_s_all_pairs"] == 32.0
    assert s["median_error"] == pytest.approx(20.0 / 24.0 - 1, abs=1e-4) and s["within_bar"]
    assert s["interval_covers_median"]
    assert s["impossible"] == {"4": "the run has not left its plateau"}
    rows["1"]["seconds"], rows["3"]["seconds"] = [30.0, 33.0, 36.0], [31.0, 35.0, 40.0]
    worse = b.summarise(rows)
    assert worse["median_predicted_s"] == 33.0 and not worse["within_bar"]  # 33 / 24 - 1 = +37.5 %
    assert not worse["interval_covers_median"]  # [30, 36] does not hold 24


def test_the_folder_s_pairs_in_key_order(tmp_path):
    for name in ("sync-10", "async-10", "sync-9", "async-9", "sync-1.0-3", "async-1.0-3", "sync-4", "notes-4"):
        (tmp_path / name).mkdir()
    (tmp_path / "async-5").write_text("a file, not a run")
    b = bench()
    assert list(b.pairs(tmp_path, None)) == ["1.0-3", "9", "10"]
    assert list(b.pairs(tmp_path, ["10", "4"])) == ["10"]


def test_several_folders_are_one_pool_of_pairs(tmp_path):
    for folder, key in (("a", "10"), ("a", "2"), ("b", "9")):
        for arm in ("sync", "async"):
            (tmp_path / folder / f"{arm}-{key}").mkdir(parents=True)
    b = bench()
    pool = b.pooled([tmp_path / "a", tmp_path / "b"], None)
    assert list(pool) == ["2", "9", "10"] and pool["9"]["async"] == tmp_path / "b/async-9"
    assert list(b.pooled([tmp_path / "a", tmp_path / "b"], ["9"])) == ["9"]
    (tmp_path / "b/sync-2").mkdir()
    (tmp_path / "b/async-2").mkdir()
    with pytest.raises(SystemExit, match="pair 2 is in .*a and in .*b"):
        b.pooled([tmp_path / "a", tmp_path / "b"], None)


# ---- real runs -----------------------------------------------------------------------------------------

def curve_at(run_dir: Path, into: Path, known: curve.Curve) -> Path:
    """A copy of the run whose eval records follow `known` at each version's samples, each at the
    time the run finished the step that made that version (version 0: the first step's start)."""
    shutil.copytree(run_dir, into)
    rows = [json.loads(line) for line in (into / "metrics.jsonl").read_text().splitlines()]
    before = np.concatenate([[0], np.cumsum([r["groups"] for r in rows])])
    times = [rows[0]["time"] - rows[0]["step_seconds"]] + [r["time"] for r in rows]
    (into / "eval.jsonl").write_text("".join(
        json.dumps({"version": v, "eval_reward": float(known.value(c)), "samples": 16, "time": t}) + "\n"
        for v, (c, t) in enumerate(zip(before, times, strict=True))))
    return into


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Path:
    parent = tmp_path_factory.mktemp("pair")
    folder = parent / "runs"
    folder.mkdir()
    curve_at(real_run(parent, "grpo_sync.yaml", "run.steps=10"), folder / "sync-1", KNOWN)
    # the async arm needs 1.5x the samples for the same progress
    curve_at(real_run(parent, "grpo_async.yaml", "run.steps=10"), folder / "async-1", curve.Curve(0.05, 0.95, 2.0, 60.0))
    return folder


def first_time(run_dir: Path, value: float) -> float | None:
    return next((json.loads(line)["time"] for line in (run_dir / "eval.jsonl").read_text().splitlines()
                 if json.loads(line)["eval_reward"] >= value), None)


def test_measured_time_to_target_and_a_finished_run(pair):
    b = bench()
    sync = pair / "sync-1"
    assert b.measured(sync, "eval_reward", 0.5) == pytest.approx(first_time(sync, 0.5)) and first_time(sync, 0.5)
    assert b.measured(sync, "eval_reward", 0.99) is None
    rows = list(RunDir(sync).metrics())
    before = np.concatenate([[0], np.cumsum([r.groups for r in rows])])
    assert b.samples_to(sync, "eval_reward", 0.5) == next(c for c in before if KNOWN.value(c) >= 0.5)
    level = float(np.median([r.reward for r in rows]))
    hit = next(i for i, r in enumerate(rows) if r.reward >= level)
    assert b.measured(sync, "reward", level) == pytest.approx(rows[hit].time)
    assert b.samples_to(sync, "reward", level) == before[hit]  # the samples trained before that row
    assert b.measured(sync, "reward", 2.0) is None and b.samples_to(sync, "train.loss", 1e9) is None
    assert b.finished(sync, "eval_reward", 0.99)  # phase.json: the run ended
    assert not b.finished(pair / "missing", "eval_reward", 0.5)


def pair_row(direction: dict, key: str) -> dict:
    """One pair's figures out of the result's per-pair lists."""
    i = direction["pair_keys"].index(key)
    return {k.removesuffix("_by_pair"): v[i] for k, v in direction.items() if k.endswith("_by_pair")}


def test_a_tiny_real_pair_end_to_end(pair, capsys, monkeypatch):
    b = bench()
    saved = []
    monkeypatch.setattr(b.results_file, "save", lambda name, result, bench: saved.append((name, bench)) or ROOT)
    b.main([str(pair), "--target", "eval_reward=0.5", "--direction", "sync-to-async", "--seeds", "1",
            "--record", "plan-target-test"])
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    assert saved == [("plan-target-test", "bench_plan_target")]
    assert list(result["directions"]) == ["sync-to-async"] and result["skipped"] == []
    d = result["directions"]["sync-to-async"]
    row = pair_row(d, "1")
    assert d["overrides"] == [["max_staleness=2", 1]] and d["not_simulated"] == [["", 1]]
    direct = b.predict(pair / "sync-1", ["max_staleness=2"], "eval_reward=0.5")  # the wiring: plan's own figure
    assert row["seconds"][1] == pytest.approx(direct["seconds"][1], abs=0.01)
    assert row["measured_s"] == pytest.approx(first_time(pair / "async-1", 0.5), abs=1e-3)
    assert row["error"] == pytest.approx(direct["seconds"][1] / row["measured_s"] - 1, abs=1e-4)
    assert row["measured_samples"] == b.samples_to(pair / "async-1", "eval_reward", 0.5) > 0
    assert row["as_run_error"] == pytest.approx(direct["as_run_seconds"] / row["source_measured_s"] - 1, abs=1e-4)
    assert d["median_error"] == pytest.approx(row["error"], abs=1e-3) and d["within_bar"] == (abs(row["error"]) <= 0.25)
    assert result["bars"] == {"sync-to-async/within_bar": d["within_bar"],
                              "sync-to-async/interval_covers_median": d["interval_covers_median"]}
    assert "max_staleness=2" in out and "median over 1 of 1 pairs" in out
    assert result["protocol"]["bench"] == "bench_plan_target" and result["protocol"]["seeds"] == [1]


def test_both_directions_and_a_pair_plan_cannot_predict(pair, tmp_path, capsys):
    b = bench()
    folder = tmp_path / "runs"
    shutil.copytree(pair / "sync-1", folder / "sync-2")
    # the async arm on a flat curve: on its plateau, and never at the target
    curve_at(pair / "async-1", folder / "async-2", curve.Curve(0.3, 0.3, 2.0, 60.0))
    b.main([str(folder), "--target", "eval_reward=0.5"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert list(result["directions"]) == ["sync-to-async", "async-to-sync"]
    back = result["directions"]["async-to-sync"]
    assert back["predicted"] == 0 and "plateau" in back["impossible"]["2"]
    assert back["median_error"] is None and not back["within_bar"]
    there = pair_row(result["directions"]["sync-to-async"], "2")
    assert there["measured_s"] is None  # the flat arm never reached the target
    assert math.isfinite(there["seconds"][1])
    assert pair_row(back, "2")["seconds"] is None


@pytest.mark.parametrize("args, words", [(["--target", "samples_per_s=3"], "measures the system"),
                                         (["--target", "eval_reward"], "METRIC=VALUE")])
def test_a_malformed_target_is_refused(tmp_path, args, words, capsys):
    with pytest.raises(SystemExit):
        bench().main([str(tmp_path), *args])
    assert words in capsys.readouterr().err


def test_a_folder_that_is_not_one_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench().main([str(tmp_path / "nowhere"), "--target", "eval_reward=0.9"])
    assert "is not a folder" in capsys.readouterr().err


def test_one_direction_alone(pair, capsys):
    bench().main([str(pair), "--target", "eval_reward=0.5", "--direction", "async-to-sync"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    d = result["directions"]
    assert list(d) == ["async-to-sync"] and d["async-to-sync"]["overrides"] == [["max_staleness=0", 1]]
    assert pair_row(d["async-to-sync"], "1")["measured_s"] == pytest.approx(first_time(pair / "sync-1", 0.5), abs=1e-3)


def test_the_quoted_unseen_quickstart_pairs_recompute_from_the_pooled_file():
    """README.md and docs/plan.md quote the fifth and sixth sets alone (seeds 1046-1057) from the
    pooled read's per-pair figures, by the bench's own median (never slower than any time)."""
    b = bench()
    pooled = json.loads((ROOT / "results/plan-target-quickstart-pooled.json").read_text())["result"]["directions"]
    quoted = {}
    for name, d in pooled.items():
        mine = [i for i, key in enumerate(d["pair_keys"]) if int(key) >= 1046]
        assert len(mine) == 12
        predicted = b.median([d["seconds_by_pair"][i][1] for i in mine])
        quoted[name] = f"{b.relative_error(predicted, b.median([d['measured_s_by_pair'][i] for i in mine])):+.1%}"
    assert quoted == {"sync-to-async": "+36.4%", "async-to-sync": "-24.8%"}
    for page in ("README.md", "docs/plan.md"):
        assert "+36.4 % and -24.8 %" in (ROOT / page).read_text(), page
