"""A quickstart GRPO step's two halves, flowrl's against the plain loop's (tools/hand_grpo.py), in CPU seconds.

    OMP_NUM_THREADS=1 python tools/bench_step.py [--repeats 3] [--steps 5]

One process, one torch thread, builtin:tiny-qwen2, the quickstart's shape: 16 prompts of 8 tokens,
8 samples each, 8 new tokens at temperature 1.
- generate: the embedded engine (128 requests, 16 groups sharing a prompt, one seed each) against
  Hugging Face `generate` of the same 128 rows (what the plain loop calls);
- train: the train node's `Learner.train` (pack, GRPO advantages, ppo_clip with the entropy bonus,
  the optimizer step, the published weights) against the plain loop's step (one padded forward,
  log_softmax, gather, entropy, backward, clip, AdamW) on the same trajectories.
Figures are CPU seconds of this process per step (`time.process_time`: the engine's own thread
included), median of `--steps` steps, for each of `--repeats` alternating rounds: on a machine that
other work keeps busy, wall time stretches with the load and CPU time much less. The last line is
one JSON object with each median and the ratios flowrl / plain.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import results_file
import torch

from flowrl.data.trajectory import Trajectory
from flowrl_operators.config import OptimConfig
from flowrl_operators.engine.embedded.engine import EmbeddedEngine
from flowrl_operators.inference import GenerateRequest, SamplingParams
from flowrl_operators.models import load_hf_model, load_tokenizer
from flowrl_operators.train import Learner, trainer_config
from flowrl_operators.training.objective import advantage_config, loss_config

MODEL = "builtin:tiny-qwen2"
PROMPTS, GROUP, NEW = 16, 8, 8


def prompts(g: torch.Generator) -> list[list[int]]:
    return [torch.randint(5, 60, (8,), generator=g).tolist() for _ in range(PROMPTS)]


def trajectories(g: torch.Generator) -> list[Trajectory]:
    out = []
    for k, prompt in enumerate(prompts(g)):
        for i in range(GROUP):
            n = 5 + int(torch.randint(0, 4, (1,), generator=g))
            out.append(Trajectory(
                id=f"{k}.{i}", group_id=str(k), sample_id=str(k), prompt_ids=prompt,
                response_ids=torch.randint(5, 60, (n,), generator=g).tolist(), loss_mask=[1] * n,
                behaviour_logprobs=[-3.0] * n, versions=[0] * n,
                token_rewards=[float(torch.rand(1, generator=g) < 0.5) for _ in range(n)]))
    return out


class Plain:
    """The plain loop's model, sampler and update (tools/hand_grpo.py)."""

    def __init__(self) -> None:
        self.tok, self.model = load_tokenizer(MODEL), load_hf_model(MODEL)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3, weight_decay=0.0)

    @torch.no_grad()
    def generate(self, batch: list[list[int]]) -> None:
        ids = torch.tensor([p for p in batch for _ in range(GROUP)])
        self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                            do_sample=True, top_k=0, top_p=1.0, pad_token_id=self.tok.pad_token_id)

    def train(self, trajs: list[Trajectory]) -> None:
        width = max(len(t.prompt_ids) + len(t.response_ids) for t in trajs)
        ids = torch.zeros((len(trajs), width), dtype=torch.long)
        mask, loss_mask = torch.zeros_like(ids), torch.zeros(len(trajs), width - 1)
        advantages = torch.zeros(len(trajs), width - 1)
        for i, t in enumerate(trajs):
            p, n = len(t.prompt_ids), len(t.prompt_ids) + len(t.response_ids)
            ids[i, :n], mask[i, :n], loss_mask[i, p - 1 : n - 1] = torch.tensor(t.prompt_ids + t.response_ids), 1, 1
            advantages[i, p - 1 : n - 1] = torch.tensor(t.token_rewards) - 0.5
        logp = torch.log_softmax(self.model(input_ids=ids, attention_mask=mask).logits[:, :-1].float(), -1)
        logprobs, entropy = logp.gather(-1, ids[:, 1:, None])[..., 0], -(logp.exp() * logp).sum(-1)
        loss = -((logprobs * advantages + 0.01 * entropy) * loss_mask).sum() / loss_mask.sum()
        self.opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()


async def engine_generate(engine: EmbeddedEngine, batch: list[list[int]], step: int) -> None:
    requests = [GenerateRequest(request_id=f"{step}-{k}-{i}", input_ids=p, sampling=SamplingParams(
        temperature=1.0, max_new_tokens=NEW, ignore_eos=True, seed=step * 1000 + k * GROUP + i))
        for k, p in enumerate(batch) for i in range(GROUP)]
    await asyncio.gather(*(engine.generate(r) for r in requests))


def cpu_median(run, make, steps: int) -> float:
    times = []
    for _ in range(steps):
        data = make()
        start = time.process_time()
        run(data)
        times.append(time.process_time() - start)
    return statistics.median(times)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    results_file.add_record_flag(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    plain, engine = Plain(), EmbeddedEngine(MODEL, max_slots=PROMPTS * GROUP, threads=1)
    learner = Learner("fsdp2", MODEL, trainer_config(OptimConfig(lr=1e-3), 8192, 3, 1, 0),
                      loss_config({"kind": "ppo_clip", "clip_low": 0.2, "clip_high": 0.28, "entropy_coef": 0.01}),
                      advantage_config({"estimator": "grpo", "gamma": 0.0}), 1, True, True)
    counter = iter(range(1 << 30))
    loop = asyncio.get_running_loop()

    def flowrl_generate(batch: list[list[int]]) -> None:
        asyncio.run_coroutine_threadsafe(engine_generate(engine, batch, next(counter)), loop).result()

    figures: dict[str, list[float]] = {k: [] for k in ("flowrl_generate", "plain_generate", "flowrl_train", "plain_train")}
    sides = {"flowrl_generate": (flowrl_generate, lambda: prompts(g)), "plain_generate": (plain.generate, lambda: prompts(g)),
             "flowrl_train": (learner.train, lambda: trajectories(g)), "plain_train": (plain.train, lambda: trajectories(g))}
    for repeat in range(args.repeats + 1):  # the first round warms up
        for name, (run, make) in sides.items():
            seconds = await asyncio.to_thread(cpu_median, run, make, args.steps if repeat else 2)
            if repeat:
                figures[name].append(seconds)
        if repeat:
            print(f"round {repeat}: " + ", ".join(f"{k} {v[-1] * 1e3:.1f} ms" for k, v in figures.items()), flush=True)
    medians = {k: statistics.median(v) for k, v in figures.items()}
    ratios = {part: round(medians[f"flowrl_{part}"] / medians[f"plain_{part}"], 3) for part in ("generate", "train")}
    total = (medians["flowrl_generate"] + medians["flowrl_train"]) / (medians["plain_generate"] + medians["plain_train"])
    print(f"CPU per step, flowrl / plain: generate {ratios['generate']}, train {ratios['train']}, both {total:.3f}")
    results_file.emit(args.record, "bench_step", {f"{k}_cpu_ms": round(v * 1e3, 1) for k, v in medians.items()}
                     | {f"{part}_ratio": r for part, r in ratios.items()} | {"step_ratio": round(total, 3),
                        "repeats": args.repeats, "steps": args.steps})
    await engine.close()


if __name__ == "__main__":
    asyncio.run(main())
