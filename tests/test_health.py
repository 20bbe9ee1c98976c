"""flowrl/health.py alone: each condition begins at the step its rule says and not before, ends, skips
supervised steps, and a detector restored from its state judges the rest of a stream as one that
never stopped. Also the train operator's health metrics (tied_group_fraction, policy_kl) against an
independent computation with the real trainer."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import msgspec
import pytest
import torch

from flowrl import health
from flowrl.health import Health, active, replay


def row(step: int, reward: float = 0.5, **train: float) -> dict:
    values = {"entropy": 1.0, "tied_group_fraction": 0.0, "clip_fraction": 0.0, "mismatch_logprob_mean": 1e-6}
    return {"step": step, "node": "learner", "reward": reward, "train": values | train}


def events_of(rows: list[dict]) -> list[dict]:
    detector, out = Health(), []
    for r in rows:
        out += detector.update(r)
    return out


def test_entropy_collapse_begins_where_the_streak_began() -> None:
    entropies = [1.0] * 5 + [0.5] * 5 + [0.15] * 12  # 0.15 <= 0.2 x 1.0 from step 10
    events = events_of([row(i, entropy=e) for i, e in enumerate(entropies)])
    assert [(e["condition"], e["event"], e["step"], e["at"]) for e in events] == [
        ("entropy_collapse", "began", 10, 10 + health.ENTROPY_STEPS - 1)]
    assert "entropy collapse from step 10" in events[0]["message"]


def test_a_dip_shorter_than_the_window_is_not_flagged() -> None:
    entropies = [1.0] * 5 + [0.1] * (health.ENTROPY_STEPS - 1) + [1.0] * 30
    assert events_of([row(i, entropy=e) for i, e in enumerate(entropies)]) == []


def test_tied_groups_begin_and_end() -> None:
    tied = [0.0] * 3 + [0.75] * 15 + [0.1] * 12
    events = events_of([row(i, tied_group_fraction=t) for i, t in enumerate(tied)])
    assert [(e["event"], e["step"]) for e in events] == [("began", 3), ("ended", 18)]
    assert active(events) == {}
    assert "75% of groups tied" in events[0]["message"]


def test_high_clip_and_mismatch_growth() -> None:
    rows = [row(i, clip_fraction=0.3 if i >= 10 else 0.05,
                mismatch_logprob_mean=0.001 if i < 20 else 0.02) for i in range(60)]
    events = {e["condition"]: e for e in events_of(rows)}
    assert events["high_clip"]["step"] == 10 and events["high_clip"]["at"] == 10 + health.CLIP_STEPS - 1
    assert events["mismatch_growth"]["step"] == 20
    # Growth alone is not enough: 2x of a tiny start stays under the floor.
    small = [row(i, mismatch_logprob_mean=1e-5 if i < 5 else 1e-4) for i in range(60)]
    assert events_of(small) == []


def test_reward_plateau_begins_after_the_best_block() -> None:
    block = health.PLATEAU_BLOCK
    rewards = [0.1] * block + [0.4] * block + [0.8] * block + [0.81] * (health.PLATEAU_BLOCKS * block) + [0.95] * block
    events = events_of([row(i, reward=r) for i, r in enumerate(rewards)])
    began = 3 * block  # the step after the best block (0.8, steps 50-74)
    assert [(e["event"], e["step"]) for e in events] == [("began", began), ("ended", len(rewards) - 1)]
    # A steady rise is no plateau.
    assert events_of([row(i, reward=i / 1000) for i in range(600)]) == []


def test_supervised_steps_are_not_judged() -> None:
    rows = [{"step": i, "node": "learner", "reward": 1.0, "train": {"entropy": 1.0 / (i + 1), "clip_fraction": 0.0}}
            for i in range(300)]
    assert events_of(rows) == []


def test_a_restored_detector_continues_as_if_uninterrupted() -> None:
    rows = [row(i, entropy=1.0 if i < 12 else 0.05, reward=min(i / 100, 0.6),
                tied_group_fraction=0.6 if 30 <= i < 60 else 0.0) for i in range(400)]
    whole = events_of(rows)
    first, second = Health(), Health()
    out = []
    for r in rows[:20]:
        out += first.update(r)
    second.restore(json.loads(json.dumps(first.state())))  # plain data, as a checkpoint keeps it
    for r in rows[20:]:
        out += second.update(r)
    assert out == whole and {e["condition"] for e in whole} == {"entropy_collapse", "tied_groups", "reward_plateau"}


def test_replay_keeps_one_detector_per_node() -> None:
    a = [row(i, entropy=1.0 if i < 5 else 0.1) | {"node": "a"} for i in range(20)]
    b = [row(i) | {"node": "b"} for i in range(20)]
    interleaved = [r for pair in zip(a, b, strict=True) for r in pair]
    assert [e["condition"] for e in replay(interleaved)] == ["entropy_collapse"]


def _batch(rewards: list[list[float]], groups: list[int], baseline: list[float] | None = None):
    """A Batch with these token rewards (one row each, all defined) in these groups."""
    from flowrl_operators.training.batch import Batch

    n, t = len(rewards), max(len(r) for r in rewards)
    values = torch.tensor([r + [0.0] * (t - len(r)) for r in rewards])
    defined = torch.tensor([[1.0] * len(r) + [0.0] * (t - len(r)) for r in rewards])
    zeros = torch.zeros(n, t + 1, dtype=torch.long)
    return Batch(input_ids=zeros, attention_mask=zeros, position_ids=zeros, loss_mask=defined,
                 behaviour_logprobs=torch.zeros(n, t), rewards=values, reward_mask=defined,
                 versions=torch.zeros(n, t, dtype=torch.long), group_index=torch.tensor(groups),
                 lengths=torch.full((n,), t + 1), baseline=None if baseline is None else torch.tensor(baseline))


def test_tied_group_fraction() -> None:
    from flowrl_operators.training.advantages import tied_group_fraction

    # Group 0 ties (same token rewards), group 1 does not, group 2 has one sample and does not count.
    batch = _batch([[1, 0, 1], [1, 0, 1], [1, 1, 1], [0, 0, 0], [1, 0]], [0, 0, 1, 1, 2])
    assert tied_group_fraction(batch) == 0.5
    # Sequence rewards of different lengths' trajectories tie on the reward alone.
    assert tied_group_fraction(_batch([[0.0], [0.0], [0.0]], [0, 0, 0])) == 1.0
    # A greedy baseline row is no sample: the two samples tie without it.
    assert tied_group_fraction(_batch([[1.0], [1.0], [0.0]], [0, 0, 0], baseline=[0.0, 0.0, 1.0])) == 1.0
    assert tied_group_fraction(_batch([[1.0], [2.0]], [0, 1])) is None


def test_policy_kl_is_the_mean_logprob_drop_over_the_trained_tokens(tmp_path: Path) -> None:
    from test_train_nodes import context, groups

    from flowrl_operators.config import TrainConfig
    from flowrl_operators.train import Train
    from flowrl_operators.training.batch import pack

    async def main() -> None:
        config = msgspec.convert({"optim": {"lr": 1e-3}, "policy_kl_every": 2}, TrainConfig)
        op = Train(config, context(tmp_path, "learner"))
        await op.setup()
        for step in range(3):
            batch = pack([t for g in groups(step) for t in g.trajectories])
            before = op.learner.trainer.compute_logprobs(batch)
            metrics = (await op.train(groups(step), step=step)).metrics
            after = op.learner.trainer.compute_logprobs(batch)
            if step % 2:
                assert "policy_kl" not in metrics  # measured every policy_kl_every steps only
                continue
            expected = float((before - after)[batch.loss_mask > 0].mean())
            assert metrics["policy_kl"] == pytest.approx(expected, rel=1e-4, abs=1e-6) and expected != 0.0
            assert metrics["tied_group_fraction"] == 0.0  # rewards 0, 1, 0, 1 in every group
            assert "logprob_sum" not in metrics
        await op.close()

    asyncio.run(main())


def test_a_converged_run_is_not_flagged_but_a_stalled_one_is() -> None:
    """Entropy spent, groups tied and a flat reward are a stall at 0.8 and a solved task at 0.97,
    the best trajectory having reached 1.0 in both."""
    def run(final: float) -> list[dict]:
        rows = []
        for step in range(600):
            late = min(1.0, step / 300)
            r = row(step, reward=0.3 + (final - 0.3) * late, entropy=1.0 - 0.95 * late, tied_group_fraction=0.9 * late)
            rows.append(r | {"reward_max": 1.0})
        return events_of(rows)

    assert set(active(run(0.8))) == {"entropy_collapse", "tied_groups", "reward_plateau"}
    converged = run(0.97)
    assert active(converged) == {}  # what began on the way up ended once it was near solved
    assert "reward_plateau" not in {e["condition"] for e in converged}


def test_without_reward_max_the_solved_rule_does_not_apply() -> None:
    rows = [row(step, reward=0.97, entropy=0.01 if step > 10 else 1.0) for step in range(40)]
    assert [e["condition"] for e in events_of(rows)] == ["entropy_collapse"]
