"""One-rank Trainer: logprobs, split invariance, non-finite steps, schedule, checkpoints, critic."""

import math

import pytest
import torch

from flowrl.data.trajectory import Trajectory
from flowrl_operators.training import checkpoint
from flowrl_operators.training.advantages import AdvantageConfig, compute_advantages
from flowrl_operators.training.batch import pack
from flowrl_operators.training.losses import LossConfig, ValueLossConfig, policy_loss, value_loss
from flowrl_operators.training.trainer import (
    Critic,
    NonFiniteError,
    Reference,
    Trainer,
    TrainerConfig,
    lr_factor,
)

torch.set_num_threads(1)
MODEL = "builtin:tiny-qwen2"


def make_batch(seed=0, rows=6):
    g = torch.Generator().manual_seed(seed)
    trajectories = []
    for i in range(rows):
        n, p = 2 + i % 4, 3
        trajectories.append(Trajectory(
            id=str(i), group_id=f"g{i // 3}", sample_id="s",
            prompt_ids=torch.randint(5, 60, (p,), generator=g).tolist(),
            response_ids=torch.randint(5, 60, (n,), generator=g).tolist(),
            loss_mask=[1] * n, behaviour_logprobs=(-4 - torch.rand(n, generator=g)).tolist(), versions=[0] * n,
            reward=float(i % 3 == 0),
        ))
    return compute_advantages(pack(trajectories), AdvantageConfig())


@pytest.fixture(scope="module")
def trainer():
    return Trainer(MODEL, TrainerConfig(lr=1e-3))


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_compute_logprobs_equal_log_softmax_of_the_model(trainer):
    batch = make_batch()
    logprobs = trainer.compute_logprobs(batch)
    with torch.no_grad():
        logits = trainer.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    expected = torch.log_softmax(logits[:, :-1].double(), -1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    expected = torch.where(batch.loss_mask > 0, expected, 0.0)
    torch.testing.assert_close(logprobs.double(), expected, atol=1e-5, rtol=0)


def test_gradient_does_not_depend_on_the_micro_batch_split(trainer):
    batch, loss = make_batch(1), policy_loss(LossConfig(aggregation="seq_mean_token_mean"))
    trainer.config.micro_batch_tokens = 10_000
    whole = trainer.forward_backward(batch, loss)
    g_whole = grads(trainer.model)
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.config.micro_batch_tokens = 8  # one row per micro-batch
    split = trainer.forward_backward(batch, loss)
    g_split = grads(trainer.model)
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.config.micro_batch_tokens = 8192
    assert abs(whole["loss"] - split["loss"]) < 1e-6
    for name in g_whole:
        torch.testing.assert_close(g_split[name], g_whole[name], atol=1e-6, rtol=1e-5)


def test_nonfinite_steps_are_skipped_then_stop_the_run():
    trainer = Trainer(MODEL, TrainerConfig(lr=1e-3, max_nonfinite_steps=2))
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    bad = make_batch()
    bad.advantages[0, int(bad.loss_mask[0].nonzero()[0])] = float("nan")  # on a trained token
    metrics = trainer.forward_backward(bad, policy_loss(LossConfig())) | trainer.step()
    assert metrics["skipped"] == 1.0 and trainer.skipped_steps == 1 and trainer.step_count == 0
    assert all(torch.equal(v, trainer.model.state_dict()[k]) for k, v in before.items())
    # A good step in between resets the count of consecutive bad ones.
    trainer.forward_backward(make_batch(), policy_loss(LossConfig()))
    assert trainer.step()["skipped"] == 0.0 and trainer.policy_version == 1
    trainer.forward_backward(bad, policy_loss(LossConfig()))
    trainer.step()
    trainer.forward_backward(bad, policy_loss(LossConfig()))
    with pytest.raises(NonFiniteError, match="2 consecutive training steps had a non-finite loss"):
        trainer.step()


def test_lr_schedule():
    """Warm-up (s+1)/w; then cosine m + (1-m)(1+cos(pi p))/2 or linear m + (1-m)(1-p),
    p = (s - w) / (T - w)."""
    cosine = TrainerConfig(warmup_steps=2, schedule="cosine", total_steps=6, min_lr_ratio=0.1)
    assert [lr_factor(s, cosine) for s in (0, 1)] == [0.5, 1.0]
    assert lr_factor(4, cosine) == pytest.approx(0.1 + 0.9 * (1 + math.cos(math.pi * 0.5)) / 2)
    assert lr_factor(9, cosine) == pytest.approx(0.1)
    linear = TrainerConfig(schedule="linear", total_steps=4)
    assert [lr_factor(s, linear) for s in range(5)] == pytest.approx([1, 0.75, 0.5, 0.25, 0])
    with pytest.raises(ValueError, match="needs total_steps"):
        TrainerConfig(schedule="cosine")


def run_steps(trainer, steps):
    for step in steps:
        trainer.forward_backward(make_batch(10 + step), policy_loss(LossConfig()))
        trainer.step()


def test_resume_is_bit_identical_and_a_crashed_save_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    config = TrainerConfig(lr=1e-3, warmup_steps=1, schedule="linear", total_steps=8)
    straight = Trainer(MODEL, config)
    run_steps(straight, range(2))
    straight.save(tmp_path / "ckpt")
    run_steps(straight, range(2, 4))

    # A save that dies half-way (after the shards, before the rename) leaves the last one intact.
    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint, "_rng_state", crash)
    with pytest.raises(OSError, match="disk full"):
        straight.save(tmp_path / "ckpt")
    monkeypatch.undo()

    resumed = Trainer(MODEL, config)
    resumed.load(tmp_path / "ckpt")
    assert (resumed.step_count, resumed.policy_version) == (2, 2)
    run_steps(resumed, range(2, 4))
    for name, value in straight.model.state_dict().items():
        assert torch.equal(value, resumed.model.state_dict()[name]), name
    assert resumed.scheduler.get_last_lr() == straight.scheduler.get_last_lr()

    # A checkpoint taken before the first step holds no optimizer state and leaves training as it was.
    zero = Trainer(MODEL, config)
    zero.save(tmp_path / "zero")
    run_steps(zero, range(4))
    fresh = Trainer(MODEL, config)
    fresh.load(tmp_path / "zero")
    run_steps(fresh, range(4))
    for name, value in straight.model.state_dict().items():
        assert torch.equal(value, zero.model.state_dict()[name]), name
        assert torch.equal(value, fresh.model.state_dict()[name]), name

    # A crash between moving the old checkpoint aside and renaming the new one into place.
    (tmp_path / "ckpt").rename(tmp_path / ".ckpt.old")
    again = Trainer(MODEL, config)
    again.load(tmp_path / "ckpt")
    assert again.step_count == 2
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        again.load(tmp_path / "nowhere")


def test_reference_is_frozen_and_matches_the_initial_policy(trainer):
    reference = Reference(MODEL)
    fresh = Trainer(MODEL)
    batch = make_batch(2)
    assert not any(p.requires_grad for p in reference.model.parameters())
    assert torch.equal(reference.compute_logprobs(batch), fresh.compute_logprobs(batch))
    with pytest.raises(RuntimeError, match="frozen"):
        reference.forward_backward(batch, policy_loss(LossConfig()))


def test_critic_fits_returns_with_the_clipped_value_loss():
    critic = Critic(MODEL, TrainerConfig(lr=3e-3))
    batch = make_batch(3)
    batch.values = critic.compute_values(batch)
    # Dropout (0.1 before HF's token-classification head) is off: values are a function of weights.
    assert torch.equal(critic.compute_values(batch), batch.values)
    batch = compute_advantages(batch, {"estimator": "gae", "gamma": 1.0, "lam": 0.95})
    loss = value_loss(ValueLossConfig(value_clip=None))
    first = critic.forward_backward(batch, loss)["value_loss"]
    critic.step()
    for _ in range(5):
        last = critic.forward_backward(batch, loss)["value_loss"]
        critic.step()
    assert last < 0.5 * first
    names = {n for bucket in critic.named_weights() for n, _ in bucket}
    assert "score.weight" in names
