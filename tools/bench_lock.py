"""How a train step's pass and the embedded engine's decoding share one process's interpreter lock,
measured side by side (issue #46: what `flowrl plan`'s machine-share model, flowrl/plan/cpu.py,
assumes about it).

    python tools/bench_lock.py [--model builtin:tiny-qwen2] [--rows 128] [--length 12] [--slots 32]
                               [--tokens 16] [--calls 8] [--repeats 3] [--record NAME]

Three figures, each the median over `--repeats`, one torch thread per thread (OMP_NUM_THREADS=1):
- the train operator's pass (a forward and backward over `--rows` rows of `--length` tokens:
  operators/timing.py) alone, and while the embedded engine decodes in another thread of this
  process: `train_rate` = alone / beside;
- the engine's decoding (`--slots` requests of `--tokens` tokens: seconds per iteration) alone, and
  while the train pass runs in another thread: `engine_rate`;
- two embedded engines decoding in two threads, against the same calls in turns in one:
  `handoff` = in turns / together. cpu.py takes two jobs that hold the lock all their time as
  taking turns at no loss (1.0); below 1, handing the lock over costs time.
cpu.py's model with the engine holding the lock all its time and the train pass a share L of it
gives both rates 1 / (1 + L). The last line is one JSON object.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results_file  # noqa: E402

OPEN: list = []  # every decoder (operators/timing.py's Decoder), closed by `close`


def decoder(model: str, slots: int, tokens: int) -> Callable[[], float]:
    """A function that decodes `tokens` tokens for `slots` requests on an embedded engine of its own
    (one event loop each) and returns the seconds per iteration."""
    from flowrl_operators.timing import Decoder

    OPEN.append(Decoder(model, slots, tokens))
    return OPEN[-1]


def close() -> None:
    while OPEN:
        OPEN.pop().close()


def beside(timed: Callable[[], float], other: Callable[[], float], calls: int) -> float:
    """The median of `calls` calls of `timed` while `other` runs without pause in another thread."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            other()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        return statistics.median(timed() for _ in range(calls))
    finally:
        stop.set()
        thread.join()


def measure(args: argparse.Namespace) -> dict:
    import torch

    from flowrl_operators import timing
    from flowrl_operators.timing import turns_over_threads

    torch.set_num_threads(1)
    timer = timing.pass_timer(args.model, args.rows, args.length, backward=True)
    train = lambda: timer(1)  # noqa: E731 - one torch thread, as the run's in-process trainer here
    engine, other = decoder(args.model, args.slots, args.tokens), decoder(args.model, args.slots, args.tokens)
    train(), engine(), other()  # warm: allocations, the thread pools
    figures: dict[str, list[float]] = {k: [] for k in ("train_alone_s", "train_beside_s", "engine_alone_s",
                                                         "engine_beside_s", "handoff")}
    for _ in range(args.repeats):
        figures["train_alone_s"].append(statistics.median(train() for _ in range(args.calls)))
        figures["train_beside_s"].append(beside(train, engine, args.calls))
        figures["engine_alone_s"].append(statistics.median(engine() for _ in range(args.calls)))
        figures["engine_beside_s"].append(beside(engine, train, args.calls))
        figures["handoff"].append(turns_over_threads(engine, other, args.calls))
    out = {k: round(statistics.median(v), 5) for k, v in figures.items()}
    out["train_rate"] = round(out["train_alone_s"] / out["train_beside_s"], 3)
    out["engine_rate"] = round(out["engine_alone_s"] / out["engine_beside_s"], 3)
    out["handoff"] = round(out["handoff"], 3)
    out["spread"] = {k: [round(min(v), 5), round(max(v), 5)] for k, v in figures.items()}
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:tiny-qwen2")
    parser.add_argument("--rows", type=int, default=128, help="rows of the train pass (the digit runs' batch)")
    parser.add_argument("--length", type=int, default=12, help="tokens of each row of the train pass")
    parser.add_argument("--slots", type=int, default=32, help="requests the engine decodes together")
    parser.add_argument("--tokens", type=int, default=16, help="tokens each request decodes per call")
    parser.add_argument("--calls", type=int, default=8, help="timed calls per figure and repeat")
    parser.add_argument("--repeats", type=int, default=3)
    results_file.add_record_flag(parser)
    args = parser.parse_args(argv)
    if min(args.rows, args.length, args.slots, args.tokens, args.calls, args.repeats) < 1:
        parser.error("--rows, --length, --slots, --tokens, --calls and --repeats: at least 1 each")
    try:
        out = measure(args)
    finally:
        close()
    print(f"train pass: {out['train_alone_s'] * 1e3:.1f} ms alone, {out['train_beside_s'] * 1e3:.1f} ms beside "
          f"decoding (rate {out['train_rate']})")
    print(f"engine: {out['engine_alone_s'] * 1e3:.2f} ms an iteration alone, {out['engine_beside_s'] * 1e3:.2f} ms "
          f"beside the train pass (rate {out['engine_rate']})")
    print(f"two engines in two threads: {out['handoff']} of the speed of taking turns")
    results_file.emit(args.record, "bench_lock", {**out, "args": {k: v for k, v in vars(args).items() if k != "record"}})


if __name__ == "__main__":
    main()
