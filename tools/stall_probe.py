"""Where a digit-reversal policy is stuck: per answer position, how often its greedy answer is right,
and at each wrong position how likely the right digit is to be sampled.

    python tools/stall_probe.py EXPORT_DIR [--temperatures 1,1.5] [--group 8] [--prompts 64]

EXPORT_DIR is a run's exported policy (`RUN/phases/<i>-grpo/export/learner`). On the held-out
prompts of `builtin:reverse_digits` (the quickstart's eval set) it prints the greedy eval, the right
answers per (answer length, position), a few wrong answers, and, over the wrong positions, the
probability of the right digit given the greedy prefix at each temperature and the chance that a
group of `--group` samples contains it at least once (what GRPO needs to reinforce it). The last
line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from flowrl_operators.tasks.digits import positions_correct, reverse_digits


def probe(path: str, temperatures: list[float], prompts: int) -> tuple[float, dict, list, list]:
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    source, score = reverse_digits(), 0.0
    right: dict[tuple[int, int], list[int]] = defaultdict(lambda: [0, 0])
    wrong_answers, chances = [], []
    for index in range(prompts):
        sample = source.eval_sample(index)
        ids = tokenizer(sample["prompt"], return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.eos_token_id)
            logits = model(out).logits[0]
        answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
        target = sample["target"]
        score += positions_correct(answer, target)
        for k, digit in enumerate(target):
            hit = k < len(answer) and answer[k] == digit
            right[(len(target), k)][0] += hit
            right[(len(target), k)][1] += 1
            if k < len(answer) and not hit:  # the right digit's probability after the greedy prefix
                row = logits[ids.shape[1] + k - 1]
                token = tokenizer.convert_tokens_to_ids(digit)
                chances.append([torch.softmax(row / t, -1)[token].item() for t in temperatures])
        if answer != target:
            wrong_answers.append((sample["prompt"], target, answer))
    return score / prompts, right, wrong_answers, chances


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export")
    parser.add_argument("--temperatures", type=lambda v: [float(x) for x in v.split(",")], default=[1.0, 1.5])
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    score, right, wrong_answers, chances = probe(args.export, args.temperatures, args.prompts)
    print(f"greedy eval {score:.3f}; right answers per position, by answer length:")
    for length in sorted({n for n, _ in right}):
        print(f"  {length} digits: " + " ".join(f"{right[(length, k)][0]}/{right[(length, k)][1]}" for k in range(length)))
    for prompt, target, answer in wrong_answers[:6]:
        print(f"  {prompt} -> {answer!r} (right: {target})")
    out = {"eval": round(score, 4), "wrong_positions": len(chances)}
    for j, t in enumerate(args.temperatures):
        p = [c[j] for c in chances]
        if p:
            in_group = statistics.mean(1 - (1 - x) ** args.group for x in p)
            print(f"temperature {t}: the right digit's probability at a wrong position: median {statistics.median(p):.2e}, "
                  f"mean {statistics.mean(p):.2e}; in a group of {args.group}: {in_group:.3f}")
            out[f"median_p_right_t{t}"] = statistics.median(p)
            out[f"p_in_group_t{t}"] = round(in_group, 4)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
