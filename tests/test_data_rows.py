"""`flowrl validate` reads every row of a dataset file before anything runs: an empty prompt, a chat
role no template knows, an image too large, a data URL that holds no image, each refused at
`data.source.<key>` naming the file and the row, through the real CLI (`flowrl.cli.main`), exit 1,
no traceback. The images are checked from their headers: nothing decodes 144 M pixels here."""

from __future__ import annotations

import base64
import json
import struct
import time
import zlib
from pathlib import Path

import pytest

from flowrl.cli import main
from flowrl.data.readers import SourceError
from flowrl.data.source import load_source

SPEC = ("flowrl: 1\nname: x\nmodel: {{path: {model}}}\n"
        "data: {{source: {{file: {file}}}, batch_size: 1}}\n"
        "nodes:\n  rollout: {{op: generate}}\n  score: {{op: reward, fn: builtin:reverse_digits}}\n"
        "  learner: {{op: train}}\n  publish: {{op: sync}}\n"
        "edges:\n  - rollout -> score\n  - score -> learner\n  - learner -> publish\n"
        "  - publish -> rollout: {{kind: weights}}\n")
CHAT = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "which color?"}]}]


def bomb_png(width: int, height: int) -> bytes:
    """A valid 1-bit black PNG of width x height: tens of KB that would decode to width*height*3 bytes."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    pixels = zlib.compress((b"\x00" + b"\x00" * ((width + 7) // 8)) * height, 9)
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels) + chunk(b"IEND", b"")


def validate(tmp_path: Path, rows: list[dict], capsys: pytest.CaptureFixture[str],
             model: str = "builtin:tiny-qwen2") -> str:
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "p.yaml").write_text(SPEC.format(model=model, file=tmp_path / "rows.jsonl"))
    started = time.monotonic()
    code = main(["validate", str(tmp_path / "p.yaml")])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err, err
    assert time.monotonic() - started < 60, "validate must answer in bounded time"
    assert "p.yaml:4:" in err and "rows.jsonl: row 3: " in err, err  # located: the key, the file, the row
    return err


def test_an_empty_prompt_in_row_3_is_refused(tmp_path, capsys):
    rows = [{"prompt": "<12>"}, {"prompt": "<34>"}, {"prompt": "  "}, {"prompt": "<56>"}]
    err = validate(tmp_path, rows, capsys)
    assert "data.source.prompt: " in err and "holds an empty prompt" in err


def test_a_message_role_no_chat_template_knows_is_refused(tmp_path, capsys):
    rows = [{"messages": [{"role": role, "content": "<12>"}]} for role in ("user", "system", "robot", "user")]
    err = validate(tmp_path, rows, capsys)
    assert "data.source.messages: " in err and "the role 'robot'; a role is one of system, developer, user, assistant, tool, ipython" in err


def test_a_data_url_of_base64_that_is_no_image_is_refused(tmp_path, capsys):
    ok = "data:image/png;base64," + base64.b64encode(bomb_png(8, 8)).decode()
    text = "data:image/png;base64," + base64.b64encode(b"plain text, valid base64").decode()
    rows = [{"messages": CHAT, "images": [ok]}] * 2 + [{"messages": CHAT, "images": [text]}]
    err = validate(tmp_path, rows, capsys, model="builtin:tiny-qwen2-vl")
    assert "data.source.images: " in err and "column 'images' holds something PIL cannot read as an image" in err


def test_an_image_over_the_pixel_limit_is_refused_from_its_header(tmp_path, capsys):
    (tmp_path / "ok.png").write_bytes(bomb_png(8, 8))
    (tmp_path / "big.png").write_bytes(bomb_png(12000, 12000))  # ~25 KB on disk, 432 MB as RGB
    rows = [{"messages": CHAT, "images": ["ok.png"]}] * 2 + [{"messages": CHAT, "images": ["big.png"]}]
    err = validate(tmp_path, rows, capsys, model="builtin:tiny-qwen2-vl")
    assert "column 'images' holds an image too large: the image is 12000x12000 pixels" in err


def test_an_image_past_pils_own_bomb_limit_is_refused_the_same_way(tmp_path):
    """20000x20000: PIL refuses it at open (DecompressionBombError); said as our limit, not PIL's."""
    (tmp_path / "huge.png").write_bytes(bomb_png(20000, 20000))
    (tmp_path / "r.jsonl").write_text(json.dumps({"messages": CHAT, "images": ["huge.png"]}) + "\n")
    with pytest.raises(SourceError, match=r"row 1: column 'images' holds an image too large: the image declares "
                                          r"400000000 pixels, over the limit of 36000000"):
        load_source({"source": {"file": str(tmp_path / "r.jsonl")}, "batch_size": 1})


@pytest.mark.parametrize("fmt", ["parquet", "datasets"])
def test_every_row_of_a_columnar_file_is_read_too(tmp_path, fmt):
    rows = [{"prompt": f"<{i}>"} for i in range(2500)]
    rows[2100]["prompt"] = ""  # past the first batch of values read
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet")
        file = tmp_path / "rows.parquet"
    else:
        import datasets

        datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "rows"))
        file = tmp_path / "rows"
    with pytest.raises(SourceError, match="row 2101: column 'prompt' holds an empty prompt"):
        load_source({"source": {"file": str(file)}, "batch_size": 1})
