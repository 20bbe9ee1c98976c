"""Sampling one token per row, with the logprob of the distribution it was drawn from.

For a sampled row (temperature > 0) the distribution is softmax(logits / temperature), restricted
to the top_k most likely tokens, then to the smallest head of those whose mass reaches top_p, and
renormalised; the token is drawn from it with the row's own torch.Generator (so a seeded request
draws the same token whatever else is in the batch) and its logprob is read from the same
distribution. A greedy row (temperature 0) takes the argmax and reports log_softmax(logits) there.
"""

from __future__ import annotations

import torch

from flowrl_operators.engine.base import SamplingParams


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]
) -> tuple[list[int], list[float]]:
    """logits [N, vocab] fp32 -> (token per row, logprob per row)."""
    count, vocab = logits.shape
    tokens = torch.empty(count, dtype=torch.long, device=logits.device)
    logprobs = torch.empty(count, dtype=torch.float, device=logits.device)

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
        top_k = [params[i].top_k if params[i].top_k > 0 else vocab for i in sampled]
        top_p = [params[i].top_p for i in sampled]
        if min(top_k) < vocab or min(top_p) < 1.0:
            scaled = restrict(scaled, top_k, top_p)
        logp = torch.log_softmax(scaled, dim=-1)
        # Gumbel-max: argmax(logp - log E), E ~ Exp(1) drawn per row from that request's generator,
        # is an exact draw from softmax(logp); excluded tokens stay at -inf.
        noise = torch.stack([torch.empty(vocab, device=logits.device).exponential_(generator=generators[i])
                             for i in sampled])
        chosen = (logp - noise.log()).argmax(dim=-1)
        tokens[rows] = chosen
        logprobs[rows] = logp.gather(1, chosen[:, None])[:, 0]
    return tokens.tolist(), logprobs.tolist()


def restrict(scaled: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Set to -inf every logit outside the row's top-k, then outside its top-p nucleus."""
    k = torch.tensor(top_k, device=scaled.device)
    p = torch.tensor(top_p, device=scaled.device, dtype=torch.float32)
    return scaled.masked_fill(~truncation_mask(scaled, k, p), float("-inf"))


def truncation_mask(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """True where a row keeps a token: among its `top_k` largest scaled logits (all if top_k <= 0),
    the tokens whose mass strictly before them, in descending order, is below `top_p` (so the first
    is always kept; top_p >= 1 keeps all). Ties keep index order (a stable sort), so the trainer's
    recomputation (flowrl_operators.training.kernels) keeps the same set from the same logits."""
    vocab = scaled.shape[1]
    ordered, order = scaled.sort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(vocab, device=scaled.device)
    k = torch.where(top_k > 0, top_k, vocab).to(scaled.device)
    in_k = ranks[None, :] < k[:, None]
    probs = torch.softmax(ordered.masked_fill(~in_k, float("-inf")), dim=-1)
    before = probs.cumsum(dim=-1) - probs
    p = top_p.to(device=scaled.device, dtype=probs.dtype)[:, None]
    kept = in_k & ((before < p) | (p >= 1.0))
    return torch.zeros_like(kept).scatter(1, order, kept)
