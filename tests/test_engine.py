"""The embedded engine against Hugging Face's reference forward (fp32, CPU), in process.

Test checkpoints are the built-in tiny models with their matrices redrawn at std 0.1: HF's default
init (0.02) gives near-uniform logits whose greedy output just repeats one token.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
import torch

from flowrl_operators.engine.embedded.engine import EmbeddedEngine
from flowrl_operators.inference import GenerateRequest, InferenceEngine, SamplingParams
from flowrl_operators.models import load_hf_model, load_tokenizer

torch.set_num_threads(1)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)


def redraw(model, seed: int, std: float = 0.1) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            if p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=generator) * std)
            else:  # norms and biases: keep them near their usual values, but not trivial
                p.add_(torch.randn(p.shape, generator=generator) * std)


def make_checkpoint(builtin: str, folder: Path, seed: int) -> Path:
    model = load_hf_model(f"builtin:{builtin}")
    redraw(model, seed)
    model.save_pretrained(folder)
    load_tokenizer(f"builtin:{builtin}").save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {name: make_checkpoint(name, root / name, seed=i) for i, name in
            enumerate(["tiny-qwen2", "tiny-llama", "tiny-qwen3"])}


def request(rid: str, ids: list[int], sampling: SamplingParams = GREEDY) -> GenerateRequest:
    return GenerateRequest(request_id=rid, input_ids=ids, sampling=sampling)


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 100) for _ in range(rng.randrange(1, 30))] for _ in range(count)]


def teacher_forced_logprobs(hf, prompt: list[int], output: list[int]) -> torch.Tensor:
    """log p(output[i] | prompt + output[:i]) under the HF model, fp32."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logp = torch.log_softmax(hf(ids).logits[0].float(), dim=-1)
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(output) - 1)
    return logp[positions, torch.tensor(output)]


@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-llama", "tiny-qwen3"])
def test_greedy_equals_hf_generate(checkpoints, name):
    hf = load_hf_model(checkpoints[name])

    async def run():
        engine = EmbeddedEngine(checkpoints[name], max_slots=8)
        assert isinstance(engine, InferenceEngine)
        try:
            return await asyncio.gather(*[engine.generate(request(str(i), p))
                                          for i, p in enumerate(prompts(6))])
        finally:
            await engine.close()

    results = asyncio.run(run())
    for prompt, result in zip(prompts(6), results, strict=True):
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert result.output_ids == expected
        assert result.finish_reason == "length" and result.versions == [0] * 24


def test_greedy_does_not_depend_on_batch_composition(checkpoints):
    target = request("target", [7, 8, 9, 10, 11], GREEDY)

    async def run():
        engine = EmbeddedEngine(checkpoints["tiny-qwen2"], max_slots=32)
        try:
            alone = await engine.generate(target)
            others = [request(f"o{i}", p, SamplingParams(max_new_tokens=random.Random(i).randrange(1, 40),
                                                          seed=i, temperature=1.0))
                      for i, p in enumerate(prompts(31, seed=3))]
            crowd = await asyncio.gather(*[engine.generate(r) for r in others[:17] + [target] + others[17:]])
            return alone, crowd[17]
        finally:
            await engine.close()

    alone, crowded = asyncio.run(run())
    assert alone.output_ids == crowded.output_ids
    assert max(abs(a - b) for a, b in zip(alone.logprobs, crowded.logprobs, strict=True)) < 1e-5


async def wait_for_tokens(engine: EmbeddedEngine, rid: str, count: int) -> None:
    while (snap := engine.snapshot(rid)) is None or len(snap.output_ids) < count:
        await asyncio.sleep(0.001)


def test_output_does_not_depend_on_what_else_is_in_flight(checkpoints):
    """Staggered arrivals: requests prefilled in the step where others decode in higher slots, and
    requests that arrive mid-decode, give the same tokens and logprobs as when each runs alone."""
    seeded = SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True, seed=7)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    long_run = SamplingParams(temperature=1.0, max_new_tokens=80, ignore_eos=True, seed=3)
    late = {f"d{i}": request(f"d{i}", p, greedy if i % 2 else seeded)
            for i, p in enumerate(prompts(4, seed=9))}
    early = {"long0": request("long0", [8, 9, 10, 11], long_run),
             "long1": request("long1", [12, 13], SamplingParams(temperature=0.0, max_new_tokens=80,
                                                                   ignore_eos=True))}

    async def run():
        engine = EmbeddedEngine(checkpoints["tiny-qwen2"], max_slots=8)
        try:
            alone = {rid: await engine.generate(r) for rid, r in {**early, **late}.items()}
            # Two one-token requests take slots 0 and 1 and finish at their prefill; the long ones
            # keep decoding in slots 2 and 3 while the late ones arrive one by one into the low slots.
            shorts = [asyncio.ensure_future(engine.generate(request(
                f"s{i}", [5, 6, 7], SamplingParams(max_new_tokens=1)))) for i in range(2)]
            running = {rid: asyncio.ensure_future(engine.generate(r)) for rid, r in early.items()}
            await asyncio.gather(*shorts)
            for i, (rid, r) in enumerate(late.items()):
                await wait_for_tokens(engine, "long0", 3 + 4 * i)
                running[rid] = asyncio.ensure_future(engine.generate(r))
            return alone, dict(zip(running, await asyncio.gather(*running.values()), strict=True))
        finally:
            await engine.close()

    alone, crowded = asyncio.run(run())
    for rid, result in crowded.items():
        assert result.output_ids == alone[rid].output_ids, rid
        gap = max(abs(a - b) for a, b in zip(alone[rid].logprobs, result.logprobs, strict=True))
        assert gap < 1e-5, (rid, gap)


def test_sampled_logprobs_match_teacher_forced_hf(checkpoints):
    hf = load_hf_model(checkpoints["tiny-qwen3"])
    plain = SamplingParams(temperature=1.0, max_new_tokens=32, ignore_eos=True)

    async def run():
        engine = EmbeddedEngine(checkpoints["tiny-qwen3"], max_slots=8)
        try:
            return await asyncio.gather(*[engine.generate(request(str(i), p, plain))
                                          for i, p in enumerate(prompts(12, seed=5))])
        finally:
            await engine.close()

    deltas = []
    for prompt, result in zip(prompts(12, seed=5), asyncio.run(run()), strict=True):
        reference = teacher_forced_logprobs(hf, prompt, result.output_ids)
        deltas.append((torch.tensor(result.logprobs) - reference).abs())
    mean_delta = torch.cat(deltas).mean().item()
    assert mean_delta < 1e-5, mean_delta


def test_top_k_top_p_temperature_logprobs_are_of_the_restricted_distribution(checkpoints):
    hf = load_hf_model(checkpoints["tiny-qwen2"])
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.8, max_new_tokens=16, ignore_eos=True, seed=11)
    prompt = [9, 8, 7, 6]

    async def run():
        engine = EmbeddedEngine(checkpoints["tiny-qwen2"], max_slots=4)
        try:
            return await engine.generate(request("r", prompt, params))
        finally:
            await engine.close()

    result = asyncio.run(run())
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + result.output_ids])).logits[0].float() / 0.7
    for i, token in enumerate(result.output_ids):
        row = logits[len(prompt) - 1 + i]
        ordered, order = row.sort(descending=True)
        probs = torch.softmax(ordered[:20], dim=-1)
        keep = int(((probs.cumsum(0) - probs) < 0.8).sum())
        allowed = order[:keep]
        assert token in allowed.tolist()
        expected = torch.log_softmax(row[allowed], dim=-1)[allowed.tolist().index(token)]
        assert abs(result.logprobs[i] - expected.item()) < 1e-4


def test_truncation_from_the_head_equals_sorting_the_whole_row():
    """`truncation_mask` decides a row from its `head` largest logits when it can: the same set as a
    stable sort of the whole row, with ties (bf16-rounded and integer logits), top_k beyond the head
    and nuclei wider than it (those rows fall back to the sort)."""
    from flowrl_operators.sampling import truncation_mask

    g = torch.Generator().manual_seed(0)
    rows, vocab = 35, 300
    top_k = torch.tensor([[-1, 5, 16, 17, 100, 300, 0][i % 7] for i in range(rows)])
    top_p = torch.tensor([[1.0, 0.5, 0.9, 0.999, 0.3][i // 7] for i in range(rows)])
    for trial in range(9):
        x = torch.randn(rows, vocab, generator=g) * (0.3 + 3 * torch.rand(rows, 1, generator=g))
        x = [x, x.to(torch.bfloat16).float(), torch.randint(0, 6, (rows, vocab), generator=g).float()][trial % 3]
        head, whole = truncation_mask(x, top_k, top_p, head=16), truncation_mask(x, top_k, top_p, head=vocab)
        assert torch.equal(head, whole), trial
        assert whole.sum(1).min() >= 1 and (whole.sum(1) < vocab).any() and (whole.sum(1) > 16).any()


def test_seeded_sampling_is_reproducible_in_any_batch(checkpoints):
    params = SamplingParams(temperature=1.0, max_new_tokens=20, ignore_eos=True, seed=42)

    async def run():
        engine = EmbeddedEngine(checkpoints["tiny-llama"], max_slots=8)
        try:
            alone = await engine.generate(request("a", [5, 6, 7], params))
            crowd = await asyncio.gather(
                engine.generate(request("b", [5, 6, 7], params)),
                *[engine.generate(request(f"x{i}", p, SamplingParams(max_new_tokens=10)))
                  for i, p in enumerate(prompts(7))])
            unseeded = await asyncio.gather(*[engine.generate(request(f"u{i}", [5, 6, 7], SamplingParams(
                max_new_tokens=20, ignore_eos=True))) for i in range(2)])
            return alone, crowd[0], unseeded
        finally:
            await engine.close()

    alone, crowded, unseeded = asyncio.run(run())
    assert alone.output_ids == crowded.output_ids
    assert unseeded[0].output_ids != unseeded[1].output_ids  # no seed: independent draws


def test_stop_tokens_and_eos(checkpoints):
    async def run():
        engine = EmbeddedEngine(checkpoints["tiny-qwen2"], max_slots=4)
        try:
            free = await engine.generate(request("free", [5, 6, 7]))
            stop_at = free.output_ids[3]
            stopped = await engine.generate(request("stop", [5, 6, 7], SamplingParams(
                temperature=0.0, max_new_tokens=24, stop_token_ids=[stop_at], ignore_eos=True)))
            return free, stopped, engine.eos_ids
        finally:
            await engine.close()

    free, stopped, eos_ids = asyncio.run(run())
    first = free.output_ids.index(free.output_ids[3])
    assert stopped.output_ids == free.output_ids[: first + 1]  # the stop token is part of the output
    assert stopped.finish_reason == "stop"
    assert eos_ids == {2, 4}  # <|endoftext|> and <|im_end|> from the built-in config


def test_bad_requests_fail_alone(checkpoints):
    async def run():
        engine = EmbeddedEngine(checkpoints["tiny-qwen2"], max_slots=4, max_context=64)
        try:
            good = [request(f"g{i}", p) for i, p in enumerate(prompts(3))]
            bad = [
                request("empty", []),
                request("vocab", [5, 100000, 6]),
                request("negative", [-1]),
                request("zero", [5], SamplingParams(max_new_tokens=0)),
                request("long", [5] * 64),
                request("top_p", [5], SamplingParams(top_p=0.0)),
            ]
            return await asyncio.gather(*[engine.generate(r) for r in bad[:3] + good + bad[3:]])
        finally:
            await engine.close()

    results = {r.request_id: r for r in asyncio.run(run())}
    for rid, words in [("empty", "empty prompt"), ("vocab", "outside the vocabulary"),
                       ("negative", "outside the vocabulary"), ("zero", "max_new_tokens"),
                       ("long", "no room in the context"), ("top_p", "top_p")]:
        assert words in results[rid].error, results[rid].error
        assert results[rid].finish_reason == "abort" and results[rid].output_ids == []
    for i in range(3):
        assert results[f"g{i}"].error is None and len(results[f"g{i}"].output_ids) == 24


def test_context_limit_finishes_with_length(checkpoints):
    async def run():
        engine = EmbeddedEngine(checkpoints["tiny-qwen2"], max_slots=2, max_context=16)
        try:
            return await engine.generate(request("r", [5] * 10, SamplingParams(max_new_tokens=100,
                                                                                ignore_eos=True)))
        finally:
            await engine.close()

    result = asyncio.run(run())
    assert result.finish_reason == "length" and len(result.output_ids) == 6
