"""The quickstart's recipe as one hand-written loop: the baseline `tools/bench_e2e.py` compares flowrl to.

    python tools/hand_grpo.py [--seed 0] [--warmup-steps 650] [--grpo-seconds 250] [--out evals.jsonl]

Same model (builtin:tiny-qwen2), tasks (copy digits on the reversal prompts, then reverse them),
held-out eval prompts, group 8 x 16 prompts, lr 1e-3, grad clip 1, token-mean loss, entropy bonus
0.01, per-token credit (`token_credit`, the quickstart's `position_rewards` values) normalised
against all token rewards of the group (flowrl's grpo with gamma 0).
None of flowrl's runtime, engine or trainer: Hugging Face `generate` samples, one forward and
backward per step (on-policy, so the PPO ratio is 1 and the loss is the plain policy gradient).
Every `--eval-every` steps a greedy evaluation on 64 held-out prompts is appended to `--out` as
{"step", "samples" (prompt groups trained on), "time", "eval_reward"}, time from the warm-up's start.
Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from flowrl_operators.models import load_hf_model, load_tokenizer
from flowrl_operators.tasks.digits import copy_digits, positions_correct, reverse_digits, token_credit

MODEL = "builtin:tiny-qwen2"
PROMPTS, GROUP = 16, 8  # a GRPO step: 16 prompts, 8 samples each
WARMUP_BATCH = 64  # fresh copy examples per warm-up step
EVAL_SAMPLES = 64  # held-out prompts per greedy evaluation


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup-steps", type=int, default=650)
    p.add_argument("--grpo-seconds", type=float, default=250)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    tok, model = load_tokenizer(MODEL), load_hf_model(MODEL)
    started = time.time()  # like flowrl's phase clocks: from the warm-up's start, model loaded
    eos, pad = tok.eos_token_id, tok.pad_token_id
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    reverse, copy = reverse_digits(seed=a.seed), copy_digits(seed=a.seed, marker=">")  # copy on reversal prompts
    held_out = [reverse.eval_sample(i) for i in range(EVAL_SAMPLES)]

    def right_padded(rows: list[tuple[list[int], list[int]]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(prompt, response) rows -> ids, attention mask, response mask of the predicted tokens."""
        width = max(len(p) + len(r) for p, r in rows)
        ids = torch.full((len(rows), width), pad)
        mask, loss_mask = torch.zeros_like(ids), torch.zeros(len(rows), width - 1)
        for i, (prompt, response) in enumerate(rows):
            ids[i, : len(prompt) + len(response)] = torch.tensor(prompt + response)
            mask[i, : len(prompt) + len(response)] = 1
            loss_mask[i, len(prompt) - 1 : len(prompt) + len(response) - 1] = 1
        return ids, mask, loss_mask

    def token_logprobs(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logprob of each next token and the entropy of each position's distribution."""
        logprobs = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits[:, :-1].float(), -1)
        return logprobs.gather(-1, ids[:, 1:, None])[..., 0], -(logprobs.exp() * logprobs).sum(-1)

    @torch.no_grad()
    def sample(prompts: list[str], n: int, greedy: bool = False) -> list[tuple[list[int], list[int]]]:
        encoded = [tok.encode(p) for p in prompts for _ in range(n)]
        width = max(len(e) for e in encoded)
        ids = torch.full((len(encoded), width), pad)
        mask = torch.zeros_like(ids)
        for i, e in enumerate(encoded):  # left-padded for generate
            ids[i, width - len(e):], mask[i, width - len(e):] = torch.tensor(e), 1
        kwargs = {"do_sample": False} if greedy else {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, pad_token_id=pad,
                             eos_token_id=eos, **kwargs)
        rows = []
        for i, e in enumerate(encoded):
            response = out[i, width:].tolist()
            rows.append((e, response[: response.index(eos) + 1] if eos in response else response))
        return rows

    def text(response: list[int]) -> str:
        return tok.decode([t for t in response if t != eos], skip_special_tokens=True)

    def evaluate() -> float:
        model.eval()
        rows = sample([s["prompt"] for s in held_out], 1, greedy=True)
        model.train()
        return sum(positions_correct(text(r), s["target"]) for (_, r), s in zip(rows, held_out, strict=True)) / len(rows)

    def update(loss: torch.Tensor) -> None:
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    for step in range(a.warmup_steps):  # supervised copy warm-up, fresh examples each step
        samples = [copy.sample(step, i) for i in range(WARMUP_BATCH)]
        ids, mask, loss_mask = right_padded([(tok.encode(s["prompt"]), tok.encode(s["target"]) + [eos]) for s in samples])
        update(-(token_logprobs(ids, mask)[0] * loss_mask).sum() / loss_mask.sum())
    warmup_s = time.time() - started
    out = open(a.out, "w") if a.out else None
    grpo_started, step, best = time.time(), 0, 0.0
    while time.time() - grpo_started < a.grpo_seconds:
        if step % a.eval_every == 0:
            record = {"step": step, "samples": step * PROMPTS, "time": round(time.time() - started, 2),
                      "eval_reward": evaluate()}
            best = max(best, record["eval_reward"])
            if out:
                print(json.dumps(record), file=out, flush=True)
        samples = [reverse.sample(step, i) for i in range(PROMPTS)]
        rows = sample([s["prompt"] for s in samples], GROUP)
        ids, mask, loss_mask = right_padded(rows)
        rewards = torch.zeros_like(loss_mask)  # token rewards on the target-aligned columns
        for i, (prompt, response) in enumerate(rows):
            credit = token_credit(text(response), samples[i // GROUP]["target"], len(response), response[-1] == eos)
            rewards[i, len(prompt) - 1 : len(prompt) - 1 + len(credit)] = torch.tensor(credit)
        advantages = torch.zeros_like(rewards)
        for g in range(PROMPTS):  # each token's reward against all token rewards of its group
            rows_g = slice(g * GROUP, (g + 1) * GROUP)
            values = rewards[rows_g][loss_mask[rows_g] > 0]
            advantages[rows_g] = (rewards[rows_g] - values.mean()) / (values.std() + 1e-6) * loss_mask[rows_g]
        logprobs, entropy = token_logprobs(ids, mask)
        update(-((logprobs * advantages + 0.01 * entropy) * loss_mask).sum() / loss_mask.sum())
        step += 1
    if out:
        out.close()
    grpo_s = time.time() - grpo_started
    print(json.dumps({"warmup_s": round(warmup_s, 1), "grpo_steps": step, "grpo_s_per_step": round(grpo_s / max(step, 1), 4),
                      "best_eval": round(best, 4)}))


if __name__ == "__main__":
    main()
