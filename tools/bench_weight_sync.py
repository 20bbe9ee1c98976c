"""Weight sync throughput of each transport against two limits measured in the same run.

    flock /tmp/flowrl-bench.lock /work/venv/bin/python tools/bench_weight_sync.py [--layers 4]
    python tools/bench_weight_sync.py --ray-path --layers 2   # the Ray executor's path across nodes

Model: a Qwen2-shaped model with random weights built here (nothing downloaded); the default shape
is about 300 MB in fp32. Every figure is one whole version moved from the sending end into live
buffers of the same shapes at the receiving end (what an engine's parameters are), best of
--repeats. Limits: `copy_` of every tensor into a live buffer (in-process), and a raw gloo
broadcast of the same bytes, in buckets of the same size, between two processes (cross-process).
Also: each transport sending one tensor at a time, and the in-process transport into the real
embedded engine (which stages a version aside before swapping, so it pays one more copy).
The machine is shared: figures are noisy; ratios are measured side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time

import ray
import results_file
import torch

from flowrl_operators.config import SyncConfig
from flowrl_operators.transport import apply, make_sender, rebucket
from flowrl_operators.transport.broadcast import BroadcastGroup, broadcast, connect


def model_weights(layers: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """HF names and shapes of a Qwen2 model (built on the meta device), filled with seeded noise."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=layers,
                         num_attention_heads=16, num_key_value_heads=4, tie_word_embeddings=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(p.shape, generator=gen) * 0.02 for name, p in model.state_dict().items()
            if name != "lm_head.weight"}  # tied to the embedding


def nbytes(weights: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in weights.values())


class LiveBuffers:
    """The receiving engine, reduced to what the transport must reach: copy each tensor into live
    parameters of the same shapes (the engine interface: version, update_weights)."""

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        self.live = {name: torch.ones_like(t) for name, t in weights.items()}  # touched: no page faults
        self.version = 0
        self.paused = False

    async def update_weights(self, buckets, version: int) -> None:
        async for bucket in buckets:
            for name, tensor in bucket:
                self.live[name].copy_(tensor)
        self.version = version


@ray.remote(num_cpus=0)
class Peer:
    """The sending process: train rank 0 holding the same weights."""

    def __init__(self, layers: int) -> None:
        torch.set_num_threads(1)
        self.weights = model_weights(layers)
        self.senders = {}

    def raw_broadcast(self, group: BroadcastGroup, chunk: int, total: int) -> None:
        """One round of the raw limit: the same bytes, bucket-sized, from a ready buffer."""
        if getattr(self, "raw", None) is None:
            self.raw = connect(group, 0), torch.ones(chunk, dtype=torch.uint8)
        pg, buffer = self.raw
        broadcast(pg, torch.zeros(1))  # start together
        for start in range(0, total, chunk):
            broadcast(pg, buffer[:min(chunk, total - start)])

    def publish(self, transport: str, layout: str, bucket_mb: float, version: int):
        key = (transport, layout, bucket_mb)
        if key not in self.senders:
            self.senders[key] = make_sender(SyncConfig(transport=transport, layout=layout, bucket_mb=bucket_mb))
        buckets = rebucket(self.weights.items(), int(bucket_mb * 2**20))
        return self.senders[key].send(buckets, version)

    def checksum(self) -> float:
        return float(sum(t.double().sum() for t in self.weights.values()))


def copy_round(weights, live: LiveBuffers) -> float:
    start = time.perf_counter()
    for name, tensor in weights.items():
        live.live[name].copy_(tensor)
    return time.perf_counter() - start


class RawBroadcast:
    """The receiving end of the raw limit; the store lives here, the peer is rank 0."""

    def __init__(self, peer, total: int, chunk: int) -> None:
        self.peer, self.total, self.chunk = peer, total, chunk
        self.store = torch.distributed.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False,
                                                multi_tenant=True)
        self.group = BroadcastGroup("127.0.0.1", self.store.port, 2, "bench-raw", "gloo", 300.0)
        self.pg = None
        self.buffer = torch.empty(chunk, dtype=torch.uint8)

    def round(self) -> float:
        done = self.peer.raw_broadcast.remote(self.group, self.chunk, self.total)
        if self.pg is None:
            self.pg = connect(self.group, 1, self.store)
        broadcast(self.pg, torch.zeros(1))
        start = time.perf_counter()
        for offset in range(0, self.total, self.chunk):
            broadcast(self.pg, self.buffer[:min(self.chunk, self.total - offset)])
        seconds = time.perf_counter() - start
        ray.get(done)
        return seconds


async def transport_round(engine, publish, version: int) -> float:
    """Seconds for one version: from asking the sender to publish until the engine holds it."""
    start = time.perf_counter()
    record = await publish(version)
    await apply(engine, record, version)
    return time.perf_counter() - start


async def bench_embedded(weights, bucket_mb: float, repeats: int) -> list[float]:
    """In-process transport into the real embedded engine (its staging copy included)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from flowrl_operators.engine.embedded.engine import EmbeddedEngine
    from flowrl_operators.tokenizer import build_tokenizer, silence_hf

    layers = 1 + max(int(n.split(".")[2]) for n in weights if n.startswith("model.layers."))
    config = Qwen2Config(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=layers,
                         num_attention_heads=16, num_key_value_heads=4, tie_word_embeddings=True)
    silence_hf()
    with tempfile.TemporaryDirectory() as folder:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        model.load_state_dict(weights, strict=False, assign=True)
        model.tie_weights()
        model.save_pretrained(folder)
        build_tokenizer().save_pretrained(folder)
        del model
        engine = EmbeddedEngine(folder, max_slots=1, max_context=64)
        sender = make_sender(SyncConfig(transport="inprocess", bucket_mb=bucket_mb))
        try:
            async def publish(v):
                return sender.send(rebucket(weights.items(), int(bucket_mb * 2**20)), v)
            return [await transport_round(engine, publish, v) for v in range(1, repeats + 2)][1:]
        finally:
            await engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (4 = about 300 MB in fp32)")
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-engine", action="store_true", help="skip the embedded-engine figure")
    parser.add_argument("--ray-path", action="store_true",
                        help="instead: a version from a train actor to engine actors on other nodes of a loopback "
                             "multi-node Ray cluster, as under executor: ray, against raw gloo (tools/ray_weight_path.py)")
    parser.add_argument("--engines", type=int, default=2, choices=(1, 2),
                        help="--ray-path: engine actors (on worker b, then on the head)")
    parser.add_argument("--transport", default="auto", choices=("auto", "broadcast"),
                        help="--ray-path: the sync node's transport (auto: the Ray object store)")
    results_file.add_record_flag(parser)
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)

    weights = model_weights(args.layers)
    total = nbytes(weights)
    mb = total / 2**20
    print(f"model: Qwen2-shaped, {args.layers} layers, {len(weights)} tensors, {mb:.0f} MB fp32; "
          f"buckets of {args.bucket_mb:g} MB; best of {args.repeats}", flush=True)
    if mb < 200:
        sys.exit(f"the model is only {mb:.0f} MB; use --layers >= 2 for at least 200 MB")
    if args.ray_path:
        from ray_weight_path import run_ray_path

        del weights  # the actors build their own
        result = {"model_mb": round(mb, 1), "bucket_mb": args.bucket_mb,
                  **run_ray_path(args.layers, args.bucket_mb, args.repeats, total, args.engines, args.transport)}
        print(f"Ray path / raw gloo broadcast: {result['ray_vs_gloo']:.2f} (target >= 0.5); weight bytes through "
              f"the coordinator: {result['coordinator_weight_bytes']} (target 0)")
        results_file.emit(args.record, "bench_weight_sync", result)
        return
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=int(max(1.5 * total, 512 * 2**20)),
             log_to_driver=False)
    peer = Peer.remote(args.layers)
    live = LiveBuffers(weights)
    rates: dict[str, float] = {}

    def report(name: str, times: list[float]) -> None:
        rates[name] = total / min(times) / 1e9
        print(f"{name:34s} {rates[name]:7.2f} GB/s   best {min(times) * 1e3:8.1f} ms   "
              f"median {statistics.median(times) * 1e3:8.1f} ms", flush=True)

    raw = RawBroadcast(peer, total, int(args.bucket_mb * 2**20))
    one = 1e-9  # bucket_mb so small that every tensor is its own bucket

    def local(bucket_mb: float):
        sender = make_sender(SyncConfig(transport="inprocess", bucket_mb=max(bucket_mb, one)))

        async def publish(v):
            return sender.send(rebucket(weights.items(), int(bucket_mb * 2**20)), v)
        return publish

    def remote(transport: str, layout: str, bucket_mb: float):
        async def publish(v):
            return await peer.publish.remote(transport, layout, max(bucket_mb, one), v)
        return publish

    publishers = {
        "inprocess": local(args.bucket_mb),
        "object_store": remote("object_store", "flat", args.bucket_mb),
        "broadcast": remote("broadcast", "per_tensor", args.bucket_mb),
        "broadcast (flat layout)": remote("broadcast", "flat", args.bucket_mb),
        "inprocess (1 tensor at a time)": local(0.0),
        "object_store (1 tensor at a time)": remote("object_store", "flat", 0.0),
        "broadcast (1 tensor at a time)": remote("broadcast", "per_tensor", 0.0),
    }
    times: dict[str, list[float]] = {name: [] for name in ["limit: copy_ into live buffers",
                                                           "limit: raw gloo broadcast", *publishers]}

    async def rounds() -> None:
        # Interleaved: every round measures everything once, so load from other processes on this
        # shared machine falls on all figures alike. Round 0 warms up (groups, buffers, pages).
        version = 0
        for r in range(args.repeats + 1):
            measured = {"limit: copy_ into live buffers": copy_round(weights, live),
                        "limit: raw gloo broadcast": raw.round()}
            for name, publish in publishers.items():
                version += 1
                measured[name] = await transport_round(live, publish, version)
                checksum = float(sum(t.double().sum() for t in live.live.values()))
                if r == 0 and checksum != ray.get(peer.checksum.remote()):
                    sys.exit(f"{name}: the received weights differ from the sender's")
            if r:
                for name, seconds in measured.items():
                    times[name].append(seconds)

    asyncio.run(rounds())
    for name, values in times.items():
        report(name, values)
    if not args.skip_engine:
        report("inprocess into embedded engine", asyncio.run(bench_embedded(weights, args.bucket_mb, args.repeats)))

    copy, raw = rates["limit: copy_ into live buffers"], rates["limit: raw gloo broadcast"]
    cross = {k: rates[k] for k in ("object_store", "broadcast", "broadcast (flat layout)")}
    best_cross = max(cross, key=cross.get)
    summary = {
        "model_mb": round(mb, 1),
        "bucket_mb": args.bucket_mb,
        "gbps": {k: round(v, 3) for k, v in rates.items()},
        "inprocess_vs_copy": round(rates["inprocess"] / copy, 3),
        "best_crossprocess": best_cross,
        "crossprocess_vs_raw_broadcast": round(cross[best_cross] / raw, 3),
        "object_store_vs_raw_broadcast": round(cross["object_store"] / raw, 3),
        "broadcast_vs_raw_broadcast": round(cross["broadcast"] / raw, 3),
        "broadcast_flat_vs_raw_broadcast": round(cross["broadcast (flat layout)"] / raw, 3),
        "bucketed_vs_one_tensor_at_a_time": {
            t: round(rates[t] / rates[f"{t} (1 tensor at a time)"], 2) for t in ("inprocess", "object_store", "broadcast")
        },
    }
    print(f"in-process / copy_: {summary['inprocess_vs_copy']:.2f} (target >= 0.5); best cross-process "
          f"({best_cross}) / raw gloo broadcast: {summary['crossprocess_vs_raw_broadcast']:.2f} (target >= 0.5)")
    ray.shutdown()
    results_file.emit(args.record, "bench_weight_sync", summary)


if __name__ == "__main__":
    main()
