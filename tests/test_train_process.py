"""A train node's trainer in a process of its own (`own_process`), and the `Child` it runs in."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import msgspec
import pytest
import torch
from test_train_nodes import context, groups

from flowrl.operator import OperatorContext
from flowrl_operators.config import TrainConfig
from flowrl_operators.train import Train
from flowrl_operators.training.process import Child, ChildDied


def test_own_process_trains_like_the_node_process(tmp_path: Path) -> None:
    """Same seed, same groups: the child's steps publish the weights the in-thread trainer does;
    checkpoints, loading and the final export go through the child."""
    threads = torch.get_num_threads()  # equal thread counts: the same reductions in both

    async def steps(own: dict | None, run_dir: Path) -> tuple[list, list]:
        config = msgspec.convert({"optim": {"lr": 1e-2}, "own_process": own}, TrainConfig)
        op = Train(config, context(run_dir, "learner"))
        await op.setup()
        published = []
        for step in range(2):
            result = await op.train(groups(step), step=step)
            published.append({n: t for bucket in result.policy for n, t in bucket})
            if step == 0:
                (run_dir / "ckpt").mkdir(parents=True)
                op.save(run_dir / "ckpt")
        op.load(run_dir / "ckpt")  # back to the weights after step 0
        again = await op.train(groups(1), step=1)
        await op.close()
        return published, [{n: t for bucket in again.policy for n, t in bucket}]

    here, here_again = asyncio.run(steps(None, tmp_path / "here"))
    child, child_again = asyncio.run(steps({"threads": threads}, tmp_path / "child"))
    for a, b in zip(here + here_again, child + child_again, strict=True):
        assert a.keys() == b.keys()
        for name in a:
            torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-6)
    assert any(not torch.equal(here[0][n], here[1][n]) for n in here[0]), "the second step changed nothing"
    for name in child[1]:  # reloaded step 0, then step 1 again: the same weights as the first time
        torch.testing.assert_close(child_again[0][name], child[1][name], rtol=0, atol=1e-6)
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "child" / "export" / "learner", local_files_only=True)
    assert sum(p.numel() for p in exported.parameters()) > 0


def test_own_process_refuses_replicas(tmp_path: Path) -> None:
    config = msgspec.convert({"own_process": {"threads": 1}}, TrainConfig)
    ctx = OperatorContext(node="learner", run_dir=tmp_path, seed=1, model={"path": "builtin:tiny-qwen2"},
                          data={"batch_size": 2}, rank=0, world_size=2)
    with pytest.raises(ValueError, match="replicas: 2.*remove own_process"):
        asyncio.run(Train(config, ctx).setup())


def test_child_returns_results_raises_errors_and_reports_its_death() -> None:
    child = Child(dict, (), threads=1, name="flowrl-test-child")
    try:
        tensors = {
            "float": torch.randn(3, 4), "strided": torch.randn(4, 3).t(), "long": torch.arange(5),
            "bool": torch.tensor([True, False]), "bf16": torch.randn(3, dtype=torch.bfloat16),
            "grad": torch.randn(2, requires_grad=True),
        }
        child.call("update", tensors)
        back = child.call("copy")
        for name, tensor in tensors.items():
            assert back[name].dtype == tensor.dtype and back[name].requires_grad == tensor.requires_grad
            assert torch.equal(back[name].detach(), tensor.detach()), name
        assert child.call("get", "missing", 7) == 7
        os.kill(child.process.pid, signal.SIGINT)  # Ctrl-C: the parent checkpoints through the child next
        time.sleep(0.2)
        assert child.call("get", "long").tolist() == [0, 1, 2, 3, 4]
        with pytest.raises(KeyError) as error:  # the child's exception, as itself
            child.call("pop", "missing")
        assert "flowrl-test-child" in "".join(error.value.__notes__)
        child.process.kill()
        with pytest.raises(ChildDied, match=r"exited with code -9"):
            child.call("copy")
    finally:
        child.close()


def test_child_constructor_errors_reach_the_caller() -> None:
    with pytest.raises(ValueError, match="invalid literal"):
        Child(int, ("not a number",))
