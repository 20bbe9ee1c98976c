"""Periodic greedy evaluation on held-out samples, declared as `data.eval` in the spec:

    data: {source: builtin:reverse_digits, batch_size: 16, eval: {every: 5, samples: 64}}

The generate node runs it with its own engine whenever it has loaded a policy version that is a
multiple of `every`, once before training, and with the final policy (the run waits for that one):
one greedy episode per held-out sample (`source.eval_sample(i)`), scored by the task's reward (`source.reward`, or `data.eval.options.reward:
module:attr`). Each evaluation appends a row to `RUN_DIR/eval.jsonl`:
`{"version", "eval_reward", "samples", "time", "seconds"}` with `time` in seconds since the run's
origin (when the evaluation ended) and `seconds` the time the evaluation took.

A sync reward runs on a daemon thread (flowrl_operators.threads), never on the event loop; a call
that takes over `REWARD_TIMEOUT_S`, or a value that is not a finite number
(flowrl_operators.reward_values), fails the evaluation with a message, as a raising reward does.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import time
from pathlib import Path
from typing import Any

from flowrl.data.source import load_source
from flowrl_operators.reward_values import as_reward
from flowrl_operators.threads import DaemonExecutor, call_in_thread
from flowrl_operators.workflows.base import is_async_callable

REWARD_TIMEOUT_S = 60.0  # one eval reward call


class Evaluator:
    def __init__(self, data: dict[str, Any], seed: int, run_dir: Path | None, tokenizer: Any = None,
                 final: int | None = None) -> None:
        spec = data["eval"]
        self.final = final  # the run's last policy version: evaluated whether or not `every` divides it
        self.every, self.samples = int(spec.get("every", 10)), int(spec.get("samples", 64))
        options = dict(spec.get("options") or {})
        reward = options.pop("reward", None)
        options = {**(data.get("options") or {}), **options}
        self.source = load_source({**data, "source": spec.get("source") or data["source"], "options": options},
                                  seed, tokenizer=tokenizer)
        if not callable(getattr(self.source, "eval_sample", None)):
            raise ValueError(f"data.eval needs a source with eval_sample(index) (held-out samples); "
                             f"{type(self.source).__name__} has none: set data.eval.source to one that has")
        self.source.eval_sample(self.samples - 1)  # a source with fewer held-out samples says so now
        if reward is not None:
            from flowrl_operators.reward import load_reward

            self.reward = load_reward(reward)
        elif callable(getattr(self.source, "reward", None)):
            self.reward = self.source.reward
        else:
            raise ValueError("data.eval needs a reward: the source has no reward(trajectory); "
                             "set data.eval.options.reward: module:attr")
        self.run_dir = run_dir
        self.origin = time.time()
        if run_dir is not None and (Path(run_dir) / "meta.json").exists():
            self.origin = json.loads((Path(run_dir) / "meta.json").read_text())["origin"]
        self.done: set[int] = set()
        # The held-out samples, drawn once: drawing them again for every evaluation cost the
        # quickstart ~30 ms each time (its eval runs every 5 steps).
        self.held_out: list[dict[str, Any]] = []
        self.thread = DaemonExecutor(1, "flowrl-eval")

    def due(self, version: int) -> bool:
        return (version % self.every == 0 or version == self.final) and version not in self.done

    async def run(self, generate: Any, version: int) -> dict[str, float]:
        """Greedy episodes of every held-out sample through `generate` (a Generate operator)."""
        self.done.add(version)
        started = time.time()
        if not self.held_out:
            self.held_out = [self.source.eval_sample(i) for i in range(self.samples)]
        groups = await asyncio.gather(*(
            generate.generate(sample, step=-1, sample_id=f"eval{version}:{i}", greedy=True)
            for i, sample in enumerate(self.held_out)))
        scores = []
        for group in groups:
            trajectories = group.trajectories if group is not None else []
            value = 0.0  # a rejected sample scores zero
            if trajectories:
                value = await self._score(trajectories[0])
            scores.append(value)
        row = {"version": version, "eval_reward": sum(scores) / len(scores), "samples": len(scores),
               "time": round(time.time() - self.origin, 3), "seconds": round(time.time() - started, 3)}
        if self.run_dir is not None:
            with open(Path(self.run_dir) / "eval.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
        return row

    async def _score(self, trajectory: Any) -> float:
        if is_async_callable(self.reward):
            call = self.reward(trajectory)
        else:
            call = call_in_thread(self.thread, self.reward, trajectory)
        try:
            value = await asyncio.wait_for(call, REWARD_TIMEOUT_S)
            if inspect.isawaitable(value):
                value = await asyncio.wait_for(value, REWARD_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise TimeoutError(f"the eval reward took over {REWARD_TIMEOUT_S} s on {trajectory.id}") from None
        return as_reward(value, f"the eval reward of {trajectory.id}")
