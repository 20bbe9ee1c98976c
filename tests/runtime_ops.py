"""Synthetic operators and plan builders for the runtime tests (importable as `runtime_ops:...`).

They produce real `Group`/`Trajectory` records whose contents are a pure function of the sample
and the policy version, so two runs of a deterministic pipeline can be compared record by record.
Durations are sleeps drawn from a hash of the sample id (the benchmark uses real CPU work).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from typing import Any, ClassVar

import msgspec

from flowrl.data.trajectory import Group, Trajectory
from flowrl.graph.plan import EdgePlan, NodePlan, Plan
from flowrl.operator import (
    POLICY,
    PROMPTS,
    TRAJECTORIES,
    WEIGHTS,
    GraphFacts,
    Knobs,
    Operator,
    Resources,
    TrainResult,
)
from flowrl.registry import resolve


def unit(key: str) -> float:
    """A deterministic number in [0, 1) from a string."""
    return int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) / 2**32


class Numbers:
    """Data source: sample (step, index) -> {"x": ...}, a pure function of seed, step and index."""

    def __init__(self, seed: int = 0, scale: int = 1000) -> None:
        self.seed, self.scale = seed, scale

    def sample(self, step: int, index: int) -> dict[str, Any]:
        return {"x": self.seed * 7 + step * self.scale + index}


async def log_setup(context: Any, delay: float) -> None:
    """Sleep `delay` seconds, then append {node, start, end} to setup.jsonl in the run directory."""
    start = time.time()
    await asyncio.sleep(delay)
    if context.run_dir is not None:
        with open(context.run_dir / "setup.jsonl", "a") as f:
            f.write(json.dumps({"node": context.node, "start": start, "end": time.time()}) + "\n")


class GenConfig(msgspec.Struct, forbid_unknown_fields=True):
    delay: float = 0.0  # seconds, scaled by a per-sample hash
    replica_delay: list[float] = []  # seconds each sample takes on replica i (instead of delay)
    group_size: int = 2
    slow_on: str = ""  # sample id that takes slow_delay seconds (a long tail)
    slow_delay: float = 0.0
    reject_every: int = 0  # reject samples whose index is a multiple of this
    fail_on: str = ""  # sample id that raises
    die_on: str = ""  # sample id that kills the process (once, marked by a file in the run dir)
    partial_rollout: bool = False
    max_concurrency: int = 64
    setup_delay: float = 0.0  # seconds that setup() takes (it logs when it ran, see log_setup)
    text: bool = False  # carry text as the real generate node does (metadata "sample" and "text")


class ToyGenerate(Operator):
    """Generates a group of trajectories per sample; tokens carry the policy version."""

    kind = "generate"
    Config = GenConfig

    @classmethod
    def knobs(cls, config: GenConfig) -> Knobs:
        return Knobs(concurrency=config.max_concurrency, partial_rollout=config.partial_rollout)
    inputs: ClassVar = {"prompts": PROMPTS, "weights": WEIGHTS}
    outputs: ClassVar = {"trajectories": TRAJECTORIES}
    resources = Resources(cpus=0.1)

    async def setup(self) -> None:
        await log_setup(self.context, self.config.setup_delay)
        self.version = 0
        self.paused = False
        self.updates: list[tuple[int, bool]] = []  # (version, while generations were in flight)
        self.in_flight = 0

    async def generate(self, sample: dict[str, Any], *, step: int, sample_id: str) -> Group | None:
        c = self.config
        if sample_id == c.fail_on:
            raise ValueError(f"toy generate cannot handle sample {sample_id}")
        marker = self.context.run_dir / f"died-{sample_id}" if self.context.run_dir else None
        if sample_id == c.die_on and marker is not None and not marker.exists():
            marker.write_text("")
            os._exit(1)
        start_version = self.version
        self.in_flight += 1
        try:
            await asyncio.sleep(c.slow_delay if sample_id == c.slow_on else
                                c.replica_delay[self.context.rank] if c.replica_delay else c.delay * unit(sample_id))
        finally:
            self.in_flight -= 1
        index = int(sample_id.split(":")[1])
        if c.reject_every and index % c.reject_every == 0:
            return None
        version = self.version  # under partial rollout, later tokens come from newer weights
        trajectories = [
            Trajectory(id=f"{sample_id}/{i}", group_id=sample_id, sample_id=sample_id, prompt_ids=[sample["x"]],
                       response_ids=[sample["x"] + i, version], loss_mask=[1, 1], behaviour_logprobs=[-1.0, -1.0],
                       versions=[start_version, version], step=step,
                       metadata={"sample": {"prompt": f"x={sample['x']}"}, "text": f"{sample['x'] + i} v{version}"}
                       if c.text else {})
            for i in range(c.group_size)
        ]
        return Group(id=sample_id, step=step, trajectories=trajectories)

    async def update_weights(self, weights: Any, version: int) -> None:
        assert weights["version"] == version
        self.updates.append((version, self.in_flight > 0))
        self.version = version

    async def pause(self) -> None:
        self.paused = True

    async def resume(self) -> None:
        self.paused = False
    # No state_dict: like the real generate node, a restarted engine holds the initial weights.


class RewardConfig(msgspec.Struct, forbid_unknown_fields=True):
    delay: float = 0.0
    filter_every: int = 0  # filter out samples whose index is a multiple of this
    fail_on: str = ""
    concurrency: int = 16


class ToyReward(Operator):
    """Sets each trajectory's reward from its tokens."""

    kind = "reward"
    Config = RewardConfig

    @classmethod
    def knobs(cls, config: RewardConfig) -> Knobs:
        return Knobs(concurrency=config.concurrency)
    inputs: ClassVar = {"trajectories": TRAJECTORIES}
    outputs: ClassVar = {"trajectories": TRAJECTORIES}
    resources = Resources(cpus=0.1)

    async def process(self, inputs: dict[str, Any]) -> dict[str, Any]:
        group: Group = inputs["trajectories"]
        if group.id == self.config.fail_on:
            raise ZeroDivisionError(f"toy reward failed on {group.id}")
        await asyncio.sleep(self.config.delay * unit("r" + group.id))
        if self.config.filter_every and int(group.id.split(":")[1]) % self.config.filter_every == 0:
            return {}
        for t in group.trajectories:
            t.reward = float(sum(t.response_ids) % 7) / 7
        return {"trajectories": group}


class JoinConfig(msgspec.Struct, forbid_unknown_fields=True):
    concurrency: int = 16


class ToyJoin(Operator):
    """Joins two copies of a group (one with rewards) into one."""

    kind = "transform"
    Config = JoinConfig

    @classmethod
    def knobs(cls, config: JoinConfig) -> Knobs:
        return Knobs(concurrency=config.concurrency)
    inputs: ClassVar = {"left": TRAJECTORIES, "right": TRAJECTORIES}
    outputs: ClassVar = {"trajectories": TRAJECTORIES}
    resources = Resources(cpus=0.1)

    async def process(self, inputs: dict[str, Any]) -> dict[str, Any]:
        left, right = inputs["left"], inputs["right"]
        assert left.id == right.id
        return {"trajectories": left if left.trajectories[0].reward is not None else right}


class TrainConfig(msgspec.Struct, forbid_unknown_fields=True):
    delay: float = 0.0
    fail_at_step: int = -1
    on_policy_only: bool = False  # reject stale data at validate time (an operator's graph rule)
    setup_delay: float = 0.0
    fail_setup: bool = False
    fail_close: bool = False
    fail_save_at: int = -1  # a checkpoint at this version fails (as on a full disk)
    weights_kb: int = 0  # publish a float32 tensor of this size (filled with the version) with the policy


class ToyTrain(Operator):
    """Folds every received group into a checksum; logs each step's batch to the run directory."""

    kind = "train"
    Config = TrainConfig
    inputs: ClassVar = {"trajectories": TRAJECTORIES}
    outputs: ClassVar = {"policy": POLICY}
    resources = Resources(cpus=0.1)

    @classmethod
    def check_graph(cls, config: TrainConfig, facts: GraphFacts) -> list[tuple[tuple[str, ...], str]]:
        if config.on_policy_only and (facts.async_upstream or facts.partial_rollout_upstream):
            return [(("on_policy_only",), "this node trains on-policy only, but an async edge feeds it")]
        return []

    async def setup(self) -> None:
        await log_setup(self.context, self.config.setup_delay)
        if self.config.fail_setup:
            raise RuntimeError("toy train cannot set up")
        self.checksum = ""
        self.version = 0
        self.batches: list[list[tuple[str, int]]] = []  # per step: (group id, its oldest version)

    async def train(self, groups: list[Group], *, step: int) -> TrainResult:
        if step == self.config.fail_at_step:
            raise RuntimeError(f"toy train failed at step {step}")
        await asyncio.sleep(self.config.delay)
        self.batches.append([(g.id, g.oldest_version) for g in groups])
        batch = [msgspec.to_builtins(g) for g in sorted(groups, key=lambda g: g.id)]
        self.checksum = hashlib.sha256((self.checksum + json.dumps(batch, sort_keys=True)).encode()).hexdigest()
        if self.context.run_dir is not None:
            row = {"step": step, "ids": [g.id for g in groups], "versions": [g.oldest_version for g in groups],
                   "checksum": self.checksum, "pid": os.getpid(), "rank": self.context.rank,
                   "world_size": os.environ.get("WORLD_SIZE")}
            with open(self.context.run_dir / f"train-{self.context.node}.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
        rewards = [t.reward for g in groups for t in g.trajectories if t.reward is not None]
        self.version = step + 1
        return TrainResult(policy=self.policy(),
                           metrics={"loss": 1.0 / (step + 1), "batch": float(len(groups)),
                                    "reward_seen": sum(rewards) / len(rewards) if rewards else 0.0})

    async def publish(self) -> TrainResult:
        return TrainResult(policy=self.policy())

    def policy(self) -> dict[str, Any]:
        policy: dict[str, Any] = {"version": self.version, "checksum": self.checksum}
        if self.config.weights_kb:
            import torch

            policy["weights"] = torch.full((self.config.weights_kb * 256,), float(self.version))
        return policy

    def state_dict(self) -> dict[str, Any]:
        return {"checksum": self.checksum, "version": self.version}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.checksum, self.version = state["checksum"], state["version"]

    def save(self, path: Any) -> None:
        if self.version == self.config.fail_save_at:
            (path / "partial.bin").write_bytes(b"x")
            raise OSError(28, "No space left on device")

    async def close(self) -> None:
        if self.config.fail_close:
            raise OSError("toy train could not export")


class ToySync(Operator):
    """Turns a policy record into a weights record."""

    kind = "sync"
    inputs: ClassVar = {"policy": POLICY}
    outputs: ClassVar = {"weights": WEIGHTS}
    resources = Resources(cpus=0.1)

    async def sync(self, policy: Any, *, version: int) -> Any:
        assert policy["version"] == version
        if "weights" in policy:  # the whole version arrived (a ray.ObjectRef would have no [0])
            assert bool((policy["weights"] == version).all()), "weights of another version"
        return {"version": version, "checksum": policy["checksum"]}


OPS = {"gen": "runtime_ops:ToyGenerate", "reward": "runtime_ops:ToyReward", "join": "runtime_ops:ToyJoin",
       "train": "runtime_ops:ToyTrain", "sync": "runtime_ops:ToySync"}


def node(name: str, op: str, replicas: int = 1, **config: Any) -> NodePlan:
    cls = resolve(OPS.get(op, op))
    return NodePlan(name=name, kind=cls.kind, op=OPS.get(op, op), config=config,
                    resources=Resources(cpus=cls.resources.cpus, replicas=replicas),
                    inputs=dict(cls.inputs), outputs=dict(cls.outputs))


def edge(src: str, dst: str, mode: str = "sync", k: int = 0, src_port: str = "", dst_port: str = "",
         **options: Any) -> EdgePlan:
    weights = dst_port == "weights"
    port_type = WEIGHTS if weights else (POLICY if dst_port == "policy" else TRAJECTORIES)
    return EdgePlan(src=src, src_port=src_port or ("weights" if weights else "policy" if port_type == POLICY
                                                   else "trajectories"),
                    dst=dst, dst_port=dst_port or "trajectories", port_type=port_type,
                    kind="weights" if weights else "data", mode=mode, max_staleness=k, **options)


def plan(nodes: list[NodePlan], edges: list[EdgePlan], steps: int = 4, batch_size: int = 4,
         name: str = "toy", **run: Any) -> Plan:
    import networkx as nx

    graph = nx.DiGraph([(e.src, e.dst) for e in edges if e.kind == "data"])
    graph.add_nodes_from(n.name for n in nodes)
    return Plan(name=name, nodes={n.name: n for n in nodes}, edges=edges,
                order=list(nx.lexicographical_topological_sort(graph)),
                data={"source": "runtime_ops:Numbers", "batch_size": batch_size},
                run={"steps": steps, **run}, seed=3)


def grpo(mode: str = "sync", k: int = 0, steps: int = 4, batch_size: int = 4, gen: dict | None = None,
         reward: dict | None = None, train: dict | None = None, train_ranks: int = 1, **edge_options: Any) -> Plan:
    """generate -> reward -> train -> sync -> generate (weights): the README's example graph."""
    return plan(
        [node("rollout", "gen", **(gen or {})), node("score", "reward", **(reward or {})),
         node("learner", "train", replicas=train_ranks, **(train or {})), node("publish", "sync")],
        [edge("rollout", "score"), edge("score", "learner", mode, k, **edge_options),
         edge("learner", "publish", dst_port="policy"), edge("publish", "rollout", dst_port="weights")],
        steps=steps, batch_size=batch_size)
