"""The engine's sampler (operators/sampling.py): one batched draw, each row from its own
request's seed and token index. Draws follow the (restricted) distribution, a row draws the same
token alone or among others, and excluded tokens are never drawn."""

from __future__ import annotations

import torch

from flowrl_operators.inference import SamplingParams
from flowrl_operators.sampling import inverse_cdf, sample, uniform

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


def draws(params: SamplingParams, rows: int = 20000) -> torch.Tensor:
    tokens, _ = sample(LOGITS.repeat(rows, 1), [params] * rows, list(range(rows)), [7] * rows)
    return torch.bincount(torch.tensor(tokens), minlength=len(LOGITS)).double() / rows


def test_draws_follow_the_sampling_distribution():
    for temperature in (1.0, 0.6):
        expected = torch.softmax(LOGITS.double() / temperature, dim=-1)
        assert (draws(SamplingParams(temperature=temperature)) - expected).abs().max() < 0.012
    # top_k 3: the three largest renormalised; the rest never drawn
    freq = draws(SamplingParams(temperature=1.0, top_k=3))
    assert freq[3:].sum() == 0
    assert (freq[:3] - torch.softmax(LOGITS[:3].double(), dim=-1)).abs().max() < 0.012


def test_a_row_draws_the_same_alone_or_among_others():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(9, 50, generator=g)
    params = [SamplingParams(temperature=t, top_p=p) for t, p in
              [(1.0, 1.0), (0.0, 1.0), (0.7, 0.9), (1.3, 1.0), (1.0, 0.5), (0.0, 1.0), (1.0, 1.0), (0.9, 1.0), (1.0, 0.8)]]
    seeds, indices = [11 * i + 3 for i in range(9)], [i % 4 for i in range(9)]
    together = sample(logits, params, seeds, indices)
    for i in range(9):
        alone = sample(logits[i : i + 1], params[i : i + 1], seeds[i : i + 1], indices[i : i + 1])
        assert alone == ([together[0][i]], [together[1][i]])
    # the logprob is the token's under the row's distribution (temperature 1, no filter: the model's)
    assert abs(together[1][0] - float(torch.log_softmax(logits[0], -1)[together[0][0]])) < 1e-6
    # another token index (or seed) draws anew
    again = sample(logits[:1].repeat(40, 1), params[:1] * 40, [3] * 40, list(range(40)))[0]
    assert len(set(again)) > 5


def test_uniforms_are_in_the_open_interval_and_spread():
    values = [uniform(seed, index) for seed in range(100) for index in range(100)]
    assert all(0.0 < v < 1.0 for v in values) and len(set(values)) == len(values)
    assert abs(sum(values) / len(values) - 0.5) < 0.01
    assert abs(sum(v < 0.1 for v in values) / len(values) - 0.1) < 0.01


def test_inverse_cdf_never_picks_a_token_without_mass():
    logp = torch.log_softmax(torch.tensor([[0.0, 1.0, -float("inf"), -float("inf")]] * 3), dim=-1)
    u = torch.tensor([0.0, 0.5, 1.0 - 2.0**-53], dtype=torch.float64)
    assert inverse_cdf(logp, u).tolist() == [0, 1, 1]
