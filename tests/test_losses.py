"""Every policy/value loss against a hand-computed (scalar Python) reference to 1e-6.

Fixed data: B = 2 rows, T = 3 tokens; the last token of row 1 is masked out.
"""

import math

import msgspec
import pytest
import torch

from flowrl_operators.config import AdvantageConfig, LossConfig
from flowrl_operators.training.batch import Batch, Normaliser
from flowrl_operators.training.losses import (
    ValueLossConfig,
    apply_kl_penalty,
    check_compatible,
    loss_config,
    needs_proximal,
    policy_loss,
    set_behaviour_weights,
    value_loss,
)
from flowrl_operators.training.objective import advantage_config, correction_config, kl_config

torch.set_num_threads(1)

LOGP = [[-1.0, -0.5, -2.0], [-0.3, -1.2, -0.7]]
OLD = [[-1.1, -0.2, -2.25], [-2.0, -1.0, -0.7]]
BEHAV = [[-1.5, -0.3, -2.0], [-2.2, -0.1, -0.7]]
REF = [[-0.9, -0.6, -1.5], [-0.4, -1.0, -0.2]]
ENT = [[0.5, 0.7, 0.9], [1.1, 1.3, 1.5]]
ADV = [[1.0, -1.0, 0.5], [-2.0, 2.0, -2.0]]
MASK = [[1, 1, 1], [1, 1, 0]]
TOKENS = [(i, t) for i in range(2) for t in range(3) if MASK[i][t]]


def make_batch(old=OLD, proximal=None):
    t = torch.tensor
    zeros = torch.zeros(2, 3)
    return Batch(
        input_ids=torch.zeros(2, 4, dtype=torch.long), attention_mask=torch.ones(2, 4, dtype=torch.long),
        position_ids=torch.zeros(2, 4, dtype=torch.long), loss_mask=t(MASK, dtype=torch.float32),
        behaviour_logprobs=t(old), rewards=zeros, reward_mask=zeros, versions=zeros.long(),
        group_index=t([0, 0]), lengths=t([4, 4]), reference_logprobs=t(REF),
        proximal_logprobs=None if proximal is None else t(proximal), advantages=t(ADV),
    )


def L(**keys):
    """The typed config of the loss these YAML keys select."""
    return loss_config(keys)


def run(config, batch=None, grad=False):
    logp = torch.tensor(LOGP, requires_grad=grad)
    output = {"logprobs": logp, "entropy": torch.tensor(ENT)}
    batch = batch or make_batch()
    if batch.proximal_logprobs is not None:
        set_behaviour_weights(batch, config)
    loss, metrics = policy_loss(config)(output, batch, Normaliser.of(batch))
    return loss, metrics, logp


def ppo_token(lp, old, a, low, high, dual=None):
    r = math.exp(lp - old)
    loss = max(-a * r, -a * min(max(r, 1 - low), 1 + high))
    if dual is not None and a < 0:
        loss = min(loss, -a * dual)
    return loss


def token_mean(values):
    return sum(values[i][t] for i, t in TOKENS) / len(TOKENS)


def table(fn):
    return [[fn(i, t) for t in range(3)] for i in range(2)]


def test_ppo_clip_token_mean():
    """l = max(-A r, -A clip(r, 0.8, 1.2)), r = exp(logp - old); loss = sum m l / N (N = 5)."""
    loss, metrics, _ = run(L())
    expected = token_mean(table(lambda i, t: ppo_token(LOGP[i][t], OLD[i][t], ADV[i][t], 0.2, 0.2)))
    assert abs(loss.item() - expected) < 1e-6
    assert metrics["clip_fraction"] > 0


def test_clip_higher_and_dual_clip():
    """DAPO: clip(r, 1 - 0.2, 1 + 0.28); dual clip c = 3: l = min(l, -A c) where A < 0.
    Row 0 token 2 has r = exp(0.25) = 1.284 > 1.28 (clip-higher changes it); row 1 token 0 has
    r = exp(1.7) with A = -2, so -A r = 10.9 is cut to -A c = 6."""
    config = L(clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    loss, _, _ = run(config)
    per = table(lambda i, t: ppo_token(LOGP[i][t], OLD[i][t], ADV[i][t], 0.2, 0.28, 3.0))
    assert per[1][0] == pytest.approx(6.0)
    assert abs(loss.item() - token_mean(per)) < 1e-6


def test_aggregations():
    """seq-mean-token-mean: sum_i (sum_t m l / n_i) / S; seq-mean-token-sum: sum_i sum_t m l / S;
    seq-mean-token-sum-norm: sum_{i,t} m l / (S norm_length) (verl's with loss_scale_factor =
    norm_length: the sequences' mean token sum over Dr.GRPO's constant)."""
    per = table(lambda i, t: ppo_token(LOGP[i][t], OLD[i][t], ADV[i][t], 0.2, 0.2))
    row_sums = [sum(per[i][t] for t in range(3) if MASK[i][t]) for i in range(2)]
    loss, _, _ = run(L(aggregation="seq_mean_token_mean"))
    assert abs(loss.item() - (row_sums[0] / 3 + row_sums[1] / 2) / 2) < 1e-6
    loss, _, _ = run(L(aggregation="seq_mean_token_sum"))
    assert abs(loss.item() - (row_sums[0] + row_sums[1]) / 2) < 1e-6
    loss, _, _ = run(L(aggregation={"kind": "seq_mean_token_sum_norm", "norm_length": 4}))
    assert abs(loss.item() - (row_sums[0] + row_sums[1]) / 2 / 4) < 1e-6


def test_seq_mean_token_sum_norm_minimal_case():
    """Per-token loss 1 on 2 sequences of 2 tokens, norm_length 2: sum m l = 4, S = 2, so the loss
    is 4 / 2 / 2 = 1.0 (verl, loss_scale_factor 2), and each token's gradient 1 / (S norm_length)."""
    from flowrl_operators.training.aggregations import SeqMeanTokenSumNorm, seq_mean_token_sum_norm

    per_token = torch.ones(2, 2, requires_grad=True)
    mask = torch.ones(2, 2)
    normaliser = Normaliser(tokens=4.0, sequences=2.0, weighted_tokens=4.0)
    loss = seq_mean_token_sum_norm(per_token, mask, normaliser, SeqMeanTokenSumNorm(norm_length=2))
    loss.backward()
    assert loss.item() == pytest.approx(1.0, abs=1e-6)
    assert per_token.grad.tolist() == [[0.25, 0.25], [0.25, 0.25]]


def test_gspo_sequence_ratio_value_and_gradient():
    """s_i = exp(sum_t m (logp - old) / n_i); l = max(-A s_i, -A clip(s_i, 1-0.2, 1+0.2)), token-mean.
    Gradient of an unclipped token: d l / d logp_t = -A s_i / N (each token carries s_i's value
    but only its own logprob's gradient)."""
    loss, _, logp = run(L(kind="gspo"), grad=True)
    s = []
    for i in range(2):
        ts = [t for t in range(3) if MASK[i][t]]
        s.append(math.exp(sum(LOGP[i][t] - OLD[i][t] for t in ts) / len(ts)))
    per = table(lambda i, t: max(-ADV[i][t] * s[i], -ADV[i][t] * min(max(s[i], 0.8), 1.2)))
    assert abs(loss.item() - token_mean(per)) < 1e-6
    loss.backward()
    # s_0 lies inside [0.8, 1.2], so no token of row 0 is clipped.
    assert 0.8 < s[0] < 1.2
    for t in range(3):
        assert abs(logp.grad[0, t].item() - (-ADV[0][t] * s[0] / 5)) < 1e-6


def test_decoupled_ppo_weights_by_the_behaviour_ratio():
    """Decoupled PPO (no correction): r = exp(logp - prox), l = ppo_clip(r) * w with
    w = exp(prox - behav) untruncated; loss = sum m w l / N."""
    config = L(decoupled=True, allow_unbounded_weight=True)
    assert needs_proximal(config)
    loss, metrics, _ = run(config, make_batch(old=BEHAV, proximal=OLD))

    def per(i, t):
        w = math.exp(OLD[i][t] - BEHAV[i][t])
        return w * ppo_token(LOGP[i][t], OLD[i][t], ADV[i][t], 0.2, 0.2)

    assert abs(loss.item() - token_mean(table(per))) < 1e-6
    assert "behaviour_weight" in metrics


def test_decoupled_ppo_one_update_is_the_importance_weighted_policy_gradient():
    """With one update per batch the policy is the proximal one (logp = prox): r = 1, nothing is
    clipped, and the gradient per token is -w A / N, w = min(exp(prox - behav), 2) (tis) without
    gradient through w. So decoupled PPO learns from stale samples as an importance-weighted policy
    gradient; the sign and the weight are the behaviour-to-proximal ratio, not its inverse."""
    config = L(decoupled=True, correction={"kind": "tis", "threshold": 2.0})
    batch = make_batch(old=BEHAV, proximal=LOGP)
    loss, metrics, logp = run(config, batch, grad=True)
    loss.backward()
    assert metrics["clip_fraction"] == 0.0
    for i, t in TOKENS:
        w = min(math.exp(LOGP[i][t] - BEHAV[i][t]), 2.0)
        assert logp.grad[i][t].item() == pytest.approx(-w * ADV[i][t] / len(TOKENS), abs=1e-6)
    # The data covers a truncated weight and weights on both sides of 1.
    ws = [math.exp(LOGP[i][t] - BEHAV[i][t]) for i, t in TOKENS]
    assert max(ws) > 2.0 and min(ws) < 1.0


def test_decoupled_ppo_clips_a_later_pass_against_the_steps_start_not_the_stale_behaviour():
    """A later pass over a stale batch (epochs > 1): the policy has moved from the step's start
    (prox = logp - 0.1, r = e^0.1 inside the clip), the behaviour policy is further back. Plain PPO
    takes the ratio against the behaviour policy, so a token already past 1 + 0.28 in its
    advantage's direction gives no gradient however far the current policy is from it; decoupled
    PPO gives every token -w A r / N, w = min(exp(prox - behav), 2) (why longtail_async.yaml uses it
    over three passes)."""
    prox = [[v - 0.1 for v in row] for row in LOGP]
    plain_loss, _, plain = run(L(clip_high=0.28), make_batch(old=BEHAV), grad=True)
    plain_loss.backward()
    config = L(clip_high=0.28, decoupled=True, correction={"kind": "tis", "threshold": 2.0})
    dec_loss, _, dec = run(config, make_batch(old=BEHAV, proximal=prox), grad=True)
    dec_loss.backward()
    r = math.exp(0.1)
    blocked = 0
    for i, t in TOKENS:
        w = min(math.exp(prox[i][t] - BEHAV[i][t]), 2.0)
        assert dec.grad[i][t].item() == pytest.approx(-w * ADV[i][t] * r / len(TOKENS), abs=1e-6)
        if plain.grad[i][t].item() == 0.0:
            blocked += 1
            assert math.exp(LOGP[i][t] - BEHAV[i][t]) > 1.28 and ADV[i][t] > 0
    assert blocked >= 1  # token (0, 0): behaviour ratio e^0.5 with A = 1


@pytest.mark.parametrize("kind,level", [("tis", "token"), ("mis", "token"), ("tis", "sequence"), ("mis", "sequence")])
def test_tis_and_mis(kind, level):
    """w = exp(prox - behav) per token, or exp(sum_t m (prox - behav)) per sequence;
    tis: min(w, threshold); mis: w if floor <= w <= threshold else 0. threshold 1.25, floor 0.5.
    The ratio is taken against the proximal logprobs: r = exp(logp - prox)."""
    floor = {"floor": 0.5} if kind == "mis" else {}  # tis has no floor: it truncates only
    config = loss_config({"correction": {"kind": kind, "level": level, "threshold": 1.25, **floor}})
    loss, _, _ = run(config, make_batch(old=BEHAV, proximal=OLD))

    def weight(i, t):
        if level == "token":
            w = math.exp(OLD[i][t] - BEHAV[i][t])
        else:
            w = math.exp(sum(OLD[i][s] - BEHAV[i][s] for s in range(3) if MASK[i][s]))
        if kind == "tis":
            return min(w, 1.25)
        return w if 0.5 <= w <= 1.25 else 0.0

    weights = table(weight)
    # The fixed data exercises both sides: some tokens kept as is, some truncated or masked.
    assert any(w == 1.25 or w == 0.0 for row in weights for w in row)
    per = table(lambda i, t: weights[i][t] * ppo_token(LOGP[i][t], OLD[i][t], ADV[i][t], 0.2, 0.2))
    assert abs(loss.item() - token_mean(per)) < 1e-6


def test_sft():
    """kind sft: l = -logp, token_mean; advantages are not needed."""
    batch = make_batch()
    batch.advantages = None
    loss, _, _ = run(L(kind="sft"), batch)
    assert abs(loss.item() - token_mean(table(lambda i, t: -LOGP[i][t]))) < 1e-6


def test_sft_ignores_behaviour_correction_keys():
    """A phase that switches a decoupled-PPO node to sft keeps `decoupled` / `correction`: the sft
    loss must stay l = -logp (no weight exp(proximal - behaviour): supervised targets have no
    behaviour policy)."""
    for config in (L(kind="sft", decoupled=True),
                   loss_config({"kind": "sft", "correction": {"kind": "tis"}})):
        assert not needs_proximal(config)
        batch = make_batch(proximal=[[0.0] * len(row) for row in LOGP])
        batch.advantages = None
        loss, _, _ = run(config, batch)
        assert abs(loss.item() - token_mean(table(lambda i, t: -LOGP[i][t]))) < 1e-6


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_loss_term_and_entropy_bonus(estimator):
    """loss = pg + coef * token_mean(k) - entropy_coef * token_mean(H), d = logp - ref:
    k1 = d, k2 = d^2 / 2, k3 = exp(-d) - 1 + d."""
    kl_fn = {"k1": lambda d: d, "k2": lambda d: d * d / 2, "k3": lambda d: math.exp(-d) - 1 + d}[estimator]
    config = msgspec.convert({"kl": {"coef": 0.1, "estimator": estimator}, "entropy_coef": 0.01}, LossConfig)
    loss, metrics, _ = run(config)
    pg = token_mean(table(lambda i, t: ppo_token(LOGP[i][t], OLD[i][t], ADV[i][t], 0.2, 0.2)))
    kl = token_mean(table(lambda i, t: kl_fn(LOGP[i][t] - REF[i][t])))
    expected = pg + 0.1 * kl - 0.01 * token_mean(ENT)
    assert abs(loss.item() - expected) < 1e-6
    assert abs(metrics["kl"] - kl) < 1e-6


def test_kl_reward_penalty():
    """kl apply_as reward: r_t -= coef * k3(behav - ref) on model tokens only."""
    config = msgspec.convert({"kl": {"coef": 0.5, "apply_as": "reward"}}, LossConfig)
    batch = apply_kl_penalty(make_batch(old=BEHAV), config)
    for i in range(2):
        for t in range(3):
            d = BEHAV[i][t] - REF[i][t]
            expected = -0.5 * (math.exp(-d) - 1 + d) * MASK[i][t]
            assert abs(batch.rewards[i, t].item() - expected) < 1e-6


def test_clipped_value_loss():
    """l = 0.5 * max((v - R)^2, (v_old + clip(v - v_old, -0.2, 0.2) - R)^2), token-mean."""
    v, v_old, ret = [[0.5, 1.0, 0.0], [0.1, -0.4, 0.3]], [[0.2, 0.9, 0.0], [0.5, 0.0, 0.0]], [[1.0, 0.0, 2.0], [0.0, 0.0, 1.0]]
    batch = make_batch()
    batch.values, batch.returns = torch.tensor(v_old), torch.tensor(ret)
    loss, _ = value_loss(ValueLossConfig(value_clip=0.2))({"values": torch.tensor(v)}, batch, Normaliser.of(batch))

    def per(i, t):
        clipped = v_old[i][t] + min(max(v[i][t] - v_old[i][t], -0.2), 0.2)
        return 0.5 * max((v[i][t] - ret[i][t]) ** 2, (clipped - ret[i][t]) ** 2)

    assert abs(loss.item() - token_mean(table(per))) < 1e-6


def test_config_errors_and_behaviour_flag():
    assert loss_config("gspo").kind == "gspo" and loss_config({"clip_high": 0.28}).clip_high == 0.28
    assert advantage_config("rloo").estimator == "rloo"
    assert not needs_proximal(L())
    assert needs_proximal(msgspec.convert({"correction": {"kind": "tis"}}, LossConfig))
    assert not needs_proximal(L(kind="sft", decoupled=True))
    with pytest.raises(msgspec.ValidationError, match="unknown field `clip_hgh`"):
        msgspec.convert({"clip_hgh": 0.3}, LossConfig)
    with pytest.raises(ValueError, match="unknown loss 'ppo' "):
        loss_config({"kind": "ppo"})
    with pytest.raises(ValueError, match="did you mean 'cispo'"):
        loss_config("cispoo")
    with pytest.raises(msgspec.ValidationError, match="> 1"):
        loss_config({"dual_clip": 0.5})
    kl_in_reward = msgspec.convert({"kl": {"coef": 0.1, "apply_as": "reward"}}, LossConfig)
    with pytest.raises(ValueError, match="use kl apply_as 'loss'"):
        check_compatible(kl_in_reward, AdvantageConfig())
    check_compatible(kl_in_reward, AdvantageConfig(estimator="gae"))
    batch = make_batch()
    with pytest.raises(ValueError, match="compute_logprobs"):
        run(msgspec.convert({"correction": {"kind": "tis"}}, LossConfig), batch)


def test_the_train_node_schema_converts():
    """The train node's YAML schema (flowrl_operators.config) converts field for field."""
    from flowrl_operators import config as schema

    node = msgspec.convert(
        {"loss": {"kind": "gspo", "clip_high": 0.28, "decoupled": True, "aggregation": "seq_mean_token_sum",
                  "correction": {"kind": "mis", "level": "sequence", "threshold": 3.0},
                  "kl": {"coef": 0.01, "apply_as": "loss"}},
         "advantage": {"estimator": "grpo", "std_normalize": False, "gamma": 0.9}},
        schema.TrainConfig,
    )
    loss, advantage = loss_config(node.loss), advantage_config(node.advantage)
    assert (loss.kind, loss.clip_high, loss.decoupled, loss.aggregation) == ("gspo", 0.28, True, "seq_mean_token_sum")
    correction = correction_config(loss)
    assert (correction.kind, correction.level, correction.threshold) == ("mis", "sequence", 3.0)
    assert kl_config(loss).coef == 0.01 and needs_proximal(loss)
    assert (advantage.estimator, advantage.std_normalize, advantage.gamma) == ("grpo", False, 0.9)


def test_decoupled_without_a_correction_is_refused_unless_allowed():
    """decoupled: true alone weights by an unbounded pi_prox / pi_behav: refused, in the loss config
    and in the node schema's graph check, unless allow_unbounded_weight says so; tis / mis bound it."""
    from flowrl.operator import GraphFacts
    from flowrl_operators import config as schema
    from flowrl_operators.train import Train

    with pytest.raises(msgspec.ValidationError, match="allow_unbounded_weight: true"):
        msgspec.convert({"decoupled": True}, LossConfig)
    assert msgspec.convert({"decoupled": True, "allow_unbounded_weight": True}, LossConfig).decoupled
    msgspec.convert({"decoupled": True, "correction": {"kind": "tis"}}, LossConfig)
    loss_config({"kind": "sft", "decoupled": True})  # sft applies no weight

    def problems(loss):
        return Train.check_graph(msgspec.convert({"loss": loss}, schema.TrainConfig), GraphFacts())

    [(path, message)] = problems({"decoupled": True})
    assert path == ("loss", "decoupled") and "correction: {kind: tis}" in message
    assert problems({"decoupled": True, "allow_unbounded_weight": True}) == []
    assert problems({"decoupled": True, "correction": {"kind": "mis"}}) == []


def test_mismatch_metrics_against_the_behaviour_logprobs():
    """d = logp - behaviour on loss tokens: mean |d|, max |d|, share with exp(d) outside [0.8, 1.28]."""
    _, metrics, _ = run(L(clip_high=0.28))
    d = [LOGP[i][t] - OLD[i][t] for i, t in TOKENS]
    assert metrics["mismatch_logprob_mean"] == pytest.approx(sum(abs(x) for x in d) / len(d), abs=1e-6)
    assert metrics["mismatch_logprob_max"] == pytest.approx(max(abs(x) for x in d), abs=1e-6)
    out = [not 0.8 <= math.exp(x) <= 1.28 for x in d]
    assert 0 < sum(out) < len(out)
    assert metrics["mismatch_out_of_clip"] == pytest.approx(sum(out) / len(out), abs=1e-6)
    _, sft, _ = run(L(kind="sft"))
    assert not any(k.startswith("mismatch_") for k in sft)  # supervised targets: no behaviour policy


def test_per_token_metrics_count_only_tokens_that_carry_loss():
    """mis (threshold 1.25, floor 0.5) gives weight 0 to two of the five loss tokens: clip fraction,
    entropy, behaviour weight and mismatch average over the other three; masked_by_correction = 2/5."""
    config = msgspec.convert({"correction": {"kind": "mis", "threshold": 1.25, "floor": 0.5}}, LossConfig)
    _, metrics, _ = run(config, make_batch(old=BEHAV, proximal=OLD))
    weights = {(i, t): math.exp(OLD[i][t] - BEHAV[i][t]) for i, t in TOKENS}
    carried = [(i, t) for i, t in TOKENS if 0.5 <= weights[(i, t)] <= 1.25]
    assert len(carried) == 3

    def was_clipped(i, t):
        r, a = math.exp(LOGP[i][t] - OLD[i][t]), ADV[i][t]
        return -a * min(max(r, 0.8), 1.2) > -a * r

    def mean(fn):
        return sum(fn(i, t) for i, t in carried) / len(carried)

    # Over all five loss tokens the clip fraction would be 2/5; over the carried ones it is 2/3.
    assert sum(was_clipped(i, t) for i, t in TOKENS) / len(TOKENS) != pytest.approx(mean(was_clipped))
    assert metrics["clip_fraction"] == pytest.approx(mean(was_clipped), abs=1e-6)
    assert metrics["entropy"] == pytest.approx(mean(lambda i, t: ENT[i][t]), abs=1e-6)
    assert metrics["behaviour_weight"] == pytest.approx(mean(lambda i, t: weights[(i, t)]), abs=1e-6)
    assert metrics["mismatch_logprob_mean"] == pytest.approx(mean(lambda i, t: abs(LOGP[i][t] - BEHAV[i][t])), abs=1e-6)
    assert metrics["masked_by_correction"] == pytest.approx(2 / 5, abs=1e-6)

