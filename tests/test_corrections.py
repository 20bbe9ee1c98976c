"""Corrections (registry flowrl.corrections) against weights computed by hand on fixed tensors, to
1e-6: with r = prox - behav per token (log pi_proximal / pi_behaviour), the weight each token's
loss is multiplied by; 0 masks it out. The config docstrings cite verl / AReaL.
"""

import math

import pytest
import torch

from flowrl_operators.training.batch import Batch, Normaliser
from flowrl_operators.training.losses import loss_config, policy_loss, set_behaviour_weights

torch.set_num_threads(1)

PROX = [[-1.0, -0.5, -2.5, -0.4], [-0.3, -1.2, -0.7, -1.0], [-2.0, -0.1, -0.6, -0.9]]
BEHAV = [[-1.3, -0.5, -1.5, -0.5], [-0.2, -2.0, -0.7, -0.3], [-2.05, -0.2, -0.5, -9.0]]
MASK = [[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 0]]
ROWS = [[t for t in range(4) if MASK[i][t]] for i in range(3)]
TOKENS = [(i, t) for i in range(3) for t in ROWS[i]]


def r(i, t):
    return PROX[i][t] - BEHAV[i][t]


def weights(correction: dict, reduce=None) -> list[list[float]]:
    t = torch.tensor
    zeros = torch.zeros(3, 4)
    batch = Batch(
        input_ids=torch.zeros(3, 5, dtype=torch.long), attention_mask=torch.ones(3, 5, dtype=torch.long),
        position_ids=torch.zeros(3, 5, dtype=torch.long), loss_mask=t(MASK, dtype=torch.float32),
        behaviour_logprobs=t(BEHAV), rewards=zeros, reward_mask=zeros, versions=zeros.long(),
        group_index=t([0, 0, 1]), lengths=t([5, 5, 5]), proximal_logprobs=t(PROX), advantages=zeros + 1,
    )
    config = loss_config({"correction": correction})
    set_behaviour_weights(batch, config, *([reduce] if reduce else []))
    # The loss sees exactly these weights: with A = 1 and old = prox, r = 1, l = -w per token.
    logp = t(PROX)
    loss, _ = policy_loss(config)({"logprobs": logp, "entropy": zeros}, batch, Normaliser.of(batch))
    assert loss.item() == pytest.approx(-float((batch.behaviour_weights * batch.loss_mask).sum()) / len(TOKENS), abs=1e-6)
    return batch.behaviour_weights.tolist()


def expect(actual, fn):
    for i, t in TOKENS:
        assert actual[i][t] == pytest.approx(fn(i, t), abs=1e-6), (i, t)


@pytest.mark.parametrize("action", ["truncate", "mask"])
def test_geometric(action):
    """w_i = exp(mean_t r) on every token of sequence i; truncate: clamp(w_i, 0.9, 1.1);
    mask: w_i if 0.9 <= w_i <= 1.1 else 0 (AReaL metric ratio, level sequence)."""
    w = [math.exp(sum(r(i, t) for t in ROWS[i]) / len(ROWS[i])) for i in range(3)]
    assert w[0] < 0.9 and 0.9 <= w[2] <= 1.1 and w[1] > 1.1  # one sequence each side and one inside
    got = weights({"kind": "geometric", "action": action, "threshold": 1.1, "floor": 0.9})
    if action == "truncate":
        expect(got, lambda i, t: min(max(w[i], 0.9), 1.1))
    else:
        expect(got, lambda i, t: w[i] if 0.9 <= w[i] <= 1.1 else 0.0)


def test_reject_token_and_sequence_checks():
    """Rejection only (weight 1 or 0), verl rollout_rs, with k1 = -r, k2 = r^2 / 2, k3 = e^r - 1 - r:
    token_k1 keeps log(0.5) <= k1 <= log(1.5); seq_max_k2 keeps sequences with max k2 <= 0.2;
    combined, a token stays if both pass."""
    def token_k1(i, t):
        return math.log(0.5) <= -r(i, t) <= math.log(1.5)

    def seq_max_k2(i):
        return max(0.5 * r(i, t) ** 2 for t in ROWS[i]) <= 0.2

    got = weights({"kind": "reject", "checks": [{"check": "token_k1", "threshold": 1.5, "floor": 0.5}]})
    expect(got, lambda i, t: float(token_k1(i, t)))
    assert any(not token_k1(i, t) for i, t in TOKENS)
    got = weights({"kind": "reject", "checks": [{"check": "seq_max_k2", "threshold": 0.2}]})
    expect(got, lambda i, t: float(seq_max_k2(i)))
    assert [seq_max_k2(i) for i in range(3)].count(True) in (1, 2)
    both = [{"check": "token_k1", "threshold": 1.5, "floor": 0.5}, {"check": "seq_max_k2", "threshold": 0.2}]
    expect(weights({"kind": "reject", "checks": both}), lambda i, t: float(token_k1(i, t) and seq_max_k2(i)))


@pytest.mark.parametrize("check,bound", [("seq_sum_k1", 1.5), ("seq_mean_k3", 0.05), ("seq_sum_k2", 0.3),
                                         ("token_k3", 0.02), ("seq_mean_k1", 1.2)])
def test_reject_sequence_statistics(check, bound):
    """seq_sum / seq_mean of k over the sequence's tokens; k1 bands default to [1/threshold, threshold]
    in ratio space: log(1/t) <= stat <= log(t); k2 / k3 keep stat <= threshold."""
    level, estimator = check.rsplit("_", 1)
    k = {"k1": lambda x: -x, "k2": lambda x: 0.5 * x * x, "k3": lambda x: math.exp(x) - 1 - x}[estimator]

    def keep(i, t):
        values = [k(r(i, s)) for s in ROWS[i]]
        stat = {"seq_sum": sum(values), "seq_mean": sum(values) / len(values), "token": k(r(i, t))}[level]
        if estimator == "k1":
            return math.log(1 / bound) <= stat <= math.log(bound)
        return stat <= bound

    kept = [keep(i, t) for i, t in TOKENS]
    assert any(kept) and not all(kept)  # the fixed data exercises both outcomes
    expect(weights({"kind": "reject", "checks": [{"check": check, "threshold": bound}]}), lambda i, t: float(keep(i, t)))


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_tis_batch_normalized(level):
    """w = min(exp(r), 1.2) per token, or min(exp(sum_t r), 1.2) per sequence; batch_normalize divides
    by the mean over the batch's loss tokens (token) or sequences (sequence) (verl
    rollout_is_batch_normalize); the ranks' sums go through `reduce`."""
    def w(i, t):
        return min(math.exp(r(i, t) if level == "token" else sum(r(i, s) for s in ROWS[i])), 1.2)

    mean = (sum(w(i, t) for i, t in TOKENS) / len(TOKENS) if level == "token"
            else sum(w(i, ROWS[i][0]) for i in range(3)) / 3)
    reduced = []

    def reduce(values):
        reduced.append(values)
        return values

    got = weights({"kind": "tis", "level": level, "threshold": 1.2, "batch_normalize": True}, reduce)
    assert reduced  # the batch mean is a sum over the ranks
    expect(got, lambda i, t: w(i, t) / mean)


def test_tis_with_rejection():
    """tis weights times a rejection mask: min(exp(r), 2) where token_k3 <= 0.02, else 0."""
    def w(i, t):
        k3 = math.exp(r(i, t)) - 1 - r(i, t)
        return min(math.exp(r(i, t)), 2.0) if k3 <= 0.02 else 0.0

    got = weights({"kind": "tis", "reject": [{"check": "token_k3", "threshold": 0.02}]})
    assert any(w(i, t) == 0 for i, t in TOKENS)
    expect(got, w)


def test_unknown_check_is_a_located_error():
    from flowrl_operators.training.objective import problems

    [(path, message)] = problems({"correction": {"kind": "reject", "checks": [{"check": "seq_max_k1", "threshold": 1}]}},
                                 "grpo")
    assert path == ("loss", "correction", "checks", 0, "check") and "seq_max_k1" in message


def kept_loss(correction: dict, aggregation: str) -> tuple[float, list[list[float]]]:
    """(loss, weights) with A = 1 and old = prox (r = 1, l = -w per token), as in `weights`."""
    t = torch.tensor
    zeros = torch.zeros(3, 4)
    batch = Batch(
        input_ids=torch.zeros(3, 5, dtype=torch.long), attention_mask=torch.ones(3, 5, dtype=torch.long),
        position_ids=torch.zeros(3, 5, dtype=torch.long), loss_mask=t(MASK, dtype=torch.float32),
        behaviour_logprobs=t(BEHAV), rewards=zeros, reward_mask=zeros, versions=zeros.long(),
        group_index=t([0, 0, 1]), lengths=t([5, 5, 5]), proximal_logprobs=t(PROX), advantages=zeros + 1,
    )
    config = loss_config({"correction": correction, "aggregation": aggregation})
    set_behaviour_weights(batch, config)
    loss, _ = policy_loss(config)({"logprobs": t(PROX), "entropy": zeros}, batch, Normaliser.of(batch))
    return loss.item(), batch.behaviour_weights.tolist()


@pytest.mark.parametrize("correction", [
    {"kind": "mis", "threshold": 1.5, "floor": 0.8},
    {"kind": "geometric", "action": "mask", "threshold": 1.1, "floor": 0.9},
    {"kind": "reject", "checks": [{"check": "token_k1", "threshold": 1.5, "floor": 0.5}]},
])
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_normalise_kept_counts_only_the_kept_tokens(correction, aggregation):
    """With l = -w: normalise all divides by every loss token (N = 10) or sequence (S = 3);
    normalise kept by the kept tokens (w > 0) and the sequences that keep one, with n_i the row's
    kept tokens (verl: the rejection-modified mask)."""
    loss_all, w = kept_loss({**correction, "normalise": "all"}, aggregation)
    loss_kept, _ = kept_loss({**correction, "normalise": "kept"}, aggregation)
    kept = [[t for t in ROWS[i] if w[i][t] > 0] for i in range(3)]
    assert 0 < sum(map(len, kept)) < len(TOKENS)  # the fixed data masks some tokens and keeps others
    if aggregation == "token_mean":
        total = -sum(w[i][t] for i in range(3) for t in kept[i])
        expected_all, expected_kept = total / len(TOKENS), total / sum(map(len, kept))
    else:
        rows = [i for i in range(3) if kept[i]]
        expected_all = sum(-sum(w[i][t] for t in kept[i]) / len(ROWS[i]) for i in range(3)) / 3
        expected_kept = sum(-sum(w[i][t] for t in kept[i]) / len(kept[i]) for i in rows) / len(rows)
    assert loss_all == pytest.approx(expected_all, abs=1e-6)
    assert loss_kept == pytest.approx(expected_kept, abs=1e-6)
