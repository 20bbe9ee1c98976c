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
