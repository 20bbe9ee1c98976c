"""Benchmark the runtime on a synthetic pipeline whose operators do real CPU work.

generate -> reward -> train -> sync -> generate (weights), in-process executor. Every operator
burns CPU with single-threaded numpy matrix products (which release the GIL, so stages overlap on
separate cores); generation time per sample is long-tailed (lognormal), train time is fixed per
step. Measured side by side in one process:

- hand loop: a plain `for` loop calling the same work functions in order (no runtime)
- sync:      the runtime with every edge sync (classic on-policy)
- async k:   the runtime with `reward -> train` async, max_staleness k (1: one-step-off; 4)

Figures: per-stage work time (from the hand loop), the ideal overlap bound (sum of stage times /
max stage time = the best possible speedup of perfect pipelining), throughputs, and the ratios
`async_vs_ideal` = the better async throughput / ideal throughput (ideal = 1 / max stage time per step) and
`overhead_vs_hand_loop` = sync runtime wall time / hand loop wall time. Each configuration runs
`--repeats` times and the fastest run counts (the machine is shared; the others are noise).

Placement (`--placement`): `pinned` (the default) binds the train work to a core of its own and
the rollout side's work (generate, reward, sync: one thread) to the other cores, as a cluster
gives the trainer devices of its own; the runtime's event loop, host code, is not pinned. `shared`
gives each stage a thread and lets the OS put any thread on any core, and then the stages' work
itself slows down from time-sharing the cores (a trace showed train 207 -> 249 ms a step for the
same work), which measures the OS scheduler more than the runtime. A scheduling check repeats the
configurations once with the same durations as sleeps, which need no core at all: what the
runtime's scheduling achieves by itself (`sleep_async_vs_ideal`, `sleep_overhead_vs_hand_loop`).
The last line is one JSON object.

    flock /tmp/flowrl-bench.lock /work/venv/bin/python tools/bench_runtime.py
"""

from __future__ import annotations

import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import asyncio  # noqa: E402
import hashlib  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from typing import Any, ClassVar  # noqa: E402

import msgspec  # noqa: E402
import numpy as np  # noqa: E402
import results_file  # noqa: E402

from flowrl.data.trajectory import Group, Trajectory  # noqa: E402
from flowrl.graph.plan import EdgePlan, NodePlan, Plan  # noqa: E402
from flowrl.operator import (  # noqa: E402
    POLICY,
    PROMPTS,
    TRAJECTORIES,
    WEIGHTS,
    Operator,
    Resources,
    TrainResult,
)

MATRIX = np.random.default_rng(0).standard_normal((192, 192)) / 192**0.5
# Generation ~160 ms a step against training's 250: all stages together need ~1.7 cores, so on
# 2 cores perfect overlap is physically possible. With gen_ms 30 (~240 ms a step) they needed
# 2.0 cores with nothing to spare; the trace then showed every stage's work inflated 30-170% by
# competing for the cores (train 229 -> 302 ms a step), which measures the OS scheduler, not us.
SETTINGS = {"gen_ms": 20.0, "tail_sigma": 0.8, "reward_ms": 2.0, "train_ms": 250.0, "sync_ms": 10.0}
UNITS_PER_MS = 1.0  # calibrated in main()
WORK = "cpu"  # "sleep" for the scheduling check: the same durations without competing for cores


# Placement, as a cluster gives the trainer devices of its own and the rollout side (engine,
# reward, weight loading) others: `pinned` runs the train work on one thread bound to the last core,
# and generate, reward and sync on one thread bound to the other cores; the runtime's event loop
# (host code) and the hand loop's caller are not pinned. `shared` gives each stage its own thread,
# and the OS puts any thread on any core.
PLACEMENT = "pinned"
_ALL_CORES = os.sched_getaffinity(0)
_POOLS: dict[str, ThreadPoolExecutor] = {}


def _cores(side: str) -> set[int]:
    cores = sorted(_ALL_CORES)
    return {cores[-1]} if side == "train" else set(cores[:-1]) or set(cores)


def pool(role: str) -> ThreadPoolExecutor:
    """The worker thread that runs `role`'s work (see PLACEMENT)."""
    side = role if PLACEMENT == "shared" else ("train" if role == "train" else "rollout")
    if side not in _POOLS:
        init = (lambda: os.sched_setaffinity(0, _cores(side))) if PLACEMENT == "pinned" else None
        _POOLS[side] = ThreadPoolExecutor(1, thread_name_prefix=f"bench-{side}", initializer=init)
    return _POOLS[side]


def call(role: str, fn: Any, *args: Any) -> Any:
    """Run `fn` on `role`'s worker thread and wait: the hand loop's way to the same cores."""
    return pool(role).submit(fn, *args).result()


async def on(role: str, fn: Any, *args: Any) -> Any:
    return await asyncio.get_running_loop().run_in_executor(pool(role), fn, *args)


def burn(ms: float) -> float:
    """About `ms` milliseconds of single-threaded CPU work."""
    if WORK == "sleep":
        time.sleep(ms / 1000)
        return 0.0
    x = MATRIX
    acc = 0.0
    for _ in range(max(1, round(ms * UNITS_PER_MS))):
        x = x @ MATRIX  # BLAS releases the GIL for the whole product: stages overlap on threads
        acc += float(x[0, 0])
    return acc


def gen_ms(sample_id: str) -> float:
    """Long-tailed generation time: lognormal around gen_ms, fixed by the sample id."""
    u = int(hashlib.sha256(sample_id.encode()).hexdigest()[:12], 16) / 16**12
    z = math.sqrt(2) * _erfinv(2 * min(max(u, 1e-9), 1 - 1e-9) - 1)
    return SETTINGS["gen_ms"] * math.exp(SETTINGS["tail_sigma"] * z - SETTINGS["tail_sigma"] ** 2 / 2)


def _erfinv(y: float) -> float:
    lo, hi = -6.0, 6.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if math.erf(mid) < y else (lo, mid)
    return (lo + hi) / 2


# ---- the work, as plain functions (the hand loop calls them directly) -----------------------

def generate_work(sample: dict[str, Any], step: int, sample_id: str, version: int) -> Group:
    burn(gen_ms(sample_id))
    t = Trajectory(id=sample_id, group_id=sample_id, sample_id=sample_id, prompt_ids=[sample["x"]],
                   response_ids=[1, 2], loss_mask=[1, 1], behaviour_logprobs=[-1.0, -1.0],
                   versions=[version, version], step=step)
    return Group(id=sample_id, step=step, trajectories=[t])


def reward_work(group: Group) -> Group:
    burn(SETTINGS["reward_ms"])
    for t in group.trajectories:
        t.reward = 1.0
    return group


def train_work(groups: list[Group], step: int) -> dict[str, Any]:
    burn(SETTINGS["train_ms"])
    return {"version": step + 1, "groups": len(groups)}


def sync_work(policy: dict[str, Any]) -> dict[str, Any]:
    burn(SETTINGS["sync_ms"])
    return dict(policy)


# ---- the same work as operators -------------------------------------------------------------

class Numbers:
    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    def sample(self, step: int, index: int) -> dict[str, Any]:
        return {"x": step * 1000 + index}


class GenConfig(msgspec.Struct):
    max_concurrency: int = 1  # one engine thread: the stage occupies one core


class BenchGenerate(Operator):
    kind = "generate"
    Config = GenConfig
    inputs: ClassVar = {"prompts": PROMPTS, "weights": WEIGHTS}
    outputs: ClassVar = {"trajectories": TRAJECTORIES}

    async def setup(self) -> None:
        self.version = 0

    async def generate(self, sample: dict[str, Any], *, step: int, sample_id: str) -> Group:
        return await on("generate", generate_work, sample, step, sample_id, self.version)

    async def update_weights(self, weights: Any, version: int) -> None:
        self.version = version


class OneAtATime(msgspec.Struct):
    concurrency: int = 1


class BenchReward(Operator):
    kind = "reward"
    Config = OneAtATime
    inputs: ClassVar = {"trajectories": TRAJECTORIES}
    outputs: ClassVar = {"trajectories": TRAJECTORIES}

    async def process(self, inputs: dict[str, Any]) -> dict[str, Any]:
        return {"trajectories": await on("reward", reward_work, inputs["trajectories"])}


class BenchTrain(Operator):
    kind = "train"
    inputs: ClassVar = {"trajectories": TRAJECTORIES}
    outputs: ClassVar = {"policy": POLICY}

    async def train(self, groups: list[Group], *, step: int) -> TrainResult:
        return TrainResult(policy=await on("train", train_work, groups, step))


class BenchSync(Operator):
    kind = "sync"
    inputs: ClassVar = {"policy": POLICY}
    outputs: ClassVar = {"weights": WEIGHTS}

    async def sync(self, policy: Any, *, version: int) -> Any:
        return await on("sync", sync_work, policy)


def make_plan(steps: int, batch: int, mode: str, k: int) -> Plan:
    me = "bench_runtime"
    specs = {"rollout": BenchGenerate, "score": BenchReward, "learner": BenchTrain, "publish": BenchSync}
    nodes = {n: NodePlan(name=n, kind=c.kind, op=f"{me}:{c.__name__}", config={}, resources=Resources(cpus=0.25),
                         inputs=dict(c.inputs), outputs=dict(c.outputs)) for n, c in specs.items()}
    edges = [
        EdgePlan(src="rollout", src_port="trajectories", dst="score", dst_port="trajectories", port_type=TRAJECTORIES),
        EdgePlan(src="score", src_port="trajectories", dst="learner", dst_port="trajectories",
                 port_type=TRAJECTORIES, mode=mode, max_staleness=k),
        EdgePlan(src="learner", src_port="policy", dst="publish", dst_port="policy", port_type=POLICY),
        EdgePlan(src="publish", src_port="weights", dst="rollout", dst_port="weights", port_type=WEIGHTS,
                 kind="weights"),
    ]
    return Plan(name=f"bench-{mode}{k}", nodes=nodes, edges=edges, order=list(specs),
                data={"source": f"{me}:Numbers", "batch_size": batch}, run={"steps": steps}, seed=0)


def hand_loop(steps: int, batch: int) -> tuple[float, dict[str, float]]:
    """The same work in a plain loop, each call on the same worker thread (so the same cores) as
    the runtime uses; returns wall time and per-stage work time."""
    stage = {"generate": 0.0, "reward": 0.0, "train": 0.0, "sync": 0.0}
    source = Numbers()
    version = 0
    start = time.perf_counter()
    for step in range(steps):
        groups = []
        for index in range(batch):
            t0 = time.perf_counter()
            group = call("generate", generate_work, source.sample(step, index), step, f"{step}:{index}", version)
            t1 = time.perf_counter()
            groups.append(call("reward", reward_work, group))
            t2 = time.perf_counter()
            stage["generate"] += t1 - t0
            stage["reward"] += t2 - t1
        t0 = time.perf_counter()
        policy = call("train", train_work, groups, step)
        t1 = time.perf_counter()
        version = call("sync", sync_work, policy)["version"]
        t2 = time.perf_counter()
        stage["train"] += t1 - t0
        stage["sync"] += t2 - t1
    return time.perf_counter() - start, stage


def runtime(steps: int, batch: int, mode: str, k: int) -> float:
    from flowrl.runtime import run

    with tempfile.TemporaryDirectory() as run_dir:
        start = time.perf_counter()
        result = run(make_plan(steps, batch, mode, k), run_dir, executor="inprocess", progress=False)
        elapsed = time.perf_counter() - start
    assert result.status == "done" and result.steps == steps
    return elapsed


def calibrate() -> float:
    global UNITS_PER_MS
    UNITS_PER_MS = 1.0
    burn(20)
    start = time.perf_counter()
    burn(200)
    return 200 / ((time.perf_counter() - start) * 1000)


def measure(args: argparse.Namespace, configs: list[tuple[str, str, int]], repeats: int) -> tuple[dict, dict]:
    """Best wall time per configuration, and the hand loop's per-stage work time."""
    best: dict[str, float] = {}
    stage_times: dict[str, float] = {}
    for _ in range(repeats):  # interleaved, so load from other processes hits all alike
        wall, stages = hand_loop(args.steps, args.batch)
        if wall < best.get("hand", math.inf):
            best["hand"], stage_times = wall, stages
        for name, mode, k in configs:
            best[name] = min(best.get(name, math.inf), runtime(args.steps, args.batch, mode, k))
    return best, stage_times


def main() -> None:
    global UNITS_PER_MS, WORK, PLACEMENT
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=32)  # pipeline fill over 16 steps alone cost ~6%
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--placement", choices=("pinned", "shared"), default="pinned")
    results_file.add_record_flag(parser)
    args = parser.parse_args()
    PLACEMENT = args.placement  # the runtime's own thread (this one) stays unpinned: it is host code
    UNITS_PER_MS = calibrate()
    runtime(2, 2, "sync", 0)  # warm-up: imports, TensorBoard writer

    configs = [("sync", "sync", 0), ("async1", "async", 1), ("async4", "async", 4)]
    best, stage_times = measure(args, configs, args.repeats)
    total, slowest = sum(stage_times.values()), max(stage_times.values())
    ideal_bound = total / slowest
    steps = args.steps
    tput = {name: steps / t for name, t in best.items()}
    ideal_tput = steps / slowest
    async_name = max(("async1", "async4"), key=lambda n: tput[n])
    print(f"calibration: {UNITS_PER_MS:.2f} matmul units per ms; steps {steps}, batch {args.batch}, "
          f"best of {args.repeats}; cores {os.cpu_count()}, load {os.getloadavg()[0]:.1f}")
    print("stage work time (hand loop): " + ", ".join(f"{k} {v:.3f}s" for k, v in stage_times.items()))
    print(f"ideal overlap bound (sum / max of stage times): {ideal_bound:.2f}x  -> ideal {ideal_tput:.2f} steps/s")
    for name in ("hand", "sync", "async1", "async4"):
        print(f"{name:>7}: {best[name]:.3f}s  {tput[name]:.2f} steps/s  "
              f"{tput[name] / ideal_tput:.2f} of ideal  {tput[name] / tput['sync']:.2f}x sync")

    # Scheduling check: the same durations as sleeps, so stages never compete for the cores.
    # This separates what the runtime's scheduling achieves from what this machine's cores allow.
    WORK = "sleep"
    sleep_best, sleep_stages = measure(args, configs, 1)
    sleep_ideal = steps / max(sleep_stages.values())
    sleep_async = max(("async1", "async4"), key=lambda n: -sleep_best[n])
    sleep_vs_ideal = (steps / sleep_best[sleep_async]) / sleep_ideal
    print(f"scheduling check (sleeps, same durations): ideal {sleep_ideal:.2f} steps/s; " + ", ".join(
        f"{n} {steps / sleep_best[n]:.2f} ({steps / sleep_best[n] / sleep_ideal:.2f} of ideal)" for n in
        ("sync", "async1", "async4")) + f"; sync/hand {sleep_best['sync'] / sleep_best['hand']:.3f}")
    summary = {
        "sync_steps_per_s": round(tput["sync"], 3), "async_steps_per_s": round(tput[async_name], 3),
        "async_staleness": int(async_name[-1]), "ideal_steps_per_s": round(ideal_tput, 3),
        "ideal_overlap_bound": round(ideal_bound, 3), "async_vs_sync": round(tput[async_name] / tput["sync"], 3),
        "async_vs_ideal": round(tput[async_name] / ideal_tput, 3),
        "overhead_vs_hand_loop": round(best["sync"] / best["hand"], 3),
        "sleep_async_vs_ideal": round(sleep_vs_ideal, 3), "sleep_async_staleness": int(sleep_async[-1]),
        "sleep_overhead_vs_hand_loop": round(sleep_best["sync"] / sleep_best["hand"], 3),
        "placement": PLACEMENT, "load_average": round(os.getloadavg()[0], 2),
    }
    results_file.emit(args.record, "bench_runtime", summary)


if __name__ == "__main__":
    sys.modules.setdefault("bench_runtime", sys.modules[__name__])  # the plan names operators by module
    main()
