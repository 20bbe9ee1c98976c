"""The trainer's micro-batches balanced by tokens (training/batch.py) leave the loss and the
gradient unchanged: one micro-batch, the padded rule's split and the token split give the same
loss, gradients (to 1e-5 of each tensor's largest entry) and logprobs, for the policy
(packed) and the critic (padded rows)."""

import pytest
import torch

from flowrl.data.trajectory import Trajectory
from flowrl_operators.training.advantages import AdvantageConfig, compute_advantages
from flowrl_operators.training.batch import micro_batch_rows, pack
from flowrl_operators.training.losses import LossConfig, ValueLossConfig, policy_loss, value_loss
from flowrl_operators.training.trainer import Critic, Trainer, TrainerConfig

torch.set_num_threads(1)


def long_tail_batch():
    g = torch.Generator().manual_seed(0)
    trajectories = []
    for i in range(10):
        n = 3 + int(30 * float(torch.rand(1, generator=g)) ** 3)
        trajectories.append(Trajectory(
            id=str(i), group_id=f"g{i // 5}", sample_id=str(i // 5),
            prompt_ids=torch.randint(5, 60, (4 + i % 3,), generator=g).tolist(),
            response_ids=torch.randint(5, 60, (n,), generator=g).tolist(), loss_mask=[1] * n,
            behaviour_logprobs=[-2.0] * n, versions=[0] * n, reward=float(i % 2)))
    return compute_advantages(pack(trajectories), AdvantageConfig(estimator="grpo"))


def run(trainer, batch, budget, packed, loss_fn):
    trainer.config.micro_batch_tokens, trainer.packed = budget, packed
    metrics = trainer.forward_backward(batch, loss_fn)
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    trainer.optimizer.zero_grad(set_to_none=True)
    return metrics.get("loss", metrics.get("value_loss")), grads, micro_batch_rows(batch, budget, packed)


@pytest.mark.parametrize("role", ["policy", "value"])
def test_token_split_gives_the_same_loss_and_gradients(role):
    batch = long_tail_batch()
    if role == "policy":
        trainer = Trainer("builtin:tiny-qwen2", TrainerConfig(lr=1e-3))
        loss_fn = policy_loss(LossConfig(kind="ppo_clip", aggregation="seq_mean_token_mean", entropy_coef=0.01))
        assert trainer.packed  # qwen2's forward packs: its micro-batches are balanced by tokens
    else:
        trainer = Critic("builtin:tiny-qwen2", TrainerConfig(lr=1e-3))
        batch.returns = torch.randn(batch.loss_mask.shape, generator=torch.Generator().manual_seed(2))
        batch.values = torch.zeros_like(batch.returns)
        loss_fn = value_loss(ValueLossConfig())
        assert not trainer.packed
    whole = run(trainer, batch, 1 << 20, trainer.packed, loss_fn)
    tokens = run(trainer, batch, 60, True, loss_fn)
    padded = run(trainer, batch, 60, False, loss_fn)
    assert len(whole[2]) == 1 and len(tokens[2]) > 2 and len(padded[2]) > 2
    assert tokens[2] != padded[2]
    for loss, grads, _ in (tokens, padded):
        assert abs(loss - whole[0]) <= 1e-5 * max(1.0, abs(whole[0]))
        assert grads.keys() == whole[1].keys() and grads
        worst = max(float((grads[n] - whole[1][n]).abs().max() / whole[1][n].abs().max().clamp(min=1e-12))
                    for n in grads)
        assert worst <= 1e-5, worst
    if role == "policy":  # rows of a micro-batch need not be consecutive: each lands on its own row
        trainer.config.micro_batch_tokens, trainer.packed = 1 << 20, True
        one = trainer.compute_logprobs(batch)
        trainer.config.micro_batch_tokens = 60
        torch.testing.assert_close(trainer.compute_logprobs(batch), one, atol=1e-5, rtol=1e-5)
        assert one.abs().sum() > 0
