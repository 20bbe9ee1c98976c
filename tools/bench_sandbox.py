"""Latency of the sandbox tool service on this machine: sequential calls (process start and the
code's own time, no queue), then one burst (the queue), at `--workers`. Ends with one JSON line.

    python tools/bench_sandbox.py --calls 200 --workers 2 [--isolation auto|bwrap|rlimits]
"""

from __future__ import annotations

import argparse
import asyncio

import results_file

from flowrl_operators.tools import SandboxService
from flowrl_operators.tools.pool import percentile

CODE = "print(47 * 38 + 12)"


def quantiles(values: list[float]) -> dict[str, float]:
    return {q: round(percentile(values, p) * 1000, 1) for q, p in (("median_ms", 0.5), ("p90_ms", 0.9), ("p99_ms", 0.99))}


async def bench(calls: int, workers: int, isolation: str) -> dict:
    service = SandboxService({"workers": workers, "isolation": isolation})
    async with service as sandbox:
        sequential = [await sandbox.run(CODE) for _ in range(calls)]
        burst = await asyncio.gather(*(sandbox.run(CODE) for _ in range(calls)))
    assert all(r.ok and r.stdout == "1798\n" for r in sequential + burst)
    return {"isolation": service.health["isolation"], "workers": workers, "calls": calls,
            "start": quantiles([r.timing.start_s for r in sequential]),
            "run": quantiles([r.timing.run_s for r in sequential]),
            "burst_queue": quantiles([r.timing.queue_s for r in burst]),
            "burst_start": quantiles([r.timing.start_s for r in burst])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--isolation", default="auto", choices=["auto", "bwrap", "rlimits"])
    results_file.add_record_flag(parser)
    args = parser.parse_args()
    out = asyncio.run(bench(args.calls, args.workers, args.isolation))
    for key in ("start", "run", "burst_queue", "burst_start"):
        print(f"{key:12s} " + "  ".join(f"{k} {v}" for k, v in out[key].items()))
    results_file.emit(args.record, "bench_sandbox", out)


if __name__ == "__main__":
    main()
