"""Images in messages, proxy calls and SGLang bodies, without a vision model: stored by reference,
refused with a clear message when remote, chained in order across an agent's calls."""

from __future__ import annotations

import asyncio
import base64
import io

import aiohttp
import openai
import pytest
from PIL import Image

from flowrl.data import images
from flowrl_operators.chat.images import ImageContentError, as_ref, store_images
from flowrl_operators.engine.sglang.image_data import image_data, request_images
from flowrl_operators.inference import SamplingParams
from flowrl_operators.workflows.proxy import Call, assemble

MODEL = "builtin:tiny-qwen2"


def data_url(color: tuple[int, int, int]) -> str:
    out = io.BytesIO()
    Image.new("RGB", (4, 4), color).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


@pytest.fixture()
def store(tmp_path):
    yield images.use_store(tmp_path / "images")
    images.use_store(images.default_root())


def test_store_images_takes_every_shape_in_order(store):
    given = store.put(data_url((0, 0, 255)))
    messages = [
        {"role": "system", "content": "look"},
        {"role": "user", "content": [{"type": "image", "image": Image.new("RGB", (4, 4), (255, 0, 0))},
                                     {"type": "text", "text": "and"},
                                     {"type": "image_url", "image_url": {"url": data_url((0, 255, 0))}},
                                     {"type": "image"}]},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]
    out, refs = store_images(messages, [list(msgspec_round_trip(given))])
    assert [store.get(r).getpixel((0, 0)) for r in refs] == [(255, 0, 0), (0, 255, 0), (0, 0, 255)]
    assert out[1]["content"] == [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"},
                                 {"type": "image"}]
    assert out[0] == messages[0] and out[2]["content"] == "ab"  # text-only content stays (or becomes) text
    for bad, message in (([{"type": "image_url", "image_url": {"url": "https://x.org/a.png"}}], "not a data URL"),
                         ([{"type": "audio"}], "unknown content part 'audio'"),
                         ([{"type": "image"}], "more {type: image} parts than the sample's 0 images")):
        with pytest.raises(ImageContentError, match=message):
            store_images([{"role": "user", "content": bad}])
    with pytest.raises(ImageContentError, match="has 1 images but its messages only 0"):
        store_images([{"role": "user", "content": "hi"}], [given])


def msgspec_round_trip(ref):
    import msgspec

    back = msgspec.json.decode(msgspec.json.encode(ref))  # as a ref travels in a sample: [sha, w, h]
    assert as_ref(back) == ref
    return back


def test_assemble_chains_calls_whose_images_extend_each_other(store):
    a, b = store.put(data_url((1, 1, 1))), store.put(data_url((2, 2, 2)))
    sampling = SamplingParams()
    calls = [Call([1, 2], [3], [-0.1], [0], "stop", sampling, [a]),
             Call([1, 2, 3, 4, 5], [6], [-0.2], [0], "stop", sampling, [a, b]),  # a new image, same chain
             Call([1, 2, 3, 4, 5], [7], [-0.3], [0], "stop", sampling, [b, b])]  # same ids, other images: new
    first, second = assemble(calls, version=0)
    assert first.images == [a, b] and first.response_ids == [3, 4, 5, 6] and first.loss_mask == [1, 0, 0, 1]
    assert second.images == [b, b] and second.prompt_ids == [1, 2, 3, 4, 5]


def test_sglang_image_data_both_ways(store):
    ref = store.put(data_url((9, 9, 9)))
    body = image_data([ref])
    assert body["image_data"][0].startswith("data:image/png;base64,") and image_data([]) == {}
    assert request_images(body["image_data"], 1, False) == [[ref]]
    bare = body["image_data"][0].split(",", 1)[1]  # SGLang also takes bare base64
    assert request_images([[bare], None], 2, True) == [[ref], []]
    assert request_images(None, 2, True) == [[], []]
    for raw, batched, message in ((["http://x/a.png"], False, "inline only"), (["a.png"], False, "inline only"),
                                  ([[bare]], True, "one entry per prompt"), ([3], False, "must be a base64")):
        with pytest.raises(ValueError, match=message):
            request_images(raw, 2 if batched else 1, batched)


@pytest.fixture(scope="module")
def text_engine():
    import torch

    from flowrl_operators.engine.embedded.engine import EmbeddedEngine

    torch.set_num_threads(1)
    loop = asyncio.new_event_loop()
    engine = EmbeddedEngine(MODEL, max_slots=4, threads=1, seed=0)
    yield loop, engine
    loop.run_until_complete(engine.close())
    loop.close()


def test_proxy_refuses_a_remote_image_url_through_the_openai_client(text_engine, store):
    from flowrl_operators.models import load_tokenizer
    from flowrl_operators.workflows.proxy import Proxy

    loop, engine = text_engine

    async def go() -> str:
        proxy = Proxy(engine, load_tokenizer(MODEL))
        await proxy.start()
        base_url = proxy.open_session("s", SamplingParams(max_new_tokens=2))
        client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
        try:
            await client.chat.completions.create(model="p", messages=[{"role": "user", "content": [
                {"type": "text", "text": "what?"},
                {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}])
        except openai.BadRequestError as e:
            return e.message
        finally:
            await client.close()
            assert proxy.close_session("s") == []  # nothing recorded, nothing generated
            await proxy.close()
        raise AssertionError("the proxy answered a remote image URL")

    message = loop.run_until_complete(go())
    assert "flowrl fetches no remote images; send the image inline as data:image/png;base64" in message


def test_proxy_refuses_images_for_a_text_only_model(text_engine, store):
    from flowrl_operators.models import load_tokenizer
    from flowrl_operators.workflows.proxy import Proxy

    loop, engine = text_engine

    async def go() -> str:
        proxy = Proxy(engine, load_tokenizer(MODEL))
        await proxy.start()
        client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0)
        try:
            await client.chat.completions.create(model="p", messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": data_url((1, 2, 3))}}]}])
        except openai.BadRequestError as e:
            return e.message
        finally:
            await client.close()
            await proxy.close()
        raise AssertionError("a text-only model answered an image")

    assert "is not a vision-language model" in loop.run_until_complete(go())


def test_engine_server_answers_400_for_a_url_in_image_data(text_engine, store):
    from flowrl_operators.engine.server.server import start_server

    loop, engine = text_engine

    async def go() -> tuple[int, dict]:
        runner, port = await start_server(engine)
        try:
            async with aiohttp.ClientSession() as session:
                async with session.post(f"http://127.0.0.1:{port}/generate", json={
                        "input_ids": [5, 6], "image_data": ["https://example.com/a.png"],
                        "sampling_params": {"max_new_tokens": 1}}) as response:
                    return response.status, await response.json()
        finally:
            await runner.cleanup()

    status, answer = loop.run_until_complete(go())
    assert status == 400 and "reads images inline only" in answer["error"]["message"]
