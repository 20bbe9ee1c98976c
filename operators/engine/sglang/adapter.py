"""SGLang backend: `SGLangEngine` drives SGLang servers over their native HTTP API behind flowrl's
`InferenceEngine` interface. Launching servers (`launch_servers`, `make_engine`) is in
`launch.py` and `../factory.py`.

Written against SGLang 0.5.23's protocol (read from its source; see the routes in
`flowrl_operators.engine.server.server`, which speaks the same protocol and is what this adapter is tested
against on CPU). Not run against a real SGLang server in flowrl's CI.

Generation. `/generate` with `input_ids`, `sampling_params` and `return_logprob`; the answer's
`output_ids` with `meta_info.output_token_logprobs` (logprob, token id, text) and the per-token weight
version from `meta_info.weight_versions` spans (SGLang >= 0.5.20), else `meta_info.weight_version`.
`sampling.top_logprobs` K > 0 sends `top_logprobs_num: K` and reads `meta_info.output_top_logprobs`
(per token K (logprob, token id, text)). SGLang reports these logprobs from the distribution it
reports `output_token_logprobs` from; flowrl's trainer compares them with softmax(logits /
temperature) (`SamplingParams`).
Each submission gets a fresh 32-character rid, because SGLang's `/abort_request` matches rids by
prefix ("a/1#1" would also abort "a/1#10"). Several servers are balanced by fewest requests in flight.
A vision-language request's images go as `image_data` data URLs (`image_data.py`).

Pause. `pause(mode)` posts `/pause_generation` to every server and holds new submissions in the
adapter until `resume()` posts `/continue_generation`. Mode "retract" (the default for partial
rollout) keeps requests and recomputes their KV under the new weights; "abort" returns partial
outputs with finish reason "abort", which flowrl's workflows resubmit as prompt + partial output.

Weights, one of (`weight_sync`):
- "tensor": `/update_weights_from_tensor`. flowrl's server takes base64 safetensors buckets; a real
  SGLang server takes its own CUDA-IPC serialisation, which works only when the buckets live on the
  server's GPU (colocated) and needs `sglang` importable here.
- "distributed": this adapter is rank 0 of a broadcast group (`/init_weights_update_group`, once);
  per bucket `/update_weights_from_distributed` carries names, dtypes and shapes while the tensors go
  by broadcast (NCCL on GPU, gloo on CPU). `push_distributed` is the same push for a trainer that
  wants to be rank 0 itself.
- "disk": buckets are written to a checkpoint folder and loaded with `/update_weights_from_disk`.
Tensor and distributed pushes run inside `/begin_weight_update` .. `/end_weight_update` when the
server has those routes (SGLang >= 0.5.21; flowrl's server applies the session atomically); the
version travels as `weight_version` and is set again with `/update_weight_version` at the end.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterable, Iterable
from pathlib import Path
from typing import Any, Literal

import aiohttp

from flowrl_operators.engine.sglang.image_data import image_data
from flowrl_operators.engine.sglang.protocol import (  # noqa: F401 - token_versions, top_tokens: named here too
    error_message,
    finish_reason,
    parse_answer,
    sampling_params,
    token_versions,
    top_tokens,
)
from flowrl_operators.engine.sglang.weights import (
    ServerError,
    WeightGroup,
    join_servers,
    push_distributed,
    sglang_ipc,
    write_checkpoint,
)
from flowrl_operators.inference import (
    PAUSE_MODES,
    Buckets,
    GenerateRequest,
    GenerateResult,
    PauseMode,
)

WeightSync = Literal["auto", "tensor", "distributed", "disk"]
FLOWRL_SERVER = "flowrl-embedded"  # what flowrl's own server reports as `engine` in /get_server_info
# --- the adapter --------------------------------------------------------------------------------------


class Server:
    """One server as the adapter sees it: its URL, requests in flight, ranks in the weight group."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.in_flight = 0
        self.kind = "sglang"
        self.tp_size = 1
        self.sessions: bool | None = None  # has /begin_weight_update (unknown until tried)


class SGLangEngine:
    """`InferenceEngine` over one or more SGLang (or flowrl) servers at `urls`.

    `weight_sync` picks how `update_weights` delivers buckets (see the module docs); "auto" is
    "tensor" for flowrl's own server and "distributed" for SGLang. `model_path` is needed by "disk"
    (config and tokenizer files are copied from it). `owned` are launched servers this engine stops on
    `close()`.
    """

    def __init__(self, urls: str | Iterable[str], *, weight_sync: WeightSync = "auto",
                 model_path: str | os.PathLike | None = None, timeout_s: float = 3600.0,
                 backend: str = "auto", owned: Iterable[Any] = ()) -> None:
        urls = [u.strip() for u in urls.split(",")] if isinstance(urls, str) else list(urls)
        if not urls or not all(urls):
            raise ValueError("engine.url: give one or more server URLs (http://host:port, comma-separated)")
        self.servers = [Server(u) for u in urls]
        self.weight_sync = weight_sync
        self.model_path = None if model_path is None else str(model_path)
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.backend = backend
        self.owned = list(owned)
        self._version = 0
        self._session: aiohttp.ClientSession | None = None
        self._starting: asyncio.Future | None = None
        self._resumed: asyncio.Event | None = None
        self._paused = False
        self._requests: dict[str, tuple[Server, str, asyncio.Future]] = {}
        self._group: WeightGroup | None = None  # the weight broadcast group (weight_sync "distributed")
        self._disk_dir: Path | None = None

    # --- InferenceEngine -----------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    @property
    def paused(self) -> bool:
        return self._paused

    async def start(self) -> None:
        """Connect: check every server is healthy and read its version, kind and tensor parallelism."""
        if self._starting is None:  # the first caller connects; concurrent callers wait for it
            self._starting = asyncio.ensure_future(self._connect())
        await asyncio.shield(self._starting)

    async def _connect(self) -> None:
        self._session = aiohttp.ClientSession(timeout=self.timeout)
        self._resumed = asyncio.Event()
        self._resumed.set()
        versions = set()
        for server in self.servers:
            info = await self._get(server, "/get_server_info")
            server.kind = FLOWRL_SERVER if info.get("engine") == FLOWRL_SERVER else "sglang"
            server.tp_size = int(info.get("tp_size") or 1)
            versions.add(int((await self._get(server, "/get_weight_version")).get("weight_version") or 0))
        if len(versions) > 1:
            raise ServerError(f"the servers serve different weight versions {sorted(versions)}; "
                              "start them from one checkpoint")
        self._version = versions.pop()
        if self.weight_sync == "auto":
            flowrl = all(s.kind == FLOWRL_SERVER for s in self.servers)
            self.weight_sync = "tensor" if flowrl else "distributed"

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        await self.start()
        if request.request_id in self._requests:
            return GenerateResult(request_id=request.request_id, finish_reason="abort",
                                  error=f"request id {request.request_id!r} is already in flight; use a unique id")
        await self._resumed.wait()  # hold new work while paused, as the embedded engine does
        server = min(self.servers, key=lambda s: s.in_flight)
        rid = uuid.uuid4().hex  # fixed length: abort_request matches by prefix
        done = asyncio.get_running_loop().create_future()
        self._requests[request.request_id] = (server, rid, done)
        server.in_flight += 1
        body = {"input_ids": list(request.input_ids), "sampling_params": sampling_params(request.sampling),
                "return_logprob": True, "rid": rid, **image_data(request.images)}
        if request.sampling.top_logprobs > 0:
            body["top_logprobs_num"] = request.sampling.top_logprobs
        try:
            status, answer = await self._call(server, "/generate", body)
            if status == 400:  # the server rejected this request; the engine serves on
                result = GenerateResult(request_id=request.request_id, finish_reason="abort",
                                        error=error_message(answer))
            elif status != 200:
                raise ServerError(f"{server.url}/generate answered {status}: {error_message(answer)}")
            else:
                result = parse_answer(request.request_id, answer, request.sampling.top_logprobs)
            done.set_result(result)
            return result
        except asyncio.CancelledError:  # the caller went away: free the server's slot too
            await asyncio.shield(self._call(server, "/abort_request", {"rid": rid}))
            raise
        finally:
            server.in_flight -= 1
            self._requests.pop(request.request_id, None)
            if not done.done():
                done.cancel()

    async def pause(self, mode: PauseMode = "retract") -> None:
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r} is not one of {', '.join(PAUSE_MODES)}")
        await self.start()
        self._resumed.clear()
        self._paused = True
        await asyncio.gather(*(self._post(s, "/pause_generation", {"mode": mode}) for s in self.servers))

    async def resume(self) -> None:
        await self.start()
        await asyncio.gather(*(self._post(s, "/continue_generation", {}) for s in self.servers))
        self._paused = False
        self._resumed.set()

    async def abort(self, request_id: str) -> GenerateResult | None:
        await self.start()
        entry = self._requests.get(request_id)
        if entry is None:
            return None
        server, rid, done = entry
        await self._post(server, "/abort_request", {"rid": rid})
        try:
            return await asyncio.shield(done)
        except asyncio.CancelledError:
            return None

    async def update_weights(self, buckets: Buckets, version: int) -> None:
        """Deliver a version by `weight_sync`; raises ServerError if a server refused it."""
        await self.start()
        if self.weight_sync == "disk":
            await self._push_disk(buckets, version)
        else:
            push = self._push_tensor if self.weight_sync == "tensor" else self._push_distributed
            await self._session_begin()
            try:
                async for bucket in iterate(buckets):
                    await push(list(bucket), version)
            except BaseException:
                await self._session_end(version, failed=True)
                raise
            await self._session_end(version, failed=False)
        self._version = version
        # Prefix-cache entries were computed by the old weights; SGLang refuses while requests run (a
        # retracted request re-prefills anyway), so a refusal here is expected and harmless.
        await asyncio.gather(*(self._call(s, "/flush_cache", {}) for s in self.servers))

    async def load(self, model_path: str | os.PathLike, version: int = 0) -> None:
        """Make every server load the checkpoint folder `model_path` (a path the servers can read)
        and serve it as weight `version`."""
        await self.start()
        for server in self.servers:
            await self._post(server, "/update_weights_from_disk",
                             {"model_path": str(model_path), "weight_version": str(version)})
        self._version = version

    async def adopt(self, record: Any) -> None:
        """Take a version a trainer-side `SGLangSender` already pushed: check the servers serve it."""
        await self.start()
        for server in self.servers:
            served = int((await self._get(server, "/get_weight_version")).get("weight_version") or 0)
            if served != record.version:
                raise ServerError(f"{server.url} serves weight version {served}, expected {record.version}")
        self._version = record.version

    async def close(self) -> None:
        if self._session is not None:
            if self._group is not None:
                await asyncio.gather(*(self._call(s, "/destroy_weights_update_group",
                                                  {"group_name": self._group.name}) for s in self.servers))
            await self._session.close()
            self._session = None
        if self._group is not None:
            import torch.distributed as dist

            dist.destroy_process_group(self._group.group)
            self._group = None
        for handle in self.owned:
            stop = getattr(handle, "stop", None)
            if stop is not None:
                result = stop()
                if hasattr(result, "__await__"):
                    await result
        self.owned = []
        if self._disk_dir is not None:
            shutil.rmtree(self._disk_dir, ignore_errors=True)

    # --- weight pushes -------------------------------------------------------------------------------

    async def _session_begin(self) -> None:
        for server in self.servers:
            if server.sessions is False:
                continue
            status, answer = await self._call(server, "/begin_weight_update", {})
            if status == 404:  # SGLang before 0.5.21: no sessions, updates apply one by one
                server.sessions = False
            elif status != 200:
                raise ServerError(f"{server.url}/begin_weight_update answered {status}: {error_message(answer)}")
            else:
                server.sessions = True

    async def _session_end(self, version: int, failed: bool) -> None:
        problems = []
        for server in self.servers:
            if server.sessions:
                status, answer = await self._call(server, "/end_weight_update", {"weight_version": str(version)})
                if status != 200 and not failed:
                    problems.append(f"{server.url}/end_weight_update answered {status}: {error_message(answer)}")
            if not failed:
                await self._post(server, "/update_weight_version", {"new_version": str(version)})
        if problems:
            raise ServerError("; ".join(problems))

    async def _push_tensor(self, bucket, version: int) -> None:
        for server in self.servers:
            if server.kind == FLOWRL_SERVER:
                from flowrl_operators.transport.engine_wire import LOAD_FORMAT, encode_bucket

                body = {"serialized_named_tensors": [await asyncio.to_thread(encode_bucket, bucket)],
                        "load_format": LOAD_FORMAT}
            else:
                body = {"serialized_named_tensors": sglang_ipc(bucket, server.tp_size)}
            body.update(flush_cache=False, weight_version=str(version))
            await self._post(server, "/update_weights_from_tensor", body)

    async def _push_distributed(self, bucket, version: int) -> None:
        if self._group is None:
            self._group = await join_servers(self, self.backend)
        await push_distributed(self, self._group, bucket, version)

    async def _push_disk(self, buckets: Buckets, version: int) -> None:
        if self.model_path is None:
            raise ValueError("weight_sync 'disk' needs model_path (its config and tokenizer files are copied)")
        from flowrl_operators.models import resolve_model

        folder = Path(tempfile.mkdtemp(prefix=f"flowrl-weights-v{version}-"))
        try:
            tensors = {}
            async for bucket in iterate(buckets):
                for name, tensor in bucket:
                    tensors[name] = tensor.detach().to("cpu", copy=True).contiguous()
            await asyncio.to_thread(write_checkpoint, resolve_model(self.model_path), folder, tensors)
            await self.load(folder, version)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        if self._disk_dir is not None:
            shutil.rmtree(self._disk_dir, ignore_errors=True)
        self._disk_dir = folder  # kept until the next version: a server may read it lazily

    # --- HTTP ------------------------------------------------------------------------------------------

    async def _call(self, server: Server, route: str, body: dict | None) -> tuple[int, Any]:
        try:
            async with self._session.post(server.url + route, json=body) as response:
                if response.content_type == "application/json":
                    return response.status, await response.json()
                return response.status, await response.text()
        except aiohttp.ClientError as exc:
            raise ServerError(f"{server.url}{route}: {exc!r} (is the server running?)") from exc

    async def _post(self, server: Server, route: str, body: dict) -> Any:
        status, answer = await self._call(server, route, body)
        if status != 200 or (isinstance(answer, dict) and answer.get("success") is False):
            raise ServerError(f"{server.url}{route} answered {status}: {error_message(answer)}")
        return answer

    async def _get(self, server: Server, route: str) -> dict:
        try:
            async with self._session.get(server.url + route) as response:
                if response.status != 200:
                    raise ServerError(f"{server.url}{route} answered {response.status}: {await response.text()}")
                return await response.json(content_type=None)
        except aiohttp.ClientError as exc:
            raise ServerError(f"{server.url}{route}: {exc!r} (is the server running?)") from exc


async def iterate(buckets: Buckets):
    if isinstance(buckets, AsyncIterable):
        async for bucket in buckets:
            yield bucket
    else:
        for bucket in buckets:
            yield bucket
