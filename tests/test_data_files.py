"""Dataset files as data sources (`data.source: {file: ...}`): every format, column mapping, held-out
rows, shuffling by epoch, exact resume, and the located errors of a bad source."""

from __future__ import annotations

import csv
import json
import random
import re
from pathlib import Path

import pytest

from flowrl.data.files import FileSource
from flowrl.data.readers import SourceError
from flowrl.data.source import load_source

ROWS = [{"question": f"what is {i} + 1?", "answer": str(i + 1),
         "messages": [{"role": "user", "content": f"what is {i} + 1?"}]} for i in range(10)]


def write(path: Path, fmt: str, rows: list[dict] = ROWS) -> Path:
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "json":
        path.write_text(json.dumps(rows))
    elif fmt == "csv":
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["question", "answer"])
            writer.writeheader()
            writer.writerows({"question": r["question"], "answer": r["answer"]} for r in rows)
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    elif fmt == "datasets":
        import datasets

        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


def source(**keys) -> FileSource:
    return load_source({"source": keys, "batch_size": keys.pop("batch_size", 4)}, seed=keys.pop("seed", 0))


@pytest.mark.parametrize("fmt", ["jsonl", "json", "csv", "parquet", "datasets"])
def test_every_format_reads_the_same_rows(tmp_path, fmt):
    file = write(tmp_path / f"rows.{fmt}", fmt)
    src = source(file=str(file), prompt="question", shuffle=False, batch_size=5)
    assert len(src) == 10
    got = [src.sample(step, i) for step in range(2) for i in range(5)]
    assert [s["prompt"] for s in got] == [r["question"] for r in ROWS]
    assert [s["answer"] for s in got] == [r["answer"] for r in ROWS]  # other columns reach the reward
    assert all("messages" not in s for s in got)  # the named prompt column is the one the workflow uses


def test_format_key_reads_a_file_whose_name_says_nothing(tmp_path):
    file = write(tmp_path / "rows.data", "jsonl")
    with pytest.raises(SourceError, match="data.source.format: cannot tell the format"):
        source(file=str(file))
    assert source(file=str(file), format="jsonl", shuffle=False).sample(0, 0)["answer"] == "1"


def test_messages_column_is_the_default_and_can_be_renamed(tmp_path):
    file = write(tmp_path / "rows.parquet", "parquet")
    sample = source(file=str(file), shuffle=False).sample(0, 1)
    assert sample["messages"] == ROWS[1]["messages"] and sample["answer"] == "2"
    chat = [{"q": r["question"], "chat": r["messages"]} for r in ROWS]
    renamed = write(tmp_path / "chat.jsonl", "jsonl", chat)
    sample = source(file=str(renamed), messages="chat", shuffle=False).sample(0, 2)
    assert sample["messages"] == chat[2]["chat"] and sample["q"] == chat[2]["q"]
    plain = write(tmp_path / "plain.jsonl", "jsonl", [{"prompt": "hi", "y": 1}])
    assert source(file=str(plain), batch_size=1).sample(3, 0) == {"prompt": "hi", "y": 1}


def test_bad_columns_are_named(tmp_path):
    file = write(tmp_path / "rows.jsonl", "jsonl")
    with pytest.raises(SourceError, match=r"data.source.prompt: no column 'query' \(columns: 'question'"):
        source(file=str(file), prompt="query")
    with pytest.raises(SourceError, match="data.source.messages: name either prompt"):
        source(file=str(file), prompt="question", messages="messages")
    with pytest.raises(SourceError, match="data.source.prompt: column 'answer' must hold text"):
        source(file=str(write(tmp_path / "n.jsonl", "jsonl", [{"answer": 3}])), prompt="answer")
    with pytest.raises(SourceError, match="data.source.messages: column 'question' must hold a non-empty list"):
        source(file=str(file), messages="question")
    bare = write(tmp_path / "bare.jsonl", "jsonl", [{"x": 1}])
    with pytest.raises(SourceError, match="data.source.prompt: the rows have no 'messages' or 'prompt' column"):
        source(file=str(bare))


def test_every_row_is_checked_not_the_first_alone(tmp_path):
    """A bad prompt deep in the file is found before the run, not when its step comes."""
    rows = [{"prompt": "a"}, {"prompt": "b"}, {"prompt": 5}]
    with pytest.raises(SourceError, match=r"data.source.prompt: .*late.jsonl: row 3: column 'prompt' must hold text"):
        source(file=str(write(tmp_path / "late.jsonl", "jsonl", rows)))
    with pytest.raises(SourceError, match=r"data.source.eval_file: .*late.jsonl: row 3: column 'prompt'"):
        source(file=str(write(tmp_path / "ok.jsonl", "jsonl", rows[:2])), eval_file=str(tmp_path / "late.jsonl"))
    with pytest.raises(SourceError, match=r"data.source.prompt: .*gap.parquet: column 'prompt' has no value in 1 row"):
        source(file=str(write(tmp_path / "gap.parquet", "parquet", [{"prompt": "a"}, {"prompt": None}])))


def test_missing_empty_and_malformed_files_are_located(tmp_path):
    with pytest.raises(SourceError, match="data.source.file: no such file or folder .*missing.jsonl") as error:
        source(file=str(tmp_path / "missing.jsonl"))
    assert error.value.key == "file" and error.value.detail.startswith("no such file or folder")
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(SourceError, match="data.source.file: .*holds no rows"):
        source(file=str(tmp_path / "empty.jsonl"))
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{oops\n')
    with pytest.raises(SourceError, match=r"data.source.file: .*bad.jsonl:2: not a JSON object"):
        source(file=str(tmp_path / "bad.jsonl"))
    (tmp_path / "obj.json").write_text('{"prompt": "a"}')
    with pytest.raises(SourceError, match="must hold a JSON list of objects"):
        source(file=str(tmp_path / "obj.json"))
    with pytest.raises(ValueError, match=r"data.options \['x'\] apply to a module:attr source"):
        load_source({"source": {"file": "x.jsonl"}, "batch_size": 1, "options": {"x": 1}})


def test_an_epoch_visits_every_row_once_and_each_epoch_is_reshuffled_by_seed(tmp_path):
    file = str(write(tmp_path / "rows.jsonl", "jsonl"))
    src = source(file=file, prompt="question", batch_size=5, seed=7)
    epochs = [[src.sample(step, i)["answer"] for step in (2 * e, 2 * e + 1) for i in range(5)] for e in range(3)]
    assert all(sorted(e, key=int) == [r["answer"] for r in ROWS] for e in epochs)
    assert len({tuple(e) for e in epochs}) == 3  # a new order every epoch
    again = source(file=file, prompt="question", batch_size=5, seed=7)
    assert [again.sample(2, i)["answer"] for i in range(5)] == epochs[1][:5]
    other = source(file=file, prompt="question", batch_size=5, seed=8)
    assert [other.sample(s, i)["answer"] for s in (0, 1) for i in range(5)] != epochs[0]


def test_sample_is_a_pure_function_of_seed_step_and_index(tmp_path):
    """Resume and re-issue ask for any (step, index) in any order, on a fresh source: same sample."""
    file = str(write(tmp_path / "rows.parquet", "parquet"))
    first = source(file=file, batch_size=3, seed=5)
    expected = {(s, i): first.sample(s, i) for s in range(12) for i in range(3)}
    keys = list(expected)
    random.Random(0).shuffle(keys)
    resumed = source(file=file, batch_size=3, seed=5)
    assert all(resumed.sample(s, i) == expected[(s, i)] for s, i in keys)
    with pytest.raises(IndexError):
        resumed.sample(0, 3)  # beyond the batch


def test_held_out_rows_by_count_or_fraction_never_train_whatever_the_seed(tmp_path):
    file = str(write(tmp_path / "rows.jsonl", "jsonl"))
    for seed in (0, 1):
        src = source(file=file, prompt="question", eval_rows=3, batch_size=7, seed=seed)
        held = [src.eval_sample(i)["answer"] for i in range(3)]
        trained = {src.sample(s, i)["answer"] for s in range(3) for i in range(7)}
        assert len(src) == 7 and not set(held) & trained and len(trained | set(held)) == 10
        assert held == sorted(held, key=int)  # file order
    fraction = source(file=file, prompt="question", eval_fraction=0.3, batch_size=7)
    assert [fraction.eval_sample(i) for i in range(3)] == [src.eval_sample(i) for i in range(3)]
    with pytest.raises(ValueError, match="data.eval.samples asks for held-out sample 3, but data.source holds 3"):
        fraction.eval_sample(3)
    with pytest.raises(SourceError, match="data.source.eval_rows: holds out 10 of 10 rows"):
        source(file=file, eval_rows=10)
    with pytest.raises(SourceError, match="data.source.eval_fraction: give one of eval_file"):
        source(file=file, eval_rows=2, eval_fraction=0.5)
    with pytest.raises(SourceError, match="data.source.eval_file: data.eval needs held-out rows"):
        source(file=file).eval_sample(0)


def test_eval_file_and_splits_of_a_datasets_folder(tmp_path):
    import datasets

    file = str(write(tmp_path / "train.jsonl", "jsonl"))
    test = [{"question": "what is 100 + 1?", "answer": "101"}]
    src = source(file=file, prompt="question", eval_file=str(write(tmp_path / "test.csv", "csv", test)))
    assert len(src) == 10 and src.eval_sample(0) == {"question": test[0]["question"], "answer": "101",
                                                     "prompt": test[0]["question"]}
    with pytest.raises(SourceError, match="data.source.eval_file: no column 'question'"):
        source(file=file, prompt="question", eval_file=str(write(tmp_path / "t.jsonl", "jsonl", [{"q": "x"}])))
    folder = tmp_path / "dict"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:6]),
                          "test": datasets.Dataset.from_list(ROWS[6:])}).save_to_disk(str(folder))
    split = source(file=str(folder), eval_split="test", shuffle=False)
    assert len(split) == 6 and split.eval_sample(0)["answer"] == "7"
    assert len(source(file=str(folder), split="test")) == 4
    with pytest.raises(SourceError, match="data.source.split: .* has no split 'dev'; it has train, test"):
        source(file=str(folder), split="dev")
    with pytest.raises(SourceError, match="data.source.split: applies to a datasets folder"):
        source(file=file, split="train")
    with pytest.raises(SourceError, match="data.source.eval_split: .* holds one dataset"):
        source(file=str(write(tmp_path / "one", "datasets")), eval_split="test")


def test_without_the_data_extra_parquet_names_it(tmp_path, monkeypatch):
    import sys

    file = write(tmp_path / "rows.parquet", "parquet")
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # as if pyarrow were not installed
    with pytest.raises(SourceError, match=r"reading parquet needs the data extra: pip install 'flowrl\[data\]'"):
        source(file=str(file))
    assert len(source(file=str(write(tmp_path / "rows.jsonl", "jsonl")))) == 10  # the standard library's


class AsksForTokenizer:
    def __init__(self, seed: int, tokenizer, batch_size: int, width: int = 1) -> None:
        self.tokenizer, self.batch_size, self.width = tokenizer, batch_size, width

    def sample(self, step: int, index: int) -> dict:
        return {"prompt_ids": self.tokenizer.encode("ab" * self.width)}


def test_a_source_may_ask_for_the_tokenizer_and_the_batch_size():
    data = {"source": "test_data_files:AsksForTokenizer", "batch_size": 3, "options": {"width": 2}}
    src = load_source(data, seed=1, model={"path": "builtin:tiny-qwen2"})
    assert src.batch_size == 3 and src.sample(0, 0)["prompt_ids"] == src.tokenizer.encode("abab")
    given = object()
    assert load_source(data, tokenizer=given).tokenizer is given
    with pytest.raises(ValueError, match="asks for a tokenizer; the pipeline's model.path is needed"):
        load_source(data)


def test_the_spec_checks_a_file_source_before_anything_runs(tmp_path):
    from flowrl.spec.errors import SpecError
    from flowrl.spec.load import load

    spec = tmp_path / "p.yaml"
    spec.write_text("flowrl: 1\nname: x\nmodel: {path: builtin:tiny-qwen2}\nnodes: {}\nedges: []\n"
                    "data:\n  source: {file: t.parquet, messages: chat, eval_rows: 4}\n  eval: {samples: 4}\n")
    loaded = load(spec)
    assert loaded.spec.data.source.messages == "chat" and loaded.spec.data.source.shuffle is True
    for override, message in (("data.eval.samples=5", "data.eval.samples: eval.samples (5) is more than source.eval_rows (4)"),
                              ("data.options.x=1", "data.options: options apply to a module:attr source"),
                              ("data.source.shuffle=maybe", "data.source.shuffle: expected bool")):
        with pytest.raises(SpecError, match=re.escape(message)):
            load(spec, [override])


@pytest.mark.parametrize("fmt", ["csv", "jsonl", "json"])
def test_a_utf8_bom_is_read_as_such(tmp_path, fmt):
    # Excel and Notepad write one: the first column is 'question', not '\ufeffquestion'.
    file = write(tmp_path / f"rows.{fmt}", fmt)
    file.write_bytes(b"\xef\xbb\xbf" + file.read_bytes())
    src = source(file=str(file), prompt="question", shuffle=False, batch_size=5)
    assert src.sample(0, 0)["prompt"] == ROWS[0]["question"]


def test_validate_accepts_a_csv_with_a_bom(tmp_path):
    import os
    import subprocess
    import sys

    file = write(tmp_path / "rows.csv", "csv")
    file.write_bytes(b"\xef\xbb\xbf" + file.read_bytes())
    base = Path(__file__).parent / "specs/good/base.yaml"
    proc = subprocess.run([sys.executable, "-m", "flowrl.cli", "validate", str(base),
                           f"data.source={{file: {file}, prompt: question}}"], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=120)
    assert proc.returncode == 0, proc.stderr
