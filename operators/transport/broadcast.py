"""torch.distributed broadcast transport: train rank 0 broadcasts each bucket to every engine.

The group. Rank 0 is the sender (train rank 0, or the sync node); engines are ranks
`rank_offset + i` (rank_offset 1; one rank per engine here, `tp_size` ranks per SGLang engine).
Rendezvous: the sender hosts a TCP store at (address, port) when it is built (port 0 picks a free
port); the weights record names it, and each receiver connects to it on its first record. Both ends
build the backend (gloo on CPU, NCCL on GPU) over the store keys that SGLang's
`init_weights_update_group(master_address, master_port, rank_offset, world_size, group_name,
backend)` uses (a tcp:// rendezvous, then torch's group construction under a "<group_name>"
prefix; tests/test_transport.py checks the two meet), so an SGLang server can join the same group
as ranks rank_offset... The backend is created directly, not registered in torch's global group
table, so a trainer that already has its FSDP group can host it, and sender and receiver can share
a process (the in-process executor). Building it returns once all `world_size` ranks have joined;
the group then lives on for every later version.

The wire, per version: for each bucket a header (int64: kind, metadata length, data length,
version), the bucket's metadata (names, dtypes, shapes; msgpack), then its bytes, either tensor by
tensor (layout "per_tensor", the default: no packing copy, and the shape SGLang's
`update_weights_from_distributed` receives) or packed into one flat uint8 buffer (layout "flat":
one broadcast per bucket; the sender packs bucket k+1 while bucket k is on the wire). Receivers
land both in reused buffers. An END header closes
the version; an ABORT header tells the engines the sender failed mid-way (they raise and keep their
old weights). A receiver whose engine rejects a bucket still drains the rest of the version, so
the group stays in step. If the group itself breaks (a peer died), the sender starts a new group
under a new name for the next version and receivers join that.
"""

from __future__ import annotations

import asyncio
import datetime
import itertools
import threading
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
import torch
import torch.distributed as dist

from flowrl_operators.transport.base import (
    Bucket,
    Stream,
    TensorMeta,
    TransferError,
    aligned,
    as_bytes,
    bucket_nbytes,
    from_bytes,
)
from flowrl_operators.transport.engine_wire import CONNECT_TIMEOUT_S, unreachable_as_error
from flowrl_operators.transport.registry import Transport

BUCKET, END, ABORT = 1, 2, 3
Layout = Literal["flat", "per_tensor"]


@dataclass(frozen=True)
class BroadcastGroup:
    """Where to join: the arguments of SGLang's `init_weights_update_group` (rank_offset is 1)."""

    address: str
    port: int
    world_size: int
    group_name: str
    backend: str  # "gloo" or "nccl"
    timeout_s: float = 600.0

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")


@dataclass(frozen=True)
class BroadcastRecord:
    version: int
    group: BroadcastGroup
    layout: Layout
    transport: str = "broadcast"


def connect(group: BroadcastGroup, rank: int, store: dist.Store | None = None):
    """Join `group` as `rank` (blocks until every rank joined); returns the backend process group."""
    timeout = datetime.timedelta(seconds=group.timeout_s)
    if store is None:  # connecting is bounded apart: an address where nothing answers fails in seconds
        reach = datetime.timedelta(seconds=min(CONNECT_TIMEOUT_S, group.timeout_s))
        store = unreachable_as_error(lambda: dist.TCPStore(
            group.address, group.port, group.world_size, is_master=False, timeout=reach, multi_tenant=True),
            group.address, group.port, reach)
        store.set_timeout(timeout)
    # The key layout of torch's group construction under SGLang's `init_custom_process_group`:
    # "<name>" then "<name>/" then "<device>/" (one gloo backend, on "cpu/"; NCCL on "cuda/").
    device = "cuda" if group.backend == "nccl" else "cpu"
    name = group.group_name
    prefixed = dist.PrefixStore(f"{device}/", dist.PrefixStore(f"{name}/", dist.PrefixStore(name, store)))
    if group.backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, group.world_size, timeout)
    if group.backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, group.world_size, options)
    raise ValueError(f"broadcast backend {group.backend!r} is not gloo or nccl")


def broadcast(pg, tensor: torch.Tensor, wait: bool = True):
    """Broadcast `tensor` from rank 0 of `pg`; with wait=False, return the handle to wait on."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    work = pg.broadcast([tensor], options)
    if wait:
        work.wait()
        return None
    return work


class BroadcastSender:
    """Rank 0 of the group. `send` returns the record at once and broadcasts in a background thread;
    the next `send` (or `wait`) waits for that transfer, so versions never interleave on the wire."""

    transport = "broadcast"

    def __init__(self, receivers: int = 1, address: str = "127.0.0.1", port: int = 0, backend: str = "auto",
                 group_name: str = "flowrl-weights", layout: Layout = "per_tensor", timeout_s: float = 600.0) -> None:
        if receivers < 1:
            raise ValueError(f"a broadcast needs at least one receiving engine, got receivers={receivers}")
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        self.receivers, self.layout, self.timeout_s = receivers, layout, timeout_s
        self.address, self.backend, self.base_name = address, backend, group_name
        timeout = datetime.timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(address, port, receivers + 1, is_master=True, timeout=timeout,
                                   wait_for_workers=False, multi_tenant=True)
        self._incarnation = itertools.count()
        self.group = self._new_group()
        self._pg = None
        # Two flat buffers: bucket k+1 is packed into one while bucket k is still on the wire from the
        # other (gloo and NCCL run the broadcast asynchronously; `_inflight` holds its handle).
        self._flat = [torch.empty(0, dtype=torch.uint8, device=self.group.device) for _ in range(2)]
        self._inflight: list = [None, None]
        self._slot = 0
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None  # why the last transfer failed, if it did
        self.seconds = 0.0  # duration of the last transfer

    def _new_group(self) -> BroadcastGroup:
        name = f"{self.base_name}-{next(self._incarnation)}"
        return BroadcastGroup(self.address, self.store.port, self.receivers + 1, name, self.backend, self.timeout_s)

    def send(self, buckets: Iterable[Bucket], version: int) -> BroadcastRecord:
        self._join(None)  # a failed previous version was already dropped by the engines: go on
        self.error = None
        record = BroadcastRecord(version, self.group, self.layout)
        self._thread = threading.Thread(target=self._run, args=(buckets, version), daemon=True,
                                        name=f"flowrl-broadcast-v{version}")
        self._thread.start()
        return record

    def wait(self, timeout: float | None = None) -> None:
        """Block until the last version was delivered; raises TransferError if it was not."""
        self._join(timeout)
        if self.error is not None:
            raise TransferError(f"the last weight broadcast failed: {self.error!r}") from self.error

    def _join(self, timeout: float | None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TransferError(f"weight broadcast still running after {timeout} s")
            self._thread = None

    def close(self) -> None:
        if self._thread is not None:
            self._thread.join(self.timeout_s)
        self._pg = None

    def _run(self, buckets: Iterable[Bucket], version: int) -> None:
        start = time.perf_counter()
        try:
            if self._pg is None:
                self._pg = connect(self.group, 0, self.store)
            iterator = iter(buckets)
            while True:
                try:
                    bucket = next(iterator, None)  # may gather from FSDP shards, and may raise
                except Exception as exc:  # the source failed, the group is fine: engines drop the version
                    self.error = exc
                    self._drain()
                    self._header(ABORT, 0, 0, version)
                    return
                if bucket is None:
                    self._drain()
                    self._header(END, 0, 0, version)
                    return
                self._send_bucket(bucket, version)
        except Exception as exc:  # the group failed (a receiver died, a timeout): never reuse it
            self.error = exc
            self._pg, self.group, self._inflight = None, self._new_group(), [None, None]
        finally:
            self.seconds = time.perf_counter() - start

    def _drain(self) -> None:
        for slot, work in enumerate(self._inflight):
            if work is not None:
                work.wait()
                self._inflight[slot] = None

    def _header(self, kind: int, meta_len: int, data_len: int, version: int) -> None:
        broadcast(self._pg, torch.tensor([kind, meta_len, data_len, version], dtype=torch.int64,
                                          device=self.group.device))

    def _send_bucket(self, bucket: Bucket, version: int) -> None:
        device = self.group.device
        metas = [TensorMeta.of(name, t) for name, t in bucket]
        meta = msgspec.msgpack.encode([[m.name, m.dtype, list(m.shape)] for m in metas])
        if self.layout == "per_tensor":  # no packing copy: each tensor goes from where it lies
            self._header(BUCKET, len(meta), bucket_nbytes(bucket), version)
            broadcast(self._pg, torch.frombuffer(bytearray(meta), dtype=torch.uint8).to(device))
            tensors = [t.detach().to(device).contiguous() for _, t in bucket]
            for work in [broadcast(self._pg, t, wait=False) for t in tensors]:
                work.wait()
            return
        # Pack first (overlapping the previous bucket's broadcast), then announce and send.
        slot, self._slot = self._slot, 1 - self._slot
        if self._inflight[slot] is not None:
            self._inflight[slot].wait()
            self._inflight[slot] = None
        size = sum(aligned(m.nbytes) for m in metas)
        if self._flat[slot].numel() < size:
            self._flat[slot] = torch.empty(size, dtype=torch.uint8, device=device)
        flat, offset = self._flat[slot], 0
        for (_, t), m in zip(bucket, metas, strict=True):
            flat[offset:offset + m.nbytes].copy_(as_bytes(t))
            offset += aligned(m.nbytes)
        self._header(BUCKET, len(meta), size, version)
        broadcast(self._pg, torch.frombuffer(bytearray(meta), dtype=torch.uint8).to(device))
        self._inflight[slot] = broadcast(self._pg, flat[:size], wait=False)


_joined: dict[tuple[str, int, str, int], object] = {}
_joined_lock = threading.Lock()
_joining: dict[tuple[str, int, str, int], threading.Lock] = {}


class BroadcastStream(Stream):
    """Rank `rank` of the record's group. It receives one bucket ahead: while the engine copies
    bucket k, bucket k+1 arrives. Buckets are views of two alternating receive buffers, so a bucket stays valid until the engine asks for the one after it (engines copy a
    bucket before taking the next)."""

    transport = "broadcast"
    _buffers: dict[tuple[torch.device, int, int], torch.Tensor] = {}  # per device, rank, slot; reused

    def __init__(self, record: BroadcastRecord, rank: int) -> None:
        super().__init__()
        if not 1 <= rank < record.group.world_size:
            raise TransferError(f"engine rank {rank} is outside the broadcast group of {record.group.world_size} "
                                "(rank 0 is the sender; set the sync node's `receivers` to the number of engines)")
        self.record, self.rank = record, rank
        self._ended = False
        self._problem: TransferError | None = None
        self._slot = 0  # which of the two receive buffers the next flat bucket lands in
        self._pending: asyncio.Future | None = None  # the bucket being received ahead

    def _group(self):
        g = self.record.group
        key = (g.address, g.port, g.group_name, self.rank)
        with _joined_lock:  # one lock per rank: two engines of one process join concurrently
            lock = _joining.setdefault(key, threading.Lock())
        with lock:
            if key not in _joined:
                _joined[key] = connect(g, self.rank)
            return _joined[key]

    def _receive(self, pg, shape: tuple[int, ...], dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
        tensor = out if out is not None else torch.empty(shape, dtype=dtype, device=self.record.group.device)
        broadcast(pg, tensor)
        return tensor

    def _next(self) -> Bucket | None:
        if self._ended:
            return None
        g = self.record.group
        try:
            pg = self._group()
            kind, meta_len, data_len, version = self._receive(pg, (4,), torch.int64).tolist()
            if kind == END:
                self._ended = True
                return None
            if kind == ABORT:
                self._ended = True
                raise TransferError(f"the sender of weights version {version} failed mid-way; the version is dropped")
            raw = self._receive(pg, (meta_len,), torch.uint8).cpu().numpy().tobytes()
            metas = [TensorMeta(n, d, tuple(s)) for n, d, s in msgspec.msgpack.decode(raw)]
            # Either layout lands in a reused receive buffer (fresh memory would page-fault).
            size = sum(aligned(m.nbytes) for m in metas)
            key = (g.device, self.rank, self._slot)
            self._slot = 1 - self._slot
            buffer = self._buffers.get(key)
            if buffer is None or buffer.numel() < size:
                buffer = self._buffers[key] = torch.empty(size, dtype=torch.uint8, device=g.device)
            bucket, offset = [], 0
            for m in metas:
                bucket.append((m.name, from_bytes(buffer[offset:offset + m.nbytes], m)))
                offset += aligned(m.nbytes)
            if self.record.layout == "per_tensor":
                for work in [broadcast(pg, t, wait=False) for _, t in bucket]:
                    work.wait()
            else:
                if data_len != size:
                    raise TransferError(f"bucket of {data_len} bytes does not match its metadata ({size} bytes)")
                self._receive(pg, (data_len,), torch.uint8, buffer[:data_len])
        except TransferError:
            raise
        except Exception as exc:  # the group broke (a peer died, a timeout): forget it
            self._ended = True
            with _joined_lock:
                _joined.pop((g.address, g.port, g.group_name, self.rank), None)
            raise TransferError(f"weight broadcast from {g.address}:{g.port} ({g.group_name}) failed: {exc}") from exc
        if version != self.record.version and self._problem is None:
            self._problem = TransferError(f"the sender is broadcasting version {version}, this record is "
                                          f"version {self.record.version}")
        if self._problem is not None:
            raise self._problem
        return bucket

    async def _iterate(self) -> AsyncIterator[Bucket]:
        self._pending = asyncio.ensure_future(asyncio.to_thread(self._next))
        while True:
            bucket = await self._pending
            if bucket is None:
                break
            self._pending = asyncio.ensure_future(asyncio.to_thread(self._next))
            self.buckets += 1
            self.bytes += bucket_nbytes(bucket)
            yield bucket
        self.done_at = time.perf_counter()

    async def close(self) -> None:
        if self._pending is not None:  # a receive still running in its thread: let it land first
            await asyncio.gather(self._pending, return_exceptions=True)
        await super().close()

    def _finish(self) -> None:
        while not self._ended:
            try:
                self._next()
            except TransferError:
                if not self._ended:
                    continue


def _sender(config: Any) -> BroadcastSender:
    return BroadcastSender(receivers=config.receivers, address=config.address, port=config.port,
                           backend=config.backend, layout=config.layout, timeout_s=config.timeout_s)


TRANSPORT = Transport("broadcast", BroadcastRecord, _sender,
                      lambda record, replica: BroadcastStream(record, rank=1 + replica))  # rank 0 sends
