"""Model checkpoints: `resolve_model(path)` turns a model path from YAML into a local Hugging Face
checkpoint directory (config.json + safetensors + tokenizer).

A plain path must already be such a directory. `builtin:<name>` names a tiny model flowrl builds
itself: a Llama / Qwen2 / Qwen3 config with deterministic random weights (fixed seed) and a real
`tokenizers` character-level tokenizer with a chat template. It is built once into a cache folder
(`$FLOWRL_CACHE/models/<name>`, default `~/.cache/flowrl/models/<name>`) and from then on loaded
like any checkpoint, offline. Nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from flowrl_operators.models_vl import SUPPORTED, VL_MODELS, build_vl_model
from flowrl_operators.models_vl import spec as vl_spec
from flowrl_operators.tokenizer import (
    BUILD_LOCK,
    CHARACTERS,
    CHAT_TEMPLATE,
    EOS,
    IM_END,
    RECIPE,
    SEED,
    SPECIAL_TOKENS,
    build_tokenizer,
    silence_hf,
)

BUILTIN_PREFIX = "builtin:"

# name -> (architecture, config keys). Vocabulary ids are filled in from the tokenizer.
_SMALL = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=384, max_position_embeddings=1024, tie_word_embeddings=True)
BUILTIN_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    # ~0.44M parameters; the default model of the CPU quickstart.
    "tiny-qwen2": ("qwen2", dict(_SMALL, rope_theta=10000.0)),
    "tiny-llama": ("llama", dict(_SMALL, num_key_value_heads=4, rope_theta=10000.0)),
    "tiny-qwen3": ("qwen3", dict(_SMALL, head_dim=32, rope_theta=10000.0)),
    # ~3.2M parameters, the same tokenizer: the teacher of pipelines/distill.yaml (twice as wide and
    # deep as tiny-qwen2, so it shares the student's vocabulary but not its size).
    "tiny-qwen2-large": ("qwen2", dict(_SMALL, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                                       num_key_value_heads=4, intermediate_size=768, rope_theta=10000.0)),
    # The shape of Qwen2.5-0.5B (its layers and padded vocabulary) with random weights, for GPU
    # checks; ~0.5B parameters, about 2 GB on disk. The tokenizer is still character level.
    "qwen2-0.5b-shape": ("qwen2", dict(
        hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        intermediate_size=4864, max_position_embeddings=4096, tie_word_embeddings=True,
        rope_theta=1000000.0, vocab_size=151936, torch_dtype="bfloat16")),
}


def cache_root() -> Path:
    return Path(os.environ.get("FLOWRL_CACHE", Path.home() / ".cache" / "flowrl")) / "models"


def resolve_model(path: str | os.PathLike) -> Path:
    """A local HF checkpoint directory for `path` (a directory, or `builtin:<name>`, built on demand)."""
    text = str(path)
    if text.startswith(BUILTIN_PREFIX):
        with BUILD_LOCK:
            return _builtin_dir(text[len(BUILTIN_PREFIX):])
    folder = Path(text).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(
            f"model path {text!r} is not a directory; give a local Hugging Face checkpoint folder "
            f"or one of {', '.join(BUILTIN_PREFIX + n for n in builtin_names())}"
        )
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"model path {text!r} has no config.json; it must be a Hugging Face checkpoint folder "
            "(config.json, *.safetensors, tokenizer files)"
        )
    return folder


def load_tokenizer(path: str | os.PathLike):
    """The checkpoint's tokenizer through `AutoTokenizer`, offline."""
    from transformers import AutoTokenizer

    silence_hf()
    return AutoTokenizer.from_pretrained(str(resolve_model(path)), local_files_only=True)


def load_config(path: str | os.PathLike):
    from transformers import AutoConfig

    silence_hf()
    return AutoConfig.from_pretrained(str(resolve_model(path)), local_files_only=True)


def auto_class(path: str | os.PathLike):
    """The transformers auto class of the checkpoint: `AutoModelForImageTextToText` for a
    vision-language model (operators/vision.py), else `AutoModelForCausalLM`."""
    import transformers

    return transformers.AutoModelForImageTextToText if is_vl(path) else transformers.AutoModelForCausalLM


def model_type(model: str | os.PathLike) -> str:
    """The `model_type` of a checkpoint's config.json (a built-in is built first)."""
    return json.loads((resolve_model(model) / "config.json").read_text()).get("model_type", "")


def is_vl(model: str | os.PathLike) -> bool:
    """Whether the checkpoint (a folder or `builtin:<name>`) is a vision-language model flowrl runs."""
    return model_type(model) in SUPPORTED


def load_hf_model(path: str | os.PathLike, dtype: Any = None):
    """The checkpoint as a Hugging Face model (`auto_class`: the reference and the trainer's model)."""
    import torch

    silence_hf()
    with BUILD_LOCK:
        return auto_class(path).from_pretrained(
            str(resolve_model(path)), local_files_only=True, dtype=dtype or torch.float32
        )


# --- built-in models ------------------------------------------------------------------------------


def builtin_folder(name: str) -> Path:
    """The folder of built-in model `name`, built on first use: what each name of the entry-point
    group `flowrl.models` (pyproject.toml) loads to, so flowrl resolves `builtin:` paths by name."""
    return resolve_model(BUILTIN_PREFIX + name)


def builtin_names() -> list[str]:
    """Every `builtin:` model: the text ones here, the vision-language ones in models_vl.py."""
    return list(BUILTIN_MODELS) + list(VL_MODELS)


def _fingerprint(name: str) -> str:
    model = vl_spec(name) if name in VL_MODELS else BUILTIN_MODELS[name]
    recipe = {"recipe": RECIPE, "seed": SEED, "model": model, "chars": CHARACTERS,
              "special": SPECIAL_TOKENS, "template": CHAT_TEMPLATE}
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def _builtin_dir(name: str) -> Path:
    if name not in builtin_names():
        known = ", ".join(BUILTIN_PREFIX + n for n in builtin_names())
        raise ValueError(f"unknown built-in model {BUILTIN_PREFIX + name!r}; known: {known}")
    final = cache_root() / name
    stamp = final / "flowrl_builtin.json"
    fingerprint = _fingerprint(name)
    if stamp.is_file() and json.loads(stamp.read_text()).get("fingerprint") == fingerprint:
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    # Build in a private folder next to the final one, then rename: a rename is atomic, so a
    # concurrent process sees either no model or a complete one, never a half-written folder.
    scratch = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=final.parent))
    try:
        build_model(name, scratch)
        (scratch / "flowrl_builtin.json").write_text(json.dumps({"name": name, "fingerprint": fingerprint}))
        if final.exists():
            # A stale build (recipe changed) or a concurrent winner: move it aside, keep ours.
            stale = Path(tempfile.mkdtemp(prefix=f".{name}-stale-", dir=final.parent))
            try:
                os.rename(final, stale / "old")
            except FileNotFoundError:
                pass
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.rename(scratch, final)
        except OSError:
            # Another process renamed its (identical) build into place between our two renames.
            if not stamp.is_file():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return final


def build_model(name: str, folder: Path) -> None:
    """Write the built-in model `name` (config, weights, tokenizer) into `folder`."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    if name in VL_MODELS:
        return build_vl_model(name, folder)
    silence_hf()
    arch, keys = BUILTIN_MODELS[name]
    keys = dict(keys)
    tokenizer = build_tokenizer()
    # Chat turns end with <|im_end|>; plain completions with <|endoftext|>: both stop generation.
    eos_ids = [tokenizer.convert_tokens_to_ids(EOS), tokenizer.convert_tokens_to_ids(IM_END)]
    config_class = {"qwen2": Qwen2Config, "llama": LlamaConfig, "qwen3": Qwen3Config}[arch]
    dtype = getattr(torch, keys.pop("torch_dtype", "float32"))
    config = config_class(
        vocab_size=keys.pop("vocab_size", len(tokenizer)),
        bos_token_id=None,
        eos_token_id=eos_ids,
        pad_token_id=tokenizer.pad_token_id,
        **keys,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = eos_ids
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.to(dtype).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def image_model_problems(name: Any, model: dict[str, Any]) -> list[tuple[tuple[str, ...], str]]:
    """A source whose samples (or whose task's episodes) carry images (its `images` attribute is
    truthy: a file source's image column, a visual task) needs a vision-language model; for
    `flowrl validate` (Generate.check_data)."""
    path = str(model.get("path", ""))
    if path.startswith(BUILTIN_PREFIX):
        kind = BUILTIN_MODELS.get(path.removeprefix(BUILTIN_PREFIX), (None,))[0]
    else:
        config = Path(path).expanduser() / "config.json"
        kind = json.loads(config.read_text()).get("model_type") if config.is_file() else None
    if kind is None or kind in SUPPORTED:  # a VL model, or one refs.py reports already
        return []
    what = name if isinstance(name, str) else "this data source"
    return [(("model", "path"), f"{what} gives the model images, but '{path}' is a text-only model ({kind}); "
                                f"use a vision-language one: builtin:tiny-qwen2-vl, or a Qwen2-VL, Qwen2.5-VL or "
                                f"Qwen3-VL folder")]
