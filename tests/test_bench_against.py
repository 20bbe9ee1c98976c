"""tools/bench_against.py on a repository of its own: two commits of a toy benchmark, compared."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "tools" / "bench_against.py"

BENCH = """import json
print("row fast {value}")
print(json.dumps({{"speed": {value}, "nested": {{"ratio": 0.5}}, "name": "toy",
                  "configs": [{{"config": "sync", "s": {value}}}, {{"config": "async", "s": 1.0}}]}}))
"""


def git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                   capture_output=True)


def test_both_trees_run_their_own_benchmark_and_the_logs_keep_every_line(tmp_path):
    repo = tmp_path / "repo"
    (repo / "tools").mkdir(parents=True)
    shutil.copy(TOOL, repo / "tools" / "bench_against.py")
    git(repo, "init", "-q")
    (repo / "tools" / "bench.py").write_text(BENCH.format(value=2.0))
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "before")
    (repo / "tools" / "bench.py").write_text(BENCH.format(value=3.0))  # this tree, uncommitted

    proc = subprocess.run([sys.executable, "tools/bench_against.py", "HEAD", "tools/bench.py", "--rounds", "2",
                           "--logs", str(tmp_path / "logs")], cwd=repo, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    last = json.loads(proc.stdout.splitlines()[-1])
    assert last["figures"] == {"speed": [2.0, 3.0], "nested.ratio": [0.5, 0.5], "configs.sync.s": [2.0, 3.0],
                               "configs.async.s": [1.0, 1.0]}
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["rev-1.log", "rev-2.log", "this-1.log",
                                                                     "this-2.log"]
    assert "row fast 2.0" in (tmp_path / "logs" / "rev-2.log").read_text()
    assert "row fast 3.0" in (tmp_path / "logs" / "this-1.log").read_text()
    worktrees = subprocess.run(["git", "worktree", "list"], cwd=repo, capture_output=True, text=True).stdout
    assert len(worktrees.splitlines()) == 1  # REV's worktree is removed


def test_from_logs_compares_what_a_folder_kept_without_running(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    for side, speed in (("rev", 2.0), ("this", 5.0)):
        for n, extra in ((1, 0.0), (2, 1.0)):
            (logs / f"{side}-{n}.log").write_text(f"row\n{json.dumps({'speed': speed + extra, 'ok': True})}\n")
    proc = subprocess.run([sys.executable, str(TOOL), "NOREV", "tools/none.py", "--from-logs", str(logs)],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1])["figures"] == {"speed": [2.5, 5.5]}  # medians of two rounds
    (logs / "this-1.log").unlink()
    (logs / "this-2.log").unlink()
    proc = subprocess.run([sys.executable, str(TOOL), "NOREV", "tools/none.py", "--from-logs", str(logs)],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 1 and "this-N.log" in proc.stderr
