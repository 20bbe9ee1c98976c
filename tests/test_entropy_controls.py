"""The loss options against entropy collapse and locked tokens: entropy_control (adaptive entropy
bonus), cov (KL-Cov, Clip-Cov) and unlikelihood, on the fixed batch of tests/test_losses.py."""

import math

import msgspec
import pytest
import torch
from test_losses import ADV, ENT, LOGP, OLD, TOKENS, L, ppo_token, run, table, token_mean

from flowrl_operators.config import LossConfig


@pytest.mark.parametrize(("target", "expected_coef"), [(2.0, 0.01 + (0.2 - 0.01) * (2.0 - 0.9) / 2.0), (0.5, 0.01)])
def test_entropy_control_raises_the_bonus_as_entropy_falls_below_its_target(target, expected_coef):
    """entropy_control: coef = entropy_coef + (max_coef - entropy_coef) * clamp((target - H) / target, 0, 1),
    H the mean entropy of the loss tokens (0.9 here): below the target the bonus grows in proportion to
    the shortfall; at or above it the fixed coefficient stays."""
    h = token_mean(ENT)
    assert abs(h - 0.9) < 1e-9
    config = msgspec.convert({"entropy_coef": 0.01, "entropy_control": {"target": target, "max_coef": 0.2}}, LossConfig)
    loss, metrics, _ = run(config)
    pg = token_mean(table(lambda i, t: ppo_token(LOGP[i][t], OLD[i][t], ADV[i][t], 0.2, 0.2)))
    assert abs(loss.item() - (pg - expected_coef * h)) < 1e-6
    assert abs(metrics["entropy_coef"] - expected_coef) < 1e-6
    fixed, fixed_metrics, _ = run(msgspec.convert({"entropy_coef": 0.01}, LossConfig))
    assert "entropy_coef" not in fixed_metrics and abs(fixed.item() - (pg - 0.01 * h)) < 1e-6


def covariances():
    """(logp - mean logp)(A - mean A) over the loss tokens, by token."""
    lp = [LOGP[i][t] for i, t in TOKENS]
    adv = [ADV[i][t] for i, t in TOKENS]
    mlp, madv = sum(lp) / len(lp), sum(adv) / len(adv)
    return {(i, t): (LOGP[i][t] - mlp) * (ADV[i][t] - madv) for i, t in TOKENS}


def test_kl_cov_adds_the_abs_log_ratio_on_the_largest_covariance_tokens_only():
    """cov {kind: kl, fraction, coef}: the top max(1, int(n * fraction)) tokens by covariance get
    coef * |logp - old| added to their PPO loss; every other token keeps its loss."""
    cov = covariances()
    top = sorted(cov, key=cov.get, reverse=True)[:2]  # 5 tokens * 0.4 = 2
    config = msgspec.convert({"cov": {"kind": "kl", "fraction": 0.4, "coef": 0.5}}, LossConfig)
    loss, _, _ = run(config)

    def per(i, t):
        base = ppo_token(LOGP[i][t], OLD[i][t], ADV[i][t], 0.2, 0.2)
        return base + (0.5 * abs(LOGP[i][t] - OLD[i][t]) if (i, t) in top else 0.0)

    assert abs(loss.item() - token_mean(table(per))) < 1e-6
    plain, _, _ = run(L())
    assert loss.item() > plain.item()


def test_clip_cov_takes_the_gradient_of_tokens_in_its_band_only():
    """cov {kind: clip}: a token drawn among those whose covariance lies in (low, high) gets no
    gradient; with a band holding exactly one token, that token's gradient is 0 and the others' are
    PPO's."""
    cov = covariances()
    target = max(cov, key=cov.get)
    others = sorted(v for k, v in cov.items() if k != target)
    low = others[-1] + 1e-6
    config = msgspec.convert({"cov": {"kind": "clip", "fraction": 0.01, "low": low, "high": cov[target] + 1}}, LossConfig)
    loss, _, logp = run(config, grad=True)
    loss.backward()
    plain_loss, _, plain = run(L(), grad=True)
    plain_loss.backward()
    assert logp.grad[target].item() == 0.0 and plain.grad[target].item() != 0.0
    for i, t in TOKENS:
        if (i, t) != target:
            assert logp.grad[i, t].item() == pytest.approx(plain.grad[i, t].item())
    with pytest.raises(msgspec.ValidationError, match="must be above low"):
        msgspec.convert({"cov": {"kind": "clip", "fraction": 0.1, "low": 2.0, "high": 1.0}}, LossConfig)


def test_unlikelihood_pushes_a_sure_wrong_token_where_the_policy_gradient_vanishes():
    """unlikelihood: c: loss += c |A| -log(1 - p) on A < 0 tokens. On a token the policy is sure of
    (p = 1 - 1e-4) with A = -1, -A log p's gradient on its logprob is ~|A| but moves its logit by
    |A| (1 - p) ~ 1e-4; the unlikelihood term's gradient on the logprob is p / (1 - p) ~ 1e4."""
    config = msgspec.convert({"unlikelihood": 0.5}, LossConfig)
    loss, _, _ = run(config)
    plain, _, _ = run(L())

    def extra(i, t):
        p = math.exp(LOGP[i][t])
        return 0.5 * -ADV[i][t] * -math.log(1 - p) if ADV[i][t] < 0 else 0.0

    assert abs(loss.item() - (plain.item() + token_mean(table(extra)))) < 1e-6
    from flowrl_operators.training.losses import unlikelihood

    sure = torch.tensor([[math.log(1 - 1e-4)]], requires_grad=True)
    unlikelihood(sure, torch.tensor([[-1.0]])).sum().backward()
    assert sure.grad.item() == pytest.approx((1 - 1e-4) / 1e-4, rel=1e-3)
    assert unlikelihood(sure, torch.tensor([[1.0]])).item() == 0.0  # positive advantages: untouched


def test_the_options_refuse_what_would_fail_or_run_backwards():
    """sft has no advantages for unlikelihood or cov to read; an entropy ceiling below the fixed
    coefficient would lower the bonus as entropy collapses."""
    for keys in ({"kind": "sft", "unlikelihood": 1.0}, {"kind": "sft", "cov": {"kind": "kl", "fraction": 0.1}}):
        with pytest.raises(ValueError, match="supervised loss"):
            L(**keys)
    with pytest.raises(msgspec.ValidationError, match="below entropy_coef"):
        msgspec.convert({"entropy_coef": 0.05, "entropy_control": {"target": 0.1, "max_coef": 0.01}}, LossConfig)
