"""flowrl's own forward pass for the Llama / Qwen2 / Qwen3 decoder family, with a slot KV cache.

The module tree mirrors Hugging Face's, so `named_parameters()` yields the checkpoint's names
(`model.layers.0.self_attn.q_proj.weight`, ...) and weights load and update by those names. The
three families differ only in details read from the config: Qwen2 has biases on q/k/v, Qwen3 has an
RMSNorm on each query/key head, Llama has neither (unless `attention_bias`).

KV cache: one tensor per layer for keys and one for values, shaped
[slots, kv_heads, capacity + 1, head_dim], grown to what admitted requests need (`KVCache.ensure`).
A request owns one slot; the key and value of its token
at position p live at [slot, :, p]. `forward` runs a rectangular block of rows: row b feeds S tokens
starting at position `start[b]` and attends to its own positions 0..start[b]+i. Decoding is S = 1
over the rows 0..B-1; prefilling one request is B = 1 over its slot. The extra column, position
`KVCache.scratch` (= capacity), is written by rows that only fill out a rectangular block and is
never attended to, so filler work cannot touch any request's KV.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ARCHITECTURES = ("llama", "qwen2", "qwen3")


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 whatever the weights' dtype, as the HF reference does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Linear(nn.Linear):
    """nn.Linear plus an optional low-rank adapter: y = x W^T + b + (x A^T) B^T.

    `lora_a` [r, in] and `lora_b` [out, r] (the scale alpha / r already folded into B) are plain
    attributes, not parameters, so the module's parameter names stay the checkpoint's. A LoRA weight
    update sets them (`EmbeddedEngine`); unset, the layer is exactly nn.Linear.
    """

    lora_a: torch.Tensor | None = None
    lora_b: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        if self.lora_a is not None:
            out = out + F.linear(F.linear(x, self.lora_a), self.lora_b)
        return out


class Attention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        qkv_bias = config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False))
        o_bias = config.model_type != "qwen2" and bool(getattr(config, "attention_bias", False))
        hidden = config.hidden_size
        self.q_proj = Linear(hidden, self.heads * self.head_dim, bias=qkv_bias)
        self.k_proj = Linear(hidden, self.kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = Linear(hidden, self.kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = Linear(self.heads * self.head_dim, hidden, bias=o_bias)
        if config.model_type == "qwen3":
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, cos, sin, keys, values, rows, positions, mask, length):
        """x [B, S, hidden]; keys/values: this layer's whole cache [slots, kv_heads, capacity + 1, head_dim].

        `rows` picks the B cache rows: a slice (decode: rows 0..B-1, read without copying) or a
        tensor of slot numbers (prefill: any slots, read through a gather).
        """
        batch, steps, _ = x.shape
        q = self.q_proj(x).view(batch, steps, self.heads, self.head_dim)
        k = self.k_proj(x).view(batch, steps, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, steps, self.kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        # Write this block's keys/values into the cache, then attend over the cached prefix.
        if isinstance(rows, slice):
            keys, values = keys[rows], values[rows]
            index = torch.arange(batch, device=x.device)[:, None]
        else:
            index = rows[:, None]
        keys[index, :, positions] = k
        values[index, :, positions] = v
        if isinstance(rows, slice):
            keys, values = keys[:, :, :length], values[:, :, :length]
        else:
            keys, values = keys[:, :, :length][rows], values[:, :, :length][rows]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, steps, self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_proj = Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DecoderBody(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        # Given its weight, nn.Embedding skips its random init: on the meta device that init
        # imports torch._dynamo (~1.8 s of a run's set-up), and load_model overwrites it anyway.
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """The decoder with its language-model head; parameter names are the HF checkpoint's."""

    embed_name = "model.embed_tokens.weight"  # the parameter a tied head shares
    cache_class: type[KVCache]  # set below the class KVCache (the VL model's cache keeps more)

    def __init__(self, config) -> None:
        super().__init__()
        check_config(config)
        self.config = config
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.model = DecoderBody(config)
        # A tied head has no parameter of its own (HF's named_parameters() omits it too).
        self.lm_head = None if self.tied else nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def live_name(self, stored: str) -> str:
        """The parameter name of a tensor name in the checkpoint's files (the same for text models)."""
        return stored

    def head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.tied else self.lm_head.weight

    def rotary(self, cache: KVCache, positions: torch.Tensor, rows: slice | torch.Tensor,
               seqs: list | None) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos/sin [B, S, head_dim] of the block's positions (the VL model's differ: model_vl.py)."""
        return cache.cos[positions], cache.sin[positions]

    def embed(self, tokens: torch.Tensor, start: torch.Tensor, seqs: list | None) -> torch.Tensor:
        """The block's input embeddings (the VL model puts image embeddings at placeholders)."""
        return self.model.embed_tokens(tokens)

    def after_layer(self, index: int, h: torch.Tensor) -> torch.Tensor:
        """Decoder layer `index`'s output as the next layer reads it (Qwen3-VL adds image features)."""
        return h

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, start: torch.Tensor, cache: KVCache, rows: slice | torch.Tensor,
                length: int, last: torch.Tensor | None = None, all_logits: bool = False,
                lengths: torch.Tensor | None = None, seqs: list | None = None) -> torch.Tensor:
        """Feed tokens [B, S] to B cache rows, row b starting at position start[b].

        `rows`: a slice of cache rows, or a tensor of B slot numbers. `length` = max(start) + S, the
        cached prefix the block attends over. Returns fp32 logits [B, vocab] at position `last[b]`
        of each row (default: the last column), or of every position [B, S, vocab] with all_logits.
        Right-padded rows are fine: with `lengths` (real tokens per row) the padding goes to the
        scratch position, so it never writes a position that any row (or another request that later
        copies this row's prefix) reads; without it, padding writes beyond the row's real tokens,
        which are masked until the row's own later tokens overwrite them. `seqs` (prefill: the
        request of each row) is read by models whose rows need more than their tokens (images).
        """
        batch, steps = tokens.shape
        columns = torch.arange(steps, device=tokens.device)
        positions = start[:, None] + columns  # [B, S]
        if lengths is not None:
            positions = positions.masked_fill(columns >= lengths[:, None], cache.scratch)
        # Key t is visible to query (b, i) iff t <= positions[b, i] (causal within the row's slot).
        mask = (torch.arange(length, device=tokens.device) <= positions[:, :, None])[:, None]
        dtype = self.model.embed_tokens.weight.dtype
        cos, sin = self.rotary(cache, positions, rows, seqs)
        cos, sin = cos.to(dtype), sin.to(dtype)
        h = self.embed(tokens, start, seqs)
        for index, (layer, keys, values) in enumerate(zip(self.model.layers, cache.keys, cache.values, strict=True)):
            attn_in = layer.input_layernorm(h)
            h = h + layer.self_attn(attn_in, cos, sin, keys, values, rows, positions, mask, length)
            h = self.after_layer(index, h + layer.mlp(layer.post_attention_layernorm(h)))
        if not all_logits:
            h = h[:, -1] if last is None else h[torch.arange(batch, device=h.device), last]
        return (self.model.norm(h) @ self.head_weight().T).float()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding on [B, S, heads, head_dim] (the half-split convention of HF Llama)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, :, None] + rotated * sin[:, :, None]


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def check_config(config) -> None:
    if config.model_type not in ARCHITECTURES:
        raise ValueError(
            f"model_type {config.model_type!r} is not supported by the embedded engine; "
            f"supported: {', '.join(ARCHITECTURES)}"
        )
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {config.hidden_act!r} is not supported; the engine implements silu")
    if getattr(config, "use_sliding_window", False):
        raise ValueError("sliding-window attention is not supported by the embedded engine")


class KVCache:
    """Per-layer key/value tensors [slots, kv_heads, capacity + 1, head_dim], plus the RoPE tables.

    Sized by need: it starts empty and `ensure(slots, length)` grows it (copying what it holds) to the
    slots and positions the admitted requests need (prompt + max_new_tokens each), never beyond
    `max_slots` x `max_context`; a model's max_position_embeddings is only the limit of max_context,
    not an allocation. Capacity grows in steps of `GROW` positions, slots to the next power of two,
    so growth is rare. Positions 0..capacity-1 hold requests' tokens; position `scratch`
    (= capacity) is a dump for filler rows (a free or just-prefilled slot inside a decoded block of
    rows). Requests never reach it (a request needs at most its admitted length, which the capacity
    covers) and so never attend to it.
    """

    GROW = 64

    def __init__(self, config, max_slots: int, max_context: int, dtype: torch.dtype, device: torch.device) -> None:
        self.config, self.dtype, self.device = config, dtype, device
        self.max_slots, self.max_context = max_slots, max_context
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.slots = self.capacity = 0
        self._allocate(1, min(self.GROW, max_context))

    @property
    def scratch(self) -> int:
        return self.capacity

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def ensure(self, slots: int, length: int) -> None:
        """Room for `slots` slots of `length` positions each (both capped at the maximum)."""
        slots, length = min(slots, self.max_slots), min(length, self.max_context)
        if slots <= self.slots and length <= self.capacity:
            return
        grown_slots = self.slots if slots <= self.slots else min(self.max_slots, 1 << (slots - 1).bit_length())
        grown = self.capacity if length <= self.capacity else min(
            self.max_context, -(-length // self.GROW) * self.GROW)
        self._allocate(grown_slots, grown)

    def copy(self, source: int, targets: list[int], length: int) -> None:
        """Copy positions 0..length-1 of slot `source` into each slot of `targets` (a shared prefix)."""
        if not targets or length <= 0:
            return
        index = torch.tensor(targets, device=self.device)
        for store in (self.keys, self.values):
            for layer in store:
                layer[index, :, :length] = layer[source, :, :length]

    def _allocate(self, slots: int, capacity: int) -> None:
        shape = (slots, self.config.num_key_value_heads, capacity + 1, head_dim_of(self.config))
        old_slots, old_capacity = self.slots, self.capacity
        for store in (self.keys, self.values):
            for i in range(self.config.num_hidden_layers):
                fresh = torch.zeros(shape, dtype=self.dtype, device=self.device)
                if store[i:]:  # keep every position requests hold (the old scratch column is not one)
                    fresh[:old_slots, :, :old_capacity] = store[i][:, :, :old_capacity]
                    store[i] = fresh
                else:
                    store.append(fresh)
        self.slots, self.capacity = slots, capacity
        self.cos, self.sin = rope_tables(self.config, capacity + 1, self.device)


CausalLM.cache_class = KVCache


def rope_tables(config, max_context: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos/sin [max_context, head_dim] for every position, computed as HF computes them."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        dim = head_dim_of(config)
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        scale = 1.0
    else:  # llama3, yarn, ...: reuse transformers' published frequency formulas
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    freqs = torch.arange(max_context, dtype=torch.float)[:, None] * inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    return (angles.cos() * scale).to(device), (angles.sin() * scale).to(device)


def end_token_ids(folder: Path, config) -> frozenset[int]:
    """The model's end-of-sequence ids: config.json's `eos_token_id` and generation_config.json's
    (an int or a list in either; instruct models often list their end-of-turn token only in the
    latter, e.g. Llama 3's <|eot_id|>)."""
    import json

    found: set[int] = set()
    sources = [config.eos_token_id]
    generation = folder / "generation_config.json"
    if generation.exists():
        sources.append(json.loads(generation.read_text()).get("eos_token_id"))
    for eos in sources:
        found.update([] if eos is None else [eos] if isinstance(eos, int) else eos)
    return frozenset(found)
