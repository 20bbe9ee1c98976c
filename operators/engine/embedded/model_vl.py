"""The embedded engine's vision-language model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): flowrl's decoder with images.

The module tree is Hugging Face's in memory (`model.language_model.layers.0...`, `model.visual...`,
`lm_head`), so the names a trainer sends are the engine's; checkpoint files name the same tensors
the older way (`model.layers.0...`, `visual...`) and `live_name` maps them.

- Text decoder: flowrl's own (model.py), the same layers as Qwen2 (Qwen3 for Qwen3-VL); only the
  rotary positions differ. They are multimodal (mrope): each token has a temporal, height and
  width position, and each rotary frequency reads one of the three (`rope_axes`: in `mrope_section`
  groups, or interleaved for Qwen3-VL). Text tokens have three equal positions; an image's tokens
  have their grid's (operators/vision.py).
- Vision tower: the checkpoint's own Hugging Face module (`model.visual`), run at prefill on the
  images whose placeholders fall in the block being prefilled; its output replaces the placeholder
  tokens' embeddings; Qwen3-VL's deepstack features are added to the hidden states at the same
  positions after the first decoder layers (`after_layer`). A prefill after a weight update
  (retract) runs the tower again, with the new weights.
- Positions: prefill reads them from each request's tokens and images (`Vision.positions`); the KV
  cache keeps each slot's `delta` (text after the last image sits at index + delta), so a decode step
  needs only its token's index, and the delta moves with the slot's KV (compaction, forks).
"""

from __future__ import annotations

import types
from pathlib import Path

import torch
from torch import nn

from flowrl_operators.engine.embedded.model import CausalLM, DecoderBody, KVCache, head_dim_of

VL_ARCHITECTURES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


class VLBody(nn.Module):
    """`model.language_model` (flowrl's decoder body) and `model.visual` (the HF vision tower)."""

    def __init__(self, text, visual: nn.Module | None) -> None:
        super().__init__()
        self.language_model = DecoderBody(text)
        self.visual = visual

    # The decoder's parts under the names model.py reads (CausalLM.forward, weights.stage).
    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.language_model.embed_tokens

    @property
    def layers(self) -> nn.ModuleList:
        return self.language_model.layers

    @property
    def norm(self) -> nn.Module:
        return self.language_model.norm


class VLKVCache(KVCache):
    """The KV cache plus each slot's mrope delta, copied with the slot's KV."""

    def _allocate(self, slots: int, capacity: int) -> None:
        old = getattr(self, "deltas", None)
        super()._allocate(slots, capacity)
        self.deltas = torch.zeros(slots, dtype=torch.long, device=self.device)
        if old is not None:
            self.deltas[: old.numel()] = old

    def copy(self, source: int, targets: list[int], length: int) -> None:
        super().copy(source, targets, length)
        if targets:
            self.deltas[torch.tensor(targets, device=self.device)] = int(self.deltas[source])


class VLCausalLM(CausalLM):
    """flowrl's decoder with a vision tower and multimodal rotary positions (see the module docs)."""

    cache_class = VLKVCache
    embed_name = "model.language_model.embed_tokens.weight"

    def __init__(self, config, visual: nn.Module | None = None) -> None:
        nn.Module.__init__(self)
        self.full_config = config
        self.config = text_config(config)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.model = VLBody(self.config, visual)
        self.lm_head = None if self.tied else nn.Linear(self.config.hidden_size, self.config.vocab_size, bias=False)
        head_dim = head_dim_of(self.config)
        self.axis = rope_axes(self.config.rope_parameters["mrope_section"], head_dim // 2,
                              interleaved=config.model_type == "qwen3_vl")
        self.deep: list[torch.Tensor] = []  # Qwen3-VL: what each early layer adds in this prefill block
        theta = self.config.rope_parameters.get("rope_theta", 10000.0)
        # A plain fp32 tensor on the CPU (not a buffer: built on meta, to_empty would blank it).
        steps = torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu")
        self.inv_freq = 1.0 / (theta ** (steps / head_dim))
        self.vision = None  # operators/vision.py's Vision of the checkpoint, set by build_vl
        self.image_token_id = config.image_token_id

    def live_name(self, stored: str) -> str:
        if stored.startswith("visual."):
            return "model." + stored
        if stored.startswith("model.") and not stored.startswith(("model.language_model.", "model.visual.")):
            return "model.language_model." + stored.removeprefix("model.")
        return stored

    def rotary(self, cache, positions, rows, seqs):
        if seqs is None:  # decode: every row is text at its index + the slot's delta
            rope = (positions + cache.deltas[rows][:, None]).expand(3, -1, -1)
        else:
            rope = self._prefill_positions(cache, positions, rows, seqs)
        return mrope(self.inv_freq.to(positions.device), self.axis.to(positions.device), rope)

    def _prefill_positions(self, cache, positions, rows, seqs) -> torch.Tensor:
        """[3, B, S] mrope positions of a prefill block (padding: 0); records each row's delta."""
        rope = torch.zeros((3, *positions.shape), dtype=torch.long, device=positions.device)
        for b, seq in enumerate(seqs):
            images = seq.request.images
            if images:
                full, delta = self.vision.positions(seq.tokens, images)
            else:
                full, delta = torch.arange(len(seq.tokens)).expand(3, -1), 0
            first = int(positions[b, 0])
            real = min(positions.shape[1], len(seq.tokens) - first)
            rope[:, b, :real] = full[:, first:first + real].to(rope.device)
            cache.deltas[int(rows[b])] = delta
        return rope

    def after_layer(self, index: int, h: torch.Tensor) -> torch.Tensor:
        return h + self.deep[index] if index < len(self.deep) else h

    def embed(self, tokens, start, seqs):
        h = self.model.embed_tokens(tokens)
        self.deep = []
        if seqs is None:
            return h
        wanted = []  # (row, column in the block, image index in the tower's output, offset in the image)
        refs: list = []
        for b, seq in enumerate(seqs):
            images = seq.request.images
            if not images:
                continue
            lo, hi = int(start[b]), int(start[b]) + tokens.shape[1]
            for ref, (s, e) in zip(images, self.vision.spans(seq.tokens, images), strict=True):
                if s < hi and e > lo:  # the image's placeholders meet this block
                    wanted.append((b, max(s, lo) - lo, len(refs), max(s, lo) - s, min(e, hi) - max(s, lo)))
                    refs.append(ref)
        if not refs:
            return h
        per_image, deep = self.image_embeddings(refs)
        self.deep = [torch.zeros_like(h) for _ in deep]
        for b, column, index, offset, count in wanted:
            for target, source in zip([h, *self.deep], [per_image, *deep], strict=True):
                target[b, column:column + count] = source[index][offset:offset + count].to(h.dtype)
        return h

    def image_embeddings(self, refs: list) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
        """The vision tower's output for each image, [tokens, hidden] (the merged patches), and for
        Qwen3-VL's deepstack layers the features each adds to the decoder after its layer i."""
        pixels = self.vision.pixels(refs)
        visual = self.model.visual
        device, dtype = visual.patch_embed.proj.weight.device, visual.patch_embed.proj.weight.dtype
        grid = pixels["image_grid_thw"].to(device)
        out = visual(pixels["pixel_values"].to(device, dtype), grid_thw=grid)
        sizes = [self.vision.image_tokens(r) for r in refs]
        deep = [list(f.split(sizes)) for f in getattr(out, "deepstack_features", None) or []]
        return list(out.pooler_output.split(sizes)), deep


def rope_axes(section: list[int], half: int, interleaved: bool) -> torch.Tensor:
    """Which position (0 temporal, 1 height, 2 width) each of the `half` rotary frequencies reads.
    Qwen2-VL / Qwen2.5-VL: consecutive groups of `section` sizes, group i axis i % 3. Qwen3-VL
    (interleaved): frequency 3k + 1 height and 3k + 2 width while k < the section's size, else temporal."""
    if not interleaved:  # (on the CPU explicitly: the model is built under torch.device("meta"))
        return torch.cat([torch.full((size,), i % 3, device="cpu") for i, size in enumerate(section)])
    axis = torch.zeros(half, dtype=torch.long, device="cpu")
    for dim in (1, 2):
        axis[dim:section[dim] * 3:3] = dim
    return axis


def mrope(inv_freq: torch.Tensor, axis: torch.Tensor, rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos/sin [B, S, head_dim] for mrope positions [3, B, S], frequency j reading axis[j]."""
    freqs = rope[..., None].float() * inv_freq  # [3, B, S, head_dim / 2]
    freqs = freqs.gather(0, axis.expand(1, *freqs.shape[1:]))[0]
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos(), angles.sin()


def text_config(config):
    """The decoder's config as model.py reads it: the text config, with Qwen2's q/k/v biases."""
    text = config.text_config.to_dict()
    # Qwen2-VL's and Qwen2.5-VL's decoders are Qwen2's, Qwen3-VL's Qwen3's (model.Attention reads it).
    text["model_type"] = "qwen3" if config.model_type == "qwen3_vl" else "qwen2"
    text["vl_model_type"] = config.model_type
    text["tie_word_embeddings"] = bool(getattr(config, "tie_word_embeddings", False))
    if text.get("eos_token_id") is None:
        text["eos_token_id"] = getattr(config, "eos_token_id", None)
    return types.SimpleNamespace(**text)


def vision_tower(config) -> nn.Module:
    """The family's Hugging Face vision module for `config.vision_config` (random weights)."""
    if config.model_type == "qwen3_vl":
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel as Tower
    elif config.model_type == "qwen2_vl":
        from transformers.models.qwen2_vl.modeling_qwen2_vl import (
            Qwen2VisionTransformerPretrainedModel as Tower,
        )
    else:
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel as Tower,
        )
    return Tower._from_config(config.vision_config)


def build_vl(folder: Path, config, dtype: torch.dtype, device) -> VLCausalLM:
    """The model of a VL checkpoint, its weights not yet loaded (model.load_model loads them)."""
    from flowrl_operators.vision import vision

    if config.model_type not in VL_ARCHITECTURES:
        raise ValueError(f"vision-language model_type {config.model_type!r} is not supported by the embedded "
                         f"engine; supported: {', '.join(VL_ARCHITECTURES)}")
    with torch.device("meta"):
        model = VLCausalLM(config)
    model = model.to_empty(device=device).to(dtype)
    # The tower is built for real (not on meta): its rotary tables are buffers no checkpoint holds.
    model.model.visual = vision_tower(config).to(device=device, dtype=dtype)
    model.vision = vision(folder)
    return model
