"""tools/bench_smollm2.py: the report's maths (gain over the random-reward control, intervals over
seeds) on synthetic evaluations, and the held-out protocol's refusals."""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

import pytest
from tool_module import tool

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def b():
    sys.path.insert(0, str(ROOT / "tools"))
    return tool("bench_smollm2")


def ac_se(p: float, n: int) -> float:
    """Agresti-Coull's standard error, written out: two successes and two failures added."""
    q = (p * n + 2) / (n + 4)
    return math.sqrt(q * (1 - q) / (n + 4))


def arm(b, folder: Path, curve: list[float], anywhere: list[float], **run) -> dict:
    """A run's figures as run_arm makes them, from an eval.jsonl written here (versions 0, 10, 20)."""
    folder.mkdir(parents=True)
    rows = [{"version": 10 * i, "eval_reward": r, "scores": {"anywhere": a}, "samples": 256, "time": i, "seconds": 1}
            for i, (r, a) in enumerate(zip(curve, anywhere, strict=True))]
    (folder / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"exit": 0, "wall_s": 1000.0, "peak_rss_gb": 3.1, **run} | b.summary(folder)


def test_a_run_reports_each_score_first_last_and_gain(b, tmp_path):
    figures = arm(b, tmp_path / "r", [0.23, 0.6, 0.73], [0.5, 0.7, 0.8])
    assert figures["curve"] == [[0, 0.23], [10, 0.6], [20, 0.73]] and figures["gain"] == 0.5
    assert figures["scores"] == {"eval_reward": {"first": 0.23, "last": 0.73, "gain": 0.5},
                                 "anywhere": {"first": 0.5, "last": 0.8, "gain": 0.3}}
    spread = math.hypot(ac_se(0.23, 256), ac_se(0.73, 256))
    assert figures["se"] == round(spread, 4) and figures["gain_se"] == round(0.5 / spread, 2)


def test_the_gain_over_the_control_is_the_real_gain_less_the_controls(b, tmp_path):
    real = arm(b, tmp_path / "r", [0.23, 0.6, 0.73], [0.5, 0.7, 0.8])
    control = arm(b, tmp_path / "c", [0.25, 0.3, 0.43], [0.5, 0.55, 0.7])  # it too gained: +0.18
    row = b.seed_row(0, real, control)
    over = row["over_control"]
    assert over["eval_reward"]["over_control"] == pytest.approx(0.5 - 0.18)
    assert over["eval_reward"]["last_over_control"] == pytest.approx(0.73 - 0.43)  # differs: the firsts differ
    assert over["anywhere"] == {"over_control": pytest.approx(0.3 - 0.2), "last_over_control": pytest.approx(0.1)}
    spread = math.hypot(ac_se(0.73, 256), ac_se(0.43, 256))
    assert over["eval_reward"]["over_control_se"] == round(0.32 / spread, 2) and row["passes"]


def test_a_control_that_gains_as_much_fails_the_seed_that_passes_alone(b, tmp_path):
    """The bar is the gain over the control: a gain that random rewards give as well is no claim."""
    real = arm(b, tmp_path / "r", [0.23, 0.6, 0.73], [0.5, 0.7, 0.8])
    control = arm(b, tmp_path / "c", [0.23, 0.55, 0.68], [0.5, 0.7, 0.8])
    assert b.seed_row(0, real, None)["passes"]
    assert not b.seed_row(0, real, control)["passes"]  # +0.05 over the control, under 0.15
    slow = dict(real, wall_s=2000.0)
    assert not b.seed_row(0, slow, None)["passes"] and not b.seed_row(0, dict(real, exit=1), None)["passes"]


def test_the_t_interval_over_seeds(b):
    out = b.t_interval([0.4, 0.5, 0.6])
    half = 4.303 * 0.1 / math.sqrt(3)  # t(0.975, 2 df) * s / sqrt(n)
    assert out == {"mean": 0.5, "ci95": [round(0.5 - half, 4), round(0.5 + half, 4)], "n": 3}
    assert b.t_interval([0.4, None, 0.6])["n"] == 2  # a failed run's missing figure is left out
    assert b.t_interval([0.4]) == {"mean": 0.4, "ci95": None, "n": 1}
    assert b.t_interval([None]) == {"mean": None, "ci95": None, "n": 0}
    # the table meets the expansion past 30 degrees of freedom, and both go to the normal quantile
    assert abs(b.t975(31) - b.t975(30)) < 0.005 and b.t975(10_000) == pytest.approx(1.96, abs=1e-3)


def test_the_last_line_over_seeds(b, tmp_path):
    seeds = {0: ([0.23, 0.6, 0.73], [0.23, 0.3, 0.33]), 1: ([0.23, 0.5, 0.63], [0.23, 0.3, 0.28]),
             2: ([0.23, 0.6, 0.78], [0.23, 0.2, 0.28])}
    rows = [b.seed_row(s, arm(b, tmp_path / f"r{s}", r, r), arm(b, tmp_path / f"c{s}", c, [0.5, 0.5, 0.5]))
            for s, (r, c) in seeds.items()]
    out = json.loads(json.dumps(b.result(rows, {"bench": "bench_smollm2", "heldout": False})))
    over = [0.4, 0.35, 0.5]  # each seed's gain less its control's
    assert out["over_control"]["eval_reward"]["by_seed"] == pytest.approx(over)
    half = 4.303 * statistics.stdev(over) / math.sqrt(3)
    figure = out["over_control"]["eval_reward"]
    assert figure["mean"] == 0.4167 and figure["n"] == 3
    assert figure["ci95"] == pytest.approx([0.4167 - half, 0.4167 + half], abs=1e-4)
    assert out["gain"]["eval_reward"]["mean"] == pytest.approx((0.5 + 0.4 + 0.55) / 3, abs=1e-4)
    assert out["control_gain"]["eval_reward"]["by_seed"] == pytest.approx([0.1, 0.05, 0.05])
    assert out["last_over_control"]["eval_reward"]["by_seed"] == pytest.approx(over)  # the same firsts
    assert out["over_control"]["anywhere"]["by_seed"] == pytest.approx([0.5, 0.4, 0.55])
    assert out["passed"] == "3/3" and out["bar"]["figure"] == "over_control" and out["seeds"] == [0, 1, 2]
    assert out["headline"].startswith("eval_reward gain over the random-reward control +0.417 (95% [")
    assert "anywhere over the control +0.483" in out["headline"] and out["headline"].endswith("passed 3/3")
    assert set(out) == {"headline", "pipeline", "passed", "bar", "interval", "gain", "control_gain", "over_control",
                        "last_over_control", "protocol", "seeds", "by_seed"}
    assert set(out["by_seed"]["1"]) == {"real", "control", "over_control", "passes"}


def test_without_the_control_the_bar_is_the_gain(b, tmp_path):
    rows = [b.seed_row(0, arm(b, tmp_path / "r", [0.23, 0.6, 0.73], [0.5, 0.7, 0.8]), None)]
    out = b.result(rows, {})
    assert out["over_control"] is None and out["control_gain"] is None and out["bar"]["figure"] == "gain"
    assert out["headline"] == ("eval_reward gain +0.500 (no interval, 1 seed); anywhere gain +0.300 (no interval, "
                               "1 seed); passed 1/1")


@pytest.mark.parametrize(("argv", "words"), [
    (["--seeds", "0,1000"], "seeds from 1000 up are held out"),
    (["--heldout", "--control", "nodes.learner.optim.lr=2e-5"], "no key=value overrides"),
    (["--heldout"], "add --control"),
    (["--heldout", "--control", "--seeds", "1000,7"], "[7] are not among them"),
    (["--control", "nodes.score.control=random"], "use --control"),
])
def test_the_protocol_refuses(b, argv, words, capsys):
    with pytest.raises(SystemExit) as stopped:
        b.check_protocol(b.parse(argv))
    assert stopped.value.code == 2 and words in capsys.readouterr().err


def test_a_heldout_run_refuses_a_dirty_tree_and_takes_the_heldout_seeds(b, monkeypatch, capsys):
    monkeypatch.setattr(b.heldout, "commit", lambda: ("abc", True))
    with pytest.raises(SystemExit):
        b.check_protocol(b.parse(["--heldout", "--control"]))
    assert "commit or stash the changes first" in capsys.readouterr().err
    monkeypatch.setattr(b.heldout, "commit", lambda: ("abc", False))
    assert b.check_protocol(b.parse(["--heldout", "--control"])) == [1000, 1001, 1002, 1003, 1004]
    assert b.check_protocol(b.parse(["--heldout", "--control", "--seeds", "1002"])) == [1002]
    assert b.check_protocol(b.parse([])) == [0, 1, 2]


def test_a_run_refuses_an_out_folder_holding_earlier_runs(b, tmp_path):
    (tmp_path / "control-1").mkdir()
    with pytest.raises(SystemExit, match="already holds control-1: give a new --out"):
        b.main(["--seeds", "0,1", "--control", "--out", str(tmp_path)])


def test_report_only_reprints_the_arms_and_adds_nothing_to_the_ledger(b, tmp_path, monkeypatch, capsys):
    for name, curve in (("seed-0", [0.23, 0.6, 0.73]), ("control-0", [0.23, 0.3, 0.33])):
        figures = arm(b, tmp_path / name, curve, curve) | {"seed": 0}
        (tmp_path / f"{name}.json").write_text(json.dumps(figures))
    monkeypatch.setattr(b.heldout, "record", lambda result: pytest.fail("a reprint went to the ledger"))
    b.main(["--seeds", "0", "--control", "--report-only", "--out", str(tmp_path)])
    lines = capsys.readouterr().out.splitlines()
    assert "seed 0 over the control: eval_reward +0.400 (last +0.400), anywhere +0.400 (last +0.400)" in lines
    assert json.loads(lines[-1])["over_control"]["eval_reward"]["mean"] == 0.4


def test_another_pipeline_has_its_own_heldout_seeds_and_is_named_in_the_stamp(b, monkeypatch, capsys):
    monkeypatch.setattr(b.heldout, "commit", lambda: ("abc", False))
    code = ["--pipeline", "pipelines/smollm2_code.yaml"]
    assert b.bench_name(b.PIPELINE) == "bench_smollm2"
    assert b.bench_name("pipelines/smollm2_code.yaml") == "bench_smollm2:smollm2_code"
    assert b.check_protocol(b.parse([*code, "--heldout", "--control"])) == [1000, 1001, 1002, 1003, 1004]
    with pytest.raises(SystemExit) as stopped:  # a recipe with no held-out seeds fixed cannot claim
        b.check_protocol(b.parse(["--pipeline", "pipelines/mine.yaml", "--heldout", "--control"]))
    assert stopped.value.code == 2 and "bench_smollm2:mine has no held-out seeds fixed" in capsys.readouterr().err
    assert b.result([], {"bench": "bench_smollm2:smollm2_code"}, "pipelines/smollm2_code.yaml")["pipeline"] \
        == "pipelines/smollm2_code.yaml"


def test_a_gain_to_1_against_a_control_at_0_passes(b, tmp_path):
    """Both last evaluations at the ends of [0, 1]: the standard error is not 0 (Agresti-Coull)."""
    real = arm(b, tmp_path / "r", [0.094, 0.969, 1.0], [0.0625, 0.969, 1.0])
    control = arm(b, tmp_path / "c", [0.094, 0.0, 0.0], [0.0625, 0.0, 0.0])
    row = b.seed_row(0, real, control)
    assert row["over_control"]["eval_reward"]["over_control_se"] > 3 and row["passes"]
    assert b.se(0.0, 64) > 0 and b.se(1.0, 64) == pytest.approx(b.se(0.0, 64))
