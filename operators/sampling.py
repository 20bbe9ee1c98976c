"""Sampling one token per row, with the logprob of the distribution it was drawn from.

For a sampled row (temperature > 0) the distribution is softmax(logits / temperature), restricted
to the top_k most likely tokens, then to the smallest head of those whose mass reaches top_p, and
renormalised; the token is read from its cumulative distribution at one uniform number, and its
logprob from the same distribution. A greedy row (temperature 0) takes the argmax and reports
log_softmax(logits) there.

Determinism per request: the uniform of a row is a hash of the request's seed and the index of the
token being drawn (`uniform`: SplitMix64, computed in Python for the batch's rows), not a draw from
a shared generator, so a seeded request draws the same tokens whatever else is in the batch, alone
or among others, after a retract and a resume too, and the whole batch samples in a few batched
tensor operations (one Gumbel noise vector per row, drawn row by row from each request's
torch.Generator, cost the quickstart ~1,000 small calls a step).
"""

from __future__ import annotations

import torch

from flowrl_operators.inference import SamplingParams

_MASK = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's increment (the golden ratio in 64 bits)


def _mix(z: int) -> int:
    """SplitMix64's finaliser: a bijection of 64-bit integers that scatters every input bit."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def uniform(seed: int, index: int) -> float:
    """The request's uniform number in (0, 1) for its `index`-th token: SplitMix64's output number
    `index` of the stream the (mixed) seed starts, 53 bits."""
    z = _mix((_mix(seed & _MASK) + (index + 1) * _GAMMA) & _MASK)
    return ((z >> 11) + 0.5) / (1 << 53)


def sample(
    logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], indices: list[int]
) -> tuple[list[int], list[float]]:
    """logits [N, vocab] fp32 -> (token per row, logprob per row). Row i draws with `uniform(seeds[i],
    indices[i])` (its request's seed and the index of the token it draws)."""
    count, vocab = logits.shape
    # A row neither greedy nor sampled (a temperature no check let through) keeps -1 and NaN: the
    # engine fails its request alone.
    tokens = torch.full((count,), -1, dtype=torch.long, device=logits.device)
    logprobs = torch.full((count,), float("nan"), dtype=torch.float, device=logits.device)

    greedy = [i for i, p in enumerate(params) if p.temperature == 0]
    if greedy:
        rows = torch.tensor(greedy, device=logits.device)
        logp = torch.log_softmax(logits[rows], dim=-1)
        chosen = logp.argmax(dim=-1)
        tokens[rows] = chosen
        logprobs[rows] = logp.gather(1, chosen[:, None])[:, 0]

    sampled = [i for i, p in enumerate(params) if p.temperature > 0]
    if sampled:
        rows = torch.tensor(sampled, device=logits.device)
        temperature = torch.tensor([params[i].temperature for i in sampled], device=logits.device)
        scaled = logits[rows] / temperature[:, None]
        top_k = [min(params[i].top_k, vocab) if params[i].top_k > 0 else vocab for i in sampled]
        top_p = [params[i].top_p for i in sampled]
        if min(top_k) < vocab or min(top_p) < 1.0:
            scaled = restrict(scaled, top_k, top_p)
        logp = torch.log_softmax(scaled, dim=-1)
        u = torch.tensor([uniform(seeds[i], indices[i]) for i in sampled], dtype=torch.float64, device=logits.device)
        chosen = inverse_cdf(logp, u)
        tokens[rows] = chosen
        logprobs[rows] = logp.gather(1, chosen[:, None])[:, 0]
    return tokens.tolist(), logprobs.tolist()


def inverse_cdf(logp: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token of each row whose cumulative probability first exceeds u (in [0, 1)) of the row's
    total: an exact draw from softmax(logp) for a uniform u; excluded tokens (-inf) have no width and
    are never chosen. fp64 sums, so that no token's width is lost to rounding."""
    cdf = logp.exp().double().cumsum(dim=-1)
    chosen = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    # u * total may round up to the total: the last token with any mass (the first at the total).
    return torch.where(chosen < cdf.shape[1], chosen, cdf.argmax(dim=-1))


def restrict(scaled: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Set to -inf every logit outside the row's top-k, then outside its top-p nucleus."""
    k = torch.tensor(top_k, device=scaled.device)
    p = torch.tensor(top_p, device=scaled.device, dtype=torch.float32)
    return scaled.masked_fill(~truncation_mask(scaled, k, p), float("-inf"))


# Candidates a filtered row takes with topk before it falls back to sorting its whole vocabulary
# (one stable sort of Qwen's 151,936 logits per row cost 12 ms on one CPU thread, a topk of 1024 1 ms).
HEAD = 1024


def truncation_mask(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, head: int = HEAD) -> torch.Tensor:
    """True where a row keeps a token: among its `top_k` largest scaled logits (all if top_k <= 0),
    the tokens whose mass strictly before them, in descending order, is below `top_p` (so the first
    is always kept; top_p >= 1 keeps all). Ties keep index order (a stable sort). The engine's
    sampler and the trainer's recomputation (flowrl_operators.training.kernels) both use it, so they
    keep the same set from the same logits.

    A row is first decided from its `head` largest logits; it is sorted whole only when its set may
    reach past them (a nucleus wider than `head`, or 0 < top_k - head, or a tie across the edge)."""
    vocab = scaled.shape[1]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab).to(scaled.device)
    p = top_p.to(device=scaled.device, dtype=torch.float32)
    mask = torch.ones_like(scaled, dtype=torch.bool)
    pending = (k < vocab) | (p < 1.0)
    if head < vocab:
        rows = (pending & ((k <= head) | (k == vocab))).nonzero().squeeze(1)
        if len(rows):
            kept, decided = _head_mask(scaled[rows], k[rows], p[rows], head)
            mask[rows] = kept
            pending[rows] = ~decided
    rows = pending.nonzero().squeeze(1)
    if len(rows):
        mask[rows] = _sorted_mask(scaled[rows], k[rows], p[rows])
    return mask


def _kept_prefix(ordered: torch.Tensor, lse: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Which positions of rows sorted in descending order are kept (a prefix of each row)."""
    in_k = torch.arange(ordered.shape[1], device=ordered.device)[None, :] < k[:, None]
    probs = torch.exp(ordered.masked_fill(~in_k, float("-inf")) - lse[:, None])
    before = probs.cumsum(dim=-1) - probs
    return in_k & ((before < p[:, None]) | (p[:, None] >= 1.0))


def _sorted_mask(scaled: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    ordered, order = scaled.sort(dim=-1, descending=True, stable=True)
    in_k = torch.arange(scaled.shape[1], device=scaled.device)[None, :] < k[:, None]
    lse = torch.logsumexp(ordered.masked_fill(~in_k, float("-inf")), dim=-1)
    return torch.zeros_like(scaled, dtype=torch.bool).scatter(1, order, _kept_prefix(ordered, lse, k, p))


def _head_mask(scaled: torch.Tensor, k: torch.Tensor, p: torch.Tensor, head: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The mask from each row's `head` largest logits (rows with k <= head or no top-k), and whether
    it is the whole-row answer."""
    values, index = scaled.topk(head, dim=-1)
    # The whole-row stable order among the candidates: value descending, then index ascending.
    index, by_index = index.sort(dim=-1)
    ordered, by_value = values.gather(1, by_index).sort(dim=-1, descending=True, stable=True)
    order = index.gather(1, by_value)
    in_k = torch.arange(head, device=scaled.device)[None, :] < k[:, None]
    # The mass is over the row's top-k set: within the candidates if k <= head, else the whole row.
    lse = torch.where(k <= head, torch.logsumexp(ordered.masked_fill(~in_k, float("-inf")), dim=-1),
                      torch.logsumexp(scaled, dim=-1))
    kept = _kept_prefix(ordered, lse, k, p)
    count = kept.sum(dim=-1)
    # Positions before the last candidate's value are in whole-row order; a tie at the edge may not be.
    exact = (ordered > ordered[:, -1:]).sum(dim=-1)
    decided = (count <= exact) & ((count < head) | (k <= head))
    return torch.zeros_like(scaled, dtype=torch.bool).scatter(1, order, kept), decided


def top_logprobs(logits: torch.Tensor, params: list[SamplingParams]) -> list[tuple[list[int], list[float]] | None]:
    """Per row asking for K = `top_logprobs` > 0: its K most likely token ids (most likely first) and
    their logprobs under softmax(logits / temperature), temperature 1 for a greedy row, over the
    whole vocabulary (before top-k / top-p); None for the other rows. The trainer computes its own
    policy's logprobs of these ids under the same temperature (training/head.py)."""
    wanted = [i for i, p in enumerate(params) if p.top_logprobs > 0]
    out: list[tuple[list[int], list[float]] | None] = [None] * len(params)
    if not wanted:
        return out
    rows = torch.tensor(wanted, device=logits.device)
    temperature = torch.tensor([params[i].temperature if params[i].temperature > 0 else 1.0 for i in wanted],
                               device=logits.device)
    logp = torch.log_softmax(logits[rows].float() / temperature[:, None], dim=-1)
    k = min(max(params[i].top_logprobs for i in wanted), logits.shape[1])
    values, ids = logp.topk(k, dim=-1)
    for row, i, vals in zip(wanted, ids.tolist(), values.tolist(), strict=True):
        count = params[row].top_logprobs
        out[row] = (i[:count], vals[:count])
    return out
