"""Chunked token logprobs / entropy equal the plain fp32 log_softmax computation, values and grads."""

import pytest
import torch

from flowrl_operators.training.kernels import reference_token_logprobs, token_logprobs

torch.set_num_threads(1)


@pytest.mark.parametrize("row_chunk,vocab_chunk", [(1024, 8192), (3, 7), (1, 50)])
def test_matches_log_softmax_values_and_gradients(row_chunk, vocab_chunk):
    """logprob[y] = x[y] - logsumexp(x); H = -sum softmax(x) * log_softmax(x); checked with grads."""
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 5, 50, generator=g) * 3).requires_grad_()
    targets = torch.randint(0, 50, (2, 5), generator=g)
    w_lp, w_ent = torch.randn(2, 5, generator=g), torch.randn(2, 5, generator=g)

    lp, ent = token_logprobs(logits, targets, row_chunk=row_chunk, vocab_chunk=vocab_chunk)
    (lp * w_lp + ent * w_ent).sum().backward()
    grad = logits.grad.clone()
    logits.grad = None
    ref_lp, ref_ent = reference_token_logprobs(logits, targets)
    (ref_lp * w_lp + ref_ent * w_ent).sum().backward()

    # fp32 kernel against an fp64 reference: a few ulps of values around 1-10.
    torch.testing.assert_close(lp.double(), ref_lp, atol=2e-6, rtol=1e-6)
    torch.testing.assert_close(ent.double(), ref_ent, atol=2e-6, rtol=1e-6)
    torch.testing.assert_close(grad, logits.grad, atol=2e-6, rtol=1e-6)


def test_bf16_logits_and_masked_vocabulary():
    """bf16 input is upcast per chunk; a -inf logit contributes p = 0 and no nan."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 33, generator=g).to(torch.bfloat16)
    logits[:, 5] = -float("inf")
    logits.requires_grad_()
    targets = torch.tensor([0, 1, 2, 32])
    lp, ent = token_logprobs(logits, targets, row_chunk=2, vocab_chunk=8)
    (lp.sum() + ent.sum()).backward()
    ref_lp, ref_ent = reference_token_logprobs(logits.detach(), targets)
    torch.testing.assert_close(lp.double(), ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=1e-5)
    assert logits.grad.dtype == torch.bfloat16
    assert torch.isfinite(logits.grad.float()).all()
    assert (logits.grad[:, 5] == 0).all()


def test_shape_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match="do not match"):
        token_logprobs(torch.zeros(2, 3, 10), torch.zeros(2, 4, dtype=torch.long))


def test_temperature_scales_values_and_gradients():
    """Per-token temperature T: logprob of softmax(x / T), entropy of it, d/dx = (onehot - p) / T."""
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(2, 5, 50, generator=g) * 3).requires_grad_()
    targets = torch.randint(0, 50, (2, 5), generator=g)
    temperature = 0.5 + torch.rand(2, 5, generator=g)
    w_lp, w_ent = torch.randn(2, 5, generator=g), torch.randn(2, 5, generator=g)
    lp, ent = token_logprobs(logits, targets, temperature=temperature, row_chunk=3, vocab_chunk=7)
    (lp * w_lp + ent * w_ent).sum().backward()
    grad, logits.grad = logits.grad.clone(), None
    ref_lp, ref_ent = reference_token_logprobs(logits, targets, temperature)
    (ref_lp * w_lp + ref_ent * w_ent).sum().backward()
    torch.testing.assert_close(lp.double(), ref_lp, atol=2e-6, rtol=1e-6)
    torch.testing.assert_close(ent.double(), ref_ent, atol=2e-6, rtol=1e-6)
    torch.testing.assert_close(grad, logits.grad, atol=2e-6, rtol=1e-6)
    untempered, _ = token_logprobs(logits, targets)
    assert (untempered - lp).abs().max() > 0.1


def test_top_k_top_p_follow_the_engines_kept_set_values_and_gradients():
    """Rows with a filter keep the engine's set (engine.sampling.restrict on x / T) renormalised,
    rows without one the full vocabulary; the gradient is that of log_softmax over the kept set."""
    from flowrl_operators.sampling import restrict

    g = torch.Generator().manual_seed(3)
    rows, vocab = 9, 40
    logits = (torch.randn(rows, vocab, generator=g) * 2).requires_grad_()
    temperature = torch.tensor([0.7, 1.0, 1.3] * 3)
    top_k = torch.tensor([-1, 5, -1, 10, -1, 3, -1, -1, 20])
    top_p = torch.tensor([0.9, 1.0, 0.8, 0.95, 1.0, 1.0, 1.0, 0.5, 0.7])
    scaled = logits.detach() / temperature[:, None]
    kept = torch.isfinite(restrict(scaled, [k if k > 0 else vocab for k in top_k.tolist()], top_p.tolist()))
    assert kept.sum(1).min() < vocab and kept[4].all() and kept[6].all()  # filters on and off
    # Each row's target is drawn from the engine's distribution: always in the kept set.
    engine_lp = torch.log_softmax(scaled.masked_fill(~kept, -float("inf")), dim=-1)
    targets = torch.multinomial(engine_lp.exp(), 1, generator=g)[:, 0]
    w_lp, w_ent = torch.randn(rows, generator=g), torch.randn(rows, generator=g)

    lp, ent = token_logprobs(logits, targets, temperature=temperature, top_k=top_k, top_p=top_p,
                             row_chunk=2, vocab_chunk=16, dense_chunk=2)
    (lp * w_lp + ent * w_ent).sum().backward()
    grad, logits.grad = logits.grad.clone(), None
    ref = torch.log_softmax((logits.double() / temperature[:, None].double()).masked_fill(~kept, -float("inf")), -1)
    ref_lp = ref.gather(1, targets[:, None])[:, 0]
    ref = torch.where(kept, ref, 0.0)  # no -inf * 0 in the entropy's backward
    ref_ent = -torch.where(kept, ref.exp() * ref, 0.0).sum(-1)
    (ref_lp * w_lp + ref_ent * w_ent).sum().backward()
    torch.testing.assert_close(lp, engine_lp.gather(1, targets[:, None])[:, 0], atol=1e-6, rtol=0)
    torch.testing.assert_close(lp.double(), ref_lp.detach(), atol=2e-6, rtol=1e-6)
    torch.testing.assert_close(ent.double(), ref_ent.detach(), atol=2e-6, rtol=1e-6)
    torch.testing.assert_close(grad, logits.grad.float(), atol=2e-6, rtol=1e-6)
    assert (grad[~kept] == 0).all()  # tokens outside the kept set get no gradient


def test_a_target_outside_the_kept_set_is_added_back():
    """Off-policy, the trainer's own set may exclude the token: it is added, so the logprob stays
    finite: log(p_y / (p_top + p_y)) with top_k 1."""
    logits = torch.tensor([[3.0, 1.0, 0.0, -1.0]])
    lp, ent = token_logprobs(logits, torch.tensor([2]), temperature=torch.ones(1), top_k=torch.tensor([1]),
                             top_p=torch.ones(1))
    expected = torch.log(torch.tensor(0.0).exp() / (torch.tensor(3.0).exp() + torch.tensor(0.0).exp()))
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
    torch.testing.assert_close(lp, expected.reshape(1), atol=1e-6, rtol=0)
