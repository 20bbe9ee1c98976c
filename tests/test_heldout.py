"""tools/heldout.py: the protocol's rules (held-out seeds only under --heldout, a clean tree, the ledger)
and its intervals (Wilson for rates, bootstrap for medians and paired ratios of medians)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def heldout():
    spec = importlib.util.spec_from_file_location("heldout", ROOT / "tools/heldout.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["heldout"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("heldout", None)


def test_wilson_interval_matches_the_formula_and_is_sound_at_the_ends(heldout):
    # 18 of 20: Wilson's 95% interval is [0.699, 0.972] (p +- 1.96 se would claim [0.77, 1.03]).
    assert heldout.wilson(18, 20) == (0.699, 0.972)
    low, high = heldout.wilson(20, 20)
    assert high == 1.0 and 0.83 < low < 0.84
    assert heldout.wilson(0, 10)[0] == 0.0 and heldout.wilson(0, 0) is None


def test_median_spread_counts_a_miss_as_slower_than_every_hit(heldout):
    out = heldout.median_spread([100, 200, None, 300, None])
    assert out["median"] == 300 and out["q25"] == 200 and out["q75"] is None  # a quartile that is a miss
    assert out["ci95"][0] is not None and out["ci95"][0] <= 300 and out["ci95"][1] is None
    tight = heldout.median_spread([10, 10, 10, 10])
    assert tight["median"] == 10 and tight["ci95"] == [10, 10]


def test_paired_ratio_interval_covers_the_point_and_narrows_when_seeds_agree(heldout):
    sync = [100, 120, 140, 160, 180, 200, 220]
    same_ratio = heldout.median_ratio([2 * x for x in sync], sync)
    assert same_ratio["ratio"] == 2.0 and same_ratio["ci95"] == [2.0, 2.0]  # paired: the shared spread cancels
    noisy = heldout.median_ratio([150, 300, 90, 500, 260, 120, 410], sync)
    low, high = noisy["ci95"]
    assert low < noisy["ratio"] < high and high - low > 0.5
    unpaired = heldout.median_ratio([2 * x for x in sync], sync, paired=False)
    assert unpaired["ci95"][1] - unpaired["ci95"][0] > 0.3  # unpaired, the seeds' own spread stays in
    assert heldout.median_ratio([None, None, 10], [5, 5, 5])["ratio"] is None  # the numerator's median is a miss
    with pytest.raises(ValueError, match="same seeds"):
        heldout.median_ratio([1, 2], [1, 2, 3])


def git(repo: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True,
                   env={"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                        "GIT_COMMITTER_EMAIL": "t@t", "HOME": str(repo)})


def test_heldout_seeds_need_heldout_and_a_clean_tree(heldout, tmp_path, capsys, monkeypatch):
    git(tmp_path, "init", "-q")
    (tmp_path / "recipe.yaml").write_text("lr: 1\n")
    git(tmp_path, "add", "recipe.yaml")
    git(tmp_path, "commit", "-qm", "recipe")
    monkeypatch.setattr(heldout, "ROOT", tmp_path)
    with pytest.raises(SystemExit) as screening:
        heldout.seeds_for("bench_e2e", False, [3, 1004])
    assert screening.value.code == 2 and "held out" in capsys.readouterr().err
    assert heldout.seeds_for("bench_e2e", False, [3, 4]) == [3, 4]
    assert heldout.seeds_for("bench_e2e", True, None) == list(range(1000, 1020))
    # another claim on the same runs has seeds of its own, none of them the first claim's
    assert not set(heldout.seeds_for("bench_e2e:plan_target", True, None)) & set(range(1000, 1020))
    assert not set(heldout.seeds_for("bench_longtail:plan_target", True, None)) & set(range(1000, 1005))
    with pytest.raises(SystemExit):
        heldout.seeds_for("bench_e2e", True, [5])  # not a held-out seed
    (tmp_path / "recipe.yaml").write_text("lr: 2\n")  # an uncommitted change to the recipe
    with pytest.raises(SystemExit) as dirty:
        heldout.seeds_for("bench_e2e", True, None)
    assert dirty.value.code == 2 and "commit or stash" in capsys.readouterr().err
    stamp = heldout.stamp("bench_e2e", False, [3])
    assert stamp["dirty"] and len(stamp["commit"]) == 40


def test_ledger_shows_the_screening_figure_beside_the_heldout_one(heldout, tmp_path, capsys):
    ledger = tmp_path / "ledger.jsonl"

    def result(held: bool, headline: str, commit: str = "c1") -> dict:
        return {"headline": headline, "protocol": {"bench": "bench_e2e", "heldout": held, "commit": commit,
                                                   "seeds": [1000] if held else [0]}}

    heldout.record(result(False, "9 of 10", commit="c0"), ledger)
    heldout.record(result(False, "10 of 10"), ledger)
    heldout.record(result(True, "15 of 20"), ledger)
    out = capsys.readouterr().out
    assert "screening at this commit (seeds [0]): 10 of 10" in out and "held-out (seeds [1000]): 15 of 20" in out
    assert [json.loads(line)["headline"] for line in ledger.read_text().splitlines()] == ["9 of 10", "10 of 10", "15 of 20"]


def test_a_held_out_set_names_another_claims_seeds_and_needs_heldout(heldout):
    """`--heldout-set NAME` offers the sets HELDOUT holds for the benchmark (`bench:NAME`) and picks
    their key; without --heldout it is refused (exit 2, one line)."""
    import argparse

    for bench in ("bench_e2e", "bench_longtail"):
        parser = argparse.ArgumentParser()
        parser.add_argument("--heldout", action="store_true")
        heldout.add_set_flag(parser, bench)
        assert heldout.bench_of(parser, parser.parse_args(["--heldout", "--heldout-set", "plan_target"]), bench) \
            == f"{bench}:plan_target"
        assert heldout.bench_of(parser, parser.parse_args(["--heldout"]), bench) == bench
        with pytest.raises(SystemExit) as unknown:
            parser.parse_args(["--heldout", "--heldout-set", "no_such_claim"])
        assert unknown.value.code == 2
        with pytest.raises(SystemExit) as alone:
            heldout.bench_of(parser, parser.parse_args(["--heldout-set", "plan_target"]), bench)
        assert alone.value.code == 2
