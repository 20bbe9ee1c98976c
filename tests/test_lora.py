"""LoRA through peft: one step equals the update computed by hand from the merged model's gradient,
a version sends only the adapters (or the merged adapted weights), and the embedded engine after a
sync computes what the merged model computes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest
import torch

from flowrl.data.trajectory import Group, Trajectory
from flowrl.operator import ConfigError, OperatorContext
from flowrl_operators.config import LoraSpec, SyncConfig, TrainConfig
from flowrl_operators.engine.embedded.engine import EmbeddedEngine
from flowrl_operators.inference import GenerateRequest, SamplingParams
from flowrl_operators.models import load_hf_model
from flowrl_operators.sync import Sync
from flowrl_operators.train import Train
from flowrl_operators.training.advantages import AdvantageConfig, compute_advantages
from flowrl_operators.training.batch import pack
from flowrl_operators.training.losses import LossConfig, policy_loss
from flowrl_operators.training.trainer import Trainer, TrainerConfig
from flowrl_operators.training.tuning import lora_layers

torch.set_num_threads(1)
MODEL = "builtin:tiny-qwen2"
TARGETS = ["q_proj", "v_proj", "down_proj"]


def trajectories(step: int = 0) -> list[Trajectory]:
    g = torch.Generator().manual_seed(step)
    out = []
    for i in range(6):
        n = 3 + i % 3
        out.append(Trajectory(
            id=f"{step}:{i}", group_id=f"{step}:{i // 3}", sample_id=f"{step}:{i // 3}", step=step,
            prompt_ids=torch.randint(5, 60, (4,), generator=g).tolist(),
            response_ids=torch.randint(5, 60, (n,), generator=g).tolist(), loss_mask=[1] * n,
            behaviour_logprobs=(-4 - torch.rand(n, generator=g)).tolist(), versions=[step] * n,
            reward=float(i % 3 == 0)))
    return out


def test_one_lora_step_equals_the_update_by_hand():
    """dL/dB = s G A^T and dL/dA = s B^T G, G the gradient of the merged weight; Adam's first step
    moves each entry by lr g / (|g| + eps)."""
    lr, spec = 1e-4, LoraSpec(r=4, alpha=8.0, target_modules=TARGETS)
    lora = Trainer(MODEL, TrainerConfig(lr=lr, grad_clip=None, lora=spec))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # B starts at zero in peft; move it so that A gets a gradient too
        for _, layer in lora_layers(lora.model):
            layer.lora_B["default"].weight.copy_(torch.randn(layer.lora_B["default"].weight.shape, generator=g) * 0.1)
    layers = dict(lora_layers(lora.model))
    before = {m: (layer.lora_A["default"].weight.detach().clone(), layer.lora_B["default"].weight.detach().clone())
              for m, layer in layers.items()}
    merged = Trainer(MODEL, TrainerConfig(lr=lr, grad_clip=None))
    state = lora.state_dict_full()
    merged.model.load_state_dict(state, strict=False)
    batch = compute_advantages(pack(trajectories()), AdvantageConfig())
    loss = policy_loss(LossConfig(kind="reinforce"))
    merged.forward_backward(batch, loss)
    lora.forward_backward(batch, loss)
    lora.step()
    full = dict(merged.model.named_parameters())
    assert len(layers) == 3 * len(merged.model.model.layers)
    for module, layer in layers.items():
        a, b = before[module]
        s = layer.scaling["default"]
        grad = full[f"{module}.weight"].grad
        expected = {"A": s * b.T @ grad, "B": s * grad @ a.T}
        for key, old in (("A", a), ("B", b)):
            param = (layer.lora_A if key == "A" else layer.lora_B)["default"].weight
            torch.testing.assert_close(param.detach(), old - lr * expected[key] / (expected[key].abs() + 1e-8),
                                       atol=1e-5, rtol=0)
    assert all(not p.requires_grad for n, p in lora.model.named_parameters() if ".lora_" not in n)
    assert {layer.scaling["default"] for layer in layers.values()} == {8.0 / 4}  # alpha / r


def test_lora_dropout_is_the_configured_one():
    """The trainer zeroes the model's own dropout (logprobs must be a function of the weights) but
    keeps LoRA's, which the user asked for."""
    trainer = Trainer(MODEL, TrainerConfig(lora=LoraSpec(r=2, dropout=0.25, target_modules=["o_proj"])))
    assert {layer.lora_dropout["default"].p for _, layer in lora_layers(trainer.model)} == {0.25}


def node(tmp_path: Path, **lora) -> Train:
    config = msgspec.convert({"optim": {"lr": 1e-2}, "lora": {"r": 4, "target_modules": TARGETS} | lora},
                             TrainConfig)
    return Train(config, OperatorContext(node="learner", run_dir=tmp_path, seed=1, model={"path": MODEL}))


async def engine_logprobs(engine: EmbeddedEngine, prompt: list[int]) -> tuple[list[int], list[float]]:
    request = GenerateRequest(request_id="r", input_ids=prompt,
                              sampling=SamplingParams(temperature=1.0, max_new_tokens=12, seed=5, ignore_eos=True))
    result = await engine.generate(request)
    return result.output_ids, result.logprobs


def model_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].double()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(output)[:, None])[:, 0]


@pytest.mark.parametrize("sync", ["adapter", "merged"])
def test_engine_after_a_lora_sync_equals_the_merged_model(tmp_path: Path, sync: str):
    prompt = [5, 17, 23, 9, 41]

    async def run():
        learner = node(tmp_path, sync=sync)
        publish = Sync(SyncConfig(transport="inprocess"), OperatorContext(node="publish"))
        engine = EmbeddedEngine(MODEL, max_slots=2)
        await learner.setup()
        try:
            groups = [Group(id=f"0:{k}", step=0, trajectories=trajectories()[3 * k:3 * k + 3]) for k in range(2)]
            await learner.train(groups, step=0)
            policy = (await learner.train([Group(id="1:0", step=1, trajectories=trajectories(1))], step=1)).policy
            names = [n for b in policy for n, _ in b]
            await asyncio.wait_for(engine.update_weights((await publish.sync(policy, version=2)).buckets, 2), 60)
            state = learner.learner.trainer.state_dict_full()
            return names, await engine_logprobs(engine, prompt), state
        finally:
            await engine.close()
            await learner.close()

    names, (output, logprobs), state = asyncio.run(run())
    layers = len(load_hf_model(MODEL).model.layers)
    if sync == "adapter":
        assert len(names) == 2 * 3 * layers and all(n.endswith((".lora_A.weight", ".lora_B.weight")) for n in names)
    else:
        assert len(names) == 3 * layers and all(n.endswith(tuple(f"{t}.weight" for t in TARGETS)) for n in names)
    merged = load_hf_model(MODEL)
    merged.load_state_dict(state)
    base = load_hf_model(MODEL)
    expected = model_logprobs(merged, prompt, output)
    torch.testing.assert_close(torch.tensor(logprobs, dtype=torch.float64), expected, atol=1e-5, rtol=0)
    assert (model_logprobs(base, prompt, output) - expected).abs().max() > 1e-3  # the adapters matter
    exported = load_hf_model(str(tmp_path / "export" / "learner"))
    torch.testing.assert_close(model_logprobs(exported, prompt, output), expected, atol=1e-6, rtol=0)


def test_lora_errors_are_located(tmp_path: Path):
    with pytest.raises(ConfigError, match=r"nodes\.learner\.lora\.target_modules\.1: 'qkv' names no linear"):
        asyncio.run(node(tmp_path, target_modules=["q_proj", "qkv"]).setup())


def test_engine_refuses_half_an_adapter():
    async def run():
        engine = EmbeddedEngine(MODEL, max_slots=2)
        try:
            before = {n: p.clone() for n, p in engine.named_parameters()}
            name = "model.layers.0.self_attn.q_proj"
            with pytest.raises(ValueError, match="needs its lora_A and lora_B together"):
                await engine.update_weights([[(f"{name}.lora_A.weight", torch.zeros(4, 128))]], 1)
            with pytest.raises(ValueError, match=r"expected \[r, 128\]"):
                await engine.update_weights([[(f"{name}.lora_A.weight", torch.zeros(4, 64))]], 1)
            with pytest.raises(KeyError, match="not a linear layer"):
                await engine.update_weights([[("model.norm.lora_A.weight", torch.zeros(4, 64))]], 1)
            assert engine.version == 0 and engine.model.model.layers[0].self_attn.q_proj.lora_a is None
            assert all(torch.equal(p, before[n]) for n, p in engine.named_parameters())
        finally:
            await engine.close()

    asyncio.run(run())


def test_lora_checkpoint_restores_the_adapters(tmp_path: Path):
    trainer = Trainer(MODEL, TrainerConfig(lr=1e-2, lora=LoraSpec(r=2, target_modules=["o_proj"])))
    batch = compute_advantages(pack(trajectories()), AdvantageConfig())
    loss = policy_loss(LossConfig())

    def adapters():
        return {n: t.clone() for b in trainer.named_weights(changed_only=True) for n, t in b}

    trainer.forward_backward(batch, loss)
    trainer.step()
    saved = adapters()
    trainer.save(tmp_path / "ckpt")
    trainer.forward_backward(batch, loss)
    trainer.step()
    assert any(not torch.equal(t, saved[n]) for n, t in adapters().items())
    trainer.load(tmp_path / "ckpt")
    assert all(torch.equal(t, saved[n]) for n, t in adapters().items())


def test_lora_base_is_the_reference(tmp_path: Path):
    """A KL term with lora needs no reference node: the train node scores the reference with its
    adapters disabled, which equals a separate reference model of the same checkpoint."""
    from flowrl.operator import GraphFacts
    from flowrl_operators.training.trainer import Reference
    from flowrl_operators.training.tuning import base_logprobs

    keys = {"optim": {"lr": 1e-2}, "loss": {"kind": "ppo_clip", "kl": {"coef": 0.1, "apply_as": "loss"}}}
    with_lora = msgspec.convert(keys | {"lora": {"r": 2}}, TrainConfig)
    assert Train.check_graph(with_lora, GraphFacts()) == []
    assert Train.check_graph(msgspec.convert(keys, TrainConfig), GraphFacts())[0][0] == ("loss", "kl", "coef")

    async def run():
        op = Train(with_lora, OperatorContext(node="learner", run_dir=tmp_path, seed=1, model={"path": MODEL}))
        await op.setup()
        try:
            groups = [Group(id=f"0:{k}", step=0, trajectories=trajectories()[3 * k:3 * k + 3]) for k in range(2)]
            first = (await op.train(groups, step=0)).metrics
            second = (await op.train([Group(id="1:0", step=1, trajectories=trajectories(1))], step=1)).metrics
            batch = pack(trajectories(2), require_reward=False)
            trainer = op.learner.trainer
            return first, second, base_logprobs(trainer, batch), trainer.compute_logprobs(batch), batch
        finally:
            await op.close()

    first, second, base, policy, batch = asyncio.run(run())
    assert abs(first["kl"]) < 1e-6 < abs(second["kl"])  # zero while the adapters are zero, then not
    reference = Reference(MODEL, TrainerConfig()).compute_logprobs(batch)
    torch.testing.assert_close(base, reference, atol=1e-6, rtol=0)
    assert (policy - reference).abs().max() > 1e-4
