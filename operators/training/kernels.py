"""Token logprobs and entropy from logits, computed chunk by chunk.

`token_logprobs(logits, targets)` returns `(logprobs, entropy)`, both shaped like `targets`, for
logits shaped `targets.shape + (vocab,)`. The work runs over chunks of rows (tokens) and, inside a
row chunk, over chunks of the vocabulary with an online log-sum-exp; only one chunk is ever cast to
fp32, so the whole batch's logits are never copied to fp32 at full vocabulary size. Autograd does
not keep the fp32 chunks either: the backward pass recomputes each chunk's softmax from the
saved (original dtype) logits and the per-token log-sum-exp.

Gradients, with p = softmax(x), lp = log p, H = -sum p lp:
    d logprob[y] / dx = onehot(y) - p
    d H / dx        = -p * (lp + H)

Pure torch; runs on CPU and CUDA.
"""

from __future__ import annotations

import torch

ROW_CHUNK = 1024
VOCAB_CHUNK = 8192


def _row_stats(x: torch.Tensor, vocab_chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-sum-exp and entropy of rows of logits `x`, streaming over vocabulary chunks.

    Sums are kept relative to the running max m: S0 = sum e^(x-m), S1 = sum e^(x-m) (x-m), so
    H = log S0 - S1 / S0 stays accurate (lse - E[x] would cancel catastrophically).
    """
    rows = x.shape[0]
    running_max = torch.full((rows,), -float("inf"), dtype=torch.float32, device=x.device)
    s0 = torch.zeros(rows, dtype=torch.float32, device=x.device)
    s1 = torch.zeros(rows, dtype=torch.float32, device=x.device)
    for start in range(0, x.shape[1], vocab_chunk):
        chunk = x[:, start : start + vocab_chunk].float()
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


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, row_chunk, vocab_chunk):  # type: ignore[override]
        rows = logits.shape[0]
        logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
        entropy = torch.empty(rows, dtype=torch.float32, device=logits.device)
        lse_all = torch.empty(rows, dtype=torch.float32, device=logits.device)
        for start in range(0, rows, row_chunk):
            x = logits[start : start + row_chunk]
            y = targets[start : start + row_chunk]
            lse, ent = _row_stats(x, vocab_chunk)
            logprobs[start : start + row_chunk] = x.gather(1, y[:, None]).squeeze(1).float() - lse
            entropy[start : start + row_chunk] = ent
            lse_all[start : start + row_chunk] = lse
        ctx.save_for_backward(logits, targets, lse_all, entropy)
        ctx.chunks = (row_chunk, vocab_chunk)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):  # type: ignore[override]
        logits, targets, lse_all, entropy = ctx.saved_tensors
        row_chunk, vocab_chunk = ctx.chunks
        grad = torch.empty_like(logits)
        if grad_logprobs is None:
            grad_logprobs = torch.zeros_like(lse_all)
        if grad_entropy is None:
            grad_entropy = torch.zeros_like(lse_all)
        for start in range(0, logits.shape[0], row_chunk):
            end = start + row_chunk
            lse, ent = lse_all[start:end, None], entropy[start:end, None]
            g_lp, g_ent = grad_logprobs[start:end, None], grad_entropy[start:end, None]
            y = targets[start:end]
            for v0 in range(0, logits.shape[1], vocab_chunk):
                x = logits[start:end, v0 : v0 + vocab_chunk].float()
                lp = x - lse
                p = torch.exp(lp)
                g = -g_lp * p - g_ent * torch.where(p > 0, p * (lp + ent), 0.0)
                # + g_lp on each row's target column, if the target falls in this vocabulary chunk.
                hit = (y >= v0) & (y < v0 + x.shape[1])
                column = (y - v0).clamp(0, x.shape[1] - 1)[:, None]
                g.scatter_add_(1, column, torch.where(hit[:, None], g_lp, 0.0))
                grad[start:end, v0 : v0 + vocab_chunk] = g.to(logits.dtype)
        return grad, None, None, None


def token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    row_chunk: int = ROW_CHUNK,
    vocab_chunk: int = VOCAB_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob of each target token and the entropy of each position's distribution (fp32).

    `logits`: `(..., vocab)` in any float dtype; `targets`: `(...)` integer token ids.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match targets {tuple(targets.shape)}")
    shape = targets.shape
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_targets = targets.reshape(-1).long()
    logprobs, entropy = _TokenLogprobs.apply(flat_logits, flat_targets, row_chunk, vocab_chunk)
    return logprobs.view(shape), entropy.view(shape)


def reference_token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain full-vocabulary fp64 computation, used to test `token_logprobs`."""
    lp = torch.log_softmax(logits.double(), dim=-1)
    entropy = -torch.where(lp.exp() > 0, lp.exp() * lp, 0.0).sum(-1)
    return lp.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1), entropy
