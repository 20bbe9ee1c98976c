"""The trainer's forward_backward against a plain padded Hugging Face forward/backward, same loss.

    OMP_NUM_THREADS=1 python tools/bench_train.py [--model PATH] [--rows 16] [--repeats 2]
                                                  [--micro-batch-tokens N]

Without `--model`, the SmolLM2-135M-shaped model with random weights that tools/bench_memory.py
builds (LlamaConfig hidden 576, 30 layers, 9 heads, 3 kv heads, intermediate 1536, vocabulary
49152, tied embeddings) in $FLOWRL_CACHE (default ~/.cache/flowrl)/bench-smollm2-135m-shape; nothing
is downloaded. `--model` takes a real checkpoint folder.

The batch is GRPO-shaped: `--rows` sequences in groups of 8, each group's prompt a shared 32-token
system prefix plus 8-48 tokens of its own (40-80 in all), responses of 10-60 tokens with a long
tail (most short), right-padded; a 0/1 reward per sequence, GRPO advantages, behaviour logprobs
near the model's own so that ppo_clip clips some tokens.

Both sides compute the train node's loss (`policy_loss`, ppo_clip, seq_mean_token_mean) on one
micro-batch of the same rows with the same weights (fp32 on the CPU, the trainer's bf16 autocast on
a GPU for both):
    flowrl      Trainer.forward_backward: each group's common prompt computed once and its samples'
                own tokens attending to it (training/prefix.py), packed end to end without padding,
                the LM head and the logprob kernel on the loss tokens only (training/head.py,
                training/kernels.py)
    unshared    the same with every sequence packed on its own (its prompt computed once per row):
                what sharing the prefix adds
    plain HF    model(...).logits over every position, log_softmax, gather, entropy (no gradient,
                for the metric), the same loss function
With `--micro-batch-tokens N` flowrl splits the rows into micro-batches of at most N tokens, balanced
by token count (training/batch.py), and a third side, `rows`, is flowrl with the padded rule's split
(rows of similar length, rows x the longest within N) over the same packed forward: what balancing
by tokens changes; and a fourth, `one`, the same forward on one micro-batch (the default run). The
loss and every parameter's gradient of each flowrl side must agree with the plain side's (max abs
difference <= 1e-5 of the tensor's largest entry; bf16 on a GPU: 2e-2); where a real checkpoint's
float32 gradients differ by more than that, those sides and the plain one are compared against the
plain computation in float64, and each one's error must be at most twice the plain side's own
(`exactness`). Times are the fastest of `--repeats` (the two sides
alternate); memory is the peak over the resting state of the first run of each: resident memory on
the CPU (VmHWM, flowrl measured first, so the plain side's figure is its own peak), allocated
memory on a GPU. The last line is one JSON object with `speedup` (plain s / flowrl s).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results_file  # noqa: E402
from bench_memory import build_model  # noqa: E402

from flowrl.data.trajectory import Trajectory  # noqa: E402
from flowrl_operators.training import head  # noqa: E402
from flowrl_operators.training.advantages import AdvantageConfig, compute_advantages  # noqa: E402
from flowrl_operators.training.batch import Normaliser, micro_batch_rows, pack  # noqa: E402
from flowrl_operators.training.head import pack_rows, packing_supported  # noqa: E402
from flowrl_operators.training.losses import LossConfig, policy_loss  # noqa: E402
from flowrl_operators.training.trainer import Trainer, TrainerConfig  # noqa: E402

LOSS = LossConfig(kind="ppo_clip", aggregation="seq_mean_token_mean")


def status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def grpo_batch(rows: int, vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(0, vocab, (32,), generator=g).tolist()
    trajectories = []
    for i in range(rows):
        if i % 8 == 0:
            prompt = system + torch.randint(0, vocab, (8 + int(torch.randint(0, 41, (1,), generator=g)),),
                                            generator=g).tolist()
        n = 10 + int(50 * float(torch.rand(1, generator=g)) ** 3)  # long-tailed: median ~16
        trajectories.append(Trajectory(
            id=str(i), group_id=f"g{i // 8}", sample_id=str(i), prompt_ids=prompt,
            response_ids=torch.randint(0, vocab, (n,), generator=g).tolist(), loss_mask=[1] * n,
            behaviour_logprobs=[0.0] * n, versions=[0] * n, reward=float(torch.rand(1, generator=g) < 0.5)))
    return compute_advantages(pack(trajectories), AdvantageConfig(estimator="grpo"))


def plain_hf(trainer: Trainer, batch, loss_fn) -> torch.Tensor:
    """The textbook computation: full logits of every padded position, log_softmax, gather."""
    mb = batch.to(trainer.device)
    with trainer._autocast():
        logits = trainer.model(input_ids=mb.input_ids, attention_mask=mb.attention_mask,
                               position_ids=mb.position_ids, use_cache=False).logits[:, :-1].float()
    logprobs_all = torch.log_softmax(logits, dim=-1)
    logprobs = logprobs_all.gather(-1, mb.input_ids[:, 1:, None]).squeeze(-1)
    with torch.no_grad():
        entropy = -(logprobs_all.exp() * logprobs_all).sum(-1)
    loss, _ = loss_fn({"logprobs": logprobs, "entropy": entropy}, mb, Normaliser.of(batch))
    loss.backward()
    return loss.detach()


def measure(trainer: Trainer, run) -> tuple[float, float, object]:
    """Seconds, peak memory over the resting state (GB) and the result of one run."""
    cuda = trainer.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        rest = torch.cuda.memory_allocated()
    else:
        rest = status_kb("VmRSS") * 1024
    start = time.perf_counter()
    result = run()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() if cuda else status_kb("VmHWM") * 1024
    return seconds, (peak - rest) / 2**30, result


def take_grads(trainer: Trainer) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    trainer.optimizer.zero_grad(set_to_none=True)
    return grads


def compare(loss_a: float, loss_b: float, grads_a: dict, grads_b: dict, tolerance: float) -> float:
    assert grads_a.keys() == grads_b.keys() and grads_a, "the two sides trained different parameters"
    assert abs(loss_a - loss_b) <= tolerance * max(1.0, abs(loss_b)), f"losses differ: {loss_a} vs {loss_b}"
    worst = 0.0
    for name, ref in grads_b.items():
        scale = float(ref.abs().max()) or 1.0
        worst = max(worst, float((grads_a[name] - ref).abs().max()) / scale)
    assert worst <= tolerance, f"gradients differ by {worst:.2e} of their largest entry (tolerance {tolerance})"
    return worst


def other_split(trainer: Trainer, batch, loss_fn, packed: bool, budget: int, check: tuple | None,
                checked: dict, side: str) -> float:
    """Seconds of flowrl's forward_backward with another split (`packed`: by tokens, else the padded
    rule's; `budget` tokens) over the same packed forward; with `check` (the plain side's loss and
    gradients) its loss is compared and its gradients' difference recorded in `checked[side]`."""
    was = trainer.packed, trainer.config.micro_batch_tokens
    trainer.packed, trainer.config.micro_batch_tokens = packed, budget
    seconds, _, metrics = measure(trainer, lambda: trainer.forward_backward(batch, loss_fn))
    trainer.packed, trainer.config.micro_batch_tokens = was
    grads = take_grads(trainer)
    if check is not None:
        assert abs(metrics["loss"] - check[0]) <= 1e-5 * max(1.0, abs(check[0])), f"{side}: the losses differ"
        checked[side] = (compare(metrics["loss"], check[0], grads, check[1], float("inf")), grads)
    return seconds


def unshared(trainer: Trainer, batch, loss_fn, check: tuple | None) -> float:
    """Seconds of flowrl's forward_backward with every sequence packed on its own, each group's
    prompt computed once per row (training/prefix.py turned off for this side only)."""
    sharing = head.shared_prefixes
    head.shared_prefixes = lambda *_args: None
    try:
        seconds, _, metrics = measure(trainer, lambda: trainer.forward_backward(batch, loss_fn))
    finally:
        head.shared_prefixes = sharing
    grads = take_grads(trainer)
    if check is not None:  # reported, not asserted: this side is not what flowrl runs
        worst = compare(metrics["loss"], check[0], grads, check[1], float("inf"))
        print(f"unshared: gradients agree with plain to {worst:.1e} of their largest entry")
    return seconds


def exactness(trainer: Trainer, batch, loss_fn, sides: dict[str, dict]) -> dict[str, float]:
    """Each side's float32 gradients (`sides`: name -> gradients, the plain side's among them) against
    the plain computation in float64: name -> its largest error relative to its tensor's largest
    entry. A real checkpoint's gradients differ by more than 1e-5 between any two float32 summation
    orders; a flowrl side then passes when its error is at most twice the plain computation's own."""
    trainer.model.double()
    wide = dataclasses.replace(batch, **{f: getattr(batch, f).double() for f in ("behaviour_logprobs", "advantages")})
    plain_hf(trainer, wide, loss_fn)
    exact = take_grads(trainer)
    errors = {name: max(float((grads[n].double() - ref).abs().max() / ref.abs().max().clamp(min=1e-30))
                        for n, ref in exact.items()) for name, grads in sides.items()}
    print("against float64, gradients within (of their largest entry): "
          + ", ".join(f"{name} {error:.1e}" for name, error in errors.items()))
    return errors


def agree(trainer: Trainer, batch, loss_fn, checked: dict[str, tuple[float, dict]], plain: dict) -> dict | None:
    """Assert each flowrl side's gradients equal the plain side's to 1e-5 of their largest entry (bf16
    on a GPU: 2e-2), or, where float32 rounding alone cannot meet that, are within twice the plain
    side's own error against float64 (`exactness`, returned; None when not needed)."""
    tolerance = 2e-2 if trainer.bf16 else 1e-5
    loose = {side: grads for side, (worst, grads) in checked.items() if worst > tolerance}
    exact = exactness(trainer, batch, loss_fn, {**loose, "plain": plain}) if loose and not trainer.bf16 else None
    for side, (worst, _) in checked.items():
        assert worst <= tolerance or (exact and exact[side] <= 2 * exact["plain"]), \
            f"{side}: gradients differ by {worst:.2e} of their largest entry, and not from float32 rounding alone: {exact}"
    return exact


def default_model() -> str:
    folder = Path(os.environ.get("FLOWRL_CACHE", Path.home() / ".cache" / "flowrl")) / "bench-smollm2-135m-shape"
    if not (folder / "config.json").exists():
        folder.parent.mkdir(parents=True, exist_ok=True)
        build_model(folder)
    return str(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a checkpoint folder (default: SmolLM2-135M's shape, random weights)")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--micro-batch-tokens", type=int, help="split flowrl's batch (default: one micro-batch)")
    results_file.add_record_flag(parser)
    args = parser.parse_args()
    model = args.model or default_model()
    trainer = Trainer(model, TrainerConfig(lr=1e-5, micro_batch_tokens=args.micro_batch_tokens or 1 << 20))
    vocab = trainer.model.config.vocab_size
    batch, loss_fn = grpo_batch(args.rows, vocab), policy_loss(LOSS)
    # Behaviour logprobs near the model's own (+-0.2), so that the clip is active on some tokens.
    noise = 0.2 * torch.randn(batch.loss_mask.shape, generator=torch.Generator().manual_seed(1))
    batch.behaviour_logprobs = (trainer.compute_logprobs(batch) + noise) * batch.loss_mask
    tokens, loss_tokens = int(batch.lengths.sum()), int(batch.loss_mask.sum())
    print(f"model {model} on {trainer.device} ({torch.get_num_threads()} threads): {args.rows} rows, "
          f"{tokens} tokens ({batch.input_ids.numel()} padded), {loss_tokens} loss tokens, vocabulary {vocab}")
    width = 6 * trainer.model.config.hidden_size
    packed = tuple(pack_rows(batch, attention_width=width)[0].shape) if packing_supported(trainer.model) else None
    shared = head.shared_prefixes(trainer.model, batch, width) if packed else None
    computed = shared.computed if shared is not None else tokens
    if shared is not None:
        print(f"flowrl computes {computed} of the {tokens} tokens (each group's prompt, and the system prompt groups share, once) in rows "
              f"{tuple(shared.input_ids.shape)}; without sharing it packs them into {packed}")
    else:
        print(f"flowrl packs them into {packed} (rows, width)" if packed else "flowrl runs the padded rows (no packing)")
    sides = ["flowrl", "plain", "unshared"] + (["rows", "one"] if args.micro_batch_tokens else [])
    if args.micro_batch_tokens:
        splits = {name: [len(g) for g in micro_batch_rows(batch, args.micro_batch_tokens, packed, shared)]
                  for name, packed, shared in (("flowrl", trainer.packed, trainer.shared), ("rows", False, False))}
        print("rows per micro-batch: " + "; ".join(f"{k} {v}" for k, v in splits.items()))
    times: dict[str, list[float]] = {side: [] for side in sides}
    memory: dict[str, float] = {}
    checked: dict[str, tuple[float, dict]] = {}  # side -> (gradient difference from plain, its gradients)
    for repeat in range(args.repeats):
        seconds, peak, metrics = measure(trainer, lambda: trainer.forward_backward(batch, loss_fn))
        times["flowrl"].append(seconds)
        memory.setdefault("flowrl", peak)
        grads_flowrl = take_grads(trainer)
        seconds, peak, loss = measure(trainer, lambda: plain_hf(trainer, batch, loss_fn))
        times["plain"].append(seconds)
        memory.setdefault("plain", peak)
        grads_plain = take_grads(trainer)
        check = (float(loss), grads_plain) if repeat == 0 else None
        times["unshared"].append(unshared(trainer, batch, loss_fn, check))
        if "rows" in sides:  # the padded rule's split, and one micro-batch, of the same packed forward
            times["rows"].append(other_split(trainer, batch, loss_fn, False, args.micro_batch_tokens, check,
                                             checked, "rows"))
            times["one"].append(other_split(trainer, batch, loss_fn, trainer.packed, 1 << 20, check, checked, "one"))
        if repeat == 0:
            worst = compare(metrics["loss"], float(loss), grads_flowrl, grads_plain, float("inf"))
            assert abs(metrics["loss"] - float(loss)) <= 1e-5 * max(1.0, abs(float(loss))), "the losses differ"
            print(f"loss {metrics['loss']:.8f} vs {float(loss):.8f}; gradients agree to {worst:.1e} of their "
                  "largest entry")
            checked["flowrl"], plain_grads = (worst, grads_flowrl), grads_plain
    exact = agree(trainer, batch, loss_fn, checked, plain_grads)
    best = {k: min(v) for k, v in times.items()}
    for side in sides:
        print(f"{side:7s} forward_backward {best[side]:.3f} s (runs: "
              f"{', '.join(f'{t:.3f}' for t in times[side])})"
              + (f", peak memory +{memory[side]:.2f} GB" if side in memory else ""))
    speedup = best["plain"] / best["flowrl"]
    print(f"speedup {speedup:.2f}x")
    results_file.emit(args.record, "bench_train", {"bench": "train", "rows": args.rows, "tokens": tokens, "loss_tokens": loss_tokens,
                      "padded_tokens": batch.input_ids.numel(), "packed_shape": packed, "computed_tokens": computed,
                      "unshared_s": round(best["unshared"], 4),
                      "sharing_speedup": round(best["unshared"] / best["flowrl"], 3),
                      "flowrl_s": round(best["flowrl"], 4), "plain_s": round(best["plain"], 4),
                      "flowrl_peak_gb": round(memory["flowrl"], 3), "plain_peak_gb": round(memory["plain"], 3),
                      "grad_max_rel_diff": checked["flowrl"][0], "fp64_rel_err": exact, "threads": torch.get_num_threads(),
                      "device": str(trainer.device), "speedup": round(speedup, 3),
                      "micro_batch_tokens": args.micro_batch_tokens,
                      **({"rows_s": round(best["rows"], 4), "rows_over_tokens": round(best["rows"] / best["flowrl"], 3),
                          "one_s": round(best["one"], 4), "one_over_tokens": round(best["one"] / best["flowrl"], 3)}
                         if "rows" in sides else {})})


if __name__ == "__main__":
    main()
