"""The reward node's own cost: scoring one quickstart step (16 groups of 8 digit answers) with the
per-token `position_rewards`, side by side:

- `node`: the reward node as it runs a sync function (one pool thread per group, calls in order);
- `per_call_hop`: one pool-thread hop per trajectory, each under its own `wait_for` (what the node
  did before; rebuilt here as the baseline);
- `direct`: the function called in a plain loop (the floor).

    flock /tmp/flowrl-bench.lock /work/venv/bin/python tools/bench_reward.py

The last line of output is one JSON object of milliseconds per step (median of `--repeats`).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import statistics
import time

import msgspec
import results_file

from flowrl.data.trajectory import Group, Trajectory, Turn
from flowrl.operator import OperatorContext
from flowrl_operators.config import RewardConfig
from flowrl_operators.reward import Reward
from flowrl_operators.tasks.digits import position_rewards

FN = "flowrl_operators.tasks.digits:position_rewards"


def step_groups(groups: int, size: int) -> list[Group]:
    def trajectory(g: int, i: int) -> Trajectory:
        return Trajectory(id=f"{g}/{i}", group_id=str(g), sample_id=str(g), prompt_ids=[1] * 7,
                          response_ids=[5, 6, 7, 8, 2], loss_mask=[1] * 5, behaviour_logprobs=[-1.0] * 5,
                          versions=[0] * 5, turns=[Turn(0, 5)],
                          metadata={"text": "4321", "sample": {"target": "4321"}})

    return [Group(id=str(g), step=0, trajectories=[trajectory(g, i) for i in range(size)]) for g in range(groups)]


async def timed(run, groups: int, size: int) -> float:
    batch = step_groups(groups, size)
    start = time.perf_counter()
    await run(batch)
    return (time.perf_counter() - start) * 1e3


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--size", type=int, default=8)
    p.add_argument("--repeats", type=int, default=30)
    results_file.add_record_flag(p)
    a = p.parse_args()
    node = Reward(msgspec.convert({"fn": FN}, RewardConfig), OperatorContext(node="score"))
    await node.setup()
    pool = concurrent.futures.ThreadPoolExecutor(16)
    loop = asyncio.get_running_loop()

    async def by_node(batch: list[Group]) -> None:
        await asyncio.gather(*(node.process({"trajectories": g}) for g in batch))

    async def per_call_hop(batch: list[Group]) -> None:
        async def one(t: Trajectory) -> None:
            future = loop.run_in_executor(pool, position_rewards, t)
            await asyncio.wait_for(asyncio.shield(future), 30.0)

        await asyncio.gather(*(one(t) for g in batch for t in g.trajectories))

    async def direct(batch: list[Group]) -> None:
        for g in batch:
            for t in g.trajectories:
                position_rewards(t)

    results = {}
    for name, run in [("node", by_node), ("per_call_hop", per_call_hop), ("direct", direct)]:
        for _ in range(3):  # warm the threads
            await timed(run, a.groups, a.size)
        results[name] = statistics.median([await timed(run, a.groups, a.size) for _ in range(a.repeats)])
    await node.close()
    pool.shutdown()
    calls = a.groups * a.size
    for name, ms in results.items():
        print(f"{name:>13}: {ms:6.2f} ms per step of {calls} calls ({ms * 1e3 / calls:5.1f} us a call)")
    print(f"per_call_hop / node: {results['per_call_hop'] / results['node']:.1f}x")
    results_file.emit(a.record, "bench_reward", {f"{k}_ms": round(v, 3) for k, v in results.items()}
                     | {"calls": calls, "per_call_hop_over_node": round(results["per_call_hop"] / results["node"], 2)})


if __name__ == "__main__":
    asyncio.run(main())
