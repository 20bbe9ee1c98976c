"""The GPU half of tools/gpu_check.sh: an FSDP2 train step, a bucketed weight sync and a few GRPO steps
of a Qwen2-shaped model with random weights, in one process (the in-process path: trainer + embedded
engine + in-process weight transport; no Ray).

    python tools/gpu_check.py                      # CUDA: qwen2-0.5b-shape in bf16
    python tools/gpu_check.py --model builtin:tiny-qwen2 --device cpu --steps 2   # CPU smoke run

Prints per GRPO step: generation tokens/s, train step time, sync GB/s, and the logprob mismatch
between the engine's behaviour logprobs and the trainer's recomputation of the same tokens under
the same weights (bf16 on CUDA). Ends with one JSON line. Every part has a deadline so the whole
script stays inside its time budget by construction; a part that overruns or fails is reported,
and the next part still runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import socket
import sys
import time

import torch
import torch.distributed as dist


def log(message: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {message}", flush=True)


def init_group(device: str) -> None:
    """A one-rank process group, so the trainer's FSDP2 path (DTensor weights, collectives) runs."""
    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1)


def fsdp_trainer(folder, lr: float, token_budget: int):
    """The flowrl Trainer with FSDP2 forced on over a 1-rank mesh.

    Trainer shards only when world_size > 1; the check machine has one GPU and NCCL refuses two ranks
    on one device, so the 1-rank mesh is the way to run fully_shard + bf16 MixedPrecisionPolicy here.
    """
    from flowrl_operators.training.trainer import Trainer, TrainerConfig, lr_factor

    trainer = Trainer(folder, TrainerConfig(lr=lr, micro_batch_tokens=token_budget, grad_clip=1.0))
    trainer.sharded = True
    trainer._shard()  # private: see the docstring (ask the training helper for a config switch)
    config = trainer.config
    trainer.optimizer = torch.optim.AdamW(trainer.model.parameters(), lr=config.lr, betas=config.betas,
                                          eps=config.eps, weight_decay=config.weight_decay)
    trainer.scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, lambda s: lr_factor(s, config))
    return trainer


def digits_prompt(rng: random.Random) -> tuple[str, str]:
    digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(3, 6)))
    return f"{digits}>", digits[::-1]


def reward(answer: str, target: str) -> float:
    answer = answer.strip()
    return sum(a == b for a, b in zip(answer, target, strict=False)) / max(len(target), len(answer), 1)


def sync(loop, trainer, engine, version: int, bucket_mb: float, dtype) -> tuple[float, float]:
    """Stream the trainer's weights into the engine in buckets; returns (bytes, seconds)."""
    total = 0
    start = time.perf_counter()

    def buckets():
        nonlocal total
        for bucket in trainer.named_weights(int(bucket_mb * 2**20), dtype=dtype):
            total += sum(t.numel() * t.element_size() for _, t in bucket)
            yield bucket

    loop.run_until_complete(engine.update_weights(buckets(), version))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return total, time.perf_counter() - start


def mismatch(trainer, batch) -> dict[str, float]:
    """Engine behaviour logprobs vs the trainer's logprobs of the same tokens under the same weights."""
    with torch.no_grad():
        trainer_lp = trainer.compute_logprobs(batch).float().cpu()
    mask = batch.loss_mask.bool()
    diff = (trainer_lp - batch.behaviour_logprobs)[mask]
    ratio = torch.exp(trainer_lp[mask] - batch.behaviour_logprobs[mask])
    return {"logprob_mean_abs_diff": diff.abs().mean().item(), "logprob_max_abs_diff": diff.abs().max().item(),
            "ratio_mean_abs_dev": (ratio - 1).abs().mean().item()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:qwen2-0.5b-shape")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--bucket-mb", type=float, default=256.0)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--budget-s", type=float, default=330.0, help="stop starting new parts after this")
    args = parser.parse_args(argv)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device == "cuda" and not torch.cuda.is_available():
        log("SKIPPED: --device cuda but torch sees no CUDA device")
        return 0
    torch.set_num_threads(1 if device == "cpu" else min(8, os.cpu_count() or 1))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    started = time.perf_counter()
    summary: dict = {"device": device, "model": args.model, "failures": []}
    if device == "cuda":
        summary["gpu"] = torch.cuda.get_device_name(0)

    from flowrl.data.trajectory import Trajectory
    from flowrl_operators.engine.embedded.engine import EmbeddedEngine
    from flowrl_operators.inference import GenerateRequest, SamplingParams
    from flowrl_operators.models import load_tokenizer, resolve_model
    from flowrl_operators.training.advantages import AdvantageConfig, compute_advantages
    from flowrl_operators.training.batch import pack
    from flowrl_operators.training.losses import LossConfig, policy_loss

    t = time.perf_counter()
    folder = resolve_model(args.model)  # builds the random-weight checkpoint once (cached)
    tokenizer = load_tokenizer(folder)
    summary["model_build_s"] = round(time.perf_counter() - t, 1)
    log(f"model {args.model} ready in {summary['model_build_s']} s at {folder}")

    init_group(device)
    t = time.perf_counter()
    trainer = fsdp_trainer(folder, args.lr, token_budget=16384)
    params = sum(p.numel() for p in trainer.model.parameters())
    summary["parameters_m"] = round(params / 1e6, 1)
    summary["fsdp2"] = type(next(trainer.model.parameters())).__name__ == "DTensor"
    if not summary["fsdp2"]:
        summary["failures"].append("the trainer's parameters are not DTensors: FSDP2 did not shard the model")
    log(f"FSDP2 trainer on {device}: {params / 1e6:.1f}M parameters, bf16={trainer.bf16}, "
        f"{time.perf_counter() - t:.1f} s")
    engine_dtype = "bfloat16" if device == "cuda" else "float32"
    engine = EmbeddedEngine(folder, max_slots=args.prompts * args.group, max_context=256, dtype=engine_dtype,
                            device=device)
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    wire_dtype = torch.bfloat16 if device == "cuda" else None

    # 1. A bucketed weight sync from the (sharded) trainer into the engine, before any training, so
    #    both sides start from the same weights (the engine loaded the checkpoint in its own dtype).
    nbytes, seconds = sync(loop, trainer, engine, 0, args.bucket_mb, wire_dtype)
    summary["sync_gb_per_s"] = round(nbytes / seconds / 1e9, 2)
    summary["sync_gb"] = round(nbytes / 1e9, 3)
    log(f"bucketed weight sync: {nbytes / 1e9:.3f} GB in {seconds:.2f} s = {nbytes / seconds / 1e9:.2f} GB/s")

    rng = random.Random(0)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens)
    steps = []
    for step in range(args.steps):
        if time.perf_counter() - started > args.budget_s:
            summary["failures"].append(f"time budget {args.budget_s} s reached before GRPO step {step}")
            log(f"STOP: budget of {args.budget_s} s reached; skipping the remaining GRPO steps")
            break
        record: dict = {"step": step}
        tasks = [digits_prompt(rng) for _ in range(args.prompts)]
        requests = []
        for i, (prompt, _) in enumerate(tasks):
            ids = tokenizer.encode(prompt, add_special_tokens=False)
            for j in range(args.group):
                requests.append((i, ids, GenerateRequest(request_id=f"{step}/{i}/{j}", input_ids=ids,
                                                         sampling=sampling)))
        t = time.perf_counter()
        results = loop.run_until_complete(asyncio.gather(*(engine.generate(r) for _, _, r in requests)))
        generate_s = time.perf_counter() - t
        tokens = sum(len(r.output_ids) for r in results)
        record["tokens_per_s"] = round(tokens / generate_s, 1)
        trajectories = []
        for (i, ids, request), result in zip(requests, results, strict=True):
            if result.error or not result.output_ids:
                continue
            text = tokenizer.decode(result.output_ids, skip_special_tokens=True)
            trajectories.append(Trajectory(
                id=request.request_id, group_id=str(i), sample_id=str(i), prompt_ids=ids,
                response_ids=result.output_ids, loss_mask=[1] * len(result.output_ids),
                behaviour_logprobs=result.logprobs, versions=result.versions, reward=reward(text, tasks[i][1]),
                finish_reason=result.finish_reason, step=step))
        record["reward"] = round(sum(t.reward for t in trajectories) / len(trajectories), 4)
        batch = pack(trajectories)
        compute_advantages(batch, AdvantageConfig())
        record.update({k: round(v, 5) for k, v in mismatch(trainer, batch).items()})
        t = time.perf_counter()
        metrics = trainer.forward_backward(batch, policy_loss(LossConfig())) | trainer.step()
        if device == "cuda":
            torch.cuda.synchronize()
        record["step_s"] = round(time.perf_counter() - t, 3)
        record["loss_finite"] = math.isfinite(metrics["loss"]) and metrics["skipped"] == 0.0
        nbytes, seconds = sync(loop, trainer, engine, step + 1, args.bucket_mb, wire_dtype)
        record["sync_gb_per_s"] = round(nbytes / seconds / 1e9, 2)
        record["engine_version"] = engine.version
        if not record["loss_finite"]:
            summary["failures"].append(f"GRPO step {step}: loss {metrics['loss']} skipped={metrics['skipped']}")
        steps.append(record)
        log(f"GRPO step {step}: {tokens} tokens at {record['tokens_per_s']:.0f} tok/s, reward {record['reward']:.3f}, "
            f"train step {record['step_s']:.2f} s, sync {record['sync_gb_per_s']:.2f} GB/s, "
            f"logprob |engine - trainer| mean {record['logprob_mean_abs_diff']:.4f} "
            f"max {record['logprob_max_abs_diff']:.3f}")
    summary["grpo_steps"] = steps
    if steps:
        later = steps[1:] or steps  # the first step includes compilation / allocator warm-up
        summary["tokens_per_s"] = round(sum(s["tokens_per_s"] for s in later) / len(later), 1)
        summary["step_s"] = round(sum(s["step_s"] for s in later) / len(later), 3)
        summary["logprob_mean_abs_diff"] = steps[0]["logprob_mean_abs_diff"]
    loop.run_until_complete(engine.close())
    loop.close()
    dist.barrier()
    dist.destroy_process_group()
    summary["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(summary), flush=True)
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
