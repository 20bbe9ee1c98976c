"""The trainer's (and reference's) forward of a vision-language policy on a micro-batch with images.

A batch row's images are `Batch.images[row]` (the trajectory's `images`: the images whose
placeholders appear in its prompt and response ids, in order). For a VL model (Qwen2-VL,
Qwen2.5-VL, Qwen3-VL, loaded through `AutoModelForImageTextToText`), `vl_inputs` turns the padded
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

Packed rows (training/head.py) work too: the position ids get four rows (the text positions first,
from which transformers finds each packed sequence's boundaries) and the images follow the packed
placeholders' order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from flowrl_operators.models_vl import SUPPORTED


def is_vl_model(model: torch.nn.Module) -> bool:
    return getattr(getattr(model, "config", None), "model_type", None) in SUPPORTED


def hidden_size(model: torch.nn.Module) -> int:
    """The decoder's width (a VL config keeps it in its text_config)."""
    config = model.config
    return getattr(config, "text_config", config).hidden_size


def _vision(model: torch.nn.Module):
    from flowrl_operators.vision import vision

    return vision(model.config._name_or_path)


@contextlib.contextmanager
def vl_inputs(model: torch.nn.Module, mb: Any, inputs: dict[str, Any],
              packed: tuple[torch.Tensor, torch.Tensor] | None = None) -> Iterator[dict[str, Any]]:
    """The model inputs for micro-batch `mb` (module docs); `inputs` unchanged for a text model.
    `inputs` are the padded rows, or with `packed` = (packed row, offset) of each of mb's rows the
    packed ones (training/head.py `pack_rows`): then position_ids get 4 rows, the text positions
    first, from which transformers finds the packed sequences' boundaries."""
    images = getattr(mb, "images", None) or [[] for _ in range(mb.size)]
    if not is_vl_model(model):
        if any(images):
            raise ValueError(f"trajectories carry images but the model ({getattr(model.config, 'model_type', '?')}) "
                             "is text-only; images need a vision-language model such as builtin:tiny-qwen2-vl")
        yield inputs
        return
    with contextlib.ExitStack() as stack:
        if not any(images):
            stack.enter_context(_idle_tower(model))
            if packed is None:  # text rows: transformers' own (text) positions are the mrope ones
                yield inputs
                return
        v = _vision(model)
        out, stray, refs = _placed(v, mb, images, inputs, packed)
        if refs:
            pixels = v.pixels(refs)
            out["pixel_values"] = pixels["pixel_values"].to(stray.device)
            out["image_grid_thw"] = pixels["image_grid_thw"].to(stray.device)
        if bool(stray.any()):
            stack.enter_context(_stray_embeddings(model, stray, v.image_token_id))
        yield out


def _placed(v: Any, mb: Any, images: list, inputs: dict[str, Any], packed: Any) -> tuple[dict, torch.Tensor, list]:
    """(inputs with mrope position ids and stray image-pad tokens as 0, the strays' mask, the images
    in the order their placeholders appear in the (packed) rows)."""
    ids, text = inputs["input_ids"], inputs["position_ids"]
    lengths = mb.lengths.tolist()
    where = list(zip(*(t.tolist() for t in packed), strict=True)) if packed else [(b, 0) for b in range(len(lengths))]
    positions = text.cpu()[None].repeat(3, 1, 1)  # padding and packed tails keep their text positions
    stray = torch.zeros(ids.shape, dtype=torch.bool)
    refs = []
    for r in sorted(range(len(lengths)), key=lambda r: where[r]):
        (at, off), n, row_refs = where[r], lengths[r], list(images[r])
        row = ids[at, off:off + n].tolist()
        in_span = torch.zeros(n, dtype=torch.bool)
        if row_refs:
            positions[:, at, off:off + n], _ = v.positions(row, row_refs)
            for start, end in v.spans(row, row_refs):
                in_span[start:end] = True
        stray[at, off:off + n] = (torch.tensor(row) == v.image_token_id) & ~in_span
        refs += row_refs
    if packed:
        positions = torch.cat([text.cpu()[None], positions])
    stray = stray.to(ids.device)
    return dict(inputs, input_ids=ids.masked_fill(stray, 0), position_ids=positions.to(ids.device)), stray, refs


@contextlib.contextmanager
def _stray_embeddings(model: torch.nn.Module, stray: torch.Tensor, image_token_id: int) -> Iterator[None]:
    """Stray image-pad tokens go in as token 0 (so the model's placeholder count is its images');
    this hook gives them back the image-pad token's embedding."""

    def restore(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        pad = module.weight[image_token_id].to(output.dtype)
        return torch.where(stray[..., None], pad, output)

    handle = model.get_input_embeddings().register_forward_hook(restore)
    try:
        yield
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
        out = hf.model.visual(blank, grid_thw=grid.to(embeds.device))
        used = sum(f.sum() for f in [out.pooler_output, *(getattr(out, "deepstack_features", None) or [])])
        kwargs["inputs_embeds"] = embeds + 0 * used.to(embeds.dtype)
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
