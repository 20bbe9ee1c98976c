"""The sandbox service's process: `python -m flowrl_operators.tools.server '<config json>'`.

It probes once what this machine enforces (bubblewrap, the per-slot uid), serves the HTTP API on a
free loopback port, and prints one JSON line on stdout when ready (`{"port", "health"}`, or
`{"error"}` before exiting 1). It stops, killing every call and removing its folders, on SIGTERM,
SIGINT, or when its stdin reaches its end: the parent holds the other end, so the service follows
its parent's death whatever killed it, however the parent's threads come and go (a parent-death
signal would follow the thread that started the service, not the process).

API: POST /run {"code": str, "timeout_s": float?} -> a result (flowrl_operators.tools.client.ToolResult
as JSON); GET /health -> what is enforced; GET /stats -> counts and latency quantiles.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web

from flowrl_operators.config import SandboxConfig
from flowrl_operators.tools.execute import Call, Limits, kill_running, run_call
from flowrl_operators.tools.isolation import (
    ROOT_PREFIX,
    UIDS_FILE,
    become_subreaper,
    kill_uids,
    python_path,
    slot_uid,
    sweep_stale,
    unused_uid,
)
from flowrl_operators.tools.pool import Pool

MAX_CODE_BYTES = 64 << 10
PROBE = "import sys; print(sys.version_info[0])"


async def _probe_one(python: str, bwrap: bool, root: Path, limits: Limits, uid: int) -> str | None:
    """None where a trivial call runs as expected in this mode, else why not."""
    if bwrap and shutil.which("bwrap") is None:
        return "bwrap is not installed"
    out = await run_call(Call(python, bwrap, root, limits, 0, uid, os.getpid()), -1 - bwrap, PROBE, 30.0)
    if out["ok"] and out["stdout"] == "3\n":
        return None
    return (out["stderr"] or out["detail"] or "no output").strip()[-300:]


async def probe(config: SandboxConfig, python: str, root: Path, limits: Limits) -> dict[str, Any]:
    """What this machine gives: {bwrap, uids, notes}. The uid drop is tried first (root only: it is
    what makes RLIMIT_NPROC apply), then bubblewrap on top of it."""
    notes: list[str] = []
    uid = slot_uid(0) if os.geteuid() == 0 else -1
    if uid < 0:
        notes.append("the service is not root: calls run as its own user, and RLIMIT_NPROC (which would "
                     "count every process of that user) is not set")
    elif (why := await _probe_one(python, False, root, limits, uid)) is not None:
        notes.append(f"dropping to a per-slot uid failed ({why}); calls run as root, without a process limit")
        uid = -1
    bwrap = False
    if config.isolation != "rlimits":
        why = await _probe_one(python, True, root, limits, uid)
        if why is not None and config.isolation == "bwrap":
            raise RuntimeError(f"isolation: bwrap does not work here: {why}")
        bwrap = why is None
        if why is not None:
            notes.append(f"bwrap does not work here ({why}); rlimits only")
    uids = [slot_uid(i) if uid >= 0 else -1 for i in range(config.workers)]
    if uid >= 0 and not all(unused_uid(u) for u in uids):
        notes.append("a slot uid belongs to an account of this machine; calls run as root, without a process limit")
        uids = [-1] * config.workers
    (root / UIDS_FILE).write_text(json.dumps([u for u in uids if u >= 0]))
    return {"bwrap": bwrap, "uids": uids, "notes": notes}


def enforcement(config: SandboxConfig, bwrap: bool, drop: bool) -> tuple[dict[str, str], dict[str, str]]:
    """(enforced, not_enforced): what a call is held to on this machine, each with how."""
    on = {"cpu_time": f"RLIMIT_CPU {config.cpu_s} s (SIGXCPU, then SIGKILL 1 s later)",
          "memory": f"RLIMIT_AS {config.memory_mb} MiB of address space",
          "wall_time": f"{config.wall_s:g} s from the start of the process, then SIGKILL of its process group",
          "output": f"{config.output_bytes} bytes of stdout and of stderr each kept; more stops the call",
          "file_size": "RLIMIT_FSIZE 16 MiB per file written", "open_files": "RLIMIT_NOFILE 64",
          "stdin": "/dev/null", "environment": "a fixed one; nothing of the service's",
          "working_dir": "a fresh folder of its own, removed after the call"}
    off: dict[str, str] = {"disk_total": "files are limited one by one (16 MiB), not in total"}
    if drop:
        on["processes"] = f"RLIMIT_NPROC {config.processes} under the slot's own uid"
        on["leftovers"] = "every process of the slot's uid is killed after the call"
    else:
        off["processes"] = "no process limit (root is exempt from RLIMIT_NPROC); fork bombs end at the CPU or wall limit"
    if bwrap:
        on["network"] = "bwrap --unshare-net: loopback only, no route out"
        on["filesystem"] = "bwrap: read-only root; writable only its own folder, mounted at /tmp"
        on["namespaces"] = "own pid, ipc and uts namespaces; killed with the service (--die-with-parent)"
        off["reads"] = "the host's world-readable files can be read (read-only)"
    else:
        off["network"] = "no bubblewrap: the code can open network connections"
        off["filesystem"] = ("no bubblewrap: the code can write wherever its user may"
                             + (" (the slot uid: world-writable places such as /tmp)" if drop else " (root!)"))
        off["namespaces"] = "no bubblewrap: it sees the host's processes"
    return on, off


def make_app(pool: Pool, health: dict[str, Any]) -> web.Application:
    async def run(request: web.Request) -> web.Response:
        try:
            body = await request.json()
            code, timeout_s = body["code"], body.get("timeout_s")
            if not isinstance(code, str) or len(code.encode()) > MAX_CODE_BYTES:
                raise ValueError(f"code must be a string of at most {MAX_CODE_BYTES} bytes")
            if timeout_s is not None and (not isinstance(timeout_s, int | float) or timeout_s <= 0):
                raise ValueError("timeout_s must be a positive number")
        except (ValueError, KeyError, TypeError) as e:
            message = f"missing key {e}" if isinstance(e, KeyError) else str(e)
            return web.json_response({"error": "bad_request", "detail": message}, status=400)
        return web.json_response(await pool.run(code, timeout_s))

    async def get_health(request: web.Request) -> web.Response:
        return web.json_response(health)

    async def get_stats(request: web.Request) -> web.Response:
        return web.json_response(pool.stats.summary())

    app = web.Application(client_max_size=MAX_CODE_BYTES * 2)
    app.add_routes([web.post("/run", run), web.get("/health", get_health), web.get("/stats", get_stats)])
    return app


def _stop_on_eof(loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
    """Sets `stop` when stdin ends (the parent is gone)."""
    def watch() -> None:
        while sys.stdin.buffer.read(4096):
            pass
        loop.call_soon_threadsafe(stop.set)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


async def serve(config: SandboxConfig) -> None:
    stale = sweep_stale()
    subreaper = become_subreaper()
    root = Path(tempfile.mkdtemp(prefix=f"{ROOT_PREFIX}{os.getpid()}-"))
    os.chmod(root, 0o711)  # the slots' uids reach their own folders, and list none
    uids: list[int] = []
    try:
        limits = Limits(config.cpu_s, config.memory_mb, config.wall_s, config.output_bytes, config.processes)
        python = python_path()
        facts = await probe(config, python, root, limits)
        uids = facts["uids"]
        enforced, not_enforced = enforcement(config, facts["bwrap"], uids[0] >= 0)
        pool = Pool(python, facts["bwrap"], root, limits, uids, os.getpid())
        health = {"ok": True, "isolation": "bwrap" if facts["bwrap"] else "rlimits", "python": python,
                  "workers": config.workers, "limits": msgspec.to_builtins(config), "enforced": enforced,
                  "not_enforced": not_enforced, "notes": facts["notes"], "swept_at_start": stale, "pid": os.getpid(),
                  "root": str(root), "uids": uids, "subreaper": subreaper}
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        runner = web.AppRunner(make_app(pool, health), shutdown_timeout=0.5, access_log=None)
        await runner.setup()
        await web.SockSite(runner, sock).start()
        loop, stop = asyncio.get_running_loop(), asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        _stop_on_eof(loop, stop)
        print(json.dumps({"port": sock.getsockname()[1], "health": health}), flush=True)
        await stop.wait()
        kill_running()
        await runner.cleanup()
    finally:
        kill_running()
        if uids and uids[0] >= 0:
            kill_uids(set(uids))
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str]) -> int:
    try:
        config = msgspec.convert(json.loads(argv[0]), SandboxConfig)
        asyncio.run(serve(config))
    except Exception as e:  # reported to the parent as one line; it raises it where it started us
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
