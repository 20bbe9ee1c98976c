"""Token logprobs and entropy from logits, computed chunk by chunk, under the sampling distribution.

`token_logprobs(logits, targets)` returns `(logprobs, entropy)`, both shaped like `targets`, for
logits shaped `targets.shape + (vocab,)`. The work runs over chunks of rows (tokens) and, inside a
row chunk, over chunks of the vocabulary with an online log-sum-exp; only one chunk is ever cast to
fp32, so the whole batch's logits are never copied to fp32 at full vocabulary size. Autograd does
not keep the fp32 chunks either: the backward pass recomputes each chunk's softmax from the
saved (original dtype) logits and the per-token log-sum-exp.

Sampling distribution. With `temperature` (shaped like `targets`, > 0) each row's logits are
divided by its temperature in fp32, exactly as the engine does before it samples
(flowrl_operators.sampling), so on-policy logprobs equal the engine's behaviour logprobs.
With `top_k` / `top_p` a row whose filter is on (0 < top_k < vocab, or top_p < 1) keeps only the
tokens `engine.sampling.truncation_mask` keeps, renormalised, plus its target token. The kept set is
recomputed from the trainer's own logits: on-policy (the same weights) it is the engine's set, the
sampled token is in it and the logprob is the engine's; off-policy the target is added back, so the
logprob stays finite (it is that of the set the current policy would sample from, with the token
forced in). The set is a constant for the gradient (not differentiable in the set). Such rows are
taken `DENSE_ROW_CHUNK` at a time at full vocabulary in fp32 (the sort needs the whole row); the
kept set is recomputed in the backward pass rather than stored.

Gradients, with z = x / T, p = softmax(z) over the kept set (0 elsewhere), lp = log p, H = -sum p lp:
    d logprob[y] / dx = (onehot(y) - p) / T
    d H / dx        = -p * (lp + H) / T

Pure torch; runs on CPU and CUDA.
"""

from __future__ import annotations

import torch

from flowrl_operators.sampling import truncation_mask

ROW_CHUNK = 1024
VOCAB_CHUNK = 8192
DENSE_ROW_CHUNK = 64


def _scaled(x: torch.Tensor, temperature: torch.Tensor | None) -> torch.Tensor:
    z = x.float()
    return z if temperature is None else z / temperature[:, None]


def _row_stats(x: torch.Tensor, vocab_chunk: int, temperature: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-sum-exp and entropy of rows of scaled logits `x / T`, streaming over vocabulary chunks.

    Sums are kept relative to the running max m: S0 = sum e^(z-m), S1 = sum e^(z-m) (z-m), so
    H = log S0 - S1 / S0 stays accurate (lse - E[z] would cancel catastrophically).
    """
    rows = x.shape[0]
    running_max = torch.full((rows,), -float("inf"), dtype=torch.float32, device=x.device)
    s0 = torch.zeros(rows, dtype=torch.float32, device=x.device)
    s1 = torch.zeros(rows, dtype=torch.float32, device=x.device)
    for start in range(0, x.shape[1], vocab_chunk):
        chunk = _scaled(x[:, start : start + vocab_chunk], temperature)
        new_max = torch.maximum(running_max, chunk.max(dim=1).values)
        shift = torch.where(torch.isfinite(running_max), running_max - new_max, 0.0)
        scale = torch.exp(shift)
        z = chunk - new_max[:, None]
        e = torch.exp(z)
        # Moving the reference point from the old max to the new one: (x - m_old) = (x - m_new) - shift.
        s1 = scale * (s1 + shift * s0) + torch.where(e > 0, e * z, 0.0).sum(dim=1)
        s0 = s0 * scale + e.sum(dim=1)
        running_max = new_max
    lse = running_max + torch.log(s0)
    entropy = torch.log(s0) - s1 / s0
    return lse, entropy


def _kept(z: torch.Tensor, targets: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The engine's kept set from these scaled logits, plus each row's target (see the module docs)."""
    return truncation_mask(z, top_k, top_p).scatter(1, targets[:, None], True)


def _dense_stats(z: torch.Tensor, kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-sum-exp and entropy of scaled logits `z` restricted to `kept` (full rows, fp32)."""
    masked = z.masked_fill(~kept, -float("inf"))
    lse = torch.logsumexp(masked, dim=1)
    lp = masked - lse[:, None]
    p = lp.exp()
    return lse, -torch.where(p > 0, p * lp, 0.0).sum(dim=1)


def _chunk_grad(z, lse, ent, g_lp, g_ent, targets, v0, kept=None) -> torch.Tensor:
    """d(g_lp * logprob + g_ent * H) / dz for a chunk of scaled logits starting at column v0."""
    lp = z - lse
    p = torch.exp(lp)
    if kept is not None:
        p = torch.where(kept, p, 0.0)
    g = -g_lp * p - g_ent * torch.where(p > 0, p * (lp + ent), 0.0)
    # + g_lp on each row's target column, if the target falls in this vocabulary chunk.
    hit = (targets >= v0) & (targets < v0 + z.shape[1])
    column = (targets - v0).clamp(0, z.shape[1] - 1)[:, None]
    return g.scatter_add(1, column, torch.where(hit[:, None], g_lp, 0.0))


def _plan(rows: int, dense: torch.Tensor | None, row_chunk: int, dense_chunk: int) -> list[tuple[object, bool]]:
    """(rows, dense) chunks: slices when every row streams, else index tensors of each kind."""
    if dense is None or not bool(dense.any()):
        return [(slice(s, s + row_chunk), False) for s in range(0, rows, row_chunk)]
    plain, truncated = (~dense).nonzero().squeeze(1), dense.nonzero().squeeze(1)
    return [(i, False) for i in plain.split(row_chunk)] + [(i, True) for i in truncated.split(dense_chunk)]


def _pick(t: torch.Tensor | None, rows) -> torch.Tensor | None:
    return None if t is None else t[rows]


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, temperature, top_k, top_p, plan, vocab_chunk):  # type: ignore[override]
        n = logits.shape[0]
        logprobs = torch.empty(n, dtype=torch.float32, device=logits.device)
        entropy = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse_all = torch.empty(n, dtype=torch.float32, device=logits.device)
        for rows, dense in plan:
            x, y, t = logits[rows], targets[rows], _pick(temperature, rows)
            if dense:
                z = _scaled(x, t)
                lse, ent = _dense_stats(z, _kept(z, y, top_k[rows], top_p[rows]))
            else:
                lse, ent = _row_stats(x, vocab_chunk, t)
            target = _scaled(x.gather(1, y[:, None]), t).squeeze(1)
            logprobs[rows], entropy[rows], lse_all[rows] = target - lse, ent, lse
        ctx.save_for_backward(logits, targets, lse_all, entropy, temperature, top_k, top_p)
        ctx.plan, ctx.vocab_chunk = plan, vocab_chunk
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):  # type: ignore[override]
        logits, targets, lse_all, entropy, temperature, top_k, top_p = ctx.saved_tensors
        grad = torch.empty_like(logits)
        if grad_logprobs is None:
            grad_logprobs = torch.zeros_like(lse_all)
        if grad_entropy is None:
            grad_entropy = torch.zeros_like(lse_all)
        for rows, dense in ctx.plan:
            x, y, t = logits[rows], targets[rows], _pick(temperature, rows)
            stats = (lse_all[rows][:, None], entropy[rows][:, None], grad_logprobs[rows][:, None],
                     grad_entropy[rows][:, None])
            scale = 1.0 if t is None else 1.0 / t[:, None]
            if dense:
                z = _scaled(x, t)
                g = _chunk_grad(z, *stats, y, 0, _kept(z, y, top_k[rows], top_p[rows]))
                grad[rows] = (g * scale).to(logits.dtype)
                continue
            for v0 in range(0, logits.shape[1], ctx.vocab_chunk):
                g = _chunk_grad(_scaled(x[:, v0 : v0 + ctx.vocab_chunk], t), *stats, y, v0)
                grad[rows, v0 : v0 + ctx.vocab_chunk] = (g * scale).to(logits.dtype)
        return grad, None, None, None, None, None, None


def token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: torch.Tensor | None = None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    row_chunk: int = ROW_CHUNK,
    vocab_chunk: int = VOCAB_CHUNK,
    dense_chunk: int = DENSE_ROW_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob of each target token and the entropy of each position's distribution (fp32).

    `logits`: `(..., vocab)` in any float dtype; `targets`: `(...)` integer token ids; `temperature`
    (> 0), `top_k` (<= 0: off) and `top_p` (1: off), each `(...)` or None (off): the distribution
    each target was sampled from (see the module docs). `top_k` and `top_p` come together.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match targets {tuple(targets.shape)}")
    shape, vocab = targets.shape, logits.shape[-1]
    flat_logits = logits.reshape(-1, vocab)
    flat_targets = targets.reshape(-1).long()
    if temperature is not None:
        temperature = temperature.reshape(-1).to(device=logits.device, dtype=torch.float32)
        if not bool((temperature > 0).all()):
            raise ValueError("token_logprobs needs temperatures > 0 (a greedy token's logprob is at temperature 1)")
    dense = None
    if top_k is not None and top_p is not None:
        top_k = top_k.reshape(-1).to(logits.device)
        top_p = top_p.reshape(-1).to(device=logits.device, dtype=torch.float32)
        dense = ((top_k > 0) & (top_k < vocab)) | (top_p < 1.0)
    plan = _plan(flat_targets.shape[0], dense, row_chunk, dense_chunk)
    logprobs, entropy = _TokenLogprobs.apply(flat_logits, flat_targets, temperature, top_k, top_p, plan, vocab_chunk)
    return logprobs.view(shape), entropy.view(shape)


def reference_token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain full-vocabulary fp64 computation, used to test `token_logprobs`."""
    x = logits.double() if temperature is None else logits.double() / temperature.double().unsqueeze(-1)
    lp = torch.log_softmax(x, dim=-1)
    entropy = -torch.where(lp.exp() > 0, lp.exp() * lp, 0.0).sum(-1)
    return lp.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1), entropy
