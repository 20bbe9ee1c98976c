"""The registered losses, KL estimators and aggregations added for verl / AReaL parity, against
values and gradients computed by hand (scalar Python) on fixed tensors, to 1e-6. Each test's
docstring states the formula; the config docstrings cite the source.

Fixed data: B = 2 rows, T = 3 tokens; the last token of row 1 is masked out (N = 5, S = 2).
"""

import math

import pytest
import torch

from flowrl_operators.training.batch import Batch, Normaliser
from flowrl_operators.training.losses import loss_config, policy_loss, set_behaviour_weights

torch.set_num_threads(1)

LOGP = [[-1.0, -0.5, -2.0], [-0.3, -1.2, -0.7]]
OLD = [[-1.1, -0.2, -2.25], [-2.0, -1.0, -0.7]]
BEHAV = [[-1.5, -0.3, -2.0], [-2.2, -0.1, -0.7]]
REF = [[-0.9, -0.6, -1.5], [-0.4, -1.0, -0.2]]
ADV = [[1.0, -1.0, 0.5], [-2.0, 2.0, -2.0]]
MASK = [[1, 1, 1], [1, 1, 0]]
TOKENS = [(i, t) for i in range(2) for t in range(3) if MASK[i][t]]
ROWS = [[t for t in range(3) if MASK[i][t]] for i in range(2)]
N = len(TOKENS)


def make_batch(old=OLD, proximal=None, logp_ref=REF):
    t = torch.tensor
    zeros = torch.zeros(2, 3)
    return Batch(
        input_ids=torch.zeros(2, 4, dtype=torch.long), attention_mask=torch.ones(2, 4, dtype=torch.long),
        position_ids=torch.zeros(2, 4, dtype=torch.long), loss_mask=t(MASK, dtype=torch.float32),
        behaviour_logprobs=t(old), rewards=zeros, reward_mask=zeros, versions=zeros.long(),
        group_index=t([0, 0]), lengths=t([4, 4]), reference_logprobs=t(logp_ref),
        proximal_logprobs=None if proximal is None else t(proximal), advantages=t(ADV),
    )


def run(keys, batch=None, logp=LOGP):
    """(loss, metrics, d loss / d logp as nested lists) for the loss these YAML keys select."""
    config = loss_config(keys)
    x = torch.tensor(logp, requires_grad=True)
    batch = batch or make_batch()
    if batch.proximal_logprobs is not None:
        set_behaviour_weights(batch, config)
    loss, metrics = policy_loss(config)({"logprobs": x, "entropy": torch.zeros(2, 3)}, batch, Normaliser.of(batch))
    loss.backward()
    return loss.item(), metrics, x.grad.tolist()


def check(actual_loss, actual_grad, loss, grad):
    assert actual_loss == pytest.approx(loss, abs=1e-6)
    for i, t in TOKENS:
        assert actual_grad[i][t] == pytest.approx(grad(i, t), abs=1e-6), (i, t)


def clip(x, low, high):
    return min(max(x, low), high)


def test_cispo():
    """l = -sg(clip(r, 0.8, 1.2)) A logp, r = exp(logp - old); token_mean.
    d l / d logp_t = -clip(r_t) A_t / N (no gradient through the weight)."""
    def w(i, t):
        return clip(math.exp(LOGP[i][t] - OLD[i][t]), 0.8, 1.2)

    loss, metrics, grad = run({"kind": "cispo"})
    check(loss, grad, sum(-w(i, t) * ADV[i][t] * LOGP[i][t] for i, t in TOKENS) / N,
          lambda i, t: -w(i, t) * ADV[i][t] / N)
    clipped = [w(i, t) != math.exp(LOGP[i][t] - OLD[i][t]) for i, t in TOKENS]
    assert 0 < sum(clipped) < N and metrics["clip_fraction"] == pytest.approx(sum(clipped) / N, abs=1e-6)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_sapo(aggregation):
    """l = -A f(r), f(r) = sigmoid(tau (r - 1)) 4 / tau, tau = 1.0 where A > 0 else 1.05.
    d l / d logp = -A 4 s (1 - s) r with s = sigmoid(tau (r - 1)); then the aggregation's weights
    (token_mean 1/N; seq_mean_token_mean 1/(n_i S))."""
    def parts(i, t):
        r, a = math.exp(LOGP[i][t] - OLD[i][t]), ADV[i][t]
        tau = 1.0 if a > 0 else 1.05
        s = 1 / (1 + math.exp(-tau * (r - 1)))
        return -a * s * 4 / tau, -a * 4 * s * (1 - s) * r

    def weight(i):
        return 1 / N if aggregation == "token_mean" else 1 / (len(ROWS[i]) * 2)

    loss, _, grad = run({"kind": "sapo", "aggregation": aggregation})
    check(loss, grad, sum(parts(i, t)[0] * weight(i) for i, t in TOKENS), lambda i, t: parts(i, t)[1] * weight(i))


def test_geo_mean():
    """GMPO: d' = sgn(A) min(sgn(A) d, sgn(A) clamp(d, -0.2, 0.2)), R_i = exp(sum_t d'_t / n_i),
    A_i = mean_t A, l_i = -A_i R_i; loss = mean_i l_i (S = 2). d l / d logp_t = -A_i R_i / (n_i S)
    where d'_t = d_t (not clipped), 0 where clipped."""
    def d_min(i, t):
        d, sign = LOGP[i][t] - OLD[i][t], math.copysign(1.0, ADV[i][t])
        return sign * min(sign * d, sign * clip(d, -0.2, 0.2))

    ratio = [math.exp(sum(d_min(i, t) for t in ROWS[i]) / len(ROWS[i])) for i in range(2)]
    adv = [sum(ADV[i][t] for t in ROWS[i]) / len(ROWS[i]) for i in range(2)]

    def grad(i, t):
        free = d_min(i, t) == LOGP[i][t] - OLD[i][t]
        return -adv[i] * ratio[i] / (len(ROWS[i]) * 2) if free else 0.0

    loss, _, g = run({"kind": "geo_mean"})
    assert any(grad(i, t) == 0.0 for i, t in TOKENS) and any(grad(i, t) != 0.0 for i, t in TOKENS)
    check(loss, g, sum(-adv[i] * ratio[i] for i in range(2)) / 2, grad)


@pytest.mark.parametrize("kind", ["reinforce", "gpg"])
def test_reinforce_and_gpg(kind):
    """l = -A logp (no ratio); d l / d logp = -A / N."""
    loss, _, grad = run({"kind": kind})
    check(loss, grad, sum(-ADV[i][t] * LOGP[i][t] for i, t in TOKENS) / N, lambda i, t: -ADV[i][t] / N)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_reinforce_bypass(level):
    """w = min(exp(logp - behaviour), 1.5) per token, or min(exp(sum_t (logp - behaviour)), 1.5) per
    sequence, without gradient; l = -w A logp; d l / d logp = -w A / N."""
    def w(i, t):
        if level == "token":
            return min(math.exp(LOGP[i][t] - BEHAV[i][t]), 1.5)
        return min(math.exp(sum(LOGP[i][s] - BEHAV[i][s] for s in ROWS[i])), 1.5)

    loss, _, grad = run({"kind": "reinforce_bypass", "level": level, "threshold": 1.5}, make_batch(old=BEHAV))
    assert any(w(i, t) == 1.5 for i, t in TOKENS) and any(w(i, t) < 1.5 for i, t in TOKENS)
    check(loss, grad, sum(-w(i, t) * ADV[i][t] * LOGP[i][t] for i, t in TOKENS) / N, lambda i, t: -w(i, t) * ADV[i][t] / N)


def test_token_sum_aggregation():
    """token_sum: sum_{i,t} m l (here the REINFORCE term); d l / d logp = -A."""
    loss, _, grad = run({"kind": "reinforce", "aggregation": "token_sum"})
    check(loss, grad, sum(-ADV[i][t] * LOGP[i][t] for i, t in TOKENS), lambda i, t: -ADV[i][t])


def test_log_ratio_safety_clamps():
    """ppo_clip clamps log r to +-20 (verl): a token with logp - old = 25 and A < 0 costs -A e^20
    and gets no gradient; gspo clamps the log sequence ratio at 10 from above."""
    logp = [[-1.0, 24.8, -2.0], [-0.3, -1.2, -0.7]]  # row 0 token 1: d = 25, A = -1
    loss, _, grad = run({"kind": "ppo_clip"}, logp=logp)
    others = [(i, t) for i, t in TOKENS if (i, t) != (0, 1)]

    def ppo(i, t):
        r, a = math.exp(logp[i][t] - OLD[i][t]), ADV[i][t]
        return max(-a * r, -a * clip(r, 0.8, 1.2))

    assert loss == pytest.approx((math.exp(20) + sum(ppo(i, t) for i, t in others)) / N, rel=1e-6)
    assert grad[0][1] == 0.0
    loss, _, grad = run({"kind": "gspo", "clip_low": 0.9, "clip_high": 1e6}, logp=logp)
    # Row 0: mean log ratio (0.1 + 25 + 0.25) / 3 = 8.45 < 10, unclamped; with A = -1 the clip at
    # 1 + 1e6 does not bind: l = -A exp(8.45); d l / d logp_t = -A_t exp(8.45) / N.
    s0 = math.exp((0.1 + 25.0 + 0.25) / 3)
    assert grad[0][1] == pytest.approx(-ADV[0][1] * s0 / N, rel=1e-6)
    big = [[30.0, 30.0, 30.0], LOGP[1]]  # mean log ratio ~31: clamped at 10, no gradient
    _, _, grad = run({"kind": "gspo", "clip_low": 0.9, "clip_high": 1e6}, logp=big)
    assert grad[0] == [0.0, 0.0, 0.0]


def kl_run(estimator_keys, logp=LOGP):
    return run({"kind": "reinforce", "kl": {"coef": 1.0, **estimator_keys}}, logp=logp)


@pytest.mark.parametrize("straight_through", [False, True])
def test_kl_abs_and_straight_through(straight_through):
    """abs: |d|, d = logp - ref, gradient sign(d); straight_through: value |d|, gradient of
    k2 = d^2 / 2, i.e. d (verl's `+` estimators). Loss = pg + token_mean(k)."""
    loss, metrics, grad = kl_run({"estimator": "abs", "straight_through": straight_through})
    kl = sum(abs(LOGP[i][t] - REF[i][t]) for i, t in TOKENS) / N
    assert metrics["kl"] == pytest.approx(kl, abs=1e-6)

    def kl_grad(i, t):
        d = LOGP[i][t] - REF[i][t]
        return d if straight_through else math.copysign(1.0, d)

    check(loss, grad, sum(-ADV[i][t] * LOGP[i][t] for i, t in TOKENS) / N + kl,
          lambda i, t: (-ADV[i][t] + kl_grad(i, t)) / N)


@pytest.mark.parametrize("straight_through", [False, True])
def test_kl_k3_and_k1_straight_through(straight_through):
    """k3 = exp(-d) - 1 + d, gradient 1 - exp(-d); straight-through gradient d (verl k3+).
    k1 = d with gradient 1, straight-through d (verl k1+)."""
    def d(i, t):
        return LOGP[i][t] - REF[i][t]

    for name, value, own in (("k3", lambda x: math.exp(-x) - 1 + x, lambda x: 1 - math.exp(-x)),
                             ("k1", lambda x: x, lambda x: 1.0)):
        _, metrics, grad = kl_run({"estimator": name, "straight_through": straight_through})
        assert metrics["kl"] == pytest.approx(sum(value(d(i, t)) for i, t in TOKENS) / N, abs=1e-6)
        for i, t in TOKENS:
            expected = (-ADV[i][t] + (d(i, t) if straight_through else own(d(i, t)))) / N
            assert grad[i][t] == pytest.approx(expected, abs=1e-6)


def test_kl_k3_clamps():
    """k3 as verl's low_var_kl: d clamped to +-20, the estimate to at most 10. d = -25 (logp far
    below ref): exp(20) - 1 - 20 -> 10, no gradient; max_value null keeps exp(20) - 21."""
    logp = [[-25.9, -0.5, -2.0], [-0.3, -1.2, -0.7]]  # row 0 token 0: d = -25
    _, metrics, grad = kl_run({"estimator": "k3"}, logp=logp)
    rest = sum(math.exp(-(logp[i][t] - REF[i][t])) - 1 + logp[i][t] - REF[i][t] for i, t in TOKENS[1:])
    assert metrics["kl"] == pytest.approx((10.0 + rest) / N, abs=1e-6)
    assert grad[0][0] == pytest.approx(-ADV[0][0] / N, abs=1e-6)  # the pg term only
    _, metrics, _ = kl_run({"estimator": "k3", "max_value": None}, logp=logp)
    assert metrics["kl"] == pytest.approx((math.exp(20) - 21 + rest) / N, rel=1e-6)


def test_geo_mean_weights_a_sequence_by_the_geometric_mean_of_its_token_weights():
    """One sequence of 2 tokens, A = 1, ratio 1, behaviour weights [0.25, 1] (decoupled, unbounded):
    l = -A R W with R = 1 and W = sqrt(0.25 * 1) = 0.5, so the loss is -0.5; d R / d logp_t = R / 2,
    so each token's gradient is -A W / 2 = -0.25 (the arithmetic mean would give -0.625, -0.3125)."""
    t = torch.tensor
    logp = [[-1.0, -0.5]]
    behaviour = [[-1.0 + math.log(4.0), -0.5]]
    zeros = torch.zeros(1, 2)
    batch = Batch(
        input_ids=torch.zeros(1, 3, dtype=torch.long), attention_mask=torch.ones(1, 3, dtype=torch.long),
        position_ids=torch.zeros(1, 3, dtype=torch.long), loss_mask=torch.ones(1, 2),
        behaviour_logprobs=t(behaviour), rewards=zeros, reward_mask=zeros, versions=zeros.long(),
        group_index=t([0]), lengths=t([3]), proximal_logprobs=t(logp), advantages=torch.ones(1, 2),
    )
    config = loss_config({"kind": "geo_mean", "decoupled": True, "allow_unbounded_weight": True})
    set_behaviour_weights(batch, config)
    assert batch.behaviour_weights.tolist()[0] == pytest.approx([0.25, 1.0])
    x = t(logp, requires_grad=True)
    loss, _ = policy_loss(config)({"logprobs": x, "entropy": zeros}, batch, Normaliser.of(batch))
    loss.backward()
    assert loss.item() == pytest.approx(-0.5, abs=1e-6)
    assert x.grad.tolist()[0] == pytest.approx([-0.25, -0.25], abs=1e-6)


def test_sapo_sequence_level():
    """level sequence: s_i = exp(mean_t (logp - old)), A_i = mean_t A, l = -A_i f(s_i) on each of
    the n_i tokens; token_mean: loss = sum_i n_i l_i / N. d s_i / d logp_t = s_i / n_i, so
    d loss / d logp_t = -A_i 4 g (1 - g) s_i / N, g = sigmoid(tau (s_i - 1)) (gradient through
    every token, as AReaL's importance_sampling_level sequence)."""
    adv = [ADV[0], [-2.0, 1.0, -2.0]]
    s = [math.exp(sum(LOGP[i][t] - OLD[i][t] for t in ROWS[i]) / len(ROWS[i])) for i in range(2)]
    a = [sum(adv[i][t] for t in ROWS[i]) / len(ROWS[i]) for i in range(2)]
    assert a[0] > 0 > a[1]  # both temperatures are used

    def parts(i):
        tau = 1.0 if a[i] > 0 else 1.05
        g = 1 / (1 + math.exp(-tau * (s[i] - 1)))
        return -a[i] * g * 4 / tau, -a[i] * 4 * g * (1 - g) * s[i]

    batch = make_batch()
    batch.advantages = torch.tensor(adv)
    loss, _, grad = run({"kind": "sapo", "level": "sequence"}, batch)
    check(loss, grad, sum(len(ROWS[i]) * parts(i)[0] for i in range(2)) / N, lambda i, t: parts(i)[1] / N)


def dppo_keep(kind, i, t, low, high):
    p, q, a = math.exp(LOGP[i][t]), math.exp(OLD[i][t]), ADV[i][t]
    if kind == "dppo_tv":
        return (p - q <= high) if a > 0 else (p - q >= -low)
    kl = q * (OLD[i][t] - LOGP[i][t]) + (1 - q) * math.log((1 - q + 1e-8) / (1 - p + 1e-8))
    return (kl <= high or p <= q) if a > 0 else (kl <= low or p >= q)


@pytest.mark.parametrize("kind", ["dppo_tv", "dppo_kl"])
def test_dppo_log_prob_surrogate(kind):
    """verl dppo_tv / dppo_kl: l = -keep A sg(min(r, c)) logp, r = exp(logp - old), c = 1.3 here;
    d l / d logp = -keep A min(r, c) / N. The thresholds (0.05, 0.1 TV; 0.01, 0.02 KL) drop some
    tokens and keep others on these tensors."""
    low, high = (0.05, 0.1) if kind == "dppo_tv" else (0.01, 0.02)

    def w(i, t):
        return min(math.exp(LOGP[i][t] - OLD[i][t]), 1.3) if dppo_keep(kind, i, t, low, high) else 0.0

    kept = [dppo_keep(kind, i, t, low, high) for i, t in TOKENS]
    assert 0 < sum(kept) < N
    loss, metrics, grad = run({"kind": kind, "delta_low": low, "delta_high": high, "truncation": 1.3})
    check(loss, grad, sum(-w(i, t) * ADV[i][t] * LOGP[i][t] for i, t in TOKENS) / N, lambda i, t: -w(i, t) * ADV[i][t] / N)
    assert metrics["clip_fraction"] == pytest.approx(1 - sum(kept) / N, abs=1e-6)


def test_dppo_ratio_surrogate_with_kl_term():
    """prime-rl's default: l = -keep A r + kl_coef d^2, d = logp - old, r = exp(d), token_mean;
    d l / d logp = -keep A r + 2 kl_coef d, over N."""
    low, high, coef = 0.05, 0.1, 0.01

    def parts(i, t):
        d = LOGP[i][t] - OLD[i][t]
        keep = dppo_keep("dppo_tv", i, t, low, high)
        return -keep * ADV[i][t] * math.exp(d) + coef * d * d, -keep * ADV[i][t] * math.exp(d) + 2 * coef * d

    keys = {"kind": "dppo_tv", "delta_low": low, "delta_high": high, "surrogate": "ratio", "kl_coef": coef}
    loss, _, grad = run(keys)
    check(loss, grad, sum(parts(i, t)[0] for i, t in TOKENS) / N, lambda i, t: parts(i, t)[1] / N)
