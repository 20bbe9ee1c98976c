"""The image store: references by pixel content, atomic files, data URLs."""

from __future__ import annotations

import io

import msgspec
import pytest
from PIL import Image

from flowrl.data.images import ImageRef, ImageStore, decode_data_url
from flowrl.data.trajectory import Trajectory
from flowrl_operators.inference import GenerateRequest


def _picture(color=(200, 30, 40), size=(6, 4)) -> Image.Image:
    image = Image.new("RGB", size, color)
    image.putpixel((1, 1), (0, 0, 0))
    return image


def test_same_pixels_one_reference_whatever_the_encoding(tmp_path):
    store = ImageStore(tmp_path)
    picture = _picture()
    buf = io.BytesIO()
    picture.save(buf, format="BMP")
    a, b = store.put(picture), store.put(buf.getvalue())
    assert a == b and (a.width, a.height) == (6, 4)
    assert store.put(_picture(color=(200, 30, 41))) != a
    assert list(store.get(a).getdata()) == list(picture.getdata())
    assert len(list(tmp_path.rglob("*.png"))) == 2
    assert not list(tmp_path.rglob("*.tmp"))


def test_data_url_round_trip_and_refusals(tmp_path):
    store = ImageStore(tmp_path)
    ref = store.put(_picture())
    url = store.data_url(ref)
    assert url.startswith("data:image/png;base64,")
    assert store.put(url) == ref
    with pytest.raises(ValueError, match="base64 data URL"):
        decode_data_url("https://example.com/cat.png")
    with pytest.raises(ValueError, match="not valid base64"):
        decode_data_url("data:image/png;base64,@@@")
    with pytest.raises(FileNotFoundError, match="not in the image store"):
        ImageStore(tmp_path / "other").get(ref)


def test_records_carry_references_not_pixels(tmp_path):
    ref = ImageStore(tmp_path).put(_picture())
    t = Trajectory(id="t", group_id="g", sample_id="s", prompt_ids=[1], response_ids=[2], loss_mask=[1],
                   behaviour_logprobs=[-0.1], versions=[0], images=[ref])
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(t), type=Trajectory)
    assert back.images == [ref] and isinstance(back.images[0], ImageRef)
    assert len(msgspec.json.encode(ref)) < 100  # a hash and a size
    request = msgspec.json.decode(msgspec.json.encode(GenerateRequest(request_id="r", input_ids=[1], images=[ref])),
                                  type=GenerateRequest)
    assert request.images == [ref]
