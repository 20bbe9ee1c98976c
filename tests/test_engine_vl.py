"""The embedded engine and the trainer on vision-language policies (fp32, CPU, tiny built-ins).

The built-ins' random weights are perturbed (saved as a checkpoint folder) so greedy outputs vary
token to token and with the image: equal outputs then mean equal computations.
"""

from __future__ import annotations

import asyncio
import shutil

import pytest
import torch
from PIL import Image

from flowrl.data.images import ImageStore, use_store
from flowrl.data.trajectory import Trajectory
from flowrl_operators.engine.embedded.engine import EmbeddedEngine
from flowrl_operators.inference import GenerateRequest, SamplingParams
from flowrl_operators.models import load_hf_model, resolve_model
from flowrl_operators.vision import vision

torch.set_num_threads(1)
QUESTION = [{"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "image"},
                                         {"type": "text", "text": "and"}, {"type": "image"}]}]


def picture(size=(56, 56), seed=0) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    return Image.fromarray(torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8).numpy(), "RGB")


def noisy_checkpoint(name: str, folder, scale: float = 0.3, seed: int = 0):
    """The built-in with every weight perturbed, saved as a checkpoint folder; returns its HF model."""
    source = resolve_model(name)
    model = load_hf_model(source)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    model.save_pretrained(folder)
    for f in source.iterdir():
        if f.name not in ("model.safetensors", "config.json", "flowrl_builtin.json"):
            shutil.copy(f, folder)
    model.config._name_or_path = str(folder)
    return model.eval()


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> ImageStore:
    return use_store(tmp_path_factory.mktemp("images"))


@pytest.fixture(scope="module")
def qwen2_vl(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen2-vl")
    return folder, noisy_checkpoint("builtin:tiny-qwen2-vl", folder)


def prompt(folder, store, seed=0):
    refs = [store.put(picture(seed=seed)), store.put(picture((100, 40), seed=seed + 10))]
    return vision(folder).prompt(QUESTION, refs)


def hf_greedy(model, folder, ids, refs, n):
    v = vision(folder)
    pixels = v.pixels(refs)
    x = torch.tensor([ids])
    out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), mm_token_type_ids=(x == v.image_token_id).int(),
                         max_new_tokens=n, do_sample=False, eos_token_id=None, **pixels)
    return out[0, len(ids):].tolist()


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)


async def generate(engine, rid, ids, refs, sampling):
    return await engine.generate(GenerateRequest(request_id=rid, input_ids=ids, images=refs, sampling=sampling))


FAMILIES = ["builtin:tiny-qwen2-vl", "builtin:tiny-qwen2.5-vl", "builtin:tiny-qwen3-vl"]


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_equals_hugging_face_generate(name, store, tmp_path):
    model = noisy_checkpoint(name, tmp_path)
    ids, refs = prompt(tmp_path, store)
    want = hf_greedy(model, tmp_path, ids, refs, 24)

    async def body():
        engine = EmbeddedEngine(tmp_path)
        try:
            return await generate(engine, "a", ids, refs, greedy(24))
        finally:
            await engine.close()

    got = asyncio.run(body())
    assert got.error is None and got.output_ids == want
    assert len(set(want)) > 5  # the perturbed model says something, not one token repeated


def test_alone_equals_among_text_and_image_requests(qwen2_vl, store):
    folder, _ = qwen2_vl
    v = vision(folder)
    image_prompts = [prompt(folder, store, seed) for seed in range(3)]
    # Same token ids as the first, other images: must not share the first one's KV.
    assert image_prompts[1][0] == image_prompts[0][0]
    # Text prompts sharing a long prefix: the second copies it from the first (prefill.py's rounds).
    text = [(v.prompt([{"role": "user", "content": f"a shared long opening, then {k}"}], [])[0], []) for k in (1, 3)]
    requests = image_prompts + text + [image_prompts[2]]  # a GRPO-like twin: computed once, KV copied

    async def body():
        engine = EmbeddedEngine(folder, max_slots=8)
        try:
            alone = [(await generate(engine, f"a{i}", ids, refs, greedy(16))).output_ids
                     for i, (ids, refs) in enumerate(requests)]
            together = await asyncio.gather(*(generate(engine, f"t{i}", ids, refs, greedy(16))
                                              for i, (ids, refs) in enumerate(requests)))
            return alone, [r.output_ids for r in together], engine.stats()
        finally:
            await engine.close()

    alone, together, stats = asyncio.run(body())
    assert together == alone
    assert alone[0] != alone[1]  # the images matter
    assert stats["prefill_forks"] == 1  # only the twin: equal ids with other images are not forks
    assert stats["prefill_shared_tokens"] >= 17  # the text prompts' common opening, copied


def test_turns_share_the_prefix_up_to_their_first_different_image(qwen2_vl, store):
    """Second turns of one episode's group: the first image's prefix is computed once, the KV after
    the differing observation image is each request's own."""
    folder, _ = qwen2_vl
    v = vision(folder)
    first_image, *observations = [store.put(picture(seed=s)) for s in (0, 1, 2)]
    opening, _ = v.prompt([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Go on."}]}],
                          [first_image])
    reply = v.tokenizer("Looking.<|im_end|>", add_special_tokens=False)["input_ids"]
    turns = []
    for ref in observations:
        tail, _ = v.observation_ids([{"role": "user", "content": [{"type": "image"}]}], [ref], model_ids=reply)
        turns.append((opening + reply + tail, [first_image, ref]))
    assert turns[0][0] == turns[1][0]

    async def body():
        engine = EmbeddedEngine(folder)
        try:
            alone = [(await generate(engine, f"a{i}", ids, refs, greedy(12))).output_ids
                     for i, (ids, refs) in enumerate(turns)]
            before = engine.stats()["prefill_shared_tokens"]
            together = await asyncio.gather(*(generate(engine, f"t{i}", ids, refs, greedy(12))
                                              for i, (ids, refs) in enumerate(turns)))
            return alone, [r.output_ids for r in together], engine.stats()["prefill_shared_tokens"] - before
        finally:
            await engine.close()

    alone, together, shared = asyncio.run(body())
    assert together == alone and alone[0] != alone[1]
    assert len(opening + reply) <= shared < len(turns[0][0])  # up to the second image, not beyond


@pytest.mark.parametrize("name", FAMILIES)
def test_behaviour_logprobs_equal_the_trainers(name, store, tmp_path):
    from flowrl_operators.training.batch import pack, response_values
    from flowrl_operators.training.trainer import Reference, TrainerConfig

    folder = tmp_path
    noisy_checkpoint(name, folder)
    prompts = [prompt(folder, store, seed) for seed in range(2)]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=20, ignore_eos=True, seed=7)

    async def body():
        engine = EmbeddedEngine(folder)
        try:
            return await asyncio.gather(*(generate(engine, f"s{i}", ids, refs, sampling)
                                          for i, (ids, refs) in enumerate(prompts)))
        finally:
            await engine.close()

    results = asyncio.run(body())
    trajectories = [Trajectory(id=f"t{i}", group_id="g", sample_id="s", prompt_ids=ids, response_ids=r.output_ids,
                               loss_mask=[1] * len(r.output_ids), behaviour_logprobs=r.logprobs, versions=r.versions,
                               images=refs) for i, ((ids, refs), r) in enumerate(zip(prompts, results, strict=True))]
    batch = pack(trajectories, require_reward=False)
    batch.reference_logprobs = Reference(folder, TrainerConfig()).compute_logprobs(batch)
    trainer = response_values(batch, "reference_logprobs", trajectories)
    diffs = [abs(a - b) for t, lps in zip(trajectories, trainer, strict=True)
             for a, b in zip(t.behaviour_logprobs, lps, strict=True)]
    assert sum(diffs) / len(diffs) < 1e-5, max(diffs)


def test_pause_update_continue_with_an_image_prompt(qwen2_vl, store, tmp_path):
    folder, model = qwen2_vl
    new = [(n, p.detach() + 0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
           for n, p in model.named_parameters()]
    ids, refs = prompt(folder, store)

    async def body():
        engine = EmbeddedEngine(folder)
        try:
            task = asyncio.create_task(generate(engine, "long", ids, refs, greedy(200)))
            while not task.done() and len(getattr(engine.snapshot("long"), "output_ids", [])) < 5:
                await asyncio.sleep(0.005)
            await engine.pause("retract")
            await engine.update_weights([new], 1)
            await engine.resume()
            result = await task
            switch = result.versions.index(1)
            rest = await generate(engine, "rest", ids + result.output_ids[:switch], refs, greedy(20))
            return result, switch, rest
        finally:
            await engine.close()

    result, switch, rest = asyncio.run(body())
    assert 0 < switch < 200 and result.versions == sorted(result.versions) and len(result.output_ids) == 200
    assert rest.output_ids == result.output_ids[switch:switch + 20]


def test_weight_sync_carries_the_vision_tower(qwen2_vl, store):
    folder, model = qwen2_vl
    ids, refs = prompt(folder, store)
    tower = [(n, p.detach() + 0.5 * torch.randn(p.shape, generator=torch.Generator().manual_seed(2)))
             for n, p in model.named_parameters() if n.startswith("model.visual.")]
    assert tower

    async def body():
        engine = EmbeddedEngine(folder)
        try:
            before = await generate(engine, "b", ids, refs, greedy(16))
            await engine.update_weights([tower], 1)
            after = await generate(engine, "c", ids, refs, greedy(16))
            live = dict(engine.named_parameters())
            return before, after, live
        finally:
            await engine.close()

    before, after, live = asyncio.run(body())
    assert before.output_ids != after.output_ids
    assert all(torch.equal(live[n], t) for n, t in tower)


def flat_config_copy(source, folder):
    """The checkpoint with config.json in the layout published Qwen2-VL checkpoints use (text keys at
    the top level, `rope_scaling: {type: mrope}`), as transformers 4 wrote it."""
    import json

    shutil.copytree(source, folder, dirs_exist_ok=True)
    config = json.loads((source / "config.json").read_text())
    text = config.pop("text_config")
    config.update({k: v for k, v in text.items() if k not in ("model_type", "rope_parameters", "dtype", "layer_types")})
    config.update(rope_theta=text["rope_parameters"]["rope_theta"], torch_dtype="float32",
                  rope_scaling={"type": "mrope", "mrope_section": text["rope_parameters"]["mrope_section"]})
    config["vision_config"]["model_type"] = "qwen2_vl"
    (folder / "config.json").write_text(json.dumps(config))


def test_a_published_layout_checkpoint_loads_the_same(qwen2_vl, store, tmp_path):
    folder, _ = qwen2_vl
    flat_config_copy(folder, tmp_path)
    ids, refs = prompt(folder, store)

    async def body(path):
        engine = EmbeddedEngine(path)
        try:
            return (await generate(engine, "a", ids, refs, greedy(16))).output_ids
        finally:
            await engine.close()

    assert "text_config" not in (tmp_path / "config.json").read_text()
    assert asyncio.run(body(tmp_path)) == asyncio.run(body(folder))


def test_images_are_refused_where_they_cannot_run(qwen2_vl, store):
    folder, _ = qwen2_vl
    ids, refs = prompt(folder, store)
    missing = type(refs[0])("0" * 64, 56, 56)

    async def body():
        text_engine, engine = EmbeddedEngine("builtin:tiny-qwen2"), EmbeddedEngine(folder)
        try:
            return (await generate(text_engine, "x", [5, 6], refs[:1], greedy(2)),
                    await generate(engine, "y", ids, refs[:1], greedy(2)),
                    await generate(engine, "w", ids, [], greedy(2)),
                    await generate(engine, "z", ids, [refs[0], missing], greedy(2)))
        finally:
            await text_engine.close()
            await engine.close()

    text_only, too_few, none, absent = asyncio.run(body())
    assert "placeholders for 2 images, 0 were given" in none.error
    assert "text-only" in text_only.error and text_only.finish_reason == "abort"
    assert "placeholders for 2 images, 1 were given" in too_few.error
    assert "not in the image store" in absent.error
