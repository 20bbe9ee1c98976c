"""Experiment trackers (`run.trackers`) and samples.jsonl, on a real run of the toy pipeline.

What each tracker got is read back from its own files, with its own reader where it has one:
TensorBoard's event files with tensorboard's loader, MLflow's file store with `MlflowClient`, and
wandb's offline `.wandb` file (LevelDB log blocks of `wandb_internal_pb2.Record`; wandb 0.2x
ships no Python reader of it any more) plus the table files it references.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, ClassVar

import pytest
import runtime_ops as ops

from flowrl.cli import main
from flowrl.runtime.run import run
from flowrl.trackers import (
    SAMPLE_COLUMNS,
    Tracker,
    TrackerContext,
    TrackerError,
    check,
    names,
    resolve,
    sample_cells,
    scalars,
)

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "tests/specs/good/base.yaml"
ALL = ["tensorboard", "wandb", "mlflow", "test_trackers:Recorder"]


class Recorder:
    """A plugin tracker named by module:attr: writes what it is handed to RUN_DIR/recorder.jsonl
    (a subclass to <its name>.jsonl)."""

    requires: ClassVar[tuple[str, ...]] = ()

    def open(self, context: TrackerContext) -> dict[str, Any]:
        self.path = context.run_dir / f"{type(self).__name__.lower()}.jsonl"
        self._write({"open": context.name, "label": context.label, "group": context.group, "state": context.state})
        return {"opened": True}

    def log(self, rows: list[dict[str, Any]], samples: list[dict[str, Any]]) -> None:
        self._write({"rows": rows, "samples": samples})

    def close(self) -> None:
        self._write({"close": True})

    def _write(self, entry: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(entry) + "\n")


class Broken(Recorder):
    def log(self, rows: list[dict[str, Any]], samples: list[dict[str, Any]]) -> None:
        raise ConnectionError("the tracking server went away")


class Hangs(Recorder):
    """A tracker whose log() never returns (a tracking server that accepts and never answers)."""

    def log(self, rows: list[dict[str, Any]], samples: list[dict[str, Any]]) -> None:
        threading.Event().wait()


class Exits(Recorder):
    def log(self, rows: list[dict[str, Any]], samples: list[dict[str, Any]]) -> None:
        raise SystemExit(3)


class Unkeepable(Recorder):
    """open() returns state that trackers.json cannot keep (an object, not JSON)."""

    def open(self, context: TrackerContext) -> dict[str, Any]:
        super().open(context)
        return {"run": object()}


class Absent(Recorder):
    requires: ClassVar[tuple[str, ...]] = ("flowrl_no_such_module",)


def toy(steps: int = 4, train_delay: float = 0.0, **run_keys: Any):
    plan = ops.grpo("sync", 0, steps=steps, batch_size=3, gen={"text": True}, train={"delay": train_delay})
    plan.run.update(trackers=ALL, **run_keys)
    return plan


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def wandb_records(path: Path) -> list[Any]:
    """Every record of an offline run's .wandb file: 32 KiB blocks of (crc, length, type) chunks."""
    from wandb.proto import wandb_internal_pb2

    data, pos, out, part = path.read_bytes(), 7, [], b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if kind == 0:  # block padding
            pos += left
            continue
        part, pos = part + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(part)
            out.append(record)
            part = b""
    return out


def wandb_history(run_dir: Path) -> tuple[set[str], list[dict[str, Any]]]:
    """(run ids, history rows in order) of every offline run folder under RUN_DIR/wandb."""
    ids, rows = set(), []
    for folder in sorted((run_dir / "wandb").glob("offline-run-*")):
        for record in wandb_records(next(folder.glob("run-*.wandb"))):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                ids.add(record.run.run_id)
            elif kind == "history":
                row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                if "samples/path" in row:
                    row["samples"] = json.loads((folder / "files" / row["samples/path"]).read_text())
                rows.append(row)
    return ids, rows


def mlflow_client(run_dir: Path) -> tuple[Any, str]:
    from mlflow.tracking import MlflowClient

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # as the tracker does for its default store
    client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    return client, json.loads((run_dir / "trackers.json").read_text())["mlflow"]["state"]["run_id"]


def tensorboard_events(run_dir: Path) -> list[Any]:
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

    return [e for path in sorted((run_dir / "tensorboard").glob("events.*"))
            for e in LegacyEventFileLoader(str(path)).Load() if e.summary.value]  # as written


def test_every_registered_tracker_keeps_the_contract() -> None:
    assert {"tensorboard", "wandb", "mlflow"} <= set(names())
    for name in names():
        cls = resolve(name)
        assert isinstance(cls(), Tracker), name
        assert all(isinstance(m, str) for m in cls.requires)
    assert isinstance(resolve("test_trackers:Recorder")(), Tracker)
    for bad, message in ((len, "not a class"), (object, "no open, log, close method"),
                         (type("NoRequires", (Recorder,), {"requires": None}), "`requires` must be a tuple")):
        with pytest.raises(TrackerError, match=message):
            check(bad, "bad")
    with pytest.raises(TrackerError, match="unknown tracker 'wandbb'.*did you mean 'wandb'"):
        resolve("wandbb")


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("trackers") / "run"
    result = run(toy(), run_dir, progress=False)
    assert result.status == "done" and result.steps == 4
    return run_dir


def test_samples_jsonl_holds_a_few_trajectories_of_each_step_with_their_text(finished: Path) -> None:
    samples = lines(finished / "samples.jsonl")
    assert [s["step"] for s in samples] == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
    first = samples[:4]  # 3 groups of 2: the first of each group, then the first group's second
    assert [s["id"] for s in first] == ["0:0/0", "0:1/0", "0:2/0", "0:0/1"]
    x = 3 * 7  # runtime_ops.Numbers(seed=3): x = 21 + index at step 0
    assert [(s["prompt"], s["response"], s["version"]) for s in first] == \
        [("x=21", "21 v0", 0), ("x=22", "22 v0", 0), ("x=23", "23 v0", 0), ("x=21", "22 v0", 0)]
    assert first[0]["reward"] == (x + 0) % 7 / 7  # the toy reward of response [21, 0]
    assert "prompt_ids" not in first[0]  # ids stand in only for text a record lacks


def test_every_tracker_gets_the_metrics_and_samples_of_each_step(finished: Path) -> None:
    rows, samples = lines(finished / "metrics.jsonl"), lines(finished / "samples.jsonl")
    expected = {r["step"]: scalars(r) for r in rows}
    assert "train/loss" in expected[0] and "runtime/reward" in expected[0]
    cells = {step: [sample_cells(s) for s in samples if s["step"] == step] for step in expected}

    recorded = lines(finished / "recorder.jsonl")
    assert recorded[0] == {"open": "toy", "label": "run", "group": None, "state": {}}
    assert recorded[-1] == {"close": True}
    assert [r for e in recorded[1:-1] for r in e["rows"]] == rows
    assert [s for e in recorded[1:-1] for s in e["samples"]] == samples

    ids, history = wandb_history(finished)
    assert len(ids) == 1 and [h["_step"] for h in history] == [0, 1, 2, 3]
    assert list((finished / "wandb/data/artifacts/staging").iterdir())  # tables staged for sync: in the run dir
    for h in history:
        assert {k: h[k] for k in expected[h["_step"]]} == pytest.approx(expected[h["_step"]])
        assert h["samples"]["columns"] == list(SAMPLE_COLUMNS) and h["samples"]["data"] == cells[h["_step"]]

    client, run_id = mlflow_client(finished)
    assert client.get_run(run_id).info.status == "FINISHED"
    for key in ("runtime/reward", "train/loss", "idle/rollout"):
        history = client.get_metric_history(run_id, key)
        assert [m.step for m in history] == [0, 1, 2, 3]
        assert [m.value for m in history] == pytest.approx([expected[s][key] for s in range(4)])
    queue = next(k for k in expected[0] if k.startswith("queues/"))  # "queues/rollout.trajectories -> ..."
    assert client.get_metric_history(run_id, queue.replace("->", "to"))
    table = json.loads(Path(client.download_artifacts(run_id, "samples/steps-000000.json",
                                                      str(finished.parent / "dl"))).read_text())
    want = [c for s in range(4) for c in cells[s]]
    assert table["columns"] == list(SAMPLE_COLUMNS)
    reward = SAMPLE_COLUMNS.index("reward")  # pandas writes floats with 10 digits
    assert [c[:reward] + c[reward + 1:] for c in table["data"]] == [c[:reward] + c[reward + 1:] for c in want]
    assert [c[reward] for c in table["data"]] == pytest.approx([c[reward] for c in want], abs=1e-9)

    events = tensorboard_events(finished)
    assert [e.step for e in events] == [0, 1, 2, 3]
    values = {v.tag: v for v in events[2].summary.value}
    assert values["train/loss"].simple_value == pytest.approx(expected[2]["train/loss"])
    text = values["samples"].tensor.string_val[0].decode()
    assert text.splitlines()[0] == "| " + " | ".join(SAMPLE_COLUMNS) + " |" and "| x=2023 | 2023 v2 |" in text


def test_a_resume_sends_each_step_to_each_tracker_once(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    first = run(toy(steps=6, checkpoint_every=2), run_dir, progress=False, max_steps=4)
    assert first.status == "interrupted"
    # As if killed after steps 2 and 3 reached every file and tracker, before checkpoint step-4.
    shutil.rmtree(run_dir / "checkpoints/step-4")
    (run_dir / "checkpoints/latest").write_text("step-2")
    assert run(toy(steps=6, checkpoint_every=2), run_dir, progress=False, resume=True).status == "done"

    assert [r["step"] for r in lines(run_dir / "metrics.jsonl")] == list(range(6))
    assert [s["step"] for s in lines(run_dir / "samples.jsonl")] == [s for s in range(6) for _ in range(4)]
    ids, history = wandb_history(run_dir)
    assert len(ids) == 1 and len(list((run_dir / "wandb").glob("offline-run-*"))) == 2  # the same run, continued
    assert [h["_step"] for h in history] == list(range(6))  # steps 2 and 3 not sent again
    client, run_id = mlflow_client(run_dir)
    assert [m.step for m in client.get_metric_history(run_id, "train/loss")] == list(range(6))
    assert len(client.search_runs([client.get_run(run_id).info.experiment_id])) == 1
    assert [e.step for e in tensorboard_events(run_dir)] == list(range(6))  # cut back, then sent again
    recorded = lines(run_dir / "recorder.jsonl")
    assert {"open": "toy", "label": "run", "group": None, "state": {"opened": True}} in recorded
    assert [r["step"] for e in recorded if "rows" in e for r in e["rows"]] == list(range(6))


KILLED = """
import sys
sys.path.insert(0, {tests!r})
import test_trackers
from flowrl.runtime.run import run
run(test_trackers.toy(steps=10, train_delay=0.25, checkpoint_every=3), {run_dir!r}, progress=False)
"""


@pytest.mark.slow
def test_a_run_killed_mid_step_resumes_its_tracker_runs(tmp_path: Path) -> None:
    """kill -9 in the 8th train step (checkpoint step-6), then --resume: each tracker continues
    its run; mlflow and TensorBoard hold every step once. wandb holds no step twice and every step
    sent after the kill; it may lack the last flush before it (its file trails by 0.5 s)."""
    run_dir = tmp_path / "run"
    killed = subprocess.run([sys.executable, "-c", KILLED.format(tests=str(Path(__file__).parent), run_dir=str(run_dir))],
                            env={**os.environ, "FLOWRL_FAULT": "train:8"}, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert (run_dir / "checkpoints/latest").read_text() == "step-6"
    sent = json.loads((run_dir / "trackers.json").read_text())["wandb"]["steps"]["learner"]
    assert sent >= 5  # the rows of steps 0-5 were flushed with checkpoint step-6
    assert run(toy(steps=10, train_delay=0.25, checkpoint_every=3), run_dir, progress=False, resume=True).status == "done"

    assert [r["step"] for r in lines(run_dir / "metrics.jsonl")] == list(range(10))
    client, run_id = mlflow_client(run_dir)
    assert [m.step for m in client.get_metric_history(run_id, "train/loss")] == list(range(10))
    assert client.get_run(run_id).info.status == "FINISHED"
    assert [e.step for e in tensorboard_events(run_dir)] == list(range(10))
    ids, history = wandb_history(run_dir)
    steps = [h["_step"] for h in history]
    assert len(ids) == 1 and len(list((run_dir / "wandb").glob("offline-run-*"))) == 2
    assert steps == sorted(set(steps)) and set(range(sent + 1, 10)) <= set(steps) and set(steps) <= set(range(10))


def test_samples_per_step_and_a_failing_tracker_that_is_dropped(tmp_path: Path) -> None:
    run_dir = tmp_path / "phases" / "1-grpo"  # a phase's folder (flowrl/spec/phases.py)
    plan = toy(samples_per_step=1)
    plan.run["trackers"] = ["test_trackers:Broken", "test_trackers:Recorder"]
    with pytest.warns(UserWarning, match="tracker 'test_trackers:Broken' failed and is dropped .* went away"):
        assert run(plan, run_dir, progress=False).status == "done"
    assert [(s["step"], s["id"]) for s in lines(run_dir / "samples.jsonl")] == [(s, f"{s}:0/0") for s in range(4)]
    recorded = lines(run_dir / "recorder.jsonl")
    assert (recorded[0]["label"], recorded[0]["group"]) == (f"{tmp_path.name}/1-grpo", tmp_path.name)
    assert [r["step"] for e in recorded if "rows" in e for r in e["rows"]] == [0, 1, 2, 3]
    assert recorded[-1] == {"close": True}
    assert [list(e) for e in lines(run_dir / "broken.jsonl")] == [["open", "label", "group", "state"]]  # never closed
    assert not (run_dir / "tensorboard").exists()  # not listed, not written
    plan.run.update(samples_per_step=0, trackers=[])
    assert run(plan, tmp_path / "none", progress=False).status == "done"
    assert not (tmp_path / "none/samples.jsonl").exists() and not (tmp_path / "none/trackers.json").exists()


def test_wandb_writes_its_file_while_the_run_goes(tmp_path: Path) -> None:
    """Durability: what was logged is in the .wandb file within FILE_FLUSH_S, the run still open
    (wandb's own default, 15 s, would lose that much to a kill -9)."""
    from flowrl.trackers.wandb import FILE_FLUSH_S, WandB

    tracker = WandB()
    tracker.open(TrackerContext(tmp_path, "toy", "run", None, time.time(), {}))
    tracker.log([{"step": s, "node": "learner", "time": 0.1 * s, "reward": s / 2, "train": {"loss": 1.0 / (s + 1)}}
                 for s in range(2)], [])
    logged = time.time()
    try:
        while [h["_step"] for h in wandb_history(tmp_path)[1]] != [0, 1]:
            assert time.time() - logged < FILE_FLUSH_S + 2.0, "the .wandb file does not hold the logged steps"
            time.sleep(0.1)
        assert wandb_history(tmp_path)[1][1]["train/loss"] == 0.5
    finally:
        tracker.close()


@pytest.mark.parametrize("trackers, where, words", [
    ("[tensorboard, wandbb]", "run.trackers[1]", "unknown tracker 'wandbb'"),
    ("[test_trackers:Absent]", "run.trackers[0]", "needs flowrl_no_such_module, which is not installed"),
    ("[wandb, wandb]", "run.trackers", "wandb is listed twice"),
])
def test_tracker_mistakes_are_located_validation_errors(trackers: str, where: str, words: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(BASE), f"run.trackers={trackers}"]) == 1
    err = capsys.readouterr().err
    assert f" {where}: " in err and words in err and "Traceback" not in err


def test_a_tracker_timeout_that_is_not_positive_is_a_located_validation_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(BASE), "run.tracker_timeout_s=0"]) == 1
    err = capsys.readouterr().err
    assert " run.tracker_timeout_s: " in err and "Traceback" not in err


def test_a_missing_tracker_package_says_what_to_install(monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "mlflow", None)  # how importlib sees a package that is not installed
    assert main(["validate", str(BASE), "run.trackers=[tensorboard, mlflow]"]) == 1
    err = capsys.readouterr().err
    assert "run.trackers[1]: tracker 'mlflow' needs mlflow, which is not installed: pip install mlflow " \
           "(or pip install 'flowrl[trackers]')" in err
    assert main(["validate", str(BASE), "run.samples_per_step=2"]) == 0


def test_a_tracker_whose_state_json_cannot_keep_is_dropped_and_the_run_finishes(tmp_path: Path) -> None:
    """Before: trackers.json's write raised TypeError at the first flush, and the run died with a traceback."""
    plan = toy()
    plan.run["trackers"] = ["test_trackers:Unkeepable", "test_trackers:Recorder"]
    with pytest.warns(UserWarning, match=r"tracker 'test_trackers:Unkeepable' failed and is dropped .*Unkeepable.open\(\) "
                      r"returned state that trackers.json cannot keep \(Object of type object is not JSON serializable\)"):
        assert run(plan, tmp_path, progress=False).status == "done"
    assert list(json.loads((tmp_path / "trackers.json").read_text())) == ["test_trackers:Recorder"]
    assert lines(tmp_path / "unkeepable.jsonl")[-1] == {"close": True}  # it opened: it was closed
    assert [r["step"] for e in lines(tmp_path / "recorder.jsonl") if "rows" in e for r in e["rows"]] == [0, 1, 2, 3]


@pytest.mark.slow
def test_flowrl_run_warns_of_a_tracker_whose_state_json_cannot_keep_and_finishes(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "flowrl.cli", "run", str(BASE), "run.steps=1", "data.batch_size=2",
                           "nodes.rollout.group_size=2", "nodes.rollout.sampling.max_new_tokens=4",
                           "run.trackers=[test_trackers:Unkeepable]", "--run-dir", str(tmp_path / "run"), "--quiet"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tracker 'test_trackers:Unkeepable' failed and is dropped" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_tracker_that_hangs_or_exits_is_dropped_after_its_timeout_and_the_run_finishes(tmp_path: Path) -> None:
    """Before: a log() that never returned blocked the run's flush forever (SIGTERM unheard: the loop
    was blocked), and a tracker's SystemExit ended the run with exit 3 and no checkpoint."""
    plan = toy(tracker_timeout_s=1.0)
    plan.run["trackers"] = ["test_trackers:Hangs", "test_trackers:Exits", "test_trackers:Recorder"]
    started = time.monotonic()
    with pytest.warns(UserWarning) as warned:
        assert run(plan, tmp_path / "run", progress=False).status == "done"
    assert time.monotonic() - started < 60
    said = [str(w.message) for w in warned]
    assert any("'test_trackers:Hangs' failed and is dropped" in m and "did not return within 1 s" in m for m in said)
    assert any("'test_trackers:Exits' failed and is dropped" in m and "SystemExit: 3" in m for m in said)
    recorded = lines(tmp_path / "run/recorder.jsonl")
    assert [r["step"] for e in recorded if "rows" in e for r in e["rows"]] == [0, 1, 2, 3]
    assert (tmp_path / "run/checkpoints/latest").exists()


def test_mlflow_at_a_dead_server_is_dropped_after_the_timeout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real unreachable tracking server (a loopback port nobody listens on): MLflow's client retries
    for minutes; the run drops the tracker after run.tracker_timeout_s and goes on."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
    plan = toy(steps=2, tracker_timeout_s=2.0)
    plan.run["trackers"] = ["mlflow", "test_trackers:Recorder"]
    started = time.monotonic()
    with pytest.warns(UserWarning, match="tracker 'mlflow' failed and is dropped.*did not return within 2 s"):
        assert run(plan, tmp_path / "run", progress=False).status == "done"
    assert time.monotonic() - started < 40
    assert [r["step"] for e in lines(tmp_path / "run/recorder.jsonl") if "rows" in e for r in e["rows"]] == [0, 1]


HUNG = """
import sys
sys.path.insert(0, {tests!r})
import test_trackers
from flowrl.runtime.run import run
plan = test_trackers.toy(steps=3, tracker_timeout_s=1.0)
plan.run["trackers"] = ["test_trackers:Hangs"]
print(run(plan, {run_dir!r}, progress=False).status)
"""


def test_a_process_with_a_hung_tracker_thread_exits_when_its_run_ends(tmp_path: Path) -> None:
    script = HUNG.format(tests=str(Path(__file__).parent), run_dir=str(tmp_path / "run"))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "done", done.stderr[-2000:]
    assert "did not return within 1 s" in done.stderr


DEAD_WANDB = """
import sys
sys.path.insert(0, {tests!r})
import test_trackers
from flowrl.runtime.run import run
plan = test_trackers.toy(steps=2, tracker_timeout_s=2.0)
plan.run["trackers"] = ["wandb", "test_trackers:Recorder"]
print(run(plan, {run_dir!r}, progress=False).status, flush=True)
"""


def test_wandb_online_at_a_dead_server_is_dropped_and_the_process_exits(tmp_path: Path) -> None:
    """wandb online at a real closed port: wandb.init waits 90 s by default, and its threads kept the
    finished process from exiting as long; init_timeout is the run's tracker timeout now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "WANDB_MODE": "online", "WANDB_API_KEY": "x" * 40, "WANDB_BASE_URL": f"http://127.0.0.1:{port}"}
    script = DEAD_WANDB.format(tests=str(Path(__file__).parent), run_dir=str(tmp_path / "run"))
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=200)
    assert done.returncode == 0 and done.stdout.strip() == "done", done.stderr[-2000:]
    assert "tracker 'wandb' failed and is dropped" in done.stderr
    assert time.monotonic() - started < 40
    assert [r["step"] for e in lines(tmp_path / "run/recorder.jsonl") if "rows" in e for r in e["rows"]] == [0, 1]
