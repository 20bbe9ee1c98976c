"""What learning health costs: the train step with `policy_kl` measured every step against never,
the detector per metrics row, and `flowrl inspect` of a 1,000-step run.

    OMP_NUM_THREADS=1 python tools/bench_health.py [--repeats 3] [--steps 10]

One process, one torch thread, builtin:tiny-qwen2 and the quickstart's batch (16 prompts x 8
samples, tools/bench_step.py): `Learner.train` with `policy_kl_every: 1` (one forward without
gradients after every update) against `0`, alternating in `--repeats` rounds, CPU seconds per step
(median of `--steps`). With the default `policy_kl_every: 10` the step's extra cost is a tenth of
the difference. Then the detector (flowrl/health.py) on 1,000 rows, and the text and html of
`flowrl inspect` on the 1,000-step run tests/test_health_report.py writes. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tools"), str(ROOT / "tests")]
import results_file  # noqa: E402
from bench_step import MODEL, trajectories  # noqa: E402

from flowrl_operators.config import OptimConfig  # noqa: E402
from flowrl_operators.train import Learner, trainer_config  # noqa: E402
from flowrl_operators.training.objective import advantage_config, loss_config  # noqa: E402


def learner(kl_every: int) -> Learner:
    return Learner("fsdp2", MODEL, trainer_config(OptimConfig(lr=1e-3), 8192, 3, 1, 0),
                   loss_config({"kind": "ppo_clip", "clip_low": 0.2, "clip_high": 0.28, "entropy_coef": 0.01}),
                   advantage_config({"estimator": "grpo", "gamma": 0.0}), 1, True, True, kl_every)


def train_seconds(kl_every: int, steps: int, g: torch.Generator) -> float:
    side, times = learner(kl_every), []
    for step in range(steps + 1):  # the first step warms up
        batch = trajectories(g)
        start = time.process_time()
        side.train(batch, step)
        if step:
            times.append(time.process_time() - start)
    return statistics.median(times)


def detector_seconds() -> float:
    from flowrl.health import replay

    rows = [{"step": i, "node": "learner", "reward": i / 1000, "train": {
        "entropy": 1.0, "tied_group_fraction": 0.1, "clip_fraction": 0.01, "mismatch_logprob_mean": 1e-6}}
        for i in range(1000)]
    start = time.perf_counter()
    replay(rows)
    return time.perf_counter() - start


def inspect_figures() -> dict[str, float]:
    import pytest
    from test_health_report import write_phase

    from flowrl.report import render_run

    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as monkeypatch:
        run = Path(tmp) / "run"
        write_phase(run / "phases/0-warmup", 650, True, monkeypatch)
        write_phase(run / "phases/1-grpo", 1000, False, monkeypatch)
        start = time.perf_counter()
        text = render_run(run, "text")
        middle = time.perf_counter()
        page = render_run(run, "html")
        end = time.perf_counter()
    return {"inspect_text_s": round(middle - start, 3), "inspect_text_lines": len(str(text).splitlines()),
            "inspect_html_s": round(end - middle, 3), "inspect_html_bytes": len(str(page).encode())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    results_file.add_record_flag(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    figures: dict[str, list[float]] = {"every_step": [], "never": []}
    for repeat in range(args.repeats):
        for name, every in (("every_step", 1), ("never", 0)):
            figures[name].append(train_seconds(every, args.steps, g))
        print(f"round {repeat}: train step with policy_kl every step {figures['every_step'][-1]:.4f} s, "
              f"never {figures['never'][-1]:.4f} s (CPU seconds, median of {args.steps})", flush=True)
    every, never = statistics.median(figures["every_step"]), statistics.median(figures["never"])
    out = {"train_step_policy_kl_every_step_s": round(every, 4), "train_step_never_s": round(never, 4),
           "policy_kl_cost_per_measure": round(every / never - 1, 3),
           "policy_kl_cost_at_every_10": round((every / never - 1) / 10, 4),
           "detector_1000_rows_s": round(detector_seconds(), 4)} | inspect_figures()
    print(f"policy_kl: {out['policy_kl_cost_per_measure']:+.1%} of a train step when measured, "
          f"{out['policy_kl_cost_at_every_10']:+.2%} a step at policy_kl_every 10; detector "
          f"{out['detector_1000_rows_s'] * 1000:.1f} ms per 1,000 rows; inspect of a 1,000-step run: "
          f"{out['inspect_text_lines']} lines in {out['inspect_text_s']} s, html {out['inspect_html_bytes'] / 1e3:.0f} kB "
          f"in {out['inspect_html_s']} s")
    results_file.emit(args.record, "bench_health", out)


if __name__ == "__main__":
    main()
