"""The Ray path of a policy version, as a flowrl run under `executor: ray` takes it, on a loopback
multi-node Ray cluster: used by `tools/bench_weight_sync.py --ray-path`.

A train actor on worker node `a` publishes the weights as the train stage does (the train node's
`StoredSnapshot.put`: one `ray.put` per bucket; ray_stage's `by_reference`: only a ref goes on); the driver stands for the
coordinator and holds nothing but that ref (its tensor bytes are counted, as metrics.jsonl's
`coordinator_weight_bytes`); a sync actor next to the trainer resolves the ref as the sync stage's
proxy does and runs the real sync operator (`transport: auto`, the object store under Ray, which
passes the trainer's bucket refs on; or `broadcast`, which sends the mapped tensors); engine
actors on the other nodes (worker `b` and the head) apply the record with the real `apply` into
live buffers. One version's time is from the trainer's publish until every engine holds it. The
reference is a raw gloo broadcast of the same bytes, in the same bucket size, from a process on
node `a` to one on node `b`.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

ROOT = Path(__file__).resolve().parents[1]


def on(worker: str | None) -> dict[str, Any]:
    """Actor options placing it on worker node `worker` (its custom resource, tests/ray_cluster.py),
    or on the head (the driver's node) for None."""
    if worker:
        return {"resources": {f"flowrl_node_{worker}": 0.01}}
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)}


@ray.remote(num_cpus=0)
class TrainEnd:
    """A train rank's process: holds the policy as the train operator publishes it (a Snapshot of
    buckets), and publishes it as the Ray train stage does."""

    def __init__(self, layers: int, bucket_mb: float) -> None:
        sys.path.insert(0, str(ROOT / "tools"))
        from bench_weight_sync import model_weights

        from flowrl_operators.transport import Snapshot, rebucket

        torch.set_num_threads(1)
        self.weights = model_weights(layers)
        self.policy = Snapshot(rebucket(self.weights.items(), int(bucket_mb * 2**20)))

    async def publish(self) -> list:
        import asyncio

        from flowrl.runtime.executors.ray_stage import by_reference
        from flowrl_operators.transport import StoredSnapshot

        start = time.perf_counter()
        ref = await by_reference(await asyncio.to_thread(StoredSnapshot.put, self.policy), 0)
        return [ref, time.perf_counter() - start]  # in a list: Ray hands back the ref, not its value

    def checksum(self) -> float:
        return float(sum(t.double().sum() for t in self.weights.values()))


@ray.remote(num_cpus=0)
class SyncEnd:
    """The sync stage's process: the real sync operator, fed the way the stage proxy feeds it."""

    def __init__(self, bucket_mb: float, transport: str, engines: int) -> None:
        from flowrl.operator import OperatorContext
        from flowrl_operators.config import SyncConfig
        from flowrl_operators.sync import Sync

        torch.set_num_threads(1)
        config = SyncConfig(transport=transport, bucket_mb=bucket_mb, receivers=engines,
                            address=ray.util.get_node_ip_address())
        self.op = Sync(config, OperatorContext(node="publish"))

    async def sync(self, ref: list, version: int) -> Any:
        policy = await ref[0]  # as RemoteCoordinator.take resolves a policy record
        return await self.op.sync(policy, version=version)


@ray.remote(num_cpus=0)
class EngineEnd:
    """A generate stage's process: live buffers of the model's shapes, updated with `apply`."""

    def __init__(self, layers: int) -> None:
        sys.path.insert(0, str(ROOT / "tools"))
        from bench_weight_sync import LiveBuffers, model_weights

        torch.set_num_threads(1)
        self.live = LiveBuffers(model_weights(layers, seed=1))

    async def apply(self, record: Any, version: int, replica: int) -> int:
        from flowrl_operators.transport import apply

        await apply(self.live, record, version, replica=replica)
        return self.live.version

    def checksum(self) -> float:
        return float(sum(t.double().sum() for t in self.live.live.values()))


@ray.remote(num_cpus=0)
class GlooEnd:
    """One end of the raw reference: a gloo broadcast of the same bytes, bucket-sized, from ready
    buffers. Rank 1 (the receiver) hosts the rendezvous store."""

    def __init__(self, rank: int, chunk: int) -> None:
        torch.set_num_threads(1)
        self.rank, self.pg, self.store = rank, None, None
        self.buffer = torch.ones(chunk, dtype=torch.uint8)
        if rank == 1:
            self.store = torch.distributed.TCPStore("0.0.0.0", 0, 2, is_master=True, wait_for_workers=False,
                                                    multi_tenant=True)

    def group(self) -> Any:
        from flowrl_operators.transport.broadcast import BroadcastGroup

        return BroadcastGroup(ray.util.get_node_ip_address(), self.store.port, 2, "bench-ray-raw", "gloo", 300.0)

    def round(self, group: Any, total: int) -> float:
        from flowrl_operators.transport.broadcast import broadcast, connect

        if self.pg is None:
            self.pg = connect(group, self.rank, self.store)
        broadcast(self.pg, torch.zeros(1))  # start together
        start = time.perf_counter()
        for offset in range(0, total, len(self.buffer)):
            broadcast(self.pg, self.buffer[:min(len(self.buffer), total - offset)])
        return time.perf_counter() - start


def measure(layers: int, bucket_mb: float, repeats: int, total: int, engines: int, transport: str) -> dict[str, Any]:
    """Interleaved rounds of the Ray path and the raw gloo broadcast on the connected cluster."""
    from flowrl.runtime.observe import tensor_bytes

    train = TrainEnd.options(**on("a")).remote(layers, bucket_mb)
    sync = SyncEnd.options(**on("a")).remote(bucket_mb, transport, engines)
    engines = [EngineEnd.options(**on(w)).remote(layers) for w in ("b", None)[:engines]]
    chunk = int(bucket_mb * 2**20)
    sender, receiver = GlooEnd.options(**on("a")).remote(0, chunk), GlooEnd.options(**on("b")).remote(1, chunk)
    group = ray.get(receiver.group.remote())
    expected = ray.get(train.checksum.remote())
    times: dict[str, list[float]] = {"ray": [], "gloo": [], "publish": [], "put": [], "sync": [], "engines": []}
    coordinator_bytes = 0
    for version in range(1, repeats + 2):  # version 1 warms up (connections, pages)
        start = time.perf_counter()
        *ref, put_s = ray.get(train.publish.remote())
        coordinator_bytes += tensor_bytes(ref)  # what the coordinator would hold: a ref, 0 bytes
        published = time.perf_counter()
        record = ray.get(sync.sync.remote(ref, version))  # the weights record: refs and names, small
        synced = time.perf_counter()
        held = ray.get([e.apply.remote(record, version, i) for i, e in enumerate(engines)])
        ray_s = time.perf_counter() - start
        sums = ray.get([e.checksum.remote() for e in engines])
        parts = {"publish": published - start, "put": put_s, "sync": synced - published, "engines": start + ray_s - synced}
        if held != [version] * len(engines) or any(abs(s - expected) > 1e-6 * abs(expected) for s in sums):
            sys.exit(f"version {version}: an engine's weights differ from the trainer's")
        gloo_s = ray.get([sender.round.remote(group, total), receiver.round.remote(group, total)])[1]
        if version > 1:
            for name, seconds in {"ray": ray_s, "gloo": gloo_s, **parts}.items():
                times[name].append(seconds)
    return {"times": times, "coordinator_weight_bytes": coordinator_bytes}


def summary(times: dict[str, list[float]], total: int, engines: int) -> dict[str, float]:
    rates = {k: total / min(times[k]) / 1e9 for k in ("ray", "gloo")}
    for name, label in (("ray", f"Ray path: train -> sync -> {engines} engine(s)"),
                        ("gloo", "raw gloo broadcast, 2 processes")):
        print(f"{label:38s} {rates[name]:7.2f} GB/s   best {min(times[name]) * 1e3:8.1f} ms   "
              f"median {statistics.median(times[name]) * 1e3:8.1f} ms", flush=True)
    print("  Ray path, median ms: " + ", ".join(f"{k} {statistics.median(times[k]) * 1e3:.0f}"
                                                for k in ("publish", "put", "sync", "engines")), flush=True)
    return rates


def run_ray_path(layers: int, bucket_mb: float, repeats: int, total: int, engines: int = 2,
                 transport: str = "auto") -> dict[str, Any]:
    """Start a head and workers a, b on 127.0.0.1 (tests/ray_cluster.py), measure, stop them."""
    sys.path.insert(0, str(ROOT / "tests"))
    from ray_cluster import LocalCluster

    # Each store holds a version or two (the one being read, the next one put).
    cluster = LocalCluster({"a": 1, "b": 1}, store_bytes=int(max(6 * total, 512 * 2**20))).start()
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        measured = measure(layers, bucket_mb, repeats, total, engines, transport)
        rates = summary(measured["times"], total, engines)
        return {"engines": engines, "transport": transport, "ms_median": {k: round(statistics.median(v) * 1e3, 1) for k, v in measured["times"].items()},
                "gbps": {k: round(v, 3) for k, v in rates.items()}, "ray_vs_gloo": round(rates["ray"] / rates["gloo"], 3),
                "coordinator_weight_bytes": measured["coordinator_weight_bytes"]}
    finally:
        ray.shutdown()
        cluster.stop()
