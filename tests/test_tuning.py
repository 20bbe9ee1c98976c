"""The train node's model keys: `freeze` (frozen parameters stay, get no optimizer state and are not
sent again) and `gradient_checkpointing` (recomputes each layer in backward, same gradients)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest
import torch

from flowrl.data.trajectory import Group, Trajectory
from flowrl.operator import ConfigError, GraphFacts, OperatorContext
from flowrl_operators.config import TrainConfig
from flowrl_operators.train import Train
from flowrl_operators.training.advantages import AdvantageConfig, compute_advantages
from flowrl_operators.training.batch import pack
from flowrl_operators.training.losses import LossConfig, policy_loss
from flowrl_operators.training.trainer import Trainer, TrainerConfig

torch.set_num_threads(1)
MODEL = "builtin:tiny-qwen2"
FROZEN = ["model.embed_tokens.*", "model.layers.0.*"]


def trajectories(seed: int = 0, rows: int = 6) -> list[Trajectory]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(rows):
        n = 2 + i % 4
        out.append(Trajectory(
            id=str(i), group_id=f"g{i // 3}", sample_id=f"g{i // 3}", step=0,
            prompt_ids=torch.randint(5, 60, (3,), generator=g).tolist(),
            response_ids=torch.randint(5, 60, (n,), generator=g).tolist(), loss_mask=[1] * n,
            behaviour_logprobs=(-4 - torch.rand(n, generator=g)).tolist(), versions=[0] * n,
            reward=float(i % 3 == 0)))
    return out


def batch():
    return compute_advantages(pack(trajectories()), AdvantageConfig())


def test_frozen_parameters_do_not_change_and_have_no_optimizer_state():
    trainer = Trainer(MODEL, TrainerConfig(lr=1e-2, freeze=FROZEN))
    params = dict(trainer.model.named_parameters())
    frozen = {n for n in params if n.startswith(("model.embed_tokens.", "model.layers.0."))}
    assert frozen and all(not params[n].requires_grad for n in frozen)
    before = {n: p.detach().clone() for n, p in params.items()}
    trainer.forward_backward(batch(), policy_loss(LossConfig()))
    assert all(params[n].grad is None for n in frozen)
    trainer.step()
    assert all(torch.equal(params[n], before[n]) for n in frozen)
    assert all(not torch.equal(params[n], before[n]) for n in params if n not in frozen and n.endswith("proj.weight"))
    in_optimizer = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert in_optimizer == {id(p) for n, p in params.items() if n not in frozen}
    assert set(map(id, trainer.optimizer.state)) == in_optimizer
    # A step publishes what it can change; everything is still there for a full publish.
    changed = {n for b in trainer.named_weights(changed_only=True) for n, _ in b}
    assert changed == set(params) - frozen
    assert {n for b in trainer.named_weights() for n, _ in b} >= set(params)


def test_gradient_checkpointing_recomputes_layers_and_keeps_gradients():
    def grads_and_calls(checkpointing: bool):
        trainer = Trainer(MODEL, TrainerConfig(lr=1e-3, gradient_checkpointing=checkpointing))
        calls = []
        trainer.model.model.layers[0].self_attn.register_forward_hook(lambda *_: calls.append(1))
        trainer.forward_backward(batch(), policy_loss(LossConfig()))
        return {n: p.grad.clone() for n, p in trainer.model.named_parameters()}, len(calls)

    plain, plain_calls = grads_and_calls(False)
    recomputed, recomputed_calls = grads_and_calls(True)
    assert (plain_calls, recomputed_calls) == (1, 2)  # the backward ran layer 0 again
    for name, grad in plain.items():
        torch.testing.assert_close(recomputed[name], grad, atol=1e-6, rtol=0)


def node(tmp_path: Path, **keys) -> Train:
    config = msgspec.convert({"optim": {"lr": 1e-2}} | keys, TrainConfig)
    return Train(config, OperatorContext(node="learner", run_dir=tmp_path, seed=1, model={"path": MODEL},
                                         data={"batch_size": 2}))


def test_train_node_reads_freeze_and_gradient_checkpointing(tmp_path: Path):
    """The first version hands the frozen parameters over as they are (no copy: they never change),
    later versions send only the trainable ones."""
    def groups(step):
        return [Group(id=f"{step}:0", step=step, trajectories=trajectories(step)[:3]),
                Group(id=f"{step}:1", step=step, trajectories=trajectories(step)[3:])]

    async def main():
        op = node(tmp_path, freeze=FROZEN, gradient_checkpointing=True)
        await op.setup()
        try:
            trainer = op.learner.trainer
            assert any(getattr(m, "gradient_checkpointing", False) for m in trainer.model.modules())
            first = {n: t for b in (await op.train(groups(0), step=0)).policy for n, t in b}
            second = {n for b in (await op.train(groups(1), step=1)).policy for n, _ in b}
            everything = {n for b in (await op.publish()).policy for n, _ in b}
            params = dict(trainer.model.named_parameters())
            return first, second, everything, params
        finally:
            await op.close()

    first, second, everything, params = asyncio.run(main())
    frozen = {n for n, p in params.items() if not p.requires_grad}
    assert frozen and set(first) == set(params) and second == set(params) - frozen and everything >= set(params)
    for name, tensor in first.items():  # frozen: the live tensor itself; trainable: a copy
        assert (tensor.data_ptr() == params[name].data_ptr()) == (name in frozen), name


def test_freeze_errors_are_located(tmp_path: Path):
    with pytest.raises(ConfigError, match=r"nodes\.learner\.freeze\.1: 'model\.nope\.\*' matches no parameter"):
        asyncio.run(node(tmp_path, freeze=["model.norm.*", "model.nope.*"]).setup())
    with pytest.raises(ConfigError, match=r"nodes\.learner\.freeze: these patterns freeze every parameter"):
        asyncio.run(node(tmp_path, freeze=["*"]).setup())
    both = msgspec.convert({"freeze": ["model.norm.*"], "lora": {}}, TrainConfig)
    assert Train.check_graph(both, GraphFacts())[0][0] == ("freeze",)
