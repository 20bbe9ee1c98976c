"""FSDP2 ranks on one GRPO batch: rows dealt by length against each group's sharing rows on one rank.

    OMP_NUM_THREADS=1 python tools/bench_shard.py [--model PATH] [--rows 32] [--ranks 2] [--repeats 2]

The model and batch are tools/bench_train.py's (default: SmolLM2-135M's shape with random weights;
`--rows` sequences in groups of 8 sharing a 32-token system prompt plus 8-48 tokens of their own).
Each rank is a process (gloo, one torch thread) holding a `Trainer` sharded with FSDP2; both split
the same batch with `shard` (operators/training/batch.py) under each rule and time
`Trainer.forward_backward` on their part, after one untimed warm-up, `--repeats` times (the rules'
order alternating):
    dealt    rows by length, longest first onto the least loaded rank (`shared=False`): a group's
             rows land on several ranks, each computing the group's prompt again
    kept     with prefix sharing (`shared=True`, what the trainer uses): a group's rows on one
             rank, a group over a rank's even share spread so that ranks stay balanced
A synchronous step waits for its slowest rank: each rule's figure is its slowest rank's time in the
fastest repeat. The loss and every gradient (gathered) must agree between the rules to 1e-5 of the
tensor's largest entry. The last line is one JSON object with `speedup` (dealt s / kept s) and the
tokens each rank computes under each rule.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results_file  # noqa: E402
from bench_train import LOSS, compare, default_model, grpo_batch  # noqa: E402

from flowrl_operators.training import head  # noqa: E402
from flowrl_operators.training.batch import shard  # noqa: E402
from flowrl_operators.training.losses import policy_loss  # noqa: E402
from flowrl_operators.training.trainer import Trainer, TrainerConfig  # noqa: E402

RULES = {"dealt": False, "kept": True}


def gathered_grads(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient (a collective: every rank calls it); then zeroed."""
    grads = {}
    for name, p in trainer.model.named_parameters():
        if p.grad is not None:
            grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[name] = grad.detach().clone()
    trainer.optimizer.zero_grad(set_to_none=True)
    return grads


def computed_tokens(trainer: Trainer, part) -> int:
    """The tokens the trainer's forward computes for `part` (each group's prefix once, as it lays it out)."""
    rows = head.shared_prefixes(trainer.model, part, 6 * head.hidden_size(trainer.model)) if part.size else None
    return rows.computed if rows is not None else int(part.lengths.sum())


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), HF_HUB_OFFLINE="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        trainer = Trainer(args.model, TrainerConfig(lr=1e-5, micro_batch_tokens=1 << 20))
        batch = grpo_batch(args.rows, trainer.model.config.vocab_size)
        loss_fn = policy_loss(LOSS)
        times: dict[str, list[float]] = {rule: [] for rule in RULES}
        checks: dict[str, tuple[float, dict]] = {}
        trainer.forward_backward(shard(batch, rank, world), loss_fn)  # warm-up (first-call costs), untimed
        gathered_grads(trainer)
        for repeat in range(args.repeats):
            for rule, shared in list(RULES.items())[:: 1 if repeat % 2 == 0 else -1]:  # alternating order
                mine = shard(batch, rank, world, shared)
                dist.barrier()
                start = time.perf_counter()
                metrics = trainer.forward_backward(mine, loss_fn)
                times[rule].append(time.perf_counter() - start)
                grads = gathered_grads(trainer)
                checks.setdefault(rule, (float(metrics["loss"]), grads))
        computed = {rule: computed_tokens(trainer, shard(batch, rank, world, shared)) for rule, shared in RULES.items()}
        torch.save({"times": times, "computed": computed, "trainer_shares": trainer.shared,
                    **({"checks": checks} if rank == 0 else {})}, f"{out}/rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a checkpoint folder (default: SmolLM2-135M's shape, random weights)")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    results_file.add_record_flag(parser)
    args = parser.parse_args()
    args.model = args.model or default_model()
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(worker, args=(args.ranks, free_port(), args, out), nprocs=args.ranks,
                           start_method="spawn", join=True)
        ranks = [torch.load(f"{out}/rank{r}.pt", weights_only=False) for r in range(args.ranks)]
    if not ranks[0]["trainer_shares"]:
        print("note: this model's forward does not share prefixes (flash attention or a VL model), so the "
              "trainer deals rows by length; 'kept' is shown for comparison only")
    (loss_a, grads_a), (loss_b, grads_b) = ranks[0]["checks"]["kept"], ranks[0]["checks"]["dealt"]
    worst = compare(loss_a, loss_b, grads_a, grads_b, 1e-5)
    # Each repeat's step lasts as long as its slowest rank; the fastest repeat is reported.
    step = {rule: min(max(r["times"][rule][k] for r in ranks) for k in range(args.repeats)) for rule in RULES}
    computed = {rule: [r["computed"][rule] for r in ranks] for rule in RULES}
    for rule in RULES:
        print(f"{rule:5s} slowest rank {step[rule]:.3f} s; tokens computed per rank {computed[rule]} "
              f"(sum {sum(computed[rule])}); runs per rank "
              + "; ".join(", ".join(f"{t:.3f}" for t in r["times"][rule]) for r in ranks))
    speedup = step["dealt"] / step["kept"]
    print(f"loss {loss_a:.8f} vs {loss_b:.8f}; gradients agree to {worst:.1e} of their largest entry; "
          f"speedup {speedup:.2f}x")
    results_file.emit(args.record, "bench_shard", {"bench": "shard", "rows": args.rows, "ranks": args.ranks, "dealt_s": round(step["dealt"], 4),
                      "kept_s": round(step["kept"], 4), "speedup": round(speedup, 3),
                      "dealt_tokens_per_rank": computed["dealt"], "kept_tokens_per_rank": computed["kept"],
                      "grad_max_rel_diff": worst})


if __name__ == "__main__":
    main()
