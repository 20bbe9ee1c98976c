"""`SandboxService`: starts the sandbox server as a child process and stops it, with nothing left.

    async with SandboxService(SandboxConfig(workers=4)) as sandbox:  # a SandboxClient
        result = await sandbox.run("print(47 * 38 + 12)")
        text = observation(result)

`start()` / `stop()` (and `with`) do the same without an event loop, for code that only needs the
`url`. The server stops when `stop()` closes its stdin, and also when this process dies in any way
(kill -9 included), because its stdin then reaches its end (flowrl_operators.tools.server).
"""

from __future__ import annotations

import asyncio
import json
import select
import subprocess
import sys
import time
from typing import Any

import msgspec

from flowrl_operators.config import SandboxConfig
from flowrl_operators.tools.client import SandboxClient
from flowrl_operators.tools.isolation import sweep_stale

START_TIMEOUT_S = 60.0  # the server's import, probe calls and bind; seconds on a loaded machine
STOP_TIMEOUT_S = 10.0  # its calls killed and its folders removed, before it is killed itself


class SandboxService:
    def __init__(self, config: SandboxConfig | dict[str, Any] | None = None) -> None:
        if not isinstance(config, SandboxConfig):
            config = msgspec.convert(config or {}, SandboxConfig)
        self.config = config
        self.process: subprocess.Popen[bytes] | None = None
        self.url: str | None = None
        self.health: dict[str, Any] = {}
        self.client: SandboxClient | None = None

    def start(self) -> str:
        """Starts the server; its URL once it answers. RuntimeError (with the server's reason) if it
        cannot start, e.g. `isolation: bwrap` where bubblewrap does not work."""
        if self.process is not None:
            raise RuntimeError("the sandbox service is already started")
        arg = json.dumps(msgspec.to_builtins(self.config))
        # A session of its own: the run's Ctrl-C stops the run gracefully, which stops this service
        # last (stdin closes); a shared SIGINT would end the calls still in flight first.
        self.process = subprocess.Popen([sys.executable, "-m", "flowrl_operators.tools.server", arg],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
        line = self._first_line()
        try:
            ready = json.loads(line)
        except ValueError:
            ready = {"error": f"unreadable start line {line[:200]!r}"}
        if "port" not in ready:
            self.stop()
            raise RuntimeError(f"the sandbox service did not start: {ready.get('error')}")
        self.url, self.health = f"http://127.0.0.1:{ready['port']}", ready["health"]
        return self.url

    def _first_line(self) -> bytes:
        assert self.process is not None and self.process.stdout is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            readable, _, _ = select.select([self.process.stdout], [], [], 0.1)
            if readable:
                return self.process.stdout.readline()
            if self.process.poll() is not None:
                return b""
        return b'{"error": "no answer within %d s"}' % START_TIMEOUT_S

    def stop(self) -> None:
        """Stops the server (its calls killed, its folders removed); idempotent."""
        process, self.process = self.process, None
        if process is None:
            return
        if process.poll() is None:
            process.stdin.close()  # its signal to stop, as if this process had died
            try:
                process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for pipe in (process.stdin, process.stdout):
            if pipe is not None and not pipe.closed:
                pipe.close()
        if process.returncode != 0:  # it could not clean up after itself
            sweep_stale()
        self.url = None

    def __enter__(self) -> SandboxService:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def astart(self) -> SandboxClient:
        """Starts the server (off the event loop) and returns a client of it."""
        url = await asyncio.to_thread(self.start)
        self.client = SandboxClient(url)
        return self.client

    async def astop(self) -> None:
        if self.client is not None:
            await self.client.close()
            self.client = None
        await asyncio.to_thread(self.stop)

    async def __aenter__(self) -> SandboxClient:
        return await self.astart()

    async def __aexit__(self, *exc: object) -> None:
        await self.astop()

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None
