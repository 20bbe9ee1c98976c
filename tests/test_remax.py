"""ReMax in the graph: a generate node with `greedy_baseline: true` adds one greedy episode per sample,
marked as its group's baseline; pack keeps it out of the loss; advantage remax subtracts its reward
(real engine, real tiny model, real trainer step)."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import torch

from flowrl.data.trajectory import GREEDY_BASELINE
from flowrl.operator import OperatorContext
from flowrl_operators.config import GenerateConfig
from flowrl_operators.generate import Generate
from flowrl_operators.tasks import reverse_digits
from flowrl_operators.training.advantages import compute_advantages
from flowrl_operators.training.batch import pack
from flowrl_operators.training.losses import policy_loss
from flowrl_operators.training.trainer import Trainer, TrainerConfig

MODEL = "builtin:tiny-qwen2"


@pytest.fixture(scope="module")
def group_and_greedy():
    torch.set_num_threads(1)
    loop = asyncio.new_event_loop()
    config = msgspec.convert({"group_size": 3, "greedy_baseline": True, "sampling": {"max_new_tokens": 6}},
                             GenerateConfig)
    op = Generate(config, OperatorContext(node="rollout", model={"path": MODEL}, seed=5))
    loop.run_until_complete(op.setup())
    sample = reverse_digits(seed=0).sample(0, 1)
    group = loop.run_until_complete(op.generate(sample, step=0, sample_id="0:1"))
    greedy = loop.run_until_complete(op.generate(sample, step=0, sample_id="0:1", greedy=True))
    loop.run_until_complete(op.close())
    loop.close()
    return group, greedy


def test_the_greedy_baseline_is_one_more_marked_greedy_episode(group_and_greedy):
    group, greedy = group_and_greedy
    *samples, baseline = group.trajectories
    assert len(samples) == 3 and all(GREEDY_BASELINE not in t.metadata for t in samples)
    assert baseline.metadata[GREEDY_BASELINE] is True and baseline.metadata["episode"] == 3
    assert [s.temperature for s in baseline.sampling] == [0.0]
    assert baseline.response_ids == greedy.trajectories[0].response_ids  # the policy's argmax answer


def test_remax_uses_its_reward_and_keeps_it_out_of_the_loss(group_and_greedy):
    group, _ = group_and_greedy
    trajectories = [msgspec.structs.replace(t, reward=r) for t, r in zip(group.trajectories, [1.0, 0.0, 0.5, 0.25],
                                                                         strict=True)]
    batch = pack(trajectories)
    assert batch.baseline.tolist() == [0.0, 0.0, 0.0, 1.0]
    assert batch.loss_mask[3].sum() == 0 and all(batch.loss_mask[i].sum() > 0 for i in range(3))
    with pytest.raises(ValueError, match="use advantage remax"):
        compute_advantages(pack(trajectories), {"estimator": "grpo"})
    compute_advantages(batch, "remax")
    for i, reward in enumerate([1.0, 0.0, 0.5]):
        on = batch.loss_mask[i] > 0
        torch.testing.assert_close(batch.advantages[i][on], torch.full((int(on.sum()),), reward - 0.25))
    assert not batch.advantages[3].any()
    # A real step: the normaliser counts the three sampled rows only; the update is finite.
    trainer = Trainer(MODEL, TrainerConfig(lr=1e-3))
    metrics = trainer.forward_backward(batch, policy_loss({"kind": "reinforce"})) | trainer.step()
    assert metrics["sequences"] == 3 and metrics["skipped"] == 0.0


def test_the_train_node_reports_the_greedy_reward_apart(group_and_greedy):
    from flowrl_operators.train import _reward_means

    group, _ = group_and_greedy
    trajectories = [msgspec.structs.replace(t, reward=r) for t, r in zip(group.trajectories, [1.0, 0.0, 0.5, 0.25],
                                                                         strict=True)]
    assert _reward_means(trajectories) == {"reward_mean": 0.5, "greedy_reward_mean": 0.25}
