"""The reward node's random-reward control arm (`control: random`, operators/reward_control.py)."""

import pytest
from test_rewards import _one, group, make, run

from flowrl.data.trajectory import Trajectory
from flowrl_operators.reward import RewardFailed


def right_answer(t: Trajectory) -> float:
    return 1.0 if t.metadata["text"] == "right" else 0.0


def test_random_control_trains_on_draws_independent_of_the_answer_and_keeps_the_true_score():
    """control: random: each trajectory keeps its true score in metadata (reported as reward/true_mean)
    and trains on a reward drawn from the scores seen so far; over many groups the drawn rewards of
    right and wrong answers have the same rate, the base rate (1 in 4 here), not 1 and 0."""
    async def main():
        op = await make("test_reward_control:right_answer", control="random")
        out = []
        for i in range(400):
            g = await op.process({"trajectories": group(["right", "wrong", "wrong", "wrong"], gid=f"{i}:0")})
            out.extend(g["trajectories"].trajectories)
        await op.close()
        return out, op.metrics()

    out, metrics = run(main())
    assert [t.metadata["true_reward"] for t in out[:4]] == [1.0, 0.0, 0.0, 0.0]
    right = [t.reward for t in out if t.metadata["true_reward"] == 1.0]
    wrong = [t.reward for t in out if t.metadata["true_reward"] == 0.0]
    assert set(right) | set(wrong) <= {0.0, 1.0}
    assert abs(sum(right) / len(right) - 0.25) < 0.08 and abs(sum(wrong) / len(wrong) - 0.25) < 0.05
    assert metrics["reward/true_mean"] == pytest.approx(0.25)
    assert abs(metrics["reward/mean"] - 0.25) < 0.05


def test_random_control_refuses_token_rewards_naming_the_option():
    with pytest.raises(RewardFailed, match="control: random draws sequence rewards"):
        run(_one("test_rewards:as_dict", group(["a"]), control="random"))
