"""flowrl/records: the run directory read back typed, by one reader.

tests/fixtures/run_format3/ is a run written by the writers before they shared the row Structs
(`flowrl run tests/specs/good/base.yaml data.batch_size=4 nodes.rollout.group_size=2
nodes.rollout.sampling.max_new_tokens=4 run.steps=2 'data.eval={every: 1, samples: 2}'` at
0fd40f7; checkpoints, export and tensorboard left out): it must still open.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import runtime_ops as ops

from flowrl.cli import main
from flowrl.records import (
    EvalRow,
    LedgerEntry,
    MetricsRow,
    NotARun,
    RecordError,
    RunDir,
    SampleRow,
    TraceEvent,
    append,
)
from flowrl.runtime.durability import ledger
from flowrl.runtime.run import run

FIXTURE = Path(__file__).parent / "fixtures" / "run_format3"


@pytest.fixture
def old(tmp_path: Path) -> Path:
    """A writable copy of the fixture run."""
    return Path(shutil.copytree(FIXTURE, tmp_path / "run"))


def test_a_run_of_the_previous_format_opens_typed() -> None:
    runs = RunDir(FIXTURE).phases()
    assert [r.name for r in runs] == ["main"] and runs[0].path == FIXTURE
    r = runs[0]
    assert r.meta().name == "bad" and r.meta().format == 3 and r.plan().name == "bad"
    rows = list(r.metrics())
    assert [(m.step, m.version, m.node) for m in rows] == [(0, 1, "learner"), (1, 2, "learner")]
    assert all(isinstance(m, MetricsRow) and isinstance(m.train["loss"], float) for m in rows)
    assert rows[0].staleness == {"0": 4} and set(rows[0].idle) == {"rollout", "score", "learner", "publish"}
    assert [(e.version, e.eval_reward) for e in r.evals()] == [(0, 0.0), (1, 0.0), (2, 0.125)]
    samples = list(r.samples())
    assert samples and all(isinstance(s, SampleRow) and s.node == "learner" for s in samples)
    events = r.trace()
    assert {"runtime", "rollout", "learner"} <= {e.args["name"] for e in events if e.ph == "M"}
    assert any(e.ph == "X" and e.name == "train" and e.dur_us > 0 for e in events)
    entries = list(r.ledger())
    assert entries[0].event == "issue" and entries[0].credit == 0 and entries[-1].event == "end"
    assert ledger.check(FIXTURE).clean
    assert r.phase_done() is not None and r.phase_done().status == "done"
    assert r.replay_info() is None and list(r.errors()) == [] and r.placement() == {}


def test_inspect_renders_the_old_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(FIXTURE)]) == 0
    out = capsys.readouterr().out
    assert "bad · phase main: 2 steps" in out and "eval reward last 0.125" in out


def test_a_torn_last_line_is_skipped(old: Path) -> None:
    with open(old / "metrics.jsonl", "ab") as f:
        f.write(b'{"step": 2, "version": 3, "node": "lea')  # killed mid-write
    assert [m.step for m in RunDir(old).metrics()] == [0, 1]
    with open(old / "eval.jsonl", "ab") as f:
        f.write(b"\0" * 40 + b"\n")  # a crash left the block padded with NUL bytes
    assert len(list(RunDir(old).evals())) == 3


def test_a_damaged_middle_line_is_located(old: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = (old / "metrics.jsonl").read_bytes().splitlines(keepends=True)
    (old / "metrics.jsonl").write_bytes(lines[0][:30] + b"\n" + lines[1])
    with pytest.raises(RecordError, match=r"metrics\.jsonl:1: not a JSON line"):
        list(RunDir(old).metrics())
    assert main(["inspect", str(old)]) == 1
    assert f"{old / 'metrics.jsonl'}:1: not a JSON line" in capsys.readouterr().err
    # A final line that ends with its newline was written whole: its damage is located too.
    (old / "metrics.jsonl").write_bytes(lines[0] + lines[1][:30] + b"\n")
    with pytest.raises(RecordError, match=r"metrics\.jsonl:2: not a JSON line"):
        list(RunDir(old).metrics())


def test_a_value_of_the_wrong_type_is_located_with_its_key(old: Path) -> None:
    (old / "eval.jsonl").write_text('{"version": 0, "eval_reward": 0.5}\n{"version": "one", "eval_reward": 0.5}\n')
    with pytest.raises(RecordError, match=r"eval\.jsonl:2: EvalRow: Expected `int`, got `str` - at `\$\.version`"):
        list(RunDir(old).evals())
    # A final line that is JSON but not a row is damage too, not a torn write.
    (old / "eval.jsonl").write_text('{"version": 0}\n')
    with pytest.raises(RecordError, match=r"eval\.jsonl:1: EvalRow: Object missing required field `eval_reward`"):
        list(RunDir(old).evals())


def test_unknown_keys_are_ignored_and_bare_nan_reads(tmp_path: Path) -> None:
    # A newer writer's key, and the NaN token Python's json module wrote before msgspec did.
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "version": 1, "node": "l", "new_key": [1], '
                                            '"train": {"loss": NaN, "lr": 1}}\n')
    row = next(RunDir(tmp_path).metrics())
    assert math.isnan(row.train["loss"]) and row.train["lr"] == 1.0 and not hasattr(row, "new_key")


def test_rows_written_with_append_read_back_equal(tmp_path: Path) -> None:
    rows = [EvalRow(version=1, eval_reward=float("nan"), samples=2), EvalRow(version=2, eval_reward=0.5,
                                                                          scores={"exact": 1.0})]
    append(tmp_path / "eval.jsonl", rows)
    back = list(RunDir(tmp_path).evals())
    assert back[0].eval_reward is None  # NaN is written as null: valid JSON, read as "no value"
    assert back[1] == rows[1] and "scores" not in back[0].as_dict()


def test_a_trace_cut_mid_append_reads_up_to_the_cut(old: Path) -> None:
    whole = RunDir(old).trace()
    text = (old / "trace.json").read_bytes()
    (old / "trace.json").write_bytes(text[: text.rindex(b"\n]}")][:-25])  # no tail, last event torn
    cut = RunDir(old).trace()
    assert cut == whole[: len(cut)] and len(cut) == len(whole) - 1
    (old / "trace.json").write_bytes(text.replace(b'"ph": "X"', b'"ph": 7', 1))
    with pytest.raises(RecordError, match=r"trace\.json:\d+: TraceEvent: Expected `str`, got `int` - at `\$\.ph`"):
        RunDir(old).trace()


def test_phases_in_order_and_the_last_one(tmp_path: Path) -> None:
    for name in ("0-warmup", "10-late", "2-grpo"):
        (tmp_path / "phases" / name).mkdir(parents=True)
        shutil.copy(FIXTURE / "meta.json", tmp_path / "phases" / name / "meta.json")
    (tmp_path / "phases" / "3-unstarted").mkdir()  # no run in it yet
    runs = RunDir(tmp_path).phases()
    assert [r.name for r in runs] == ["warmup", "grpo", "late"]
    assert RunDir(tmp_path).last().path == tmp_path / "phases" / "10-late"
    assert RunDir(tmp_path / "phases" / "2-grpo").last().path == tmp_path / "phases" / "2-grpo"


def test_a_directory_without_a_run_says_so(tmp_path: Path) -> None:
    with pytest.raises(NotARun, match=f"{tmp_path} is not a run directory"):
        RunDir(tmp_path).phases()
    assert list(RunDir(tmp_path).metrics()) == [] and RunDir(tmp_path).trace() == []


def test_what_the_runtime_writes_reads_back_typed(tmp_path: Path) -> None:
    """The writers encode the row Structs: a fresh run reads back whole, with no key left untyped."""
    plan = ops.grpo("sync", 0, steps=3, batch_size=2)
    assert run(plan, tmp_path, progress=False).status == "done"
    r = RunDir(tmp_path)
    rows = list(r.metrics())
    assert [m.step for m in rows] == [0, 1, 2] and all(m.groups == 2 for m in rows)
    assert all(isinstance(e, TraceEvent) for e in r.trace())
    assert {"step", "train"} <= {e.name for e in r.trace() if e.ph == "X"}
    assert all(isinstance(e, LedgerEntry) for e in r.ledger()) and ledger.check(tmp_path).clean
    assert r.meta().health == 1
    # A process name has no timestamp, as before the Structs (Chrome's metadata event).
    assert '{"name":"process_name","ph":"M","pid":0,"tid":0,"args":{"name":"runtime"}}' in \
        (tmp_path / "trace.json").read_text()
