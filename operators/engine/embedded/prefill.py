"""Prefill with shared prompts: compute each distinct prompt once, copy its KV to every request that shares it.

GRPO-shaped work submits a group of requests with equal prompt ids (the generate node gathers a
sample's episodes at once), and groups often open with the same system prompt. Prefill therefore

1. picks one *leader* per distinct token list (and images: requests with images compare
   `vl_requests.prefix_key`s, so KV is never shared across different images) among the requests to prefill; the others (*forks*)
   take a copy of the leader's KV and the leader's last-position logits, then sample from them with
   their own generator (so each request's noise still comes from its own seed);
2. lets each leader copy the longest prefix it shares with a request already cached (a *donor*:
   decoding, with KV computed by the current weights) and compute only the rest, starting there;
   new prompts that share a long prefix (>= MIN_SHARED tokens, e.g. a system prompt) with another
   new prompt wait for that one's forward (a second round) and copy the prefix from it;
3. runs the leaders in as few right-padded forwards as padding allows (rows sorted by length; a
   forward takes rows while its padded area stays within `PADDING` of the real tokens), the
   padding written to the cache's scratch position.

A request's KV at a position depends only on the weights and the tokens up to it, so a copied prefix
equals a computed one up to float rounding of different matmul shapes (the same ~1e-7 as batching).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from flowrl_operators.engine.embedded.model import CausalLM, KVCache
from flowrl_operators.engine.embedded.vl_requests import prefix_key
from flowrl_operators.inference import GenerateRequest

PADDING = 1.25  # a batched prefill forward computes at most this many tokens per real token
# A leader sharing at least this many more tokens with another new prompt than with any cached one
# (a system prompt) waits for that prompt's forward and copies from it: one more forward, fewer tokens.
MIN_SHARED = 16


class Cached(Protocol):
    """What prefill reads of a request (embedded.Sequence)."""

    tokens: list[int]
    slot: int | None
    request: GenerateRequest


@dataclass
class PrefillStats:
    """Counters for EmbeddedEngine.stats(): requests computed / forked, tokens computed / copied."""

    prefills: int = 0
    forks: int = 0
    forwards: int = 0
    tokens: int = 0
    shared_tokens: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"prefills": self.prefills, "prefill_forks": self.forks, "prefill_forwards": self.forwards,
                "prefill_tokens": self.tokens, "prefill_shared_tokens": self.shared_tokens}


@dataclass
class Leader:
    seq: Cached
    start: int = 0  # positions copied from a donor; computing starts here
    donor: int | None = None  # the donor's slot
    forks: list[Cached] = field(default_factory=list)
    key: list[int] | None = None  # the tokens as sharing compares them (vl_requests.prefix_key)

    def __post_init__(self) -> None:
        if self.key is None:
            self.key = self.seq.tokens


def plan(seqs: Seq[Cached], donors: Seq[Cached], vision: Any = None) -> list[Leader]:
    """One leader per distinct token list and images (with its forks), each with its best donor prefix.
    `vision`: a VL model's operators/vision.py `Vision`, which finds the images' placeholders."""
    leaders: dict[tuple[int, ...], Leader] = {}
    donor_keys = [prefix_key(donor.request, donor.tokens, vision) for donor in donors]
    for seq in seqs:
        mine = prefix_key(seq.request, seq.tokens, vision)
        key = tuple(mine)
        if key in leaders:
            leaders[key].forks.append(seq)
            continue
        leader = leaders[key] = Leader(seq, key=mine)
        for donor, theirs in zip(donors, donor_keys, strict=True):
            # The donor's cache holds all its tokens but the last; the leader computes >= 1 token.
            shared = common_prefix(mine, theirs, min(len(mine), len(theirs)) - 1)
            if shared > leader.start:
                leader.start, leader.donor = shared, donor.slot
    return list(leaders.values())


def common_prefix(a: list[int], b: list[int], limit: int) -> int:
    n = 0
    while n < limit and a[n] == b[n]:
        n += 1
    return n


def batches(leaders: list[Leader]) -> list[list[Leader]]:
    """Leaders sorted by tokens to compute, cut where one more row would pad beyond PADDING."""
    rows = sorted(leaders, key=lambda r: len(r.seq.tokens) - r.start)
    out: list[list[Leader]] = []
    real = 0
    for row in rows:
        size = len(row.seq.tokens) - row.start
        if out and size * (len(out[-1]) + 1) <= PADDING * (real + size):
            out[-1].append(row)
            real += size
        else:
            out.append([row])
            real = size
    return out


def rounds(leaders: list[Leader]) -> tuple[list[Leader], list[Leader]]:
    """Split leaders into those computed first and those that then copy a long prefix from one of them."""
    first: list[Leader] = []
    later: list[Leader] = []
    for leader in leaders:
        tokens = leader.key
        best = max((common_prefix(tokens, f.key, min(len(tokens) - 1, len(f.key))) for f in first),
                   default=0)
        (later if best - leader.start >= MIN_SHARED else first).append(leader)
    return first, later


def adopt(later: list[Leader], first: list[Leader]) -> None:
    """Point each second-round leader at the first-round leader it shares most with (its KV now cached:
    every token, since nothing was sampled yet)."""
    for leader in later:
        tokens = leader.key
        for f in first:
            shared = common_prefix(tokens, f.key, min(len(tokens) - 1, len(f.key)))
            if shared > leader.start:
                leader.start, leader.donor = shared, f.seq.slot


@torch.no_grad()
def prefill(model: CausalLM, cache: KVCache, seqs: Seq[Cached], donors: Seq[Cached],
            stats: PrefillStats) -> tuple[list[Cached], torch.Tensor]:
    """Fill the cache for `seqs` (each in its own slot); returns them reordered with one logits row each."""
    first, later = rounds(plan(seqs, donors, getattr(model, "vision", None)))
    order: list[Cached] = []
    rows: list[torch.Tensor] = []
    for group in (first, later):
        if group is later:  # the first round is cached now: the second copies from it
            adopt(later, first)
        for batch in batches(group):
            for row in batch:
                if row.donor is not None:
                    cache.copy(row.donor, [row.seq.slot], row.start)
            logits = forward(model, cache, batch)
            stats.forwards += 1
            for row, logit in zip(batch, logits, strict=True):
                length = len(row.seq.tokens)
                cache.copy(row.seq.slot, [fork.slot for fork in row.forks], length)
                order += [row.seq, *row.forks]
                rows.append(logit[None].expand(1 + len(row.forks), -1))
                stats.prefills += 1
                stats.forks += len(row.forks)
                stats.tokens += length - row.start
                stats.shared_tokens += row.start + length * len(row.forks)
    return order, torch.cat(rows)


def forward(model: CausalLM, cache: KVCache, batch: list[Leader]) -> torch.Tensor:
    """One right-padded forward over the leaders' uncached tokens -> logits [rows, vocab]."""
    device = cache.device
    sizes = [len(row.seq.tokens) - row.start for row in batch]
    width = max(sizes)
    tokens = torch.tensor([row.seq.tokens[row.start:] + [0] * (width - size) for row, size in zip(batch, sizes, strict=True)],
                          device=device)
    sizes_t = torch.tensor(sizes, device=device)
    return model(tokens, torch.tensor([row.start for row in batch], device=device), cache,
                 torch.tensor([row.seq.slot for row in batch], device=device),
                 max(len(row.seq.tokens) for row in batch), last=sizes_t - 1, lengths=sizes_t,
                 seqs=[row.seq for row in batch])


def compact(slots: list, decode: Seq[Cached], cache: KVCache) -> int:
    """Move the highest decoding requests down into free slots below them (copying their KV), so a
    batched decode over slots 0..hi computes no rows for finished or empty slots. Returns the moves.

    `slots` is the engine's slot table (None = free); call it between forwards, under the step lock.
    """
    free = [i for i, seq in enumerate(slots) if seq is None]
    moved = 0
    for seq in sorted(decode, key=lambda s: s.slot, reverse=True):
        if not free or free[0] > seq.slot:
            break
        target = free.pop(0)
        cache.copy(seq.slot, [target], len(seq.tokens) - 1)  # the cache holds all its tokens but the last
        slots[target], slots[seq.slot] = seq, None
        seq.slot = target
        moved += 1
    return moved
