"""The policy's forward on packed rows, and the LM head and logprob kernel on the loss tokens only.

    output = loss_token_logprobs(model, mb)   # {"logprobs": (B, T), "entropy": (B, T)}
                                              # + "top_logprobs": (B, T, K) when mb.top_ids is set

A causal LM ends with `logits = lm_head(hidden)` over every position of every padded row: with
~60-token prompts, ~50-token responses and right padding, most of those positions are prompt or
padding, yet each costs a hidden x vocab product and a vocab-wide row of logits (and of its
gradient). Every caller of the trainer's logprobs reads them on the loss mask only: the losses and
their metrics mask with `loss_mask` (or the narrower `weighted_mask`), and `compute_logprobs`
(proximal, reference, teacher) zeroes everything else. So the head and the kernel run on the
positions j with `loss_mask[:, j] > 0` (whose logits predict token j + 1), and the results are
spread back to (B, T) with zeros elsewhere; the gradient is that of the full computation, whose
other positions carry no loss.

Packing. Right padding to the longest row wastes the decoder's work as well. When transformers
reads sequence boundaries from position ids (`packing_supported`), the micro-batch's sequences are
laid end to end in a few rows (`pack_rows`), each with its own position ids 0, 1, ... and no
attention mask: transformers then masks attention to each segment (a causal block-diagonal mask),
so every sequence sees exactly its own tokens at its own positions, as in its padded row. The
outputs come back to the batch's (B, T) layout; the losses, which aggregate per row, see no change.
The critic's value head still runs on the padded rows (a one-output head costs nothing). Where rows
of a group share a prefix (a GRPO group's prompt), `shared_prefixes` computes it once instead
(training/prefix.py).

Why a hook on the head rather than calling the decoder and the head by hand: the model's own
forward still runs end to end, so FSDP2's root hooks (which gather the embedding, final norm and
head shards) wrap the head, peft's adapters and `disable_adapter` apply to every layer the forward
uses, tied embeddings need nothing special, and what a model does to its logits after the head
(scaling, soft-capping: elementwise) is done on the kept rows as on all of them.
"""

from __future__ import annotations

import contextlib
import functools
import heapq
import math
from collections.abc import Iterator

import torch

from flowrl_operators.training.kernels import token_logprobs
from flowrl_operators.training.prefix import MASKED_ATTENTION, SharedRows, row_cost, shared_rows, trees, units
from flowrl_operators.training.vl_inputs import hidden_size, is_vl_model, vl_inputs

# Packed rows aim at about this many tokens (or the longest sequence, if longer): wide enough that
# the rows fill evenly, narrow enough that attention over a packed row (quadratic in its width, and
# computed densely under a mask) stays small next to the linear layers.
PACK_TOKENS = 256


# Families whose attention is checked to stop at packed sequences' boundaries (tests/test_training_head.py
# compares packed against padded rows; the VL families tests/test_training_vl.py, with their 4-row position
# ids from training/vl_inputs.py). Others (sliding windows, custom attention) get padded rows until they
# are checked the same way.
PACKED_FAMILIES = frozenset({"llama", "qwen2", "qwen2_vl", "qwen2_5_vl", "qwen3_vl"})  # VL: tests/test_training_vl.py


def packing_supported(model: torch.nn.Module | None = None) -> bool:
    """Whether this transformers reads sequence boundaries from restarting position ids (with no
    attention mask) and masks attention across them (`masking_utils.find_packed_sequence_indices`),
    and `model` is of a family checked to honour them."""
    family = getattr(getattr(model, "config", None), "model_type", None) if model is not None else None
    return _transformers_packs() and (model is None or family in PACKED_FAMILIES)


@functools.cache
def _transformers_packs() -> bool:
    """Asked once per process: the lookup through transformers' lazy module cost ~3 ms a forward."""
    try:
        from transformers import masking_utils
    except ImportError:
        return False
    return hasattr(masking_utils, "find_packed_sequence_indices")


def output_head(model: torch.nn.Module) -> torch.nn.Module:
    """The module that maps hidden states to logits (a peft LoRA layer when the head is adapted)."""
    head = model.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(model).__name__} has no output embedding (lm_head) to compute logprobs with")
    return head


@contextlib.contextmanager
def head_rows(head: torch.nn.Module, rows: torch.Tensor, cols: torch.Tensor) -> Iterator[None]:
    """While open, `head` sees only the hidden states at (rows, cols) of its (B, L, hidden) input:
    it returns (N, vocab) logits for N = len(rows).

    A position may be listed more than once (a shared prefix's loss position, read once per row:
    training/prefix.py), so its gradient is a sum. `pick_rows` takes it in a fixed order, which
    `flowrl replay` needs to be bit for bit; `hidden[rows, cols]` summed it with atomic adds from
    several threads in a varying order (docs/runs.md, Replay).
    """

    def keep(_module: torch.nn.Module, args: tuple) -> tuple:
        hidden = args[0]
        if hidden.dim() != 3:  # e.g. a model that already sliced or flattened its positions
            raise RuntimeError(f"the output head got hidden states shaped {tuple(hidden.shape)}, not (B, L, hidden)")
        return (pick_rows(hidden, rows, cols), *args[1:])

    handle = head.register_forward_pre_hook(keep)
    try:
        yield
    finally:
        handle.remove()


def pick_rows(hidden: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """`hidden[rows, cols]` ((N, hidden) of a (B, L, hidden) tensor) with a deterministic backward
    where positions repeat (`head_rows`)."""
    return torch.nn.functional.embedding(rows * hidden.shape[1] + cols, hidden.flatten(0, 1))


def _spread_rows(lengths: list[int], count: int) -> tuple[list[int], list[tuple[int, int]]]:
    """Sequences longest first onto the least loaded of `count` rows: each row's load, and each
    sequence's (row, offset)."""
    loads, where = [0] * count, [(0, 0)] * len(lengths)
    heap = [(0, k) for k in range(count)]  # (load, row): the least loaded first, then the lowest row
    for row in sorted(range(len(lengths)), key=lambda r: (-lengths[r], r)):
        load, packed = heap[0]
        where[row], loads[packed] = (packed, load), load + lengths[row]
        heapq.heapreplace(heap, (loads[packed], packed))
    return loads, where


def lay_out(lengths: list[int], target: float = PACK_TOKENS,
            attention_width: float = math.inf) -> tuple[list[int], list[tuple[int, int]]]:
    """Sequences of these lengths onto packed rows (`pack_rows`): each row's load, and each
    sequence's (row, offset)."""
    first = max(1, math.ceil(sum(lengths) / max(target, max(lengths))))
    counts = {*range(first, max(first, min(len(lengths), 2 * first)) + 1), len(lengths)}
    options = [(c, *_spread_rows(lengths, c)) for c in sorted(counts)]
    _, loads, where = min(options, key=lambda o: (o[0] * row_cost(max(o[1]), attention_width), -o[0]))
    return loads, where


def pack_rows(
    mb, target: int = PACK_TOKENS, attention_width: float = math.inf
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The micro-batch's sequences laid end to end in fewer rows, without padding between them.

    Returns (input_ids, position_ids) shaped (P, W), and for each original row its packed row and
    offset. P is chosen between c = ceil(tokens / max(target, longest)) and 2c, or one row per
    sequence (the padded layout), for the least work P x W x (1 + W / attention_width), W being the
    fullest row: attention over a row grows with its width, and at `attention_width` (about 6 x the
    hidden size) it costs as much as the linear layers. Each sequence keeps its own position ids
    (0, 1, ...), and a row's unused tail gets positions 0, 1, ... too, so the model sees every
    sequence and the tail as separate segments and attends within each.
    """
    loads, where = lay_out(mb.lengths.tolist(), target, attention_width)
    count, width, device = len(loads), max(loads), mb.input_ids.device
    input_ids = torch.zeros(count, width, dtype=mb.input_ids.dtype, device=device)
    position_ids = (torch.arange(width, device=device)[None, :]
                    - torch.tensor(loads, device=device)[:, None]).clamp(min=0)
    packed_row, offset = torch.tensor(where, device=device).unbind(1)
    # Every token of every sequence in one copy: (row, col) -> (its packed row, its offset + col).
    src = (torch.arange(mb.input_ids.shape[1], device=device)[None, :] < mb.lengths.to(device)[:, None]).nonzero(
        as_tuple=True)
    dst = (packed_row[src[0]], offset[src[0]] + src[1])
    input_ids[dst] = mb.input_ids[src]
    position_ids[dst] = mb.position_ids[src]
    return input_ids, position_ids, packed_row, offset


def loss_token_logprobs(model: torch.nn.Module, mb, autocast=None, pack: bool | None = None) -> dict[str, torch.Tensor]:
    """Logprobs (under each token's sampling distribution) and entropies of the loss-mask tokens of
    micro-batch `mb` (a training.batch.Batch on the model's device), as (B, T) fp32, 0 off the mask.
    With `pack` (default: when transformers supports it) the model runs on `pack_rows`, or on
    `shared_prefixes` where rows share a prefix."""
    keep = mb.loss_mask > 0
    rows, cols = keep.nonzero(as_tuple=True)
    if pack is None:
        pack = packing_supported(model)
    attention_width = 6 * hidden_size(model)
    shared = shared_prefixes(model, mb, attention_width) if pack else None
    if shared is not None:
        inputs = {"input_ids": shared.input_ids, "position_ids": shared.position_ids,
                  "attention_mask": shared.attention_mask}
        at = (shared.place_row[rows, cols], shared.place_col[rows, cols])
    elif pack:
        input_ids, position_ids, packed_row, offset = pack_rows(mb, attention_width=attention_width)
        inputs = {"input_ids": input_ids, "position_ids": position_ids, "attention_mask": None}
        at = (packed_row[rows], offset[rows] + cols)
    else:
        inputs = {"input_ids": mb.input_ids, "position_ids": mb.position_ids, "attention_mask": mb.attention_mask}
        at = (rows, cols)
    layout = (packed_row, offset) if pack and shared is None else None  # VL models: images in the packed order
    with autocast or contextlib.nullcontext(), head_rows(output_head(model), *at), \
            vl_inputs(model, mb, inputs, layout) as inputs:
        logits = model(**inputs, use_cache=False).logits
    if logits.shape[:-1] != rows.shape:
        raise RuntimeError(f"the model returned logits shaped {tuple(logits.shape)} for {len(rows)} kept positions")
    targets = mb.input_ids[rows, cols + 1]
    logprobs, entropy = token_logprobs(logits, targets, **mb.sampling_inputs(rows, cols))
    out = {"logprobs": spread(logprobs, keep, rows, cols), "entropy": spread(entropy, keep, rows, cols)}
    if mb.top_ids is not None:
        temperature = mb.temperature[rows, cols] if mb.temperature is not None else None
        top = gathered_logprobs(logits, mb.top_ids[rows, cols], temperature)
        out["top_logprobs"] = torch.zeros((*keep.shape, top.shape[1]), device=top.device).index_put((rows, cols), top)
    return out


@torch.no_grad()
def gathered_logprobs(logits: torch.Tensor, ids: torch.Tensor, temperature: torch.Tensor | None,
                      chunk: int = 128) -> torch.Tensor:
    """(N, K) logprobs of `ids` under log_softmax(logits / temperature) over the whole vocabulary, as
    the engine records the behaviour policy's top tokens (engine/sampling.py `top_logprobs`); fp32,
    `chunk` rows at a time (128 x a 152k vocabulary: 78 MB), without gradient (a top-K divergence only decides which tokens a DPPO
    loss keeps)."""
    out = torch.empty(ids.shape, dtype=torch.float32, device=logits.device)
    for start in range(0, logits.shape[0], chunk):
        z = logits[start : start + chunk].detach().float()
        if temperature is not None:
            z = z / temperature[start : start + chunk, None]
        out[start : start + chunk] = z.gather(1, ids[start : start + chunk]) - torch.logsumexp(z, dim=1, keepdim=True)
    return out


def shares_prefixes(model: torch.nn.Module) -> bool:
    """Whether the packed forward computes a group's shared prefix once (`shared_prefixes`): not for a
    vision-language model (its positions come from training/vl_inputs.py), nor for an attention
    implementation that takes no explicit mask (flash attention)."""
    implementation = getattr(model.config, "_attn_implementation", None)
    return packing_supported(model) and not is_vl_model(model) and implementation in MASKED_ATTENTION


def shared_prefixes(model: torch.nn.Module, mb, attention_width: float) -> SharedRows | None:
    """The micro-batch with each group's common prefix, and a common start of several groups (a
    system prompt), computed once (training/prefix.py), or None when no rows share one or the model
    does not (`shares_prefixes`)."""
    if not shares_prefixes(model):
        return None
    found = trees(mb, units(mb, attention_width), attention_width)
    if all(len(t.units) == 1 and len(t.units[0].rows) == 1 for t in found):
        return None
    eager = model.config._attn_implementation == "eager"
    dtype = torch.float32 if eager else None  # eager adds the mask to its scores; sdpa takes a bool one
    return shared_rows(mb, found, lambda widths: lay_out(widths, PACK_TOKENS, attention_width), dtype)


def spread(values: torch.Tensor, keep: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """(N,) values back onto a (B, T) grid of zeros at (rows, cols); differentiable in `values`."""
    return torch.zeros(keep.shape, dtype=values.dtype, device=values.device).index_put((rows, cols), values)
