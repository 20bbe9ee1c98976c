"""Peak memory of a real GRPO run of a SmolLM2-135M-shaped model: full fine-tune and LoRA.

    python tools/bench_memory.py [--model PATH] [--steps 2] [--configs full,lora] [--max-new-tokens 48]

Without `--model`, builds a model with SmolLM2-135M-Instruct's shape (LlamaConfig: hidden 576, 30
layers, 9 heads, 3 kv heads, intermediate 1536, vocabulary 49152, tied embeddings,
max_position_embeddings 8192) and random weights, with the built-in character tokenizer, into
$FLOWRL_CACHE (default ~/.cache/flowrl)/bench-smollm2-135m-shape: nothing is downloaded. `--model`
takes a real checkpoint folder instead.

Each configuration runs in a process of its own: `flowrl run` of a generate -> reward -> train ->
sync graph (the project's embedded engine, FSDP2 trainer and in-process transport, in-process
executor; fp32 on the CPU) for `--steps` GRPO steps of 2 prompts x group 8 = 16 trajectories of
about 8 prompt + `--max-new-tokens` tokens, exported at the end as every run is. Its peak resident
memory is the kernel's high-water mark (`VmHWM` in /proc/self/status), read by the process itself
after the run; the model's fp32 size is printed next to it. The targets
from issue #24: under 4 GB full, under 2.5 GB with LoRA. Configurations (`--configs`): `full` and
`lora` (r 8, alpha 16, every linear layer) with `gradient_checkpointing: true`, the default pair;
`full_plain` and `lora_plain` without it. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import results_file

from flowrl.records import RunDir

ROOT = Path(__file__).resolve().parents[1]
SHAPE = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
             intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=8192,
             rope_theta=100000.0, rms_norm_eps=1e-5)
LORA = {"r": 8, "alpha": 16.0}  # on every linear layer of the decoder (the default target_modules)
CONFIGS = {  # the train node's keys per configuration; the defaults measured are full and lora
    "full": {"gradient_checkpointing": True},
    "lora": {"lora": LORA, "gradient_checkpointing": True},
    "full_plain": {},
    "lora_plain": {"lora": LORA},
}
TARGETS_GB = {"full": 4.0, "lora": 2.5, "full_plain": 4.0, "lora_plain": 2.5}


def status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def build_model(folder: Path) -> None:
    """SmolLM2-135M's shape with random weights and the built-in tokenizer (ids beyond its 101
    tokens decode to nothing, which the reward scores as wrong)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from flowrl_operators.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = LlamaConfig(**SHAPE, bos_token_id=None, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    scratch = folder.parent / f".{folder.name}.tmp"
    model.save_pretrained(scratch)
    tokenizer.save_pretrained(scratch)
    scratch.rename(folder)


def spec(model: str, steps: int, max_new_tokens: int, train: dict) -> dict:
    learner = {"op": "train", "advantage": {"estimator": "grpo"}, "loss": {"kind": "ppo_clip"},
               "optim": {"lr": 1.0e-5}} | train
    return {
        "flowrl": 1, "name": "bench-memory", "model": {"path": model},
        "data": {"source": "builtin:reverse_digits", "batch_size": 2},
        "cluster": {"cpus": 2}, "run": {"steps": steps, "executor": "inprocess", "seed": 0},
        "nodes": {
            "rollout": {"op": "generate", "group_size": 8, "engine": {"threads": 2},
                        "sampling": {"temperature": 1.0, "max_new_tokens": max_new_tokens}},
            "score": {"op": "reward", "fn": "builtin:reverse_digits"},
            "learner": learner,
            "publish": {"op": "sync"},
        },
        "edges": ["rollout -> score", "score -> learner", "learner -> publish",
                  {"publish -> rollout": {"kind": "weights"}}],
    }


def child(args: argparse.Namespace) -> None:
    """One configuration, in this process: the run, then its figures as one JSON line."""
    import yaml

    from flowrl.launch import start

    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / "spec.yaml"
        file.write_text(yaml.safe_dump(spec(args.model, args.steps, args.max_new_tokens, CONFIGS[args.child])))
        started = time.perf_counter()
        start(str(file), [], run_dir=Path(tmp) / "run", progress=False)
        seconds = time.perf_counter() - started
        rows = list(RunDir(Path(tmp) / "run").metrics())
    train = [r.train for r in rows]
    print(json.dumps({
        "config": args.child, "train_keys": CONFIGS[args.child], "peak_rss_gb": status_kb("VmHWM") / 2**20,
        "steps": len(train), "seconds": seconds,
        "trajectories_per_step": sum(t["sequences"] for t in train) / max(len(train), 1),
        "model_tokens_per_trajectory": sum(t["tokens"] for t in train) / max(sum(t["sequences"] for t in train), 1),
    }))


def model_bytes(folder: str) -> int:
    from safetensors import safe_open

    total = 0
    for file in Path(folder).glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has keys(), not iteration
                t = f.get_slice(name)
                total += 4 * math.prod(t.get_shape())
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a checkpoint folder (default: SmolLM2-135M's shape, random weights)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--configs", default="full,lora")
    parser.add_argument("--child", choices=sorted(CONFIGS), help=argparse.SUPPRESS)
    results_file.add_record_flag(parser)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    if args.model is None:
        cache = Path(os.environ.get("FLOWRL_CACHE", Path.home() / ".cache" / "flowrl"))
        folder = cache / "bench-smollm2-135m-shape"
        if not (folder / "config.json").exists():
            folder.parent.mkdir(parents=True, exist_ok=True)
            build_model(folder)
        args.model = str(folder)
    print(f"model {args.model}: {model_bytes(args.model) / 2**30:.2f} GB of fp32 weights; {args.steps} GRPO steps "
          f"of 16 trajectories (8 prompt + {args.max_new_tokens} new tokens at most) per configuration")
    env = dict(os.environ, OMP_NUM_THREADS="2", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    results = {}
    for name in args.configs.split(","):
        command = [sys.executable, __file__, "--child", name, "--model", args.model, "--steps", str(args.steps),
                   "--max-new-tokens", str(args.max_new_tokens)]
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            sys.exit(f"configuration {name} failed:\n{done.stderr[-3000:]}")
        figures = json.loads(done.stdout.strip().splitlines()[-1])
        results[name] = figures
        print(f"{name:10s} peak RSS {figures['peak_rss_gb']:.2f} GB (target < {TARGETS_GB[name]} GB; train keys "
              f"{json.dumps(CONFIGS[name])}), {figures['steps']} steps of "
              f"{figures['trajectories_per_step']:.0f} trajectories, {figures['model_tokens_per_trajectory']:.1f} "
              f"new tokens each, {figures['seconds']:.0f} s")
    results_file.emit(args.record, "bench_memory", {f"{name}_peak_rss_gb": round(r["peak_rss_gb"], 3) for name, r in results.items()}
                     | {f"{name}_under_target": r["peak_rss_gb"] < TARGETS_GB[name] for name, r in results.items()}
                     | {"steps": args.steps, "max_new_tokens": args.max_new_tokens, "model": args.model})


if __name__ == "__main__":
    main()
