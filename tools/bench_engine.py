"""Throughput of the embedded engine vs Hugging Face `generate`, same model, same requests.

256 requests with random prompts and output lengths drawn from a long tail (most short, a few near
max_new_tokens); each request's length is enforced with its own max_new_tokens and ignore_eos, so
both sides produce exactly the same number of useful tokens. The engine takes all requests at once
and keeps at most 32 in flight (continuous batching); HF runs batches of 32 (left-padded), each until
its longest request is done. Sampling at temperature 1, fp32, one torch thread. Tokens/s counts
useful tokens only.

    flock /tmp/flowrl-bench.lock /work/venv/bin/python tools/bench_engine.py

The last line of output is one JSON object (engine_tok_s, hf_tok_s, speedup, ...).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

import torch

from flowrl_operators.engine.base import GenerateRequest, SamplingParams
from flowrl_operators.engine.embedded import EmbeddedEngine
from flowrl_operators.models import load_hf_model


def workload(count: int, max_new: int, seed: int) -> list[tuple[list[int], int]]:
    """(prompt, output length) pairs: 85% short (8-32 tokens), 15% long (75-100% of max_new)."""
    rng = random.Random(seed)
    requests = []
    for _ in range(count):
        prompt = [rng.randrange(5, 100) for _ in range(rng.randrange(8, 33))]
        if rng.random() < 0.85:
            length = rng.randrange(8, 33)
        else:
            length = rng.randrange(int(0.75 * max_new), max_new + 1)
        requests.append((prompt, length))
    return requests


def run_engine(model: str, requests, slots: int) -> tuple[float, int]:
    async def main():
        engine = EmbeddedEngine(model, max_slots=slots, threads=1)
        try:
            warm = [GenerateRequest(request_id=f"w{i}", input_ids=p, sampling=SamplingParams(max_new_tokens=4))
                    for i, (p, _) in enumerate(requests[:slots])]
            await asyncio.gather(*[engine.generate(r) for r in warm])
            started = time.perf_counter()
            results = await asyncio.gather(*[
                engine.generate(GenerateRequest(request_id=str(i), input_ids=prompt, sampling=SamplingParams(
                    temperature=1.0, max_new_tokens=length, ignore_eos=True, seed=i)))
                for i, (prompt, length) in enumerate(requests)])
            elapsed = time.perf_counter() - started
        finally:
            await engine.close()
        assert all(r.error is None for r in results)
        assert [len(r.output_ids) for r in results] == [length for _, length in requests]
        return elapsed, sum(len(r.output_ids) for r in results)

    return asyncio.run(main())


def run_hf(model: str, requests, batch: int) -> tuple[float, int, int]:
    hf = load_hf_model(model)
    hf.generation_config.pad_token_id = 0

    def generate(chunk):
        width = max(len(p) for p, _ in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk])
        steps = max(length for _, length in chunk)
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                              do_sample=True, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=None)
        return (out.shape[1] - width) * len(chunk)

    generate(requests[:batch][:4])  # warm-up
    started = time.perf_counter()
    computed = sum(generate(requests[i:i + batch]) for i in range(0, len(requests), batch))
    elapsed = time.perf_counter() - started
    return elapsed, sum(length for _, length in requests), computed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="builtin:tiny-qwen2")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--slots", type=int, default=32, help="engine max in flight = HF batch size")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    requests = workload(args.requests, args.max_new_tokens, args.seed)
    lengths = sorted(length for _, length in requests)
    print(f"{args.requests} requests, output lengths: median {lengths[len(lengths) // 2]}, "
          f"max {lengths[-1]}, total {sum(lengths)}; model {args.model}; 1 thread")

    engine_s, engine_tokens = run_engine(args.model, requests, args.slots)
    engine_tok_s = engine_tokens / engine_s
    print(f"engine: {engine_tokens} tokens in {engine_s:.2f} s = {engine_tok_s:,.0f} tok/s "
          f"(continuous batching, {args.slots} slots)")
    hf_s, hf_tokens, hf_computed = run_hf(args.model, requests, args.slots)
    hf_tok_s = hf_tokens / hf_s
    print(f"hf generate: {hf_tokens} useful tokens ({hf_computed} computed) in {hf_s:.2f} s = "
          f"{hf_tok_s:,.0f} tok/s (batches of {args.slots})")
    speedup = engine_tok_s / hf_tok_s
    print(f"speedup: {speedup:.2f}x (target >= 2x)")
    print(json.dumps({"engine_tok_s": round(engine_tok_s, 1), "hf_tok_s": round(hf_tok_s, 1),
                      "speedup": round(speedup, 3), "engine_s": round(engine_s, 3), "hf_s": round(hf_s, 3),
                      "tokens": engine_tokens, "hf_computed_tokens": hf_computed, "requests": args.requests,
                      "slots": args.slots, "max_new_tokens": args.max_new_tokens, "model": args.model}))


if __name__ == "__main__":
    main()
