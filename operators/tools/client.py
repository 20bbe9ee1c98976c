"""What a workflow uses: `ToolResult`, the async `SandboxClient` (`await sandbox.run(code)`) and
`observation(result)`, the text a model reads back after its code ran.

Every outcome of the user's code is a `ToolResult` (an error in `error`, never an exception); an
exception from `run` means the service itself could not be reached or answered badly.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import msgspec


class Timing(msgspec.Struct):
    queue_s: float = 0.0  # waiting for a free worker
    start_s: float = 0.0  # from spawning the process to the first line of the code
    run_s: float = 0.0  # the code's own time, to the process's end


class ToolResult(msgspec.Struct):
    ok: bool
    stdout: str = ""
    stderr: str = ""
    exit_code: int | None = None
    # None, or: exception, exit, timeout, cpu_time, memory, output_limit, crash, start_failed
    error: str | None = None
    detail: str | None = None  # the exception's class, the limit, the signal
    timing: Timing = msgspec.field(default_factory=Timing)


class SandboxError(RuntimeError):
    """The service could not run a call (unreachable, a bad request): not the code's own error."""


ERROR_TEXT = {
    "timeout": "timed out",
    "cpu_time": "ran out of CPU time",
    "memory": "ran out of memory",
    "output_limit": "printed too much output (truncated)",
    "crash": "crashed",
    "start_failed": "could not be started",
}


def observation(result: ToolResult, max_chars: int = 2000) -> str:
    """The text given back to the model: stdout, then stderr's last lines (where a traceback ends),
    then one line naming what ended the call if it was not a clean exit; each part cut to fit."""
    parts = []
    if result.stdout:
        parts.append(_cut(result.stdout.rstrip("\n"), max_chars, keep="head"))
    if result.stderr and not result.ok:
        parts.append(_cut(result.stderr.rstrip("\n"), max_chars, keep="tail"))
    if result.error in ERROR_TEXT:
        parts.append(f"[error: the code {ERROR_TEXT[result.error]}" + (f": {result.detail}]" if result.detail else "]"))
    elif result.error == "exit":
        parts.append(f"[exit code {result.exit_code}]")
    return "\n".join(parts) if parts else "[no output]"


def _cut(text: str, limit: int, keep: str) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + "\n[...]" if keep == "head" else "[...]\n" + text[-limit:]


class SandboxClient:
    """Async client of one sandbox service (`url`: http://127.0.0.1:<port>). One HTTP session, opened
    on first use in the running event loop; `close()` it (the service's owner does)."""

    # Connections this client opens at once: above any burst, so that calls wait in the service's
    # queue (where the wait is measured), not in the client's.
    def __init__(self, url: str, connections: int = 1024) -> None:
        self.url = url
        self.connections = connections
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # No total timeout: a call waits in the service's queue as long as the queue is; the service
            # bounds each call's run by its wall limit.
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=self.connections),
                                                  timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        return self._session

    async def run(self, code: str, timeout_s: float | None = None) -> ToolResult:
        """Runs `code` (Python) in a fresh sandboxed process; its result, errors included."""
        body: dict[str, Any] = {"code": code}
        if timeout_s is not None:
            body["timeout_s"] = timeout_s
        try:
            async with self._http().post(self.url + "/run", json=body) as response:
                payload = await response.read()
                if response.status != 200:
                    raise SandboxError(f"sandbox answered {response.status}: {payload[:300]!r}")
        except aiohttp.ClientError as e:
            raise SandboxError(f"sandbox at {self.url} unreachable: {e}") from e
        return msgspec.json.decode(payload, type=ToolResult)

    async def _get(self, route: str) -> dict[str, Any]:
        async with self._http().get(self.url + route) as response:
            response.raise_for_status()
            return await response.json()

    async def health(self) -> dict[str, Any]:
        return await self._get("/health")

    async def stats(self) -> dict[str, Any]:
        return await self._get("/stats")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
