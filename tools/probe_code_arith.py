"""Screening probe for pipelines/smollm2_code.yaml: how often a model's first reply to a code_arith
problem (train split) prints the right value, by sampling temperature, and the share of GRPO groups
that hold both a right and a wrong reply (the only groups GRPO learns from).

    python tools/probe_code_arith.py models/smollm2-135m-instruct [--prompts 12] [--group 8]
                                     [--temperatures 0.3,0.5,0.7] [--max-new-tokens 64] [--seed 5]
                                     [--sample-seed 0]

One reply per sample (the pipeline's agent may retry once after an error: not here), generated with
transformers' `generate` from the tokenizer's chat template; its code block runs in `python3 -I` with
a 5 s timeout (not the sandbox service: this measures the model, not the tool). The reward is the
task's: the right value written in the printed output. Prints one JSON line per temperature.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def printed(code: str) -> str:
    try:
        done = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=5)
    except subprocess.TimeoutExpired:
        return ""
    return done.stdout.replace(",", "")


def right(answer: str, output: str) -> bool:
    return re.search(rf"(?<![\d.-]){answer}(?!\d|\.\d)", output) is not None


def group_rewards(model, tokenizer, prompt: str, answer: str, args: argparse.Namespace, temperature: float) -> list[float]:
    import torch

    from flowrl_operators.tasks.code_arith import code_block

    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        return_tensors="pt")
    ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=True, temperature=temperature,
                             top_p=1.0, num_return_sequences=args.group, pad_token_id=tokenizer.eos_token_id)
    replies = [tokenizer.decode(o[ids.shape[1]:], skip_special_tokens=True) for o in out]
    return [float(right(answer, printed(code))) if (code := code_block(r)) else 0.0 for r in replies]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--temperatures", default="0.3,0.5,0.7")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=5, help="draws the problems")
    parser.add_argument("--sample-seed", type=int, default=0, help="seeds torch's sampling")
    args = parser.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from flowrl_operators.tasks.code_arith import code_arith

    torch.set_num_threads(1)
    torch.manual_seed(args.sample_seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    source, rng = code_arith(seed=args.seed, split="train"), random.Random(args.seed)
    problems = [source.make(rng, "train") for _ in range(args.prompts)]
    for temperature in (float(t) for t in args.temperatures.split(",")):
        start = time.time()
        groups = [group_rewards(model, tokenizer, p["prompt"], p["answer"], args, temperature) for p in problems]
        flat = [r for g in groups for r in g]
        print(json.dumps({"temperature": temperature, "prompts": args.prompts, "group": args.group,
                          "mean_reward": round(sum(flat) / len(flat), 3),
                          "informative_groups": round(sum(0 < sum(g) < len(g) for g in groups) / len(groups), 3),
                          "seconds": round(time.time() - start)}), flush=True)


if __name__ == "__main__":
    main()
