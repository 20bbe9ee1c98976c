"""Built-in vision-language models and operators/vision.py: prompts, pixels and mrope positions
checked against the Hugging Face model of each family."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from flowrl.data.images import ImageStore, use_store
from flowrl_operators.models import is_vl, resolve_model
from flowrl_operators.vision import vision

FAMILIES = ["builtin:tiny-qwen2-vl", "builtin:tiny-qwen2.5-vl", "builtin:tiny-qwen3-vl"]


@pytest.fixture()
def store(tmp_path) -> ImageStore:
    return use_store(tmp_path / "images")


def picture(size=(56, 56), seed=0) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy(), "RGB")


def two_image_prompt(v, store):
    refs = [store.put(picture()), store.put(picture((100, 40), seed=1))]
    messages = [{"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "image"},
                                             {"type": "text", "text": "and"}, {"type": "image"}]}]
    return v.prompt(messages, refs)


@pytest.mark.parametrize("model", FAMILIES)
def test_builtin_loads_with_transformers_auto_classes(model):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    folder = resolve_model(model)
    hf = AutoModelForImageTextToText.from_pretrained(str(folder), local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    processor = AutoImageProcessor.from_pretrained(str(folder), local_files_only=True)
    assert tokenizer.convert_tokens_to_ids("<|image_pad|>") == hf.config.image_token_id
    assert type(processor).__name__ == "Qwen2VLImageProcessorPil"
    assert is_vl(model) and not is_vl("builtin:tiny-qwen2")
    assert sum(p.numel() for p in hf.model.visual.parameters()) < 200_000
    # Text ids are those of the text built-in.
    text = AutoTokenizer.from_pretrained(str(resolve_model("builtin:tiny-qwen2")), local_files_only=True)
    assert tokenizer("Hello, world!")["input_ids"] == text("Hello, world!")["input_ids"]


@pytest.mark.parametrize("model", FAMILIES)
def test_prompt_pixels_and_positions_match_hugging_face(model, store):
    v = vision(model)
    ids, refs = two_image_prompt(v, store)
    # 56x56 -> 2x2 merged; 100x40 -> 1x4 merged (patch 14) or 2x4 (patch 16: the area is raised to 64x64's)
    want = [4, 4] if v.patch_size == 14 else [4, 8]
    assert [v.image_tokens(r) for r in refs] == want and ids.count(v.image_token_id) == sum(want)
    pixels = v.pixels(refs)
    assert pixels["image_grid_thw"].tolist() == [list(v.grid(r)) for r in refs]
    assert pixels["pixel_values"].shape == (4 * sum(want), 3 * 2 * v.patch_size**2)
    from transformers import AutoModelForImageTextToText

    hf = AutoModelForImageTextToText.from_pretrained(str(resolve_model(model)), local_files_only=True)
    input_ids = torch.tensor([ids])
    types = (input_ids == v.image_token_id).int()
    want, want_delta = hf.model.get_rope_index(input_ids, types, image_grid_thw=pixels["image_grid_thw"])
    got, delta = v.positions(ids, refs)
    assert torch.equal(got, want[:, 0]) and delta == int(want_delta)
    # Text after the prompt continues at index + delta, as HF's decoding does.
    more = ids + [10, 11]
    assert v.positions(more, refs)[0][:, -1].tolist() == [len(more) - 1 + delta] * 3


def test_observation_ids_continue_a_conversation(store):
    v = vision("builtin:tiny-qwen2-vl")
    ref = store.put(picture())
    first, _ = v.prompt([{"role": "user", "content": "hi"}], [])
    observation = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]}]
    whole, _ = v.prompt([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}] + observation, [ref])
    reply = v.tokenizer("yo<|im_end|>", add_special_tokens=False)["input_ids"]  # the model stopped at its end token
    tail, refs = v.observation_ids(observation, [ref], model_ids=reply)
    assert refs == [ref] and first + reply + tail == whole and tail.count(v.image_token_id) == 4
    cut = v.tokenizer("yo", add_special_tokens=False)["input_ids"]  # ran out of tokens: the end is added
    assert first + cut + v.observation_ids(observation, [ref], model_ids=cut)[0] == whole


def test_images_named_in_the_parts_are_stored(store):
    v = vision("builtin:tiny-qwen2-vl")
    url = ImageStore(store.root).data_url(store.put(picture()))
    ids, refs = v.prompt([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}])
    assert len(refs) == 1 and store.get(refs[0]).size == (56, 56) and ids.count(v.image_token_id) == 4


def test_mistakes_are_reported(store):
    v = vision("builtin:tiny-qwen2-vl")
    ref = store.put(picture())
    with pytest.raises(ValueError, match="1 image parts but 0 images"):
        v.prompt([{"role": "user", "content": [{"type": "image"}]}], [])
    ids, _ = v.prompt([{"role": "user", "content": [{"type": "image"}]}], [ref])
    with pytest.raises(ValueError, match="placeholders for 1 images, 2 were given"):
        v.positions(ids, [ref, ref])
    big = store.put(picture((112, 112)))  # 16 tokens: the prompt has room for 4
    with pytest.raises(ValueError, match="needs 16 placeholder tokens, the sequence has 4"):
        v.positions(ids, [big])
    with pytest.raises(ValueError, match="not a vision-language model"):
        vision("builtin:tiny-qwen2")
