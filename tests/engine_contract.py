"""The contract every generate engine passes (`InferenceEngine` in flowrl_operators/inference.py).

Each check is `async def check_*(target)` on a `Target`: an engine that serves `folder`'s weights,
and `new` weights of the same shapes to update it with. Checks are engine-agnostic: they speak only
the `InferenceEngine` interface and compare with a Hugging Face reference of the same checkpoint. A
check that updates weights restores the old ones (as a newer version) before it returns, so the
checks share one engine in any order. `tests/test_engine_contract.py` runs them over the engines.
"""

from __future__ import annotations

import asyncio
import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from flowrl_operators.inference import GenerateRequest, GenerateResult, SamplingParams

# Tokens: long enough that a pause or abort 0.1 s in lands mid-request (fast engines: raise it).
LONG = int(os.environ.get("FLOWRL_CONTRACT_LONG", "400"))


@dataclass
class Target:
    engine: Any
    reference: Any  # the HF model of the served weights (same device), for teacher-forced logprobs
    old: list[tuple[str, torch.Tensor]]  # the served weights, to restore after an update
    new: list[tuple[str, torch.Tensor]]  # other weights of the same names and shapes
    vocab: int
    max_context: int  # the model's max_position_embeddings
    check_vocab: bool = True
    tolerance: float = 2e-3  # mean |logprob - reference| allowed (fp32); bf16 needs ~5e-2
    retract_exact: bool = True  # after a retract, tokens equal what the new weights give from the prefix
    calls: list[int] = field(default_factory=lambda: [0])

    def rid(self, tag: str) -> str:
        self.calls[0] += 1
        return f"{tag}-{self.calls[0]}"


def greedy(n: int, ignore_eos: bool = True, **extra) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=ignore_eos, **extra)


async def run(target: Target, ids: list[int], sampling: SamplingParams, tag: str = "r") -> GenerateResult:
    return await target.engine.generate(GenerateRequest(request_id=target.rid(tag), input_ids=ids,
                                                        sampling=sampling))


@torch.no_grad()
def teacher_forced(model, prompt: list[int], output: list[int]) -> list[float]:
    device = next(model.parameters()).device
    ids = torch.tensor([prompt + output], device=device)
    logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt):, None])[:, 0].tolist()


def well_formed(result: GenerateResult, limit: int) -> None:
    assert result.error is None, result.error
    n = len(result.output_ids)
    assert 1 <= n <= limit and len(result.logprobs) == n and len(result.versions) == n, result
    assert all(math.isfinite(lp) and lp <= 1e-6 for lp in result.logprobs), result.logprobs
    assert result.finish_reason in ("stop", "length", "abort")


def close(a: list[float], b: list[float], tolerance: float) -> bool:
    return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / max(len(a), 1) <= tolerance


async def update(target: Target, weights) -> int:
    version = target.engine.version + 1
    await target.engine.update_weights([list(weights)], version)
    assert target.engine.version == version
    return version


# --- the checks ----------------------------------------------------------------------------------------


async def check_greedy(target: Target) -> None:
    """Token ids, logprobs of the model's distribution, one version per token; deterministic."""
    prompt = [5, 17, 23, 42]
    first = await run(target, prompt, greedy(24))
    well_formed(first, 24)
    assert first.finish_reason == "length" and len(first.output_ids) == 24
    assert first.versions == [target.engine.version] * 24
    again = await run(target, prompt, greedy(24))
    assert again.output_ids == first.output_ids
    assert close(first.logprobs, teacher_forced(target.reference, prompt, first.output_ids), target.tolerance)


async def check_stop_token(target: Target) -> None:
    """A stop token ends the request and is part of its output."""
    prompt = [9, 8, 7]
    token = (await run(target, prompt, greedy(4))).output_ids[0]
    stopped = await run(target, prompt, greedy(8, stop_token_ids=[token]))
    assert stopped.output_ids == [token] and stopped.finish_reason == "stop"


async def check_seeded_sampling(target: Target) -> None:
    """A seed reproduces a sampled request; at temperature 1 the logprobs are the model's."""
    sampling = SamplingParams(temperature=1.0, max_new_tokens=32, ignore_eos=True, seed=1234)
    prompt = [11, 12, 13]
    one, two = await asyncio.gather(run(target, prompt, sampling), run(target, prompt, sampling))
    well_formed(one, 32)
    assert one.output_ids == two.output_ids
    assert close(one.logprobs, teacher_forced(target.reference, prompt, one.output_ids), target.tolerance)


async def check_batch_invariance(target: Target) -> None:
    """Requests decoded together give what each gives alone (greedy)."""
    prompts = [[5 + i, 30 + 2 * i, 60 - i][: 1 + i % 3] for i in range(6)]
    alone = [(await run(target, p, greedy(12))).output_ids for p in prompts]
    together = await asyncio.gather(*(run(target, p, greedy(12)) for p in prompts))
    assert [r.output_ids for r in together] == alone


async def check_rejects_bad_request(target: Target) -> None:
    """A prompt longer than the context (or, where safe, a token outside the vocabulary) fails alone
    with an error; the engine serves on."""
    too_long = [5] * (target.max_context + 8)
    bad = await run(target, too_long, greedy(4))
    assert bad.error and bad.finish_reason == "abort" and bad.output_ids == [], bad
    if target.check_vocab:  # off for real SGLang: an out-of-range id can fail on the GPU, not politely
        bad = await run(target, [5, target.vocab + 10], greedy(4))
        assert bad.error and bad.finish_reason == "abort" and bad.output_ids == []
    well_formed(await run(target, [5, 6], greedy(4)), 4)


async def check_abort_request(target: Target) -> None:
    """abort(request_id) ends one running request with its partial output; others continue."""
    engine = target.engine
    victim = GenerateRequest(request_id=target.rid("victim"), input_ids=[5, 6], sampling=greedy(LONG))
    task = asyncio.create_task(engine.generate(victim))
    other = asyncio.create_task(run(target, [7, 8], greedy(LONG)))
    await asyncio.sleep(0.1)
    aborted = await engine.abort(victim.request_id)
    result = await task
    assert aborted is not None and aborted.finish_reason == "abort"
    assert result.finish_reason == "abort" and len(result.output_ids) < LONG
    assert result.error is None
    finished = await other
    assert finished.finish_reason == "length" and len(finished.output_ids) == LONG
    assert await engine.abort("no-such-request") is None


async def check_pause_abort(target: Target) -> None:
    """pause("abort") ends running requests with partial output; new ones wait for resume()."""
    engine = target.engine
    running = [asyncio.create_task(run(target, [5 + i, 6], greedy(LONG))) for i in range(2)]
    await asyncio.sleep(0.1)
    await engine.pause("abort")
    try:
        for result in await asyncio.gather(*running):
            assert result.finish_reason == "abort" and 0 < len(result.output_ids) < LONG, result
        waiting = asyncio.create_task(run(target, [9, 9], greedy(8)))
        await asyncio.sleep(0.3)
        assert not waiting.done(), "a request submitted while paused finished before resume()"
    finally:
        await engine.resume()
    assert (await waiting).finish_reason == "length"


async def check_retract_update_resume(target: Target) -> None:
    """Partial rollout: pause("retract"), new weights, resume: the same request continues under the
    new version, its tokens stamped with the version that produced them."""
    engine = target.engine
    old_version = engine.version
    prompt = [5, 17, 23]
    task = asyncio.create_task(run(target, prompt, greedy(LONG)))
    await asyncio.sleep(0.1)
    await engine.pause("retract")
    try:
        new_version = await update(target, target.new)
    finally:
        await engine.resume()
    result = await task
    try:
        well_formed(result, LONG)
        assert len(result.output_ids) == LONG, "a retracted request lost tokens"
        assert result.versions == sorted(result.versions)
        assert result.versions[0] == old_version and result.versions[-1] == new_version, result.versions
        switch = result.versions.index(new_version)
        if target.retract_exact:
            # The KV was recomputed under the new weights: the rest is their greedy continuation.
            count = min(48, LONG - switch)
            rest = await run(target, prompt + result.output_ids[:switch], greedy(count))
            assert rest.output_ids == result.output_ids[switch:switch + count]
    finally:
        await update(target, target.old)


async def check_update_changes_outputs(target: Target) -> None:
    """update_weights applies the whole version: outputs follow the new weights, then the old again."""
    prompt = [33, 34, 35]
    before = await run(target, prompt, greedy(16))
    version = await update(target, target.new)
    after = await run(target, prompt, greedy(16))
    assert after.versions == [version] * 16
    await update(target, target.old)
    restored = await run(target, prompt, greedy(16))
    assert restored.output_ids == before.output_ids
    assert after.output_ids != before.output_ids or not close(after.logprobs, before.logprobs, 1e-3)


async def check_update_is_atomic(target: Target) -> None:
    """A version with an unknown name is refused as a whole: old weights and version stay."""
    prompt = [40, 41]
    before = await run(target, prompt, greedy(12))
    version = target.engine.version
    broken = [target.new[0], ("model.no_such_layer.weight", target.new[0][1])]
    try:
        await target.engine.update_weights([broken], version + 1)
    except Exception:
        pass
    else:
        raise AssertionError("update_weights accepted a weight name the model does not have")
    assert target.engine.version == version
    after = await run(target, prompt, greedy(12))
    assert after.output_ids == before.output_ids and close(after.logprobs, before.logprobs, 1e-5)


@torch.no_grad()
def teacher_forced_all(model, prompt: list[int], output: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / temperature) at every output position, [n, vocab]."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt + output], device=device)
    return torch.log_softmax(model(ids).logits[0, len(prompt) - 1:-1].float() / temperature, -1).cpu()


async def check_top_logprobs(target: Target) -> None:
    """`top_logprobs` K: at each output token the K most likely ids, most likely first, with their
    logprobs under softmax(logits / temperature) (temperature 1 when greedy); none unless asked."""
    prompt = [21, 22, 23]
    sampled = await run(target, prompt, SamplingParams(temperature=0.7, max_new_tokens=12, ignore_eos=True,
                                                       seed=77, top_logprobs=4))
    well_formed(sampled, 12)
    n = len(sampled.output_ids)
    assert len(sampled.top_ids) == len(sampled.top_logprobs) == n
    assert all(len(ids) == len(lps) == 4 for ids, lps in zip(sampled.top_ids, sampled.top_logprobs, strict=True))
    reference = teacher_forced_all(target.reference, prompt, sampled.output_ids, 0.7)
    at_ids = reference.gather(1, torch.tensor(sampled.top_ids)).flatten().tolist()
    assert close(sum(sampled.top_logprobs, []), at_ids, target.tolerance)
    assert close(sum(sampled.top_logprobs, []), reference.topk(4).values.flatten().tolist(), target.tolerance)
    assert all(lps == sorted(lps, reverse=True) for lps in sampled.top_logprobs)
    greedy_top = await run(target, prompt, greedy(6, top_logprobs=2))
    assert [ids[0] for ids in greedy_top.top_ids] == greedy_top.output_ids
    assert close([lps[0] for lps in greedy_top.top_logprobs], greedy_top.logprobs, 1e-5)
    plain = await run(target, prompt, greedy(3))
    assert plain.top_ids == [] and plain.top_logprobs == []


CHECKS = [check_greedy, check_stop_token, check_seeded_sampling, check_batch_invariance, check_top_logprobs,
          check_rejects_bad_request, check_abort_request, check_pause_abort, check_retract_update_resume,
          check_update_changes_outputs, check_update_is_atomic]
