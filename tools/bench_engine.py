"""Throughput of the embedded engine vs Hugging Face `generate`, same model, same requests.

256 requests with random prompts and output lengths drawn from a long tail (most short, a few near
max_new_tokens); each request's length is enforced with its own max_new_tokens and ignore_eos, so
both sides produce exactly the same number of useful tokens. The engine takes all requests at once
and keeps at most 32 in flight (continuous batching); HF runs batches of 32 (left-padded), each until
its longest request is done. Sampling at temperature 1, fp32, one torch thread. Tokens/s counts
useful tokens only.

    flock /tmp/flowrl-bench.lock /work/venv/bin/python tools/bench_engine.py

`--workload grpo` is GRPO-shaped instead: groups of 8 requests with equal prompts (a ~40-token
system prompt shared by all, then 20-40 question tokens), long-tail output lengths up to
--max-new-tokens (default 64 there), greedy on both sides so every request's tokens are checked
identical to HF's; without --model it runs a SmolLM2-135M-shaped Llama with random weights built
locally. The engine computes each group's prompt once (and copies the system
prompt from requests already cached); HF prefills every row.

Each side runs `--repeats` times (default 2), alternating, and the fastest run of each counts.
The last line of output is one JSON object (engine_tok_s, hf_tok_s, speedup, ...).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path

import results_file
import torch

from flowrl_operators.engine.embedded.engine import EmbeddedEngine
from flowrl_operators.inference import GenerateRequest, SamplingParams
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


def grpo_workload(count: int, max_new: int, seed: int, group: int = 8) -> list[tuple[list[int], int]]:
    """Groups of `group` equal prompts (one 40-token system prompt for all, 20-40 question tokens);
    output lengths 70% short (8-24 tokens), 30% long (75-100% of max_new)."""
    rng = random.Random(seed)
    system = [rng.randrange(5, 1000) for _ in range(40)]
    requests = []
    for _ in range(-(-count // group)):
        prompt = system + [rng.randrange(5, 1000) for _ in range(rng.randrange(20, 41))]
        for _ in range(group):
            short = rng.random() < 0.7
            length = rng.randrange(8, 25) if short else rng.randrange(int(0.75 * max_new), max_new + 1)
            requests.append((prompt, length))
    return requests[:count]


def smollm2_shaped(folder: Path) -> str:
    """A Llama with SmolLM2-135M's shapes and random weights (std 0.02), saved once to `folder`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if not (folder / "config.json").exists():
        config = LlamaConfig(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                             intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True,
                             max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=100000.0,
                             bos_token_id=1, eos_token_id=2)
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(folder)
    return str(folder)


def run_engine(model: str, requests, slots: int, greedy: bool = False) -> tuple[float, list[list[int]], dict]:
    async def main():
        engine = EmbeddedEngine(model, max_slots=slots, threads=1)
        try:
            warm = [GenerateRequest(request_id=f"w{i}", input_ids=p, sampling=SamplingParams(max_new_tokens=4))
                    for i, (p, _) in enumerate(requests[:slots])]
            await asyncio.gather(*[engine.generate(r) for r in warm])
            started = time.perf_counter()
            before = engine.stats()
            results = await asyncio.gather(*[
                engine.generate(GenerateRequest(request_id=str(i), input_ids=prompt, sampling=SamplingParams(
                    temperature=0.0 if greedy else 1.0, max_new_tokens=length, ignore_eos=True, seed=i)))
                for i, (prompt, length) in enumerate(requests)])
            elapsed = time.perf_counter() - started
            stats = {k: v - before[k] for k, v in engine.stats().items() if k.startswith("prefill")}
        finally:
            await engine.close()
        assert all(r.error is None for r in results)
        assert [len(r.output_ids) for r in results] == [length for _, length in requests]
        return elapsed, [r.output_ids for r in results], stats

    return asyncio.run(main())


def run_hf(model: str, requests, batch: int, greedy: bool = False) -> tuple[float, list[list[int]], int]:
    hf = load_hf_model(model)
    hf.generation_config.pad_token_id = 0

    def generate(chunk):
        width = max(len(p) for p, _ in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk])
        steps = max(length for _, length in chunk)
        sampling = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                              eos_token_id=None, **sampling)
        return [row[width:width + length].tolist() for row, (_, length) in zip(out, chunk, strict=True)]

    generate(requests[:batch][:4])  # warm-up
    started = time.perf_counter()
    outputs = [o for i in range(0, len(requests), batch) for o in generate(requests[i:i + batch])]
    elapsed = time.perf_counter() - started
    computed = sum(max(length for _, length in requests[i:i + batch]) * len(requests[i:i + batch])
                   for i in range(0, len(requests), batch))
    return elapsed, outputs, computed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=("longtail", "grpo"), default="longtail")
    parser.add_argument("--model", default=None,
                        help="default: builtin:tiny-qwen2 (longtail), a SmolLM2-135M-shaped random model (grpo)")
    parser.add_argument("--requests", type=int, default=None, help="default: 256 (longtail), 64 (grpo)")
    parser.add_argument("--slots", type=int, default=32, help="engine max in flight = HF batch size")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default: 256 (longtail), 64 (grpo)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=2, help="alternating runs of each side; the fastest counts")
    results_file.add_record_flag(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    grpo = args.workload == "grpo"
    args.requests = args.requests or (64 if grpo else 256)
    args.max_new_tokens = args.max_new_tokens or (64 if grpo else 256)
    if args.model is None:
        args.model = (smollm2_shaped(Path(tempfile.gettempdir()) / "flowrl-bench-smollm2-shaped") if grpo
                      else "builtin:tiny-qwen2")
    requests = (grpo_workload if grpo else workload)(args.requests, args.max_new_tokens, args.seed)
    lengths = sorted(length for _, length in requests)
    print(f"{args.workload}: {args.requests} requests, output lengths: median {lengths[len(lengths) // 2]}, "
          f"max {lengths[-1]}, total {sum(lengths)}; model {args.model}; 1 thread")

    # The two sides alternate and each keeps its fastest run: on a shared machine a single run of
    # either can be slowed by the load, and the two run one after the other.
    times: dict[str, list[float]] = {"engine": [], "hf": []}
    cpu: dict[str, list[float]] = {"engine": [], "hf": []}
    for _ in range(args.repeats):
        started = time.process_time()
        engine_s, engine_out, prefill = run_engine(args.model, requests, args.slots, greedy=grpo)
        times["engine"].append(engine_s)
        cpu["engine"].append(time.process_time() - started)
        started = time.process_time()
        hf_s, hf_out, hf_computed = run_hf(args.model, requests, args.slots, greedy=grpo)
        times["hf"].append(hf_s)
        cpu["hf"].append(time.process_time() - started)
    engine_s, hf_s = min(times["engine"]), min(times["hf"])
    engine_tokens = sum(map(len, engine_out))
    engine_tok_s = engine_tokens / engine_s
    print(f"engine: {engine_tokens} tokens in {engine_s:.2f} s = {engine_tok_s:,.0f} tok/s "
          f"(continuous batching, {args.slots} slots; runs {', '.join(f'{t:.2f}' for t in times['engine'])} s); "
          f"{prefill}")
    hf_tokens = sum(map(len, hf_out))
    hf_tok_s = hf_tokens / hf_s
    identical = sum(a == b for a, b in zip(engine_out, hf_out, strict=True)) if grpo else None
    if grpo:
        print(f"greedy tokens identical to HF generate's: {identical} of {len(requests)} requests")
    print(f"hf generate: {hf_tokens} useful tokens ({hf_computed} computed) in {hf_s:.2f} s = "
          f"{hf_tok_s:,.0f} tok/s (batches of {args.slots}; runs {', '.join(f'{t:.2f}' for t in times['hf'])} s)")
    cpu_ratio = min(cpu["hf"]) / min(cpu["engine"])  # process CPU s, load and model loading included
    print(f"process CPU seconds, fastest run (model loading included): engine {min(cpu['engine']):.1f}, "
          f"hf {min(cpu['hf']):.1f}: {cpu_ratio:.2f}x")
    speedup = engine_tok_s / hf_tok_s
    print(f"speedup: {speedup:.2f}x (target >= 2x)")
    results_file.emit(args.record, "bench_engine", {"engine_tok_s": round(engine_tok_s, 1), "hf_tok_s": round(hf_tok_s, 1),
                      "speedup": round(speedup, 3), "cpu_ratio": round(cpu_ratio, 3), "repeats": args.repeats,
                      "engine_s": round(engine_s, 3), "hf_s": round(hf_s, 3),
                      "tokens": engine_tokens, "hf_computed_tokens": hf_computed, "requests": args.requests,
                      "slots": args.slots, "max_new_tokens": args.max_new_tokens, "model": args.model,
                      "workload": args.workload, "identical_requests": identical, **prefill})


if __name__ == "__main__":
    main()
