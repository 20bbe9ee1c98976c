"""Packing, sharding and micro-batching: alignment, coverage, and split-invariant normalisation."""

import math

import pytest
import torch

from flowrl.data.trajectory import SamplingSpan, Trajectory, Turn
from flowrl_operators.training.batch import (
    Normaliser,
    micro_batch_rows,
    micro_batches,
    pack,
    response_values,
    shard,
)
from flowrl_operators.training.losses import LossConfig, policy_loss
from flowrl_operators.training.prefix import units


def traj(i, prompt, response, **kw):
    n = len(response)
    fields = dict(loss_mask=[1] * n, behaviour_logprobs=[-0.5 - 0.1 * k for k in range(n)], versions=[3] * n)
    fields.update(kw)
    return Trajectory(id=f"t{i}", group_id=f"g{i // 2}", sample_id="s", prompt_ids=prompt, response_ids=response, **fields)


def test_pack_aligns_response_tokens_with_targets():
    """Column j of per-token tensors describes input_ids[:, j+1]; prompts and padding have mask 0;
    a sequence reward sits on the last model token, turn rewards on the last token of each turn."""
    a = traj(0, [1, 2, 3], [7, 8], reward=1.5)
    b = traj(1, [4], [9, 10, 11, 12], loss_mask=[1, 0, 1, 1], turns=[Turn(0, 1), Turn(2, 4)], turn_rewards=[0.5, 2.0])
    batch = pack([a, b])
    assert batch.input_ids.tolist() == [[1, 2, 3, 7, 8], [4, 9, 10, 11, 12]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]
    assert batch.loss_mask.tolist() == [[0, 0, 1, 1], [1, 0, 1, 1]]
    assert batch.input_ids[0, 1:][batch.loss_mask[0] > 0].tolist() == [7, 8]
    assert batch.rewards.tolist() == [[0, 0, 0, 1.5], [0.5, 0, 0, 2.0]]
    assert batch.reward_mask.tolist() == [[0, 0, 0, 1], [1, 0, 0, 1]]
    assert batch.group_index.tolist() == [0, 0] and batch.versions[1].tolist() == [3, 3, 3, 3]
    assert response_values(batch, "behaviour_logprobs", [a, b])[1] == pytest.approx([-0.5, -0.6, -0.7, -0.8])


def test_pack_credits_the_finest_reward_granularity_once():
    """`reward` next to turn or token rewards is their total (the environment workflow sets it so):
    crediting it again would count the episode twice on its last token."""
    turns = traj(0, [4], [9, 10, 11], turns=[Turn(0, 1), Turn(1, 3)], turn_rewards=[0.5, 2.0], reward=2.5)
    tokens = traj(1, [4], [9, 10, 11], token_rewards=[1.0, 0.0, -1.0], reward=0.5)
    batch = pack([turns, tokens])
    assert batch.rewards.tolist() == [[0.5, 0, 2.0], [1.0, 0.0, -1.0]]
    assert batch.reward_mask.tolist() == [[1, 0, 1], [1, 1, 1]]


def test_pack_lays_sampling_spans_on_the_target_columns():
    """Per-token temperature / top_p / top_k from the spans; greedy spans and uncovered tokens get
    temperature 1 without filters; a batch of defaults carries no sampling fields."""
    a = traj(0, [1, 2], [7, 8, 9, 10, 11], reward=1.0, loss_mask=[1, 1, 0, 1, 1],
             sampling=[SamplingSpan(0, 2, 0.7, 0.9, -1), SamplingSpan(3, 4, 1.3, 1.0, 5), SamplingSpan(4, 5, 0.0)])
    b = traj(1, [3], [12, 13], reward=0.0)
    batch = pack([a, b])
    torch.testing.assert_close(batch.temperature, torch.tensor([[1, 0.7, 0.7, 1, 1.3, 1], [1.0] * 6]))
    torch.testing.assert_close(batch.top_p, torch.tensor([[1, 0.9, 0.9, 1, 1, 1], [1.0] * 6]))
    assert batch.top_k.tolist() == [[-1, -1, -1, -1, 5, -1], [-1] * 6]
    at = batch.sampling_inputs(torch.tensor([0, 0]), torch.tensor([1, 4]))
    assert at["temperature"].tolist() == pytest.approx([0.7, 1.3]) and at["top_k"].tolist() == [-1, 5]
    assert batch.select([1]).temperature.tolist() == [[1.0, 1.0]]
    plain = pack([traj(0, [1], [5, 6], reward=1.0, sampling=[SamplingSpan(0, 2, 1.0), SamplingSpan(2, 2, 0.0)])])
    assert plain.temperature is None and plain.top_p is None and plain.sampling_inputs(torch.tensor([0]), torch.tensor([0])) == {}
    with pytest.raises(ValueError, match="sampling span lies outside"):
        pack([traj(0, [1], [5, 6], reward=1.0, sampling=[SamplingSpan(1, 3, 0.7)])])


def test_pack_rejects_missing_rewards_and_bad_lengths():
    with pytest.raises(ValueError, match="has no reward"):
        pack([traj(0, [1], [2])])
    with pytest.raises(ValueError, match="loss_mask has 1 entries, response has 2"):
        pack([traj(0, [1], [2, 3], loss_mask=[1], reward=0.0)])


def test_shard_covers_every_row_once_and_balances_tokens():
    lengths = [9, 2, 7, 3, 3, 8, 1]
    batch = pack([traj(i, [100 + i], list(range(2, 2 + n)), reward=float(i)) for i, n in enumerate(lengths)])
    shards = [shard(batch, r, 3) for r in range(3)]
    # Rows are told apart by their reward (= their index).
    owners = sorted(int(r) for s in shards for r in s.rewards.sum(dim=1).tolist())
    assert owners == list(range(7))
    loads = [int(s.lengths.sum()) for s in shards]
    assert max(loads) - min(loads) <= max(lengths)
    # More ranks than rows: the extra rank gets an empty batch.
    assert shard(pack([traj(0, [1], [2], reward=0.0)]), 1, 2).size == 0


def test_micro_batches_respect_the_token_budget():
    lengths = [4, 4, 4, 10, 2, 2]
    batch = pack([traj(i, [1], list(range(2, 1 + n)), reward=0.0) for i, n in enumerate(lengths)])
    rows = micro_batch_rows(batch, 12)
    assert sorted(r for group in rows for r in group) == list(range(6))
    for group in rows:
        width = max(lengths[r] for r in group)
        assert len(group) * width <= 12 or len(group) == 1
    assert [mb.input_ids.shape[1] for mb in micro_batches(batch, 12)] == [max(lengths[r] for r in g) for g in rows]


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_global_normaliser_makes_the_loss_split_invariant(aggregation):
    """sum over micro-batches of loss(mb, normaliser of the whole batch) == loss(whole batch)."""
    g = torch.Generator().manual_seed(0)
    trajs = [traj(i, [1, 2], list(range(3, 3 + n)), reward=float(i)) for i, n in enumerate([2, 5, 3, 4])]
    batch = pack(trajs)
    batch.advantages = torch.randn(batch.loss_mask.shape, generator=g)
    logprobs = -torch.rand(batch.loss_mask.shape, generator=g)
    fn = policy_loss(LossConfig(aggregation=aggregation))
    normaliser = Normaliser.of(batch)
    whole, _ = fn({"logprobs": logprobs, "entropy": torch.zeros_like(logprobs)}, batch, normaliser)
    total = 0.0
    for rows in micro_batch_rows(batch, 8):
        mb = batch.select(rows)
        lp = logprobs[rows, : mb.loss_mask.shape[1]]
        total += fn({"logprobs": lp, "entropy": torch.zeros_like(lp)}, mb, normaliser)[0].item()
    assert len(micro_batch_rows(batch, 8)) > 1
    assert abs(total - whole.item()) < 1e-6


def test_packed_micro_batches_are_balanced_by_tokens():
    """A long-tailed batch: the token split fills micro-batches evenly, where consecutive rows left
    one nearly empty; every row once, each micro-batch within the budget (a longer row alone)."""
    lengths = [60, 12, 14, 11, 13, 58, 10, 12, 15, 11, 55, 12]
    # Each row its own prompt token: no two rows share a prefix (that case: the test below).
    batch = pack([traj(i, [100 + i], list(range(2, 1 + n)), reward=0.0) for i, n in enumerate(lengths)])
    rows = micro_batch_rows(batch, 100, packed=True)
    assert sorted(r for group in rows for r in group) == list(range(len(lengths)))
    loads = [sum(lengths[r] for r in group) for group in rows]
    assert len(rows) == 3 and all(load <= 100 for load in loads)  # 283 tokens: the fewest that fit
    assert max(loads) - min(loads) <= min(lengths)
    assert all(group == sorted(group) for group in rows)
    # A row over the budget runs alone, the others still share.
    rows = micro_batch_rows(batch, 40, packed=True)
    assert sorted(r for group in rows for r in group) == list(range(len(lengths)))
    for group in rows:
        assert sum(lengths[r] for r in group) <= 40 or len(group) == 1
    assert [g for g in rows if len(g) == 1 and lengths[g[0]] > 40] == [[0], [5], [10]]


def test_packed_micro_batches_keep_a_groups_shared_prefix_together():
    """Rows of a group sharing a prompt go into one micro-batch, counted at the tokens they cost
    with the prompt once; a group too large for the budget is split into rows."""
    prompts = [list(range(100, 130)), list(range(200, 230)), list(range(300, 330))]
    trajs = [traj(i, prompts[i // 2] if i < 6 else [400 + i], [7, 8 + i, 9], reward=0.0) for i in range(8)]
    batch = pack(trajs)  # groups of two: (0, 1), (2, 3), (4, 5) share 30-token prompts; 6, 7 do not
    assert len(micro_batch_rows(batch, 70, packed=True)) == 3  # not shared: 3 x 66 + 2 x 34 tokens
    rows = micro_batch_rows(batch, 70, packed=True, shared=True)
    assert sorted(r for group in rows for r in group) == list(range(8))
    for pair in ((0, 1), (2, 3), (4, 5)):
        assert any(set(pair) <= set(group) for group in rows), rows
    # Counted shared, a pair is its 31 common tokens (the prompt and token 7) + 2 + 2 = 35 (66 as two
    # rows): 3 x 35 + 2 x 4 = 113 tokens fit in 2 micro-batches of 70.
    assert len(rows) == 2
    split = micro_batch_rows(batch, 34, packed=True, shared=True)  # a pair no longer fits: its rows go apart
    assert not any({0, 1} <= set(group) for group in split) and len(split) > 2


def test_shard_keeps_a_groups_shared_prefix_on_one_rank():
    """With sharing, the rows of a group that share a prompt go to one rank (the prompt computed once
    in all), ranks balanced by the tokens they cost; a group over a rank's even share is split."""
    prompts = [list(range(100, 130)), list(range(200, 230)), list(range(300, 330)), list(range(400, 430))]
    trajs = [traj(i, prompts[i // 2], [7, 8 + i, 9], reward=float(i)) for i in range(8)]
    batch = pack(trajs)  # four groups of two rows sharing a 30-token prompt (+ token 7): 35 tokens each

    def owners(shards):
        return [sorted(int(r) for r in s.rewards.sum(dim=1).tolist()) for s in shards]

    by_rows = owners(shard(batch, r, 2) for r in range(2))  # rows by tokens: pairs split across ranks
    assert any(not ({2 * k, 2 * k + 1} <= set(rows)) for rows in by_rows for k in range(4) if 2 * k in rows)
    kept = owners(shard(batch, r, 2, shared=True) for r in range(2))
    assert sorted(r for rows in kept for r in rows) == list(range(8))
    assert all({2 * k, 2 * k + 1} <= set(rows) for rows in kept for k in range(4) if 2 * k in rows), kept
    assert [len(rows) for rows in kept] == [4, 4]  # two groups a rank: 70 tokens each
    # One group and two ranks: keeping it whole would idle a rank, so its rows are split.
    one = pack([traj(i, prompts[0], [7, 8 + i, 9], reward=float(i)) for i in range(4)])
    assert [shard(one, r, 2, shared=True).size for r in range(2)] == [2, 2]
    # Four groups of two over three ranks: no rank computes more than with rows dealt by length, and
    # all ranks together compute fewer tokens (fewer copies of each prompt): 70 / 35 / 35 against 99 / 99 / 66.
    dealt, kept = ([sum(u.width for u in units(shard(batch, r, 3, sharing), math.inf)) for r in range(3)]
                   for sharing in (False, True))
    assert max(kept) <= max(dealt) and sum(kept) < sum(dealt), (kept, dealt)


def test_padded_micro_batches_group_rows_of_similar_length():
    lengths = [60, 12, 14, 58, 10, 12]
    batch = pack([traj(i, [1], list(range(2, 1 + n)), reward=0.0) for i, n in enumerate(lengths)])
    rows = micro_batch_rows(batch, 120)
    # rows x widest: the two long rows together (2 x 60), the four short ones (4 x 14)
    assert rows == [[0, 3], [1, 2, 4, 5]]
