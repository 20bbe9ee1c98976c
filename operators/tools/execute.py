"""One sandboxed call: a fresh folder, a process under limits, its output read within bounds, and
its end (exit, crash, a limit) classified as a structured result. Nothing the user's code does
raises here: every outcome is a result (`error` names which limit or failure ended it).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flowrl_operators.tools.isolation import SANDBOX_HOME, command, environment, kill_uids, reap_orphans

CHUNK = 4096
RUNNING: set[asyncio.subprocess.Process] = set()  # the calls' processes now, for a service that stops
SPAWNING = [0]  # calls between fork and RUNNING: their process may not be collected by reap_orphans
DRAIN_S = 1.0  # after the process ends, how long its pipes may stay open (a child holding them is killed first)


@dataclass(frozen=True)
class Limits:
    cpu_s: int
    memory_mb: int
    wall_s: float
    output_bytes: int
    processes: int


@dataclass
class Call:
    """Where and how one call runs: the service's facts plus the slot it holds."""

    python: str
    bwrap: bool
    root: Path
    limits: Limits
    slot: int
    uid: int  # -1: no privilege drop (the service is not root)
    service_pid: int


class Bounded:
    """Reads one pipe to its end, keeping at most `cap` bytes; `over` is set when there was more."""

    def __init__(self, stream: asyncio.StreamReader, cap: int, over: asyncio.Event) -> None:
        self.stream, self.cap, self.over = stream, cap, over
        self.kept = bytearray()

    async def read(self) -> None:
        while chunk := await self.stream.read(CHUNK):
            room = self.cap - len(self.kept)
            self.kept += chunk[:max(room, 0)]
            if len(chunk) > room:
                self.over.set()  # the caller stops the process; reading on only drains the pipe

    def text(self) -> str:
        return self.kept.decode("utf-8", errors="replace")


async def _marker(fd: int, started: list[float]) -> bytes:
    """Reads the prelude's pipe: its clock when the user's code began, then an exception's name."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", 0))
    try:
        line = await reader.readline()
        with contextlib.suppress(ValueError):
            started.append(float(line))
        return await reader.read(256)
    finally:
        transport.close()


def _prepare(call: Call, call_id: int, code: str) -> Path:
    workdir = call.root / f"call-{call_id}"
    workdir.mkdir(mode=0o700)
    (workdir / "main.py").write_text(code, encoding="utf-8")
    if call.uid >= 0:  # the call's own uid owns its folder; no other call can read it
        os.chown(workdir, call.uid, call.uid)
        os.chown(workdir / "main.py", call.uid, call.uid)
    return workdir


async def _exit(pid: int) -> float:
    """Returns when process `pid` has ended. asyncio's Process.wait() also waits for its pipes to
    close, which a child that outlives it (and holds them) would delay until the wall limit."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:  # ended, and already collected by asyncio's child watcher
        return time.monotonic()
    loop = asyncio.get_running_loop()
    ended = loop.create_future()  # its result: when the loop saw the end (not when a task got to it)
    loop.add_reader(fd, lambda: ended.done() or ended.set_result(time.monotonic()))
    try:
        return await ended
    finally:
        loop.remove_reader(fd)
        os.close(fd)


async def _reap() -> None:
    """Collects the calls' orphans (reap_orphans) once no call is between fork and RUNNING."""
    for _ in range(100):
        if not SPAWNING[0]:
            reap_orphans({p.pid for p in RUNNING})  # no await in it: no spawn starts meanwhile
            return
        await asyncio.sleep(0.002)


def kill_running() -> None:
    for proc in list(RUNNING):
        _kill(proc)


def _kill(proc: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: the group is the call's processes


async def run_call(call: Call, call_id: int, code: str, wall_s: float) -> dict[str, Any]:
    """The result of running `code` once: ok, stdout, stderr, exit_code, error, detail, timing."""
    workdir = _prepare(call, call_id, code)
    read_fd, write_fd = os.pipe()
    argv, cwd = command(call.python, call.bwrap, workdir, cpu_s=call.limits.cpu_s, memory_mb=call.limits.memory_mb,
                        processes=call.limits.processes, uid=call.uid, service_pid=call.service_pid,
                        marker_fd=write_fd)
    spawned = time.monotonic()
    SPAWNING[0] += 1
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, cwd=cwd, env=environment(SANDBOX_HOME if call.bwrap else str(workdir)),
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            pass_fds=(write_fd,), start_new_session=True)
    except OSError as e:
        os.close(read_fd)
        shutil.rmtree(workdir, ignore_errors=True)
        return result(error="start_failed", detail=str(e), timing=(0.0, 0.0))
    finally:
        os.close(write_fd)
        SPAWNING[0] -= 1
    RUNNING.add(proc)
    try:
        return await _supervise(call, proc, read_fd, spawned, wall_s)
    finally:
        RUNNING.discard(proc)
        _kill(proc)  # cancelled (the service stopping): its own sweep kills the slots' uids
        await _reap()
        await asyncio.to_thread(shutil.rmtree, workdir, True)


async def _supervise(call: Call, proc: asyncio.subprocess.Process, read_fd: int, spawned: float,
                     wall_s: float) -> dict[str, Any]:
    over = asyncio.Event()
    out = Bounded(proc.stdout, call.limits.output_bytes, over)
    err = Bounded(proc.stderr, call.limits.output_bytes, over)
    started: list[float] = []
    readers = [asyncio.ensure_future(out.read()), asyncio.ensure_future(err.read())]
    marker = asyncio.ensure_future(_marker(read_fd, started))
    exited = asyncio.ensure_future(_exit(proc.pid))
    overflow = asyncio.ensure_future(over.wait())
    await asyncio.wait([exited, overflow], timeout=max(wall_s - (time.monotonic() - spawned), 0.0),
                       return_when=asyncio.FIRST_COMPLETED)
    timed_out, over_limit = not exited.done() and not overflow.done(), overflow.done()
    ended = exited.result() if exited.done() else time.monotonic()
    exited.cancel()
    overflow.cancel()
    _kill(proc)  # the call is over: whatever of it still runs goes (a background child included)
    if call.uid >= 0 and not call.bwrap:  # children that left the group (setsid) share the slot's uid
        await asyncio.to_thread(kill_uids, {call.uid})
    code = await proc.wait()
    done, pending = await asyncio.wait([*readers, marker], timeout=DRAIN_S)
    for task in pending:
        task.cancel()
    exception = marker.result().decode(errors="replace") if marker in done and not marker.exception() else ""
    begun = min(started[0], ended) if started else ended
    timing = (begun - spawned, ended - begun)
    error, detail = classify(code, call.bwrap, timed_out, over_limit, exception)
    if error == "timeout":
        detail = f"wall time limit {wall_s:g} s"
    return result(error=error, detail=detail, timing=timing, stdout=out.text(), stderr=err.text(), exit_code=code)


SIGNAL_NAMES = {int(s): s.name for s in signal.Signals}


def classify(code: int, bwrap: bool, timed_out: bool, over_limit: bool, exception: str) -> tuple[str | None, str | None]:
    """(error, detail) of a call that ended with exit status `code` (negative: a signal; under bwrap,
    128 + the signal)."""
    if timed_out:
        return "timeout", None
    if over_limit:
        return "output_limit", "output beyond the limit was dropped and the call stopped"
    if exception == "MemoryError":
        return "memory", "MemoryError: the memory limit was reached"
    signum = -code if code < 0 else code - 128 if bwrap and code > 128 else 0
    if signum in (signal.SIGXCPU, signal.SIGKILL):  # RLIMIT_CPU: SIGXCPU at the soft limit, SIGKILL at the hard one
        return "cpu_time", "CPU time limit reached"
    if signum:
        return "crash", f"killed by {SIGNAL_NAMES.get(signum, signum)}"
    if exception:
        return "exception", exception
    if code != 0:
        return "exit", f"exit code {code}"
    return None, None


def result(*, error: str | None, detail: str | None, timing: tuple[float, float], stdout: str = "",
           stderr: str = "", exit_code: int | None = None) -> dict[str, Any]:
    return {"ok": error is None, "stdout": stdout, "stderr": stderr, "exit_code": exit_code, "error": error,
            "detail": detail, "timing": {"queue_s": 0.0, "start_s": round(timing[0], 6), "run_s": round(timing[1], 6)}}
