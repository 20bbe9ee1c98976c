"""Images on the engine server's /v1/chat/completions, over real loopback HTTP with real tiny models:
a vision-language policy reads OpenAI image_url parts (data URLs) and generates as `/generate` does
with the same ids and `image_data`; a text-only model, a remote URL or a part the server does not
read is a 400, never ignored."""

from __future__ import annotations

import pytest
import torch
from engines import tap
from test_engine_server import post, serve
from test_engine_vl import noisy_checkpoint, picture

from flowrl.data import images
from flowrl_operators.chat.images import store_images
from flowrl_operators.models import load_tokenizer
from flowrl_operators.vision import vision
from flowrl_operators.workflows.proxy import Proxy

torch.set_num_threads(1)
CHAT = "/v1/chat/completions"


def look(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "Look:"},
                                         {"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "what is it?"}]}]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    yield images.use_store(tmp_path_factory.mktemp("run") / "images")
    images.use_store(images.default_root())


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    """A perturbed tiny Qwen2-VL, so greedy answers vary with the image (test_engine_vl.py)."""
    folder = tmp_path_factory.mktemp("qwen2-vl")
    noisy_checkpoint("builtin:tiny-qwen2-vl", folder)
    return folder


def test_chat_with_an_image_generates_as_generate_with_its_ids_and_image_data(vl, store):
    ref, other = store.put(picture(seed=0)), store.put(picture(seed=1))  # same size: same ids
    facts = vision(vl)
    ids, _ = facts.prompt([{"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "image"},
                                                        {"type": "text", "text": "what is it?"}]}], [ref])
    assert ids.count(facts.image_token_id) == facts.image_tokens(ref) > 1  # the placeholder expanded

    async def test(session, url, engine):
        messages, refs = store_images(look(store.data_url(ref)))
        proxied = Proxy(engine, load_tokenizer(vl)).render(messages, None, None, refs)
        seen = tap(engine)
        chat = {"model": "tiny", "max_tokens": 8, "temperature": 0, "logprobs": True}
        answer = await post(session, url + CHAT, {**chat, "messages": look(store.data_url(ref))})
        generated = await post(session, f"{url}/generate", {
            "input_ids": ids, "image_data": [store.data_url(ref)], "return_logprob": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 8}})
        elsewhere = await post(session, url + CHAT, {**chat, "messages": look(store.data_url(other))})
        return answer, generated, elsewhere, seen, proxied

    answer, generated, elsewhere, seen, proxied = serve(vl, test)
    assert proxied == ids  # the agent proxy builds the same prompt for the same messages
    (chat_request, chat_result), (generate_request, generate_result), (other_request, other_result) = seen
    assert chat_request.input_ids == generate_request.input_ids == other_request.input_ids == ids
    assert chat_request.images == generate_request.images == [ref] and other_request.images == [other]
    assert chat_result.output_ids == generate_result.output_ids == generated["output_ids"]
    assert chat_result.logprobs == pytest.approx(generate_result.logprobs, abs=1e-5)
    tokens = generated["output_ids"][:-1] if chat_result.finish_reason == "stop" else generated["output_ids"]
    assert answer["choices"][0]["message"]["content"] == load_tokenizer(vl).decode(tokens, skip_special_tokens=True)
    assert [e["logprob"] for e in answer["choices"][0]["logprobs"]["content"]] == pytest.approx(
        [lp for lp, _, _ in generated["meta_info"]["output_token_logprobs"][:len(tokens)]], abs=1e-5)
    assert answer["usage"]["prompt_tokens"] == len(ids)
    # The image is read: another picture in the same placeholders changes the first token's logprob.
    assert abs(other_result.logprobs[0] - chat_result.logprobs[0]) > 1e-2  # measured: 0.48
    assert elsewhere["usage"]["prompt_tokens"] == len(ids)


def test_images_the_server_cannot_read_are_a_400(vl, store):
    url_of = store.data_url(store.put(picture(seed=2)))
    bad = {
        "not a data URL: flowrl fetches no remote images": look("https://example.com/cat.png"),
        "cannot read the image": look("data:image/png;base64,AAAA"),
        "part type 'image' is not read": [{"role": "user", "content": [{"type": "image", "image": str(vl)}]}],
        "part type 'audio' is not read": [{"role": "user", "content": [{"type": "audio"}]}],
        "messages[0].content must be a string or a list of parts": [{"role": "user", "content": 3}],
    }

    async def test(session, url, engine):
        seen = tap(engine)
        refused = {message: await post(session, url + CHAT, {"messages": messages, "max_tokens": 2}, status=400)
                   for message, messages in bad.items()}
        fine = await post(session, url + CHAT, {"messages": look(url_of), "max_tokens": 2})
        return refused, fine, seen

    refused, fine, seen = serve(vl, test)
    for message, answer in refused.items():
        assert message in answer["error"]["message"]
    assert len(seen) == 1 and fine["usage"]["completion_tokens"] >= 1  # only the good request generated


def test_a_text_model_refuses_images_and_reads_text_parts(store, tmp_path):
    hi = [{"role": "user", "content": "hi there"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": " there"}]}]
    picture_url = store.data_url(store.put(picture(seed=3)))
    images.use_store(tmp_path / "fresh")  # the refused image must not even be stored

    async def test(session, url, engine):
        seen = tap(engine)
        refused = await post(session, url + CHAT, {"messages": look(picture_url), "max_tokens": 2}, status=400)
        greedy = {"max_tokens": 4, "temperature": 0, "logprobs": True}
        plain = await post(session, url + CHAT, {**greedy, "messages": hi})
        listed = await post(session, url + CHAT, {**greedy, "messages": parts})
        return refused, plain, listed, seen

    try:
        refused, plain, listed, seen = serve("builtin:tiny-qwen2", test)
        assert not (tmp_path / "fresh").exists() or not any((tmp_path / "fresh").iterdir())
    finally:
        images.use_store(store.root)
    message = refused["error"]["message"]
    assert message.startswith("this model takes no images") and "is not a vision-language model" in message
    assert [r.input_ids for r, _ in seen] == [seen[0][0].input_ids] * 2 and not seen[0][0].images
    assert listed["choices"] == plain["choices"]  # text parts are the same text
