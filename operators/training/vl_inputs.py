"""The trainer's (and reference's) forward of a vision-language policy on a micro-batch with images.

A batch row's images are `Batch.images[row]` (the trajectory's `images`: the images whose
placeholders appear in its prompt and response ids, in order). For a VL model (Qwen2-VL,
Qwen2.5-VL, loaded through `AutoModelForImageTextToText`), `vl_inputs` turns the padded
micro-batch's model inputs into the family's:

- `pixel_values` / `image_grid_thw`: every row's images, in row order, rebuilt from the run's image
  store with the checkpoint's own image processor (operators/vision.py): the model's forward runs
  its vision tower and puts the output at the placeholder tokens (inside the forward, so FSDP2's
  hooks gather the tower's shards and the tower trains unless frozen);
- `position_ids` [3, B, L]: the multimodal rotary positions of each row (`Vision.positions`, equal
  to transformers' `get_rope_index`), 0 on padding;
- image-pad tokens outside every image's span (a model may sample that token in a response) are
  fed as token 0 and their embedding set back to the image-pad token's by a hook on the embedding,
  so the model's placeholder count equals its images' tokens while those tokens stay text, as in
  the engine.

Packing (training/head.py) is off for VL families: packed rows would need the 4-row position ids
and images in packed order; padded rows are used (`head.PACKED_FAMILIES` lists no VL family).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from flowrl_operators.vision import SUPPORTED


def is_vl_model(model: torch.nn.Module) -> bool:
    return getattr(getattr(model, "config", None), "model_type", None) in SUPPORTED


def _vision(model: torch.nn.Module):
    from flowrl_operators.vision import vision

    return vision(model.config._name_or_path)


@contextlib.contextmanager
def vl_inputs(model: torch.nn.Module, mb: Any, inputs: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The model inputs for padded micro-batch `mb` (module docs); `inputs` unchanged for a text model
    or a batch without images. Rows must be the padded layout (input_ids [B, L], lengths [B])."""
    images = getattr(mb, "images", None)
    if not is_vl_model(model):
        yield inputs
        return
    if not images or not any(images):
        with _idle_tower(model):
            yield inputs
        return
    v = _vision(model)
    ids = inputs["input_ids"]
    if ids.shape != mb.input_ids.shape:
        raise ValueError("vision-language rows cannot be packed (training/head.py): call with pack=False")
    positions = torch.zeros((3, *ids.shape), dtype=torch.long)
    stray = torch.zeros(ids.shape, dtype=torch.bool)
    refs = []
    for b, n in enumerate(mb.lengths.tolist()):
        row, row_refs = ids[b, :n].tolist(), list(images[b])
        in_span = torch.zeros(n, dtype=torch.bool)
        if row_refs:
            positions[:, b, :n], _ = v.positions(row, row_refs)
            for start, end in v.spans(row, row_refs):
                in_span[start:end] = True
        else:
            positions[:, b, :n] = torch.arange(n)
        stray[b, :n] = (ids[b, :n].cpu() == v.image_token_id) & ~in_span
        refs += row_refs
    device = ids.device
    stray = stray.to(device)
    out = dict(inputs, input_ids=ids.masked_fill(stray, 0), position_ids=positions.to(device))
    if refs:
        pixels = v.pixels(refs)
        out["pixel_values"] = pixels["pixel_values"].to(device)
        out["image_grid_thw"] = pixels["image_grid_thw"].to(device)
    if not bool(stray.any()):
        yield out
        return

    def restore(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        pad = module.weight[v.image_token_id].to(output.dtype)
        return torch.where(stray[..., None], pad, output)

    handle = model.get_input_embeddings().register_forward_hook(restore)
    try:
        yield out
    finally:
        handle.remove()


@contextlib.contextmanager
def _idle_tower(model: torch.nn.Module) -> Iterator[None]:
    """A sharded model's forward on a micro-batch without images still runs the vision tower, on a
    blank image, and adds 0 x its output: under FSDP2 every rank must gather (and reduce the
    gradients of) the same shards, whichever rows each holds. Unsharded: nothing to do."""
    if not any(hasattr(p, "full_tensor") for p in model.parameters()):
        yield
        return
    v = _vision(model)
    grid = torch.tensor([[1, 2 * v.merge_size, 2 * v.merge_size]])
    width = 3 * v.temporal_patch_size * v.patch_size**2
    hf = model.get_base_model() if hasattr(model, "get_base_model") else model

    def touch(_module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple:
        embeds = kwargs["inputs_embeds"]
        blank = torch.zeros(int(grid.prod()), width, device=embeds.device, dtype=hf.model.visual.dtype)
        out = hf.model.visual(blank, grid_thw=grid.to(embeds.device)).pooler_output
        kwargs["inputs_embeds"] = embeds + 0 * out.sum().to(embeds.dtype)
        return args, kwargs

    handle = hf.model.language_model.register_forward_pre_hook(touch, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def vl_value_model(path: Any) -> torch.nn.Module:
    """A VL critic: the policy's model with its LM head replaced by a fresh one-output head (what
    AutoModelForTokenClassification builds for text families, which it has no class for here);
    `.logits[..., 0]` are the values. The head is untied from the embedding and drawn from the
    torch seed the trainer set."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(str(path), local_files_only=True, dtype=torch.float32)
    hidden = model.config.text_config.hidden_size
    model.config.tie_word_embeddings = False
    model.config.text_config.tie_word_embeddings = False
    model.lm_head = torch.nn.Linear(hidden, 1, bias=True)
    torch.nn.init.normal_(model.lm_head.weight, std=model.config.text_config.initializer_range)
    torch.nn.init.zeros_(model.lm_head.bias)
    return model


def shard_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks FSDP2 shards one by one: the decoder layers, and a VL model's vision blocks (each
    gathered for its own forward; the patch embedding and merger stay with the root)."""
    if is_vl_model(model):
        return [*model.model.language_model.layers, *model.model.visual.blocks]
    return list(model.base_model.layers)
