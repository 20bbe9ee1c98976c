"""The engine's HTTP mode over real loopback HTTP: SGLang's native routes and OpenAI chat."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import threading

import aiohttp
import openai
import pytest
import torch
from test_engine import make_checkpoint, teacher_forced_logprobs

from flowrl_operators.engine.embedded.engine import EmbeddedEngine
from flowrl_operators.engine.server.server import start_server, version_spans
from flowrl_operators.models import load_hf_model, load_tokenizer
from flowrl_operators.transport.engine_wire import encode_bucket, weight_update_group

torch.set_num_threads(1)
GREEDY = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
LONG = {"temperature": 0, "max_new_tokens": 60, "ignore_eos": True}


@pytest.fixture(scope="module")
def old_and_new(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return make_checkpoint("tiny-qwen2", root / "old", seed=0), make_checkpoint("tiny-qwen2", root / "new", seed=1)


def serve(folder, test):
    """Run `test(session, base_url, engine)` against a server on a free loopback port."""

    async def run():
        engine = EmbeddedEngine(folder, max_slots=8)
        runner, port = await start_server(engine, tokenizer=load_tokenizer(folder), model_name="tiny")
        try:
            async with aiohttp.ClientSession() as session:
                return await test(session, f"http://127.0.0.1:{port}", engine)
        finally:
            await runner.cleanup()
            await engine.close()

    return asyncio.run(run())


async def post(session, url, body=None, status=200):
    async with session.post(url, json=body if body is not None else {}) as response:
        assert response.status == status, await response.text()
        return await response.json() if response.content_type == "application/json" else await response.text()


def greedy_reference(folder, prompt, count):
    return load_hf_model(folder).generate(torch.tensor([prompt]), max_new_tokens=count, do_sample=False,
                                          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()


def test_generate_speaks_sglang(old_and_new):
    old, _ = old_and_new

    async def test(session, url, engine):
        single = await post(session, f"{url}/generate", {"input_ids": [5, 6, 7], "sampling_params": GREEDY,
                                                         "return_logprob": True, "rid": "abc"})
        batch = await post(session, f"{url}/generate", {"input_ids": [[5, 6, 7], [9]], "sampling_params": GREEDY})
        text = await post(session, f"{url}/generate", {"text": "12+3=", "sampling_params": GREEDY})
        bad = await post(session, f"{url}/generate", {"input_ids": [5, 99999]}, status=400)
        mixed = await post(session, f"{url}/generate", {"input_ids": [[5], [99999]], "sampling_params": GREEDY})
        unsupported = await post(session, f"{url}/generate", {"input_ids": [5], "sampling_params": {"min_p": 0.1}},
                                 status=400)
        async with session.get(f"{url}/get_weight_version") as r:
            version = await r.json()
        async with session.get(f"{url}/health") as r:
            assert r.status == 200
        return single, batch, text, bad, mixed, unsupported, version

    single, batch, text, bad, mixed, unsupported, version = serve(old, test)
    assert single["output_ids"] == greedy_reference(old, [5, 6, 7], 16)
    meta = single["meta_info"]
    assert meta["id"] == "abc" and meta["finish_reason"] == {"type": "length", "length": 16}
    assert [t for _, t, _ in meta["output_token_logprobs"]] == single["output_ids"]
    reference = teacher_forced_logprobs(load_hf_model(old), [5, 6, 7], single["output_ids"])
    got = torch.tensor([lp for lp, _, _ in meta["output_token_logprobs"]])
    assert (got - reference).abs().max() < 1e-4
    assert meta["weight_version"] == "0" and meta["weight_versions"] == [{"version": "0", "start": 0, "end": 16}]
    assert [b["output_ids"] for b in batch] == [single["output_ids"], greedy_reference(old, [9], 16)]
    tok = load_tokenizer(old)
    assert text["output_ids"] == greedy_reference(old, tok.encode("12+3="), 16)
    assert text["text"] == tok.decode(text["output_ids"])
    assert "outside the vocabulary" in bad["error"]["message"]
    assert mixed[0]["meta_info"]["finish_reason"]["type"] == "length"
    assert "outside the vocabulary" in mixed[1]["meta_info"]["finish_reason"]["message"]
    assert "min_p" in unsupported["error"]["message"]
    assert version == {"weight_version": "0"}


def test_pause_update_by_tensor_continue(old_and_new):
    old, new = old_and_new
    new_params = list(load_hf_model(new).state_dict().items())
    prompt = [5, 9, 13, 17]

    async def test(session, url, engine):
        task = asyncio.create_task(post(session, f"{url}/generate", {
            "input_ids": prompt, "sampling_params": LONG, "return_logprob": True, "rid": "req-000001"}))
        while (snap := engine.snapshot("req-000001")) is None or len(snap.output_ids) < 5:
            await asyncio.sleep(0.001)
        await post(session, f"{url}/pause_generation", {"mode": "retract"})
        old_embedding = dict(engine.named_parameters())["model.embed_tokens.weight"].clone()
        # A session with one bad bucket applies nothing, not even the good bucket before it.
        await post(session, f"{url}/begin_weight_update")
        await post(session, f"{url}/begin_weight_update", status=400)  # no nesting
        await post(session, f"{url}/update_weights_from_tensor", {
            "serialized_named_tensors": [encode_bucket(new_params[:3])]})
        bad = await post(session, f"{url}/update_weights_from_tensor", {
            "serialized_named_tensors": [encode_bucket([("model.nope.weight", torch.zeros(2))])]}, status=400)
        assert "model.nope.weight" in bad["error"]["message"]
        refused = await post(session, f"{url}/end_weight_update", {"weight_version": "1"}, status=400)
        assert "nothing applied" in refused["error"]["message"] and engine.version == 0
        assert torch.equal(old_embedding, dict(engine.named_parameters())["model.embed_tokens.weight"])
        # A good session: several buckets staged, applied together at the end.
        await post(session, f"{url}/begin_weight_update")
        for start in range(0, len(new_params), 7):
            await post(session, f"{url}/update_weights_from_tensor", {
                "serialized_named_tensors": [encode_bucket(new_params[start:start + 7])],
                "load_format": "flowrl_safetensors", "flush_cache": False})
        assert engine.version == 0  # staged, not applied
        assert torch.equal(old_embedding, dict(engine.named_parameters())["model.embed_tokens.weight"])
        await post(session, f"{url}/end_weight_update", {"weight_version": "1"})
        await post(session, f"{url}/continue_generation")
        return await task

    answer = serve(old, test)
    spans = answer["meta_info"]["weight_versions"]
    assert len(spans) == 2 and spans[0]["version"] == "0" and spans[1] == {"version": "1", "start": spans[0]["end"],
                                                                          "end": 60}
    assert answer["meta_info"]["weight_version"] == "1"
    cut = spans[0]["end"]
    got = torch.tensor([lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]])
    expected = teacher_forced_logprobs(load_hf_model(new), prompt, answer["output_ids"])
    assert (got[cut:] - expected[cut:]).abs().mean() < 1e-5


def test_abort_routes_and_disk_update(old_and_new):
    old, new = old_and_new

    async def test(session, url, engine):
        tasks = [asyncio.create_task(post(session, f"{url}/generate", {
            "input_ids": [5 + i], "sampling_params": LONG, "rid": f"group7-{i}"})) for i in range(2)]
        keep = asyncio.create_task(post(session, f"{url}/generate", {
            "input_ids": [8], "sampling_params": LONG, "rid": "other"}))
        while len(engine.request_ids()) < 3 or not engine.snapshot("group7-0").output_ids:
            await asyncio.sleep(0.001)
        await post(session, f"{url}/abort_request", {"rid": "group7-"})
        aborted = await asyncio.gather(*tasks)
        async with session.post(f"{url}/flush_cache") as r:
            busy_flush = r.status
        kept = await keep
        async with session.post(f"{url}/flush_cache") as r:
            idle_flush = r.status
        # Pause with SGLang's default mode (abort) returns partial output; new requests wait.
        long = asyncio.create_task(post(session, f"{url}/generate", {"input_ids": [5], "sampling_params": LONG}))
        while not engine.request_ids() or not engine.snapshot(engine.request_ids()[0]).output_ids:
            await asyncio.sleep(0.001)
        await post(session, f"{url}/pause_generation")
        paused = await long
        await post(session, f"{url}/update_weights_from_disk", {"model_path": str(new), "weight_version": "5"})
        await post(session, f"{url}/continue_generation")
        after = await post(session, f"{url}/generate", {"input_ids": [5, 6, 7], "sampling_params": GREEDY})
        missing = await post(session, f"{url}/update_weights_from_disk", {"model_path": "/no/such"}, status=400)
        return aborted, busy_flush, kept, idle_flush, paused, after, missing

    aborted, busy_flush, kept, idle_flush, paused, after, missing = serve(old, test)
    for answer in aborted:
        assert answer["meta_info"]["finish_reason"]["type"] == "abort" and 0 < len(answer["output_ids"]) < 60
    assert busy_flush == 400 and idle_flush == 200
    assert kept["meta_info"]["finish_reason"]["type"] == "length" and len(kept["output_ids"]) == 60
    assert paused["meta_info"]["finish_reason"]["type"] == "abort" and len(paused["output_ids"]) < 60
    assert after["output_ids"] == greedy_reference(new, [5, 6, 7], 16)
    assert after["meta_info"]["weight_version"] == "5"
    assert "not a directory" in missing["error"]["message"]


def test_openai_client_and_subprocess_server_with_broadcast_update(old_and_new):
    """`python -m flowrl_operators.engine.server` as a real process: the openai client, then a weight
    broadcast from this process (rank 0 of a gloo group), checked by greedy output."""
    old, new = old_and_new
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    server = subprocess.Popen([sys.executable, "-m", "flowrl_operators.engine.server", "--model", str(old),
                               "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = server.stdout.readline()
        match = re.search(r"http://127\.0\.0\.1:(\d+)", line)
        assert match, line + server.stderr.read()
        url = f"http://127.0.0.1:{match.group(1)}"
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        assert [m.id for m in client.models.list().data] == [str(old)]
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=8, temperature=0)
        tok = load_tokenizer(old)
        prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                         tokenize=False)
        reference = greedy_reference(old, tok.encode(prompt), 8)
        eos = {tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")}
        cut = next((i for i, t in enumerate(reference) if t in eos), len(reference))
        assert chat.choices[0].message.content == tok.decode(reference[:cut], skip_special_tokens=True)
        assert chat.choices[0].finish_reason == ("stop" if cut < 8 else "length")
        assert chat.usage.prompt_tokens == len(tok.encode(prompt))
        sampled = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=8, temperature=1.0, n=2, seed=3)
        assert [c.index for c in sampled.choices] == [0, 1]
        assert 2 <= sampled.usage.completion_tokens <= 16

        params = list(load_hf_model(new).named_parameters())
        answers = asyncio.run(broadcast_update(url, params))
        assert answers["init"]["success"] and answers["update"]["success"]
        assert answers["generate"]["output_ids"] == greedy_reference(new, [5, 6, 7], 16)
        assert answers["generate"]["meta_info"]["weight_version"] == "9"
    finally:
        server.terminate()
        server.wait(timeout=30)


async def broadcast_update(url: str, params) -> dict:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    answers = {}
    async with aiohttp.ClientSession() as session:
        joined: dict = {}
        thread = threading.Thread(target=lambda: joined.setdefault("group", weight_update_group(
            "127.0.0.1", port, 0, 2, "flowrl-test")))
        thread.start()
        answers["init"] = await post(session, f"{url}/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": "flowrl-test", "backend": "gloo"})
        thread.join()
        group = joined["group"]

        def send():
            for _, tensor in params:
                torch.distributed.broadcast(tensor.detach().contiguous(), src=0, group=group)

        request = asyncio.create_task(post(session, f"{url}/update_weights_from_distributed", {
            "names": [n for n, _ in params], "dtypes": [str(p.dtype) for _, p in params],
            "shapes": [list(p.shape) for _, p in params], "group_name": "flowrl-test",
            "weight_version": "9"}))
        await asyncio.to_thread(send)
        answers["update"] = await request
        answers["generate"] = await post(session, f"{url}/generate", {"input_ids": [5, 6, 7],
                                                                      "sampling_params": GREEDY})
        await post(session, f"{url}/destroy_weights_update_group", {"group_name": "flowrl-test"})
    torch.distributed.destroy_process_group(group)
    return answers


def test_version_spans():
    assert version_spans([0, 0, 1, 1, 1, 3], 3) == [
        {"version": "0", "start": 0, "end": 2}, {"version": "1", "start": 2, "end": 5},
        {"version": "3", "start": 5, "end": 6}]
    assert version_spans([], 4) == [{"version": "4", "start": 0, "end": 0}]
