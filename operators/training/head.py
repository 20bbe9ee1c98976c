"""The language-model head and the logprob kernel on the loss-bearing positions only.

    output = loss_token_logprobs(model, mb)   # {"logprobs": (B, T), "entropy": (B, T)}

A causal LM ends with `logits = lm_head(hidden)` over every position of every padded row: with
~60-token prompts, ~50-token responses and right padding, most of those positions are prompt or
padding, yet each costs a hidden x vocab product and a vocab-wide row of logits (and of its
gradient). Every caller of the trainer's logprobs reads them on the loss mask only: the losses and
their metrics mask with `loss_mask` (or the narrower `weighted_mask`), and `compute_logprobs`
(proximal, reference, teacher) zeroes everything else. So the head and the kernel run on the
positions j with `loss_mask[:, j] > 0` (whose logits predict token j + 1), and the results are
spread back to (B, T) with zeros elsewhere; the gradient is that of the full computation, whose
other positions carry no loss.

Why a hook on the head rather than calling the decoder and the head by hand: the model's own
forward still runs end to end, so FSDP2's root hooks (which gather the embedding, final norm and
head shards) wrap the head, peft's adapters and `disable_adapter` apply to every layer the forward
uses, tied embeddings need nothing special, and what a model does to its logits after the head
(scaling, soft-capping: elementwise) is done on the kept rows as on all of them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from flowrl_operators.training.kernels import token_logprobs


def output_head(model: torch.nn.Module) -> torch.nn.Module:
    """The module that maps hidden states to logits (a peft LoRA layer when the head is adapted)."""
    head = model.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(model).__name__} has no output embedding (lm_head) to compute logprobs with")
    return head


@contextlib.contextmanager
def head_rows(head: torch.nn.Module, rows: torch.Tensor, cols: torch.Tensor) -> Iterator[None]:
    """While open, `head` sees only the hidden states at (rows, cols) of its (B, L, hidden) input:
    it returns (N, vocab) logits for N = len(rows)."""

    def keep(_module: torch.nn.Module, args: tuple) -> tuple:
        hidden = args[0]
        if hidden.dim() != 3:  # e.g. a model that already sliced or flattened its positions
            raise RuntimeError(f"the output head got hidden states shaped {tuple(hidden.shape)}, not (B, L, hidden)")
        return (hidden[rows, cols], *args[1:])

    handle = head.register_forward_pre_hook(keep)
    try:
        yield
    finally:
        handle.remove()


def loss_token_logprobs(model: torch.nn.Module, mb, autocast=None) -> dict[str, torch.Tensor]:
    """Logprobs (under each token's sampling distribution) and entropies of the loss-mask tokens of
    micro-batch `mb` (a training.batch.Batch on the model's device), as (B, T) fp32, 0 off the mask."""
    keep = mb.loss_mask > 0
    rows, cols = keep.nonzero(as_tuple=True)
    with autocast or contextlib.nullcontext(), head_rows(output_head(model), rows, cols):
        logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask,
                       position_ids=mb.position_ids, use_cache=False).logits
    if logits.shape[:-1] != rows.shape:
        raise RuntimeError(f"the model returned logits shaped {tuple(logits.shape)} for {len(rows)} kept positions")
    targets = mb.input_ids[rows, cols + 1]
    logprobs, entropy = token_logprobs(logits, targets, **mb.sampling_inputs(rows, cols))
    return {"logprobs": spread(logprobs, keep, rows, cols), "entropy": spread(entropy, keep, rows, cols)}


def spread(values: torch.Tensor, keep: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """(N,) values back onto a (B, T) grid of zeros at (rows, cols); differentiable in `values`."""
    return torch.zeros(keep.shape, dtype=values.dtype, device=values.device).index_put((rows, cols), values)
