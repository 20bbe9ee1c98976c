"""Advantage estimators against hand-computed values on fixed small tensors (to 1e-6)."""

import math

import pytest
import torch

from flowrl.data.trajectory import Trajectory, Turn
from flowrl_operators.training.advantages import AdvantageInputs, compute_advantages
from flowrl_operators.training.batch import pack
from flowrl_operators.training.registry import ADVANTAGES

torch.set_num_threads(1)


def outcome_inputs(rewards, groups, tokens=2):
    """One row per reward; `tokens` model tokens each; the reward sits on the last token."""
    rows = len(rewards)
    r = torch.zeros(rows, tokens)
    r[:, -1] = torch.tensor(rewards)
    defined = torch.zeros(rows, tokens)
    defined[:, -1] = 1
    return AdvantageInputs(r, defined, torch.ones(rows, tokens), torch.tensor(groups))


def estimate(name, x, **keys):
    """The registered estimator `name` with these YAML keys."""
    return ADVANTAGES.get(name).fn(x, ADVANTAGES.config({"estimator": name, **keys}))


def close(actual, expected):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=1e-6, rtol=0)


def test_grpo_outcome_with_std():
    """A_i = (R_i - mean_g R) / (std_g R + eps), std unbiased; one reward per sequence is
    broadcast to every token. Group {1, 0, 0.5}: mean 0.5, std 0.5 -> {1, -1, 0}.
    A group of one uses mean 0, std 1: R = 2 -> 2/(1+eps)."""
    eps = 1e-6
    x = outcome_inputs([1.0, 0.0, 0.5, 2.0], [0, 0, 0, 1])
    adv, returns = estimate("grpo", x, eps=eps)
    a = [0.5 / (0.5 + eps), -0.5 / (0.5 + eps), 0.0, 2.0 / (1 + eps)]
    close(adv, [[v, v] for v in a])
    close(returns, [[1, 1], [0, 0], [0.5, 0.5], [2, 2]])


def test_grpo_tied_batch_takes_the_batch_baseline_where_a_group_is_tied():
    """tied: batch. Outcome rewards, groups {0, 0} (tied), {1, 1} (tied), {1, 0}: the tied groups
    are normalised against all six rewards (mean 0.5, unbiased std sqrt(0.3)), the varied one as
    GRPO; tied: zero (the default) gives the tied groups 0."""
    x = outcome_inputs([0.0, 0.0, 1.0, 1.0, 1.0, 0.0], [0, 0, 1, 1, 2, 2])
    eps, b, g = 1e-6, 0.5 / (math.sqrt(0.3) + 1e-6), 0.5 / (math.sqrt(0.5) + 1e-6)
    adv, _ = estimate("grpo", x, tied="batch", eps=eps)
    close(adv, [[-b, -b], [-b, -b], [b, b], [b, b], [g, g], [-g, -g]])
    default, _ = estimate("grpo", x, eps=eps)
    close(default, [[0, 0], [0, 0], [0, 0], [0, 0], [g, g], [-g, -g]])


def test_grpo_position_tied_batch_uses_the_batch_at_that_position():
    """baseline: position, tied: batch, token rewards (gamma 0). Index 0: group 0 {0, 0} tied, group
    1 {1, 0}: group 0 takes the batch's index-0 rewards {0, 0, 1, 0} (mean 1/4, std 1/2) -> -1/2;
    group 1 as before -> +-1/sqrt(2). Index 1: every group tied at 1 and the batch too (std 0) ->
    0. A batch index that one row reaches leaves the reward as it is (mean 0, std 1)."""
    r = torch.tensor([[0.0, 1.0, 0.0], [0.0, 1.0, 0.0], [1.0, 1.0, 0.0], [0.0, 1.0, 1.0]])
    defined = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 0], [1, 1, 1]]).float()
    x = AdvantageInputs(r, defined, torch.ones_like(r), torch.tensor([0, 0, 1, 1]))
    eps, g = 1e-6, 0.5 / (math.sqrt(0.5) + 1e-6)
    a, _ = estimate("grpo", x, baseline="position", tied="batch", gamma=0.0, eps=eps)
    q = 0.25 / (0.5 + eps)
    close(a, [[-q, 0, 0], [-q, 0, 0], [g, 0, 0], [-g, 0, 1]])
    zero, _ = estimate("grpo", x, baseline="position", gamma=0.0, eps=eps)
    close(zero, [[0, 0, 0], [0, 0, 0], [g, 0, 0], [-g, 0, 1]])


def test_grpo_without_std_and_dr_grpo():
    """std_normalize false and dr_grpo: A_i = R_i - mean_g R. Group {3, 1}: mean 2 -> {1, -1}."""
    x = outcome_inputs([3.0, 1.0], [0, 0])
    for adv, _ in (
        estimate("grpo", x, std_normalize=False),
        estimate("dr_grpo", x),
    ):
        close(adv, [[1, 1], [-1, -1]])


def test_rloo():
    """A_i = R_i - mean_{j != i} R_j. {1, 0, 0.5}: baselines 0.25, 0.75, 0.5 -> 0.75, -0.75, 0."""
    x = outcome_inputs([1.0, 0.0, 0.5], [0, 0, 0])
    adv, _ = estimate("rloo", x)
    close(adv, [[0.75, 0.75], [-0.75, -0.75], [0.0, 0.0]])


def test_grpo_turn_rewards_through_pack():
    """Turn rewards (DeepSeekMath process supervision): r~ = (r - mean_g) / std_g over all turn
    rewards of the group, A_t = sum of r~ at or after t. Rewards {1, 2} and {0, 1}: mean 1,
    std sqrt(2/3); r~ = {0, s}, {-s, 0} with s = 1/sqrt(2/3). Trajectory a: turn 1 tokens get 0 + s,
    turn 2 tokens s; the environment token between turns (loss_mask 0) gets 0."""
    def traj(i, rewards):
        return Trajectory(
            id=f"t{i}", group_id="g", sample_id="s", prompt_ids=[1, 2], response_ids=[5, 6, 7, 8, 9],
            loss_mask=[1, 1, 0, 1, 1], behaviour_logprobs=[0.0] * 5, versions=[0] * 5,
            turns=[Turn(0, 2), Turn(3, 5)], turn_rewards=rewards,
        )

    batch = compute_advantages(pack([traj(0, [1.0, 2.0]), traj(1, [0.0, 1.0])]), {"eps": 0.0})
    s = 1 / math.sqrt(2 / 3)
    # Target-aligned columns: prompt of 2 tokens -> response starts at column 1 of 6.
    close(batch.advantages, [[0, s, s, 0, s, s], [0, -s, -s, 0, 0, 0]])


def test_reinforce_pp_discounted_and_batch_whitened():
    """G_t = r_t + gamma G_{t+1} (gamma 0.5); A = (G - mean G) / sqrt(var G + eps) over all model
    tokens of the batch (unbiased variance). Row 0 rewards (0, 0, 1) -> G (0.25, 0.5, 1); row 1 (1, 0, 0) ->
    G (1, 0, 0)."""
    r = torch.tensor([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    x = AdvantageInputs(r, torch.ones(2, 3), torch.ones(2, 3), torch.tensor([0, 1]))
    adv, returns = estimate("reinforce_pp", x, gamma=0.5, eps=0.0)
    g = [0.25, 0.5, 1.0, 1.0, 0.0, 0.0]
    mean = sum(g) / 6
    std = math.sqrt(sum((v - mean) ** 2 for v in g) / 5)
    close(returns, [g[:3], g[3:]])
    close(adv, [[(v - mean) / std for v in g[:3]], [(v - mean) / std for v in g[3:]]])


def test_reinforce_pp_baseline():
    """A = whiten_B(R_i - mean_g R) over all model tokens. Groups {1, 0} and {3, 1}:
    centred {0.5, -0.5, 1, -1}, two tokens each; batch mean 0, unbiased std sqrt(5/7)."""
    x = outcome_inputs([1.0, 0.0, 3.0, 1.0], [0, 0, 1, 1])
    adv, _ = estimate("reinforce_pp_baseline", x, eps=0.0)
    std = math.sqrt(2 * (0.25 + 0.25 + 1 + 1) / 7)
    close(adv, [[v / std, v / std] for v in (0.5, -0.5, 1.0, -1.0)])


def test_gae_skips_environment_tokens():
    """delta_t = r_t + gamma V_next - V_t; A_t = delta_t + gamma lam A_next; returns = A + V.
    gamma 0.9, lam 0.8, V = (0.5, 0.2, 0.1) on the model tokens, reward 1 at the end, an environment
    token (mask 0) between the first two model tokens:
    delta = (0.9*0.2 - 0.5, 0.9*0.1 - 0.2, 1 - 0.1) = (-0.32, -0.11, 0.9);
    A = (-0.32 + 0.72*0.538, -0.11 + 0.72*0.9, 0.9) = (0.06736, 0.538, 0.9)."""
    r = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0, 1.0]])
    values = torch.tensor([[0.5, 9.0, 0.2, 0.1]])  # the value on the environment token is ignored
    x = AdvantageInputs(r, mask, mask, torch.tensor([0]), values)
    adv, returns = estimate("gae", x, gamma=0.9, lam=0.8, whiten=False)
    close(adv, [[0.06736, 0.0, 0.538, 0.9]])
    close(returns, [[0.56736, 0.0, 0.738, 1.0]])


def test_gae_needs_values_and_unknown_names_are_rejected():
    x = outcome_inputs([1.0], [0])
    with pytest.raises(ValueError, match="critic"):
        estimate("gae", x)
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'"):
        ADVANTAGES.config("ppo")


def test_grpo_biased_std():
    """unbiased_std: false divides by the population std (AReaL's group normalisation):
    {1, 0, 0.5}: std sqrt(1/6) -> (R - 0.5) / (sqrt(1/6) + eps)."""
    x = outcome_inputs([1.0, 0.0, 0.5], [0, 0, 0])
    adv, _ = estimate("grpo", x, unbiased_std=False, eps=1e-5)
    std = math.sqrt(1 / 6)
    close(adv, [[v / (std + 1e-5)] * 2 for v in (0.5, -0.5, 0.0)])


def test_rloo_group_of_one_keeps_its_reward():
    """A group of one has no other trajectory: its baseline is 0 and A = R (verl rloo)."""
    adv, _ = estimate("rloo", outcome_inputs([0.7], [0]))
    close(adv, [[0.7, 0.7]])


def test_whitening_eps_inside_the_square_root():
    """reinforce_pp whitens with (G - mean) / sqrt(var + eps) (verl masked_whiten); eps 0.5 makes the
    placement visible: G = (1, 0, 0, 0) over four tokens, mean 1/4, unbiased var 1/4."""
    x = AdvantageInputs(torch.tensor([[0.0, 1.0], [0.0, 0.0]]), torch.ones(2, 2), torch.ones(2, 2), torch.tensor([0, 1]))
    adv, _ = estimate("reinforce_pp", x, gamma=0.0, eps=0.5)
    scale = 1 / math.sqrt(0.25 + 0.5)
    close(adv, [[-0.25 * scale, 0.75 * scale], [-0.25 * scale, -0.25 * scale]])


def test_grpo_passk():
    """Only each group's best row gets R_max - R_second, / (std_g + eps) with std_normalize (unbiased):
    group {1, 0.25, 0.5} -> row 0 gets 0.5 / (std + eps), std = sqrt(((0.4167)^2 + ...) / 2);
    group {2, 3} -> row 4 gets 1 / (std + eps), std = sqrt(0.5)."""
    x = outcome_inputs([1.0, 0.25, 0.5, 2.0, 3.0], [0, 0, 0, 1, 1])
    adv, _ = estimate("grpo_passk", x)
    mean = 1.75 / 3
    std0 = math.sqrt(sum((v - mean) ** 2 for v in (1.0, 0.25, 0.5)) / 2)
    a = [0.5 / (std0 + 1e-6), 0.0, 0.0, 0.0, 1 / (math.sqrt(0.5) + 1e-6)]
    close(adv, [[v, v] for v in a])
    adv, _ = estimate("grpo_passk", x, std_normalize=False)
    close(adv, [[v, v] for v in (0.5, 0, 0, 0, 1.0)])
    with pytest.raises(ValueError, match="at least 2"):
        estimate("grpo_passk", outcome_inputs([1.0], [0]))


def test_opo_length_weighted_baseline():
    """b = sum_j n_j R_j / sum_j n_j over the group (n_j model tokens), A = R - b: rows of 1 and 3
    tokens with R = 1 and 0 -> b = 1/4, A = (0.75, -0.25); a group of one keeps R."""
    r = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0], [0.0, 0.0, 2.0]])
    mask = torch.tensor([[0.0, 0.0, 1.0], [1.0, 1.0, 1.0], [0.0, 1.0, 1.0]])
    adv, _ = estimate("opo", AdvantageInputs(r, mask, mask, torch.tensor([0, 0, 1])))
    close(adv, [[0, 0, 0.75], [-0.25, -0.25, -0.25], [0, 2.0, 2.0]])


def test_gpg_advantage():
    """A = alpha (R - mean_g R) / f_norm, alpha = B / #(R != 0): R = (1, 0, 0, 2) in groups {0, 1} and
    {2, 3}: alpha = 4 / 2 = 2, means 0.5 and 1 -> (1, -1, -2, 2) / f_norm (f_norm 2 -> halves)."""
    x = outcome_inputs([1.0, 0.0, 0.0, 2.0], [0, 0, 1, 1])
    adv, _ = estimate("gpg", x, f_norm=2.0)
    close(adv, [[v, v] for v in (0.5, -0.5, -1.0, 1.0)])


def test_remax_greedy_baseline():
    """A_t = G_t - b with b the reward of the group's greedy row (ReMax); the greedy row itself has no
    loss tokens, so no advantage. Group 0: R = (1, 0.25), greedy 0.5 -> (0.5, -0.25)."""
    x = outcome_inputs([1.0, 0.25, 0.5], [0, 0, 0])
    x.mask[2] = 0.0  # the greedy row carries no loss (pack zeroes its loss mask)
    x.baseline = torch.tensor([0.0, 0.0, 1.0])
    adv, returns = estimate("remax", x)
    close(adv, [[0.5, 0.5], [-0.25, -0.25], [0.0, 0.0]])
    close(returns, [[1.0, 1.0], [0.25, 0.25], [0.0, 0.0]])
    x.baseline = None
    with pytest.raises(ValueError, match="greedy_baseline: true"):
        estimate("remax", x)


def test_token_norm_weighs_tokens():
    """AReaL's adv_norm: mean and std over the group's model *tokens*. Rows of 1 and 3 tokens with
    R = 1 and 0: G = (1 | 0, 0, 0); mean 1/4, unbiased std sqrt(0.75 / 3) = 0.5 ->
    A = 0.75 / (0.5 + 1e-5) and -0.25 / (0.5 + 1e-5) (GRPO's per-sequence mean would be 1/2).
    mean_level none, std_level none: A = G."""
    r = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[0.0, 0.0, 1.0], [1.0, 1.0, 1.0]])
    x = AdvantageInputs(r, torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 1.0]]), mask, torch.tensor([0, 0]))
    adv, returns = estimate("token_norm", x)
    close(adv, [[0, 0, 0.75 / (0.5 + 1e-5)], [-0.25 / (0.5 + 1e-5)] * 3])
    close(returns, [[0, 0, 1.0], [0, 0, 0]])
    adv, _ = estimate("token_norm", x, mean_level="none", std_level="none")
    close(adv, [[0, 0, 1.0], [0, 0, 0]])


def test_grpo_position_baseline_compares_like_with_like():
    """baseline: position normalises the k-th defined reward of each row against the group's k-th
    rewards. Group 0, token rewards (gamma 0): index 0 all 1 -> 0; index 1 {0, 1, 0}: mean 1/3, std
    sqrt(1/3) -> {-1/sqrt(3), 2/sqrt(3), -1/sqrt(3)} (pooled over the group the lone right token
    would get (1 - 7/9) / std instead); index 2 {1, 1} -> 0; index 3 only row 1 reaches: mean 0,
    std 1 -> its reward 0. Group 1, one reward per row: the same as baseline group."""
    r = torch.tensor([[1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0],
                      [0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    defined = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 1], [0, 0, 1, 0]]).float()
    x = AdvantageInputs(r, defined, torch.ones_like(r), torch.tensor([0, 0, 0, 1, 1]))
    eps, s = 1e-6, math.sqrt(1 / 3)
    a, _ = estimate("grpo", x, baseline="position", gamma=0.0)
    outcome = 0.5 / (math.sqrt(0.5) + eps)
    close(a, [[0, -1 / 3 / (s + eps), 0, 0], [0, 2 / 3 / (s + eps), 0, 0], [0, -1 / 3 / (s + eps), 0, 0],
              [0, 0, 0, outcome], [0, 0, -outcome, 0]])
    pooled, _ = estimate("grpo", x, gamma=0.0)
    close(pooled[3:], a[3:].tolist())
    centred, _ = estimate("grpo", x, baseline="position", gamma=0.0, std_normalize=False)
    close(centred[:3, 1], [-1 / 3, 2 / 3, -1 / 3])
