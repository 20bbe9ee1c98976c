"""The embedded engine behind HTTP on 127.0.0.1, speaking SGLang's native protocol and OpenAI chat.

    python -m flowrl_operators.engine.server --model builtin:tiny-qwen2 --port 0

prints `flowrl engine listening on http://127.0.0.1:PORT` once it serves. Routes (SGLang 0.5.23's
names and bodies; weight versions are strings on the wire, as in SGLang, holding integers):

  POST /generate                 input_ids (or text), sampling_params, return_logprob, top_logprobs_num,
                                 rid, image_data
                                 (inline images: image_data.py); a list of prompts is a batch. Answer:
                                 output_ids, text, meta_info (finish_reason {"type": stop|length|abort},
                                 output_token_logprobs [(logprob, token_id, null)], output_top_logprobs
                                 (with top_logprobs_num), weight_version(s));
                                 a rejected request: 400 {"error": {"message"}}; in a batch, abort.
  POST /pause_generation         {"mode": "abort" (default, as SGLang) | "retract" | "in_place"}
  POST /continue_generation
  POST /abort_request            {"rid": prefix} or {"abort_all": true}; rids match by prefix
  POST /update_weights_from_tensor   serialized_named_tensors: base64 safetensors (see transfer.py)
  POST /update_weights_from_disk     {"model_path"}
  POST /init_weights_update_group, /update_weights_from_distributed, /destroy_weights_update_group
                                 (the rendezvous bounded by rendezvous_timeout_s: groups.py)
  POST /begin_weight_update, /end_weight_update: updates in between are staged and applied together
  POST /update_weight_version    {"new_version"}
  GET|POST /flush_cache          400 while requests run (nothing else is cached)
  GET  /get_weight_version, /get_model_info, /get_server_info, /health, /health_generate, /v1/models
  POST /v1/chat/completions      OpenAI chat through the tokenizer's chat template: `stop`, `logprobs`,
                                 image_url parts (VL models), `tools`; the rest a 400 (see chat.py)
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import sys
import time
import uuid

import msgspec
import torch
from aiohttp import web

from flowrl_operators.chat.request import MAX_COMPLETIONS, check_length, off_loop
from flowrl_operators.engine.embedded.engine import EmbeddedEngine
from flowrl_operators.engine.server import chat, groups
from flowrl_operators.engine.server.wire import (  # noqa: F401 - version_spans, sampling_from: named here too
    BODY_LIMIT,
    WEIGHTS_LIMIT,
    BadRequest,
    errors_as_json,
    json_body,
    ok,
    parse_version,
    sampling_from,
    success,
    version_spans,
)
from flowrl_operators.engine.sglang.image_data import request_images
from flowrl_operators.inference import PAUSE_MODES, GenerateRequest, GenerateResult
from flowrl_operators.models import load_tokenizer
from flowrl_operators.transport.engine_wire import LOAD_FORMAT, decode_bucket, parse_dtype


class EngineServer:
    """aiohttp routes around one engine. Build with `start_server`, or `app()` for a custom runner."""

    def __init__(self, engine: EmbeddedEngine, tokenizer=None, model_name: str | None = None,
                 rendezvous_timeout_s: float = groups.RENDEZVOUS_TIMEOUT_S) -> None:
        self.engine = engine
        self.rendezvous_timeout_s = rendezvous_timeout_s  # /init_weights_update_group's bound (groups.py)
        self.tokenizer = tokenizer
        self.model_name = model_name or str(engine.folder)
        self.session: dict[str, torch.Tensor] | None = None  # staged weights between begin/end
        self.session_version: int | None = None
        self.session_error: str | None = None  # a failed update poisons the session: none applies
        self.groups: dict[str, object] = {}  # weight broadcast groups by name
        self.joining: set[str] = set()  # group names whose rendezvous is under way

    def app(self) -> web.Application:
        # Bodies are read by json_body, with each route's own limit (WEIGHTS_LIMIT for weights).
        app = web.Application(client_max_size=WEIGHTS_LIMIT, middlewares=[errors_as_json])
        get, post = app.router.add_get, app.router.add_post
        post("/generate", self.generate)
        post("/pause_generation", self.pause)
        post("/continue_generation", self.resume)
        post("/abort_request", self.abort)
        post("/update_weights_from_tensor", self.update_from_tensor)
        post("/update_weights_from_disk", self.update_from_disk)
        post("/init_weights_update_group", self.init_group)
        post("/update_weights_from_distributed", self.update_from_distributed)
        post("/destroy_weights_update_group", self.destroy_group)
        post("/begin_weight_update", self.begin_update)
        post("/end_weight_update", self.end_update)
        post("/update_weight_version", self.set_version)
        for route in ("/flush_cache",):
            get(route, self.flush_cache)
            post(route, self.flush_cache)
        get("/get_weight_version", self.weight_version)
        get("/get_model_info", self.model_info)
        get("/get_server_info", self.server_info)
        get("/health", self.health)
        get("/health_generate", self.health)
        get("/v1/models", self.models)
        post("/v1/chat/completions", self.chat)
        return app

    # --- generation -------------------------------------------------------------------------------

    async def generate(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        if body.get("stream"):
            raise BadRequest("stream=true is not supported by the embedded engine's /generate")
        prompts, batched = await self._prompts(body)
        rids = body.get("rid")
        if rids is None:
            rids = [uuid.uuid4().hex for _ in prompts]
        elif isinstance(rids, str):
            rids = [rids] if not batched else [f"{rids}-{i}" for i in range(len(prompts))]
        if not isinstance(rids, list) or len(rids) != len(prompts):
            raise BadRequest(f"rid must be a string or a list of one per prompt ({len(prompts)}), got {rids!r:.80}")
        sampling = sampling_from(body.get("sampling_params"))
        top = body.get("top_logprobs_num") or 0
        if not isinstance(top, int) or top < 0:
            raise BadRequest(f"top_logprobs_num must be a non-negative integer, got {top!r}")
        sampling = msgspec.structs.replace(sampling, top_logprobs=top)
        started = time.perf_counter()
        pictures = await off_loop(request_images, body.get("image_data"), len(prompts), batched)
        requests = [GenerateRequest(request_id=str(rid), input_ids=ids, sampling=sampling, images=refs)
                    for rid, ids, refs in zip(rids, prompts, pictures, strict=True)]
        results = await asyncio.gather(*[self.engine.generate(r) for r in requests])
        if not batched and results[0].error:
            raise BadRequest(results[0].error)
        answers = [self._answer(r, len(ids), bool(body.get("return_logprob")), started)
                   for r, ids in zip(results, prompts, strict=True)]
        return web.json_response(answers if batched else answers[0])

    async def _prompts(self, body: dict) -> tuple[list[list[int]], bool]:
        if body.get("input_ids") is not None:
            ids = body["input_ids"]
            batched = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
            prompts = ids if batched else [ids]
            if not isinstance(ids, list) or not all(isinstance(p, list) for p in prompts):
                raise BadRequest("input_ids must be a list of token ids, or a list of such lists (a batch)")
        elif body.get("text") is not None:
            if self.tokenizer is None:
                raise BadRequest("this server has no tokenizer; send input_ids")
            text = body["text"]
            batched = isinstance(text, list)
            prompts = text if batched else [text]
            if not all(isinstance(t, str) for t in prompts):
                raise BadRequest("text must be a string, or a list of strings (a batch)")
        else:
            raise BadRequest("a /generate request needs input_ids (or text)")
        if not 1 <= len(prompts) <= MAX_COMPLETIONS:
            raise BadRequest(f"a /generate batch holds 1 to {MAX_COMPLETIONS} prompts, got {len(prompts)}")
        if body.get("input_ids") is None:
            check_length(prompts, self.tokenizer, self.engine.max_context, BadRequest)
            prompts = await off_loop(self._encode, prompts)
        return prompts, batched

    def _encode(self, texts: list[str]) -> list[list[int]]:
        try:
            return [self.tokenizer.encode(t, add_special_tokens=False) for t in texts]
        except UnicodeEncodeError as e:  # a lone surrogate sent as a JSON escape, if a parser let one through
            raise BadRequest(f"text is not valid Unicode: {e}") from None

    def _answer(self, result: GenerateResult, prompt_tokens: int, logprobs: bool, started: float) -> dict:
        if result.finish_reason == "stop":
            reason = {"type": "stop", "matched": result.output_ids[-1]}
        elif result.finish_reason == "length":
            reason = {"type": "length", "length": len(result.output_ids)}
        else:
            reason = {"type": "abort", "message": result.error or "aborted"}
        spans = version_spans(result.versions, self.engine.version)
        meta = {
            "id": result.request_id,
            "finish_reason": reason,
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(result.output_ids),
            "cached_tokens": 0,
            "weight_version": spans[-1]["version"],
            "weight_versions": spans,
            "e2e_latency": time.perf_counter() - started,
        }
        if logprobs:
            meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in
                                             zip(result.logprobs, result.output_ids, strict=True)]
            if result.top_ids:  # top_logprobs_num > 0: per token, its K (logprob, token id, text)
                meta["output_top_logprobs"] = [[[lp, tok, None] for lp, tok in zip(lps, ids, strict=True)]
                                               for lps, ids in zip(result.top_logprobs, result.top_ids, strict=True)]
        text = self.tokenizer.decode(result.output_ids) if self.tokenizer is not None else ""
        return {"text": text, "output_ids": result.output_ids, "meta_info": meta}

    async def chat(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        if self.tokenizer is None:
            raise BadRequest("this server has no tokenizer, so no chat template")
        return web.json_response(await chat.complete(self.engine, self.tokenizer, body, self.model_name, BadRequest))

    # --- control ------------------------------------------------------------------------------------

    async def pause(self, request: web.Request) -> web.Response:
        mode = (await json_body(request)).get("mode", "abort")
        if mode not in PAUSE_MODES:
            raise BadRequest(f"mode {mode!r} is not one of {', '.join(PAUSE_MODES)}")
        await self.engine.pause(mode)
        return ok("Generation paused successfully.")

    async def resume(self, request: web.Request) -> web.Response:
        await self.engine.resume()
        return ok("Generation continued successfully.")

    async def abort(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        if body.get("abort_all"):
            await self.engine.abort_all()
        else:
            prefix = str(body.get("rid", ""))
            if not prefix:
                raise BadRequest("give rid (a prefix of request ids) or abort_all: true")
            for rid in self.engine.request_ids():
                if rid.startswith(prefix):
                    await self.engine.abort(rid)
        return web.Response(status=200)

    async def flush_cache(self, request: web.Request) -> web.Response:
        if self.engine.stats()["running"] or self.engine.stats()["waiting"]:
            return web.Response(status=400, text="Cache not flushed: requests are running.\n")
        return web.Response(status=200, text="Cache flushed.\n")

    # --- weights ------------------------------------------------------------------------------------

    async def _install(self, staged: dict[str, torch.Tensor], body: dict) -> web.Response:
        """Commit staged tensors now, or add them to the open begin/end session."""
        if body.get("abort_all_requests"):
            await self.engine.abort_all()
        if self.session is not None:
            self.session.update(staged)
            if body.get("weight_version") is not None:
                self.session_version = parse_version(body["weight_version"])
            return success(f"staged {len(staged)} tensors in the open weight update")
        version = body.get("weight_version")
        await self.engine.commit(staged, self.engine.version if version is None else parse_version(version))
        return success(f"updated {len(staged)} tensors; weight version {self.engine.version}")

    async def update_from_tensor(self, request: web.Request) -> web.Response:
        body = await json_body(request, WEIGHTS_LIMIT)
        load_format = body.get("load_format") or LOAD_FORMAT
        if load_format != LOAD_FORMAT:
            raise BadRequest(f"load_format {load_format!r} is not supported; the embedded engine takes "
                             f"{LOAD_FORMAT!r} (base64 safetensors, see flowrl_operators.transport.engine_wire)")
        staged = {}
        for entry in body.get("serialized_named_tensors") or []:
            staged.update(await self._stage(decode_bucket, entry))
        return await self._install(staged, body)

    async def _stage(self, receive, *args) -> dict[str, torch.Tensor]:
        """Receive a bucket with `receive(*args)` and stage it; a failure inside a session poisons it."""
        try:
            bucket = await asyncio.to_thread(receive, *args)
            return await asyncio.to_thread(self.engine.stage, bucket)
        except Exception as exc:
            if self.session is not None:
                self.session_error = f"{type(exc).__name__}: {exc}"
            raise

    async def update_from_disk(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        if not body.get("model_path"):
            raise BadRequest("update_weights_from_disk needs model_path")
        version = body.get("weight_version")
        await self.engine.load_weights_from_disk(
            body["model_path"], self.engine.version if version is None else parse_version(version))
        return success(f"loaded {body['model_path']}", num_paused_requests=0)

    async def init_group(self, request: web.Request) -> web.Response:
        args = groups.group_args(await json_body(request), self.rendezvous_timeout_s, torch.cuda.is_available())
        if args.name in self.groups or args.name in self.joining:
            raise BadRequest(f"weight update group {args.name!r} exists; destroy it first")
        self.joining.add(args.name)  # two concurrent joins of one name: the second is refused, not leaked
        try:
            self.groups[args.name] = await groups.join(args)
        finally:
            self.joining.discard(args.name)
        return success(f"joined weight update group {args.name!r}")

    async def update_from_distributed(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        name = body.get("group_name", "weight_update_group")
        if name not in self.groups:
            raise BadRequest(f"no weight update group {name!r}; call /init_weights_update_group first")
        shapes, dtypes = body["shapes"], [parse_dtype(d) for d in body["dtypes"]]
        staged = await self._stage(receive_broadcast, self.groups[name], body["names"], dtypes, shapes)
        return await self._install(staged, body)

    async def destroy_group(self, request: web.Request) -> web.Response:
        name = (await json_body(request)).get("group_name", "weight_update_group")
        group = self.groups.pop(name, None)
        if group is not None:
            torch.distributed.destroy_process_group(group)
        return success(f"destroyed weight update group {name!r}")

    async def begin_update(self, request: web.Request) -> web.Response:
        if self.session is not None:
            raise BadRequest("a weight update session is already open; end it with /end_weight_update")
        self.session, self.session_version, self.session_error = {}, None, None
        return success("weight update session open")

    async def end_update(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        if self.session is None:
            raise BadRequest("no weight update session is open; call /begin_weight_update first")
        staged, self.session = self.session, None
        if self.session_error:
            raise BadRequest(f"nothing applied: an update in this session failed ({self.session_error})")
        version = body.get("weight_version")
        version = parse_version(version) if version is not None else self.session_version
        await self.engine.commit(staged, self.engine.version if version is None else version)
        return success(f"applied {len(staged)} tensors; weight version {self.engine.version}")

    async def set_version(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        if body.get("abort_all_requests"):
            await self.engine.abort_all()
        await self.engine.set_version(parse_version(body.get("new_version")))
        return success(f"weight version {self.engine.version}", new_version=str(self.engine.version))

    # --- information --------------------------------------------------------------------------------

    async def weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": str(self.engine.version)})

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": str(self.engine.folder), "is_generation": True,
                                  "weight_version": str(self.engine.version)})

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response({"engine": "flowrl-embedded", **self.engine.stats(),
                                  "weight_version": str(self.engine.version)})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=503 if self.engine.closed else 200)

    async def models(self, request: web.Request) -> web.Response:
        card = {"id": self.model_name, "object": "model", "owned_by": "flowrl", "root": self.model_name,
                "max_model_len": self.engine.max_context}
        return web.json_response({"object": "list", "data": [card]})


def receive_broadcast(group, names: list[str], dtypes: list[torch.dtype], shapes: list[list[int]]):
    """Receive one bucket broadcast by rank 0 of `group`, tensor by tensor in the given order."""
    bucket = []
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        tensor = torch.empty(shape, dtype=dtype)
        torch.distributed.broadcast(tensor, src=0, group=group)
        bucket.append((name, tensor))
    return bucket


async def start_server(engine: EmbeddedEngine, host: str = "127.0.0.1", port: int = 0, tokenizer=None,
                       model_name: str | None = None,
                       rendezvous_timeout_s: float = groups.RENDEZVOUS_TIMEOUT_S) -> tuple[web.AppRunner, int]:
    """Serve `engine` on host:port (port 0: a free one) in the running loop; returns (runner, port).
    Stop with `await runner.cleanup()`."""
    if not ipaddress.ip_address(host).is_loopback:
        raise ValueError(f"host {host!r}: the engine server binds loopback addresses only (127.0.0.1)")
    # handler_cancellation: a client that disconnects cancels its handler, and so its requests' work
    # (EmbeddedEngine.generate aborts a cancelled request), instead of generating for nobody.
    runner = web.AppRunner(EngineServer(engine, tokenizer, model_name, rendezvous_timeout_s).app(), access_log=None,
                           handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]


async def serve(args: argparse.Namespace) -> None:
    engine = EmbeddedEngine(args.model, max_slots=args.max_slots, max_context=args.max_context,
                            dtype=args.dtype, device=args.device, threads=args.threads, seed=args.seed)
    tokenizer = load_tokenizer(engine.folder)
    runner, port = await start_server(engine, args.host, args.port, tokenizer, model_name=args.model,
                                      rendezvous_timeout_s=args.rendezvous_timeout)
    print(f"flowrl engine listening on http://{args.host}:{port}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
        await engine.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="flowrl's embedded engine as an SGLang-compatible server")
    parser.add_argument("--model", required=True, help="checkpoint folder or builtin:<name>")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port (printed on start)")
    parser.add_argument("--max-slots", type=int, default=32)
    parser.add_argument("--max-context", type=int, default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (one per process is fastest "
                        "when processes share cores)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rendezvous-timeout", type=float, default=groups.RENDEZVOUS_TIMEOUT_S,
                        help="seconds /init_weights_update_group waits for rank 0 before a 400")
    try:
        asyncio.run(serve(parser.parse_args(argv)))
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
