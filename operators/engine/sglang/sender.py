"""`SGLangSender`: the trainer side of a weight push straight into SGLang servers (a `WeightSender`),
and `PushedRecord`, what it hands the generate side, which only adopts the version."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable
from dataclasses import dataclass

from flowrl_operators.engine.sglang.adapter import SGLangEngine


@dataclass(frozen=True)
class PushedRecord:
    """A version the sender already pushed into the servers; the generate side only adopts it
    (`SGLangEngine.adopt(record)`): nothing travels through the generate node."""

    version: int
    urls: tuple[str, ...]
    transport: str = "sglang"


class SGLangSender:
    """Trainer side: pushes each version straight into the SGLang servers at `urls` (`WeightSender`).

    With weight_sync "distributed" this process is rank 0 of the broadcast group (NCCL on GPU), as in
    SGLang's RL recipe. `pause_mode` (retract by default) pauses the servers around each push, so
    requests in flight continue under the new weights; None pushes without pausing. `send` returns
    when the servers serve the new version.
    """

    transport = "sglang"

    def __init__(self, urls: str | Iterable[str], *, weight_sync: str = "distributed", backend: str = "auto",
                 model_path: str | None = None, pause_mode: str | None = "retract") -> None:
        self.engine = SGLangEngine(urls, weight_sync=weight_sync, backend=backend, model_path=model_path)
        self.pause_mode = pause_mode
        self.loop = asyncio.new_event_loop()  # a private loop: the trainer's thread stays synchronous
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="flowrl-sglang-sender")
        self.thread.start()

    def _run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    async def _push(self, buckets, version: int) -> None:
        engine = self.engine
        await engine.start()
        if self.pause_mode:
            await engine.pause(self.pause_mode)
        try:
            await engine.update_weights(buckets, version)
        finally:
            if self.pause_mode:
                await engine.resume()

    def send(self, buckets, version: int) -> PushedRecord:
        self._run(self._push(buckets, version))
        return PushedRecord(version, tuple(s.url for s in self.engine.servers))

    def wait(self, timeout: float | None = None) -> None:
        """`send` is synchronous: nothing is left to wait for."""

    def close(self) -> None:
        if self.loop.is_running():
            self._run(self.engine.close())
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(30)
