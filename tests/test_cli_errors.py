"""Every command answers a user's mistake with one explained line on stderr and exit 1, never a
traceback; `--debug` shows the traceback; a flowrl bug is called one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from flowrl import cli as flowrl_cli
from flowrl.cli import main

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "tests/specs/good/base.yaml"
TINY_RUN = ["run.steps=1", "data.batch_size=2", "nodes.rollout.group_size=2", "--quiet"]


def flowrl(*args: str, cwd: Path = ROOT, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flowrl.cli", *args], capture_output=True, text=True, timeout=300,
                          cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def explained(proc: subprocess.CompletedProcess, *words: str) -> None:
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert all(w in proc.stderr for w in words), proc.stderr


def test_resume_explains_a_missing_or_foreign_directory(tmp_path: Path) -> None:
    explained(flowrl("run", "--resume", str(tmp_path / "nope")), "no run directory", "--resume takes")
    explained(flowrl("run", "--resume", str(tmp_path)), "is not a run directory", "launch.json")
    (tmp_path / "launch.json").write_text("{not json")
    (tmp_path / "spec.yaml").write_text(BASE.read_text())
    explained(flowrl("run", "--resume", str(tmp_path)), "cannot read", "launch.json")
    explained(flowrl("inspect", str(tmp_path)), "cannot inspect", "not a run directory")
    explained(flowrl("run", "--resume", str(tmp_path), str(BASE)), "give no pipeline file")
    explained(flowrl("run"), "give a pipeline file, or --resume RUN_DIR")


def test_finished_run_and_a_reused_run_directory_are_explained(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    done = flowrl("run", str(BASE), *TINY_RUN, "--run-dir", str(run_dir))
    assert done.returncode == 0, done.stderr[-2000:]
    explained(flowrl("run", "--resume", str(run_dir)), "has finished; nothing to resume")
    explained(flowrl("run", str(BASE), *TINY_RUN, "--run-dir", str(run_dir)), "already holds a run",
              f"flowrl run --resume {run_dir}")
    (tmp_path / "file").write_text("")
    explained(flowrl("run", str(BASE), *TINY_RUN, "--run-dir", str(tmp_path / "file")), "is a file")


def test_run_checks_the_spec_before_any_stage_starts(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = flowrl("run", str(BASE), "nodes.score.fn=no_such_module_x:f", *TINY_RUN, "--run-dir", str(run_dir))
    explained(proc, "nodes.score.fn", "cannot import module 'no_such_module_x'")
    assert not run_dir.exists()  # nothing started, nothing blocks a corrected re-run into it


def test_broken_plugin_is_named_and_the_others_still_listed(tmp_path: Path) -> None:
    dist = tmp_path / "brokenplug-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: brokenplug\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[flowrl.operators]\nbrokenplug = brokenplug_mod:Op\n")
    (tmp_path / "brokenplug_mod.py").write_text("def broken(:\n")  # a syntax error
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = flowrl("operators", env=env)
    explained(proc, "operator 'brokenplug' cannot be loaded", "SyntaxError")
    assert "generate" in proc.stdout  # the working operators are still described


def test_debug_shows_the_traceback_before_or_after_the_command(tmp_path: Path) -> None:
    bad = ROOT / "tests/specs/bad/unknown_op.yaml"
    for args in (["--debug", "validate", str(bad)], ["validate", str(bad), "--debug"]):
        proc = flowrl(*args)
        assert proc.returncode == 1 and "Traceback" in proc.stderr and "unknown operator" in proc.stderr
    assert "Traceback" not in flowrl("validate", str(bad)).stderr


def test_a_flowrl_bug_is_reported_as_one(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def broken(file: str, overrides: list[str], probe: bool = False) -> None:
        raise KeyError("plan")

    monkeypatch.setattr(flowrl_cli, "_compile", broken)
    assert main(["validate", str(BASE)]) == 1
    err = capsys.readouterr().err
    assert "internal error: KeyError" in err and "--debug" in err and "Traceback" not in err


def test_many_problems_are_capped_and_an_unwritable_output_explained(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    spec = tmp_path / "many.yaml"
    isolated = "".join(f"  extra{i}: {{op: sync}}\n" for i in range(80))
    spec.write_text(BASE.read_text().replace("nodes:\n", "nodes:\n" + isolated))
    assert main(["validate", str(spec)]) == 1
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == flowrl_cli.MAX_SHOWN + 1 and lines[-1] == "... and 30 more problems"
    assert main(["inspect", str(BASE), "-o", str(tmp_path / "no" / "such" / "dir.txt")]) == 1
    assert "cannot write" in capsys.readouterr().err


@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="needs /dev/zero and mkfifo")
def test_a_spec_that_is_no_regular_file_is_refused_unread(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.yaml"
    os.mkfifo(fifo)  # opened for reading, it would wait for a writer forever
    for target in ("/dev/zero", str(fifo), str(tmp_path)):
        explained(flowrl("validate", target), "not a regular file")


async def no_trajectory(ctx, sample):
    """A workflow that rejects every sample (returns no trajectory)."""
    return None


async def every_other(ctx, sample):
    """Rejects the samples of odd index, answers the others as the default workflow does."""
    from flowrl_operators.workflows import load_workflow

    return None if ctx.sample_id.endswith(("1", "3", "5", "7", "9")) else await load_workflow("single_turn")(ctx, sample)


def test_a_run_that_lost_its_samples_says_so(tmp_path: Path) -> None:
    # Half the samples are rejected: the run trains on the others, and its summary line says where
    # the lost ones went. (A run that loses every sample fails: tests/test_untrained.py.)
    proc = flowrl("run", str(BASE), "nodes.rollout.workflow=test_cli_errors:every_other", *TINY_RUN,
                  "--run-dir", str(tmp_path / "run"), env={"PYTHONPATH": str(ROOT / "tests")})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "samples lost on the way: 1 rejected" in proc.stdout, proc.stdout
    done = flowrl("run", str(BASE), *TINY_RUN, "--run-dir", str(tmp_path / "ok"))
    assert "samples lost" not in done.stdout, done.stdout


@pytest.mark.parametrize(("override", "where", "words"), [
    # a key the override adds: the problem inside it is the override's, not the file's `nodes:`
    ("nodes.extra.op=reward", "command-line override 'nodes.extra.op=reward' nodes.extra:", "missing required key 'fn'"),
    # a digit is a mapping's key where the value is a mapping (a list index only in a list)
    ("nodes.0=3", "command-line override 'nodes.0=3' nodes[\"0\"]:", "a node is a mapping"),
    ("nodes.score.=x", "command-line override 'nodes.score.=x':", "not a dotted key (an empty part)"),
    ("nodes.score={op: reward, op: judge, fn: builtin:reverse_digits}", "command-line override 'nodes.score={op: ",
     "duplicate key 'op'"),
])
def test_an_override_problem_is_located_at_the_override(override: str, where: str, words: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(BASE), override]) == 1
    err = capsys.readouterr().err
    assert err.startswith(where) and words in err and "Traceback" not in err, err


def test_a_command_line_mistake_exits_1_like_every_user_error(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["run", str(BASE), "--executor", "k8s"], ["inspect", str(BASE), "--format", "png"], ["bogus"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 1 and "error:" in capsys.readouterr().err


def test_inspect_names_the_damaged_record_of_a_run_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "meta.json").write_text('{"name": "x", "origin": 0}')
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1, oops\n')
    assert main(["inspect", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"{tmp_path}/metrics.jsonl:2: not a JSON line" in err and "internal error" not in err, err
