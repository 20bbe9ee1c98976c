"""The trainer, reference and critic on a vision-language policy: images reach the forward (and its
gradient the vision tower), `freeze: [vision]` keeps the tower still and out of weight sync."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from flowrl.data.images import use_store
from flowrl.data.trajectory import Trajectory
from flowrl_operators.training import tuning
from flowrl_operators.training.advantages import AdvantageConfig, compute_advantages
from flowrl_operators.training.batch import pack
from flowrl_operators.training.losses import LossConfig, policy_loss
from flowrl_operators.training.trainer import Critic, Trainer, TrainerConfig
from flowrl_operators.vision import vision

torch.set_num_threads(1)
MODEL = "builtin:tiny-qwen2-vl"


def picture(seed: int) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    return Image.fromarray(torch.randint(0, 256, (56, 56, 3), generator=g, dtype=torch.uint8).numpy(), "RGB")


def trajectories(tmp_path, seeds=(0, 1, 2, 3), model=MODEL) -> list[Trajectory]:
    store = use_store(tmp_path / "images")
    v = vision(model)
    out = []
    for i, seed in enumerate(seeds):
        ids, refs = v.prompt([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]}],
                             [store.put(picture(seed))])
        # A response holding a stray image-pad token: text, not an image.
        response = [20, 21, v.image_token_id, 22 + i]
        out.append(Trajectory(id=str(i), group_id="g", sample_id="g", step=0, prompt_ids=ids, response_ids=response,
                              loss_mask=[1] * 4, behaviour_logprobs=[-4.0] * 4, versions=[0] * 4,
                              reward=float(i % 2), images=refs))
    return out


def test_a_step_trains_the_tower_unless_frozen(tmp_path):
    batch = compute_advantages(pack(trajectories(tmp_path)), AdvantageConfig())
    for freeze in ([], ["vision"]):
        trainer = Trainer(MODEL, TrainerConfig(lr=1e-2, freeze=freeze))
        params = dict(trainer.model.named_parameters())
        tower = {n for n in params if n.startswith("model.visual.")}
        before = {n: p.detach().clone() for n, p in params.items()}
        trainer.forward_backward(batch, policy_loss(LossConfig()))
        trainer.step()
        moved = {n for n in params if not torch.equal(params[n], before[n])}
        changed = {n for b in trainer.named_weights(changed_only=True) for n, _ in b}
        if freeze:
            assert not moved & tower and not changed & tower and moved
        else:
            assert "model.visual.patch_embed.proj.weight" in moved & changed


def test_images_change_the_logprobs_and_values(tmp_path):
    first = trajectories(tmp_path, seeds=(0, 0))
    other = trajectories(tmp_path, seeds=(5, 5))
    policy = Trainer(MODEL, TrainerConfig())
    critic = Critic(MODEL, TrainerConfig())
    a, b = pack(first, require_reward=False), pack(other, require_reward=False)
    assert torch.equal(a.input_ids, b.input_ids)  # the same tokens: only the pixels differ
    lp_a, lp_b = policy.compute_logprobs(a), policy.compute_logprobs(b)
    assert torch.allclose(lp_a[0, :-1], lp_a[1, :-1]) and not torch.allclose(lp_a, lp_b)  # last token differs
    v_a, v_b = critic.compute_values(a), critic.compute_values(b)
    assert v_a.shape == a.loss_mask.shape and not torch.allclose(v_a, v_b)


def test_a_text_model_refuses_trajectories_with_images(tmp_path):
    with pytest.raises(ValueError, match="carry images but the model .qwen2. is text-only"):
        Trainer("builtin:tiny-qwen2", TrainerConfig()).compute_logprobs(pack(trajectories(tmp_path), require_reward=False))


def test_freeze_vision_is_checked_against_the_model():
    assert tuning.check(MODEL, ["vision"], None) == []
    problems = tuning.check("builtin:tiny-qwen2", ["vision"], None)
    assert problems and problems[0][0] == ("freeze", 0) and "text-only" in problems[0][1]


def test_lora_adapters_reach_the_engine(tmp_path):
    """A LoRA policy on a VL model: the adapters (decoder layers) sync to the embedded engine, whose
    behaviour logprobs on an image prompt then equal the trainer's."""
    import asyncio

    from flowrl_operators.config import LoraSpec
    from flowrl_operators.engine.embedded.engine import EmbeddedEngine
    from flowrl_operators.inference import GenerateRequest, SamplingParams
    from flowrl_operators.training.tuning import adapter_tensors, lora_layers

    trainer = Trainer(MODEL, TrainerConfig(lora=LoraSpec(r=4, target_modules=["q_proj", "v_proj"])))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # peft's B starts at zero: move it so the adapters change the outputs
        for _, layer in lora_layers(trainer.model):
            layer.lora_B["default"].weight.copy_(torch.randn(layer.lora_B["default"].weight.shape, generator=g))
    adapters = list(adapter_tensors(trainer.model, "adapter"))
    assert adapters and all(n.startswith("model.language_model.layers.") for n, _ in adapters)
    [traj] = trajectories(tmp_path, seeds=(0,))

    async def body():
        engine = EmbeddedEngine(MODEL)
        try:
            await engine.update_weights([adapters], 1)
            return await engine.generate(GenerateRequest(
                request_id="r", input_ids=traj.prompt_ids, images=traj.images,
                sampling=SamplingParams(temperature=1.0, max_new_tokens=12, seed=5, ignore_eos=True)))
        finally:
            await engine.close()

    result = asyncio.run(body())
    traj.response_ids, traj.behaviour_logprobs = result.output_ids, result.logprobs
    traj.loss_mask, traj.versions = [1] * 12, result.versions
    batch = pack([traj], require_reward=False)
    mine = trainer.compute_logprobs(batch)[0, len(traj.prompt_ids) - 1:]
    torch.testing.assert_close(mine, torch.tensor(result.logprobs), atol=1e-4, rtol=0)


@pytest.mark.slow
def test_a_trainer_in_its_own_process_reads_the_runs_images(tmp_path):
    """`own_process` trainers (training/process.py) use the parent's image store, not the default."""
    from flowrl_operators.training.process import Child
    from flowrl_operators.training.trainer import Reference

    rows = trajectories(tmp_path, seeds=(0,))
    batch = pack(rows, require_reward=False)
    child = Child(Reference, (MODEL, TrainerConfig()))
    try:
        there = child.call("compute_logprobs", batch)
    finally:
        child.close()
    torch.testing.assert_close(there, Reference(MODEL, TrainerConfig()).compute_logprobs(batch), atol=1e-6, rtol=0)


def test_an_exported_policy_is_a_vl_checkpoint(tmp_path):
    """export_hf of a VL policy: the engine and transformers load it, with its image processor."""
    import asyncio

    from flowrl_operators.engine.embedded.engine import EmbeddedEngine
    from flowrl_operators.inference import GenerateRequest, SamplingParams
    from flowrl_operators.models import load_hf_model

    trainer = Trainer(MODEL, TrainerConfig())
    with torch.no_grad():
        trainer.model.model.visual.patch_embed.proj.weight.mul_(2.0)
    folder = trainer.export_hf(tmp_path / "export")
    exported = dict(load_hf_model(folder).named_parameters())
    assert torch.equal(exported["model.visual.patch_embed.proj.weight"], trainer.model.model.visual.patch_embed.proj.weight)
    [traj] = trajectories(tmp_path, seeds=(0,))

    async def body():
        engine = EmbeddedEngine(folder)
        try:
            live = dict(engine.named_parameters())
            result = await engine.generate(GenerateRequest(request_id="r", input_ids=traj.prompt_ids, images=traj.images,
                                                           sampling=SamplingParams(temperature=0.0, max_new_tokens=4)))
            return live, result
        finally:
            await engine.close()

    live, result = asyncio.run(body())
    assert result.error is None and result.output_ids
    assert torch.equal(live["model.visual.patch_embed.proj.weight"], exported["model.visual.patch_embed.proj.weight"])
    assert vision(folder).image_tokens(traj.images[0]) == 4


@pytest.mark.parametrize("model", [MODEL, "builtin:tiny-qwen2.5-vl", "builtin:tiny-qwen3-vl"])
def test_packed_rows_equal_padded_rows(tmp_path, model):
    """Packed VL rows (4-row position ids, images in packed order) give the padded rows' logprobs and
    gradients, with a text-only row and stray image-pad tokens among them."""
    from flowrl_operators.training.head import loss_token_logprobs, pack_rows, packing_supported

    rows = trajectories(tmp_path, seeds=(0, 1, 2), model=model)
    rows.append(Trajectory(id="text", group_id="g", sample_id="g", step=0, prompt_ids=[5, 6, 7, 101, 103],
                           response_ids=[103, 9, 10], loss_mask=[1] * 3, behaviour_logprobs=[-4.0] * 3,
                           versions=[0] * 3, reward=0.0))
    batch = pack(rows)
    trainer = Trainer(model, TrainerConfig())
    assert packing_supported(trainer.model) and pack_rows(batch)[0].shape[0] == 1  # all four rows in one
    results = []
    for packed in (False, True):
        trainer.model.zero_grad()
        out = loss_token_logprobs(trainer.model, batch, pack=packed)
        out["logprobs"].sum().backward()
        grad = trainer.model.model.visual.patch_embed.proj.weight.grad.clone()
        results.append((out["logprobs"].detach(), grad))
    (padded, g_padded), (packed, g_packed) = results
    assert (padded != 0).sum() == batch.loss_mask.sum()
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=0)
    torch.testing.assert_close(g_packed, g_padded, atol=1e-5, rtol=1e-4)
