"""The embedded engine on a vision-language built-in: greedy tokens against Hugging Face `generate`,
behaviour logprobs against the trainer's teacher-forced ones, and tokens/s with images.

--requests image requests (two images each, a 56x56 and a 100x40 one: 8 image tokens) and as many
text requests, all at once, greedy, --max-new-tokens each, fp32, one torch thread. The built-in's
weights are perturbed (scale 0.3) so that greedy outputs vary. Every request's tokens are checked
against HF `generate` of the same prompt and images (one at a time); the first two image requests
are then sampled (temperature 1) and their logprobs compared with the trainer's.

    python tools/bench_vl.py [--model builtin:tiny-qwen2.5-vl | builtin:tiny-qwen3-vl] [--requests 16] [--max-new-tokens 64]

`--device cuda` runs the engine and the HF model on the GPU (fp32; the trainer picks CUDA itself).

The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
import time
from pathlib import Path

import results_file
import torch
from PIL import Image

from flowrl.data.images import use_store
from flowrl.data.trajectory import Trajectory
from flowrl_operators.engine.embedded.engine import EmbeddedEngine
from flowrl_operators.inference import GenerateRequest, SamplingParams
from flowrl_operators.models import load_hf_model, resolve_model
from flowrl_operators.training.batch import pack, response_values
from flowrl_operators.training.trainer import Reference, TrainerConfig
from flowrl_operators.vision import vision

DEVICE = "cpu"


def picture(size, seed) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    return Image.fromarray(torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8).numpy(), "RGB")


def perturbed(name: str, folder: Path):
    model = load_hf_model(resolve_model(name))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    model.save_pretrained(folder)
    for f in resolve_model(name).iterdir():
        if f.name not in ("model.safetensors", "config.json", "flowrl_builtin.json"):
            shutil.copy(f, folder)
    return model.eval()


def requests(folder: Path, store, n: int) -> list[tuple[list[int], list]]:
    v = vision(folder)
    out = []
    for i in range(n):
        refs = [store.put(picture((56, 56), i)), store.put(picture((100, 40), 100 + i))]
        parts = [{"type": "text", "text": f"#{i}"}, {"type": "image"}, {"type": "image"}]
        out.append(v.prompt([{"role": "user", "content": parts}], refs))
        out.append(v.prompt([{"role": "user", "content": f"text request {i} " * (1 + i % 3)}], []))
    return out


async def serve(folder: Path, work, sampling: SamplingParams) -> tuple[list, float]:
    engine = EmbeddedEngine(folder, max_slots=32, device=DEVICE)
    try:
        start = time.perf_counter()
        results = await asyncio.gather(*(engine.generate(GenerateRequest(
            request_id=str(i), input_ids=ids, images=refs, sampling=sampling)) for i, (ids, refs) in enumerate(work)))
        return results, time.perf_counter() - start
    finally:
        await engine.close()


def hf_greedy(model, folder: Path, ids: list[int], refs: list, n: int) -> list[int]:
    x = torch.tensor([ids], device=DEVICE)
    extra = {}
    if refs:
        v = vision(folder)
        pixels = {k: t.to(DEVICE) for k, t in v.pixels(refs).items()}
        extra = dict(pixels, mm_token_type_ids=(x == v.image_token_id).int())
    out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                         eos_token_id=None, **extra)
    return out[0, len(ids):].tolist()


def logprob_gap(folder: Path, work) -> tuple[float, float]:
    sampling = SamplingParams(temperature=1.0, max_new_tokens=32, ignore_eos=True, seed=3)
    results, _ = asyncio.run(serve(folder, work, sampling))
    trajectories = [Trajectory(id=str(i), group_id="g", sample_id="s", prompt_ids=ids, response_ids=r.output_ids,
                               loss_mask=[1] * len(r.output_ids), behaviour_logprobs=r.logprobs, versions=r.versions,
                               images=refs) for i, ((ids, refs), r) in enumerate(zip(work, results, strict=True))]
    batch = pack(trajectories, require_reward=False)
    batch.reference_logprobs = Reference(folder, TrainerConfig()).compute_logprobs(batch)
    diffs = [abs(a - b) for t, lps in zip(trajectories, response_values(batch, "reference_logprobs", trajectories),
                                          strict=True) for a, b in zip(t.behaviour_logprobs, lps, strict=True)]
    return sum(diffs) / len(diffs), max(diffs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="builtin:tiny-qwen2-vl")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    results_file.add_record_flag(parser)
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        store = use_store(Path(tmp) / "images")
        folder = Path(tmp) / "model"
        model = perturbed(args.model, folder).to(DEVICE)
        work = requests(folder, store, args.requests)
        greedy = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens, ignore_eos=True)
        results, seconds = asyncio.run(serve(folder, work, greedy))
        errors = [r.error for r in results if r.error]
        if errors:
            raise SystemExit(f"{len(errors)} requests failed: {errors[0]}")
        same = sum(r.output_ids == hf_greedy(model, folder, ids, refs, args.max_new_tokens)
                   for (ids, refs), r in zip(work, results, strict=True))
        mean, worst = logprob_gap(folder, work[:4:2])
    tokens = sum(len(r.output_ids) for r in results)
    results_file.emit(args.record, "bench_vl", {"model": args.model, "requests": len(work), "image_requests": args.requests,
                      "equal_to_hf_generate": f"{same}/{len(work)}", "engine_tok_s": round(tokens / seconds, 1),
                      "logprob_mean_abs_diff": mean, "logprob_max_abs_diff": worst})


if __name__ == "__main__":
    main()
