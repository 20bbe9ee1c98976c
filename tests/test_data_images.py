"""Vision-language rows in dataset files: images as paths relative to the file, parquet bytes or
`datasets` Image dicts; stored in the run's image store, the sample carries `ImageRef`s; bad
images are located at data.source.images before anything runs."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from flowrl.data import images
from flowrl.data.images import ImageRef
from flowrl.data.readers import SourceError
from flowrl.data.source import load_source, problems


def picture(color: tuple[int, int, int], size: int = 8) -> Image.Image:
    return Image.new("RGB", (size, size), color)


def png(color: tuple[int, int, int]) -> bytes:
    out = io.BytesIO()
    picture(color).save(out, format="PNG")
    return out.getvalue()


def chat(n_images: int, text: str = "which color?") -> list[dict]:
    parts = [{"type": "image"}] * n_images + [{"type": "text", "text": text}]
    return [{"role": "user", "content": parts}]


COLORS = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0)]


@pytest.fixture()
def store(tmp_path):
    """A run's store, as a stage or the coordinator sets it."""
    yield images.use_store(tmp_path / "run" / "images")
    images.use_store(images.default_root())


def source(**keys):
    return load_source({"source": {"shuffle": False, **keys}, "batch_size": 2}, seed=0)


def test_jsonl_rows_with_image_paths_relative_to_the_file(tmp_path, store):
    data = tmp_path / "data"
    (data / "pics").mkdir(parents=True)
    rows = []
    for i, color in enumerate(COLORS):
        picture(color).save(data / "pics" / f"{i}.png")
        rows.append({"messages": chat(1), "images": [f"pics/{i}.png"], "answer": str(i)})
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    src = source(file=str(data / "train.jsonl"))
    samples = [src.sample(0, 0), src.sample(0, 1), src.sample(1, 0)]
    for sample, color in zip(samples, COLORS, strict=False):
        (ref,) = sample["images"]
        assert isinstance(ref, ImageRef) and (ref.width, ref.height) == (8, 8)
        assert store.get(ref).getpixel((3, 3)) == color  # the pixels are in the run's store
        assert store.path(ref).is_relative_to(tmp_path / "run" / "images")
    assert samples[0]["messages"] == chat(1) and samples[0]["answer"] == "0"
    assert src.sample(0, 0)["images"] == samples[0]["images"]  # the same sample again: the same refs


def test_parquet_binary_column_and_a_renamed_column_with_two_images(tmp_path, store):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"chat": chat(2), "pics": [png(COLORS[i]), png(COLORS[i + 1])]} for i in range(3)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "t.parquet")
    src = source(file=str(tmp_path / "t.parquet"), messages="chat", images="pics")
    sample = src.sample(0, 1)
    assert "pics" not in sample  # the bytes never travel in records: their references do
    assert [store.get(r).getpixel((0, 0)) for r in sample["images"]] == [COLORS[1], COLORS[2]]


def test_datasets_image_feature_and_held_out_rows_from_another_folder(tmp_path, store):
    datasets = pytest.importorskip("datasets")
    rows = [{"messages": chat(1), "images": [{"bytes": png(c), "path": None}]} for c in COLORS]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    (tmp_path / "held").mkdir()
    picture(COLORS[3]).save(tmp_path / "held" / "x.png")
    (tmp_path / "held" / "eval.jsonl").write_text(json.dumps({"messages": chat(1), "images": "x.png"}) + "\n")
    src = source(file=str(tmp_path / "ds"), eval_file=str(tmp_path / "held" / "eval.jsonl"))
    assert store.get(src.sample(0, 0)["images"][0]).getpixel((1, 1)) == COLORS[0]
    (held,) = src.eval_sample(0)["images"]  # a single path, relative to the eval file's own folder
    assert store.get(held).getpixel((1, 1)) == COLORS[3]


def test_bad_image_cells_are_located_at_data_source_images(tmp_path, store):
    def rows_file(name: str, row: dict) -> str:
        (tmp_path / name).write_text(json.dumps(row) + "\n")
        return str(tmp_path / name)

    (tmp_path / "not.png").write_text("text")
    cases = [
        ({"messages": chat(1), "images": ["missing.png"]}, {}, "no image file"),
        ({"messages": chat(1), "images": ["https://example.com/a.png"]}, {}, "remote URL"),
        ({"messages": chat(1), "images": ["not.png"]}, {}, "cannot read as an image"),
        ({"messages": chat(2), "images": [f"data:image/png;base64,{__import__('base64').b64encode(png(COLORS[0])).decode()}"]},
         {}, "1 image(s) in column 'images' but its messages have 2"),
        ({"messages": chat(1), "images": [3]}, {}, "must hold image paths, bytes or data URLs"),
        ({"messages": chat(1)}, {"images": "pics"}, "no column 'pics'"),
    ]
    for i, (row, keys, message) in enumerate(cases):
        file = rows_file(f"r{i}.jsonl", row)
        with pytest.raises(SourceError, match=__import__("re").escape(message)) as e:
            source(file=file, **keys)
        assert e.value.key == "images"
        data = {"source": {"file": file, **keys}, "batch_size": 1}
        assert problems(data) == [(("data", "source", "images"), e.value.detail)]


def test_messages_with_image_parts_must_be_well_formed(tmp_path, store):
    bad = [{"role": "user", "content": [{"type": "video"}]}]
    (tmp_path / "r.jsonl").write_text(json.dumps({"messages": bad}) + "\n")
    with pytest.raises(SourceError, match="a list of \\{type: text, text\\} and \\{type: image\\}"):
        source(file=str(tmp_path / "r.jsonl"))


def test_flowrl_validate_names_the_key_and_exits_1(tmp_path):
    (tmp_path / "r.jsonl").write_text(json.dumps({"messages": chat(1), "images": ["gone.png"]}) + "\n")
    spec = tmp_path / "p.yaml"
    spec.write_text("flowrl: 1\nname: x\nmodel: {path: builtin:tiny-qwen2}\n"
                    "data: {source: {file: r.jsonl, images: images}, batch_size: 1}\n"
                    "nodes:\n  rollout: {op: generate}\n  score: {op: reward, fn: builtin:grid_nav}\n"
                    "  learner: {op: train}\n  publish: {op: sync}\n"
                    "edges:\n  - rollout -> score\n  - score -> learner\n  - learner -> publish\n"
                    "  - publish -> rollout: {kind: weights}\n")
    proc = subprocess.run([sys.executable, "-m", "flowrl.cli", "validate", str(spec)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "data.source.images: r.jsonl: row 1: column 'images': no image file" in proc.stderr + proc.stdout
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(("bad", "message"), [
    ({"messages": chat(1), "images": ["gone.png"]}, "no image file"),
    ({"messages": chat(1), "images": ["not.png"]}, "cannot read as an image"),
    ({"messages": chat(2), "images": ["pics/0.png"]}, "1 image(s) in column 'images' but its messages have 2"),
    ({"messages": chat(1)}, "0 image(s) in column 'images' but its messages have 1"),
])
def test_every_rows_images_are_checked_not_the_first_alone(tmp_path, store, bad, message):
    (tmp_path / "pics").mkdir()
    picture(COLORS[0]).save(tmp_path / "pics" / "0.png")
    (tmp_path / "not.png").write_text("text")
    rows = [{"messages": chat(1), "images": ["pics/0.png"]}] * 5 + [bad]
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(SourceError, match="r.jsonl: row 6: ") as e:
        source(file=str(tmp_path / "r.jsonl"))
    assert message in str(e.value) and e.value.key == "images"


def test_flowrl_validate_finds_a_bad_image_in_a_later_row(tmp_path):
    (tmp_path / "ok.png").write_bytes(png(COLORS[1]))
    rows = [{"messages": chat(1), "images": ["ok.png"]}] * 3 + [{"messages": chat(1), "images": ["broken.png"]}]
    (tmp_path / "broken.png").write_bytes(png(COLORS[2])[:40])  # a torn file
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = tmp_path / "p.yaml"
    spec.write_text("flowrl: 1\nname: x\nmodel: {path: builtin:tiny-qwen2}\n"
                    "data: {source: {file: r.jsonl, images: images}, batch_size: 1}\n"
                    "nodes:\n  rollout: {op: generate}\n  score: {op: reward, fn: builtin:grid_nav}\n"
                    "  learner: {op: train}\n  publish: {op: sync}\n"
                    "edges:\n  - rollout -> score\n  - score -> learner\n  - learner -> publish\n"
                    "  - publish -> rollout: {kind: weights}\n")
    proc = subprocess.run([sys.executable, "-m", "flowrl.cli", "validate", str(spec)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "data.source.images: r.jsonl: row 4: column 'images' holds something PIL cannot read" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_image_parts_without_an_images_column_are_refused_at_their_row(tmp_path, store):
    rows = [{"messages": chat(0)}] * 3 + [{"messages": chat(2)}]
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(SourceError, match="r.jsonl: row 4: its messages have 2 \\{type: image\\} part\\(s\\) but "
                       "the rows have no images column \\(columns: 'messages'\\)") as e:
        source(file=str(tmp_path / "r.jsonl"))
    assert e.value.key == "images"
    spec = tmp_path / "p.yaml"
    spec.write_text("flowrl: 1\nname: x\nmodel: {path: builtin:tiny-qwen2}\n"
                    "data: {source: {file: r.jsonl}, batch_size: 1}\n"
                    "nodes:\n  rollout: {op: generate}\n  score: {op: reward, fn: builtin:grid_nav}\n"
                    "  learner: {op: train}\n  publish: {op: sync}\n"
                    "edges:\n  - rollout -> score\n  - score -> learner\n  - learner -> publish\n"
                    "  - publish -> rollout: {kind: weights}\n")
    proc = subprocess.run([sys.executable, "-m", "flowrl.cli", "validate", str(spec)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "p.yaml:4:16 data.source.images: r.jsonl: row 4: its messages have 2" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def data_problems(data, model):
    """The data checks `flowrl validate` runs: the source's own, then the generate node's (check_data)."""
    from flowrl.data.source import check
    from flowrl.operator import DataFacts
    from flowrl_operators.config import GenerateConfig
    from flowrl_operators.generate import Generate

    built, found = check(data, 0, model)
    return found + Generate.check_data(GenerateConfig(), DataFacts(data=data, model=model, source=built))


def test_a_source_of_images_needs_a_vision_language_model(tmp_path, store):
    (tmp_path / "r.jsonl").write_text(json.dumps({"messages": chat(1), "images": ["a.png"]}) + "\n")
    picture(COLORS[0]).save(tmp_path / "a.png")
    data = {"source": {"file": str(tmp_path / "r.jsonl")}, "batch_size": 1}
    text_folder = tmp_path / "text-model"
    text_folder.mkdir()
    (text_folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    for path, kind in (("builtin:tiny-qwen2", "qwen2"), (str(text_folder), "llama")):
        [(key, message)] = data_problems(data, {"path": path})
        assert key == ("model", "path") and f"is a text-only model ({kind})" in message
    assert data_problems(data, {"path": "builtin:tiny-qwen2-vl"}) == []
    (tmp_path / "t.jsonl").write_text(json.dumps({"prompt": "no pictures"}) + "\n")
    assert data_problems({"source": {"file": str(tmp_path / "t.jsonl")}, "batch_size": 1}, {"path": "builtin:tiny-qwen2"}) == []
    # A visual task: its episodes render the pictures, its samples hold none.
    [(key, message)] = data_problems({"source": "builtin:grid_nav", "batch_size": 4}, {"path": "builtin:tiny-qwen2"})
    assert key == ("model", "path") and message.startswith("builtin:grid_nav gives the model images")


def test_check_images_reads_a_spread_sample_of_a_large_file_and_says_so(tmp_path, store, capsys):
    (tmp_path / "ok.png").write_bytes(png(COLORS[0]))
    rows = [{"messages": chat(1), "images": ["ok.png"]} for _ in range(10)]
    rows[2] = {"messages": chat(1), "images": ["gone.png"]}  # between the rows sampled: 0, 4, 9 (k=3 over 10)
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    source(file=str(tmp_path / "r.jsonl"), check_images=3)
    assert "the images of 3 of its 10 rows were checked (data.source.check_images)" in capsys.readouterr().err
    with pytest.raises(SourceError, match="row 3: column 'images': no image file"):
        source(file=str(tmp_path / "r.jsonl"))  # the default: every row
    rows[2], rows[9] = rows[0], rows[2]  # the last row is always among those sampled
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(SourceError, match="row 10: column 'images': no image file"):
        source(file=str(tmp_path / "r.jsonl"), check_images=3)
    base = Path(__file__).parent / "specs/good/base.yaml"
    proc = subprocess.run([sys.executable, "-m", "flowrl.cli", "validate", str(base),
                           f"data.source={{file: {tmp_path / 'r.jsonl'}, check_images: 0}}"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "check_images" in proc.stderr, proc.stderr  # a positive count
