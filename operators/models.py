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
import string
import tempfile
import threading
from pathlib import Path
from typing import Any

BUILTIN_PREFIX = "builtin:"
SEED = 1234
# Bump when the build recipe changes in a way the spec fingerprint does not capture.
RECIPE = 1

PAD, UNK, EOS = "<|pad|>", "<|unk|>", "<|endoftext|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, UNK, EOS, IM_START, IM_END]
# Every printable ASCII character except the whitespace ones we add explicitly.
CHARACTERS = string.digits + string.ascii_letters + string.punctuation + " \n"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

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


# Building a model is not thread-safe: transformers' from_pretrained switches process-wide weight-init
# flags and patches torch's init functions, and fork_rng + manual_seed share torch's global RNG (seen:
# "Cannot copy out of meta tensor" when the reference, critic and trainer set up together). The runtime
# sets stages up together, so every model build in this process holds this lock; a trainer in a child
# process of its own still builds alongside.
BUILD_LOCK = threading.RLock()


def import_transformers() -> None:
    """Import transformers in this thread, before setup work moves to threads: two threads that
    import it for the first time at once can fail ("cannot import name 'AutoModelForCausalLM' from
    'transformers'": one sees the package half-initialised; reproduced here with two threads, and
    seen when the runtime set up the engine and the trainer together)."""
    import transformers  # noqa: F401


def silence_hf() -> None:
    """Hugging Face prints progress bars and advisory warnings on save/load; they drown test logs."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    try:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    except ImportError:  # pragma: no cover - huggingface_hub always ships with transformers
        pass


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

    from flowrl_operators.vision import is_vl

    return transformers.AutoModelForImageTextToText if is_vl(path) else transformers.AutoModelForCausalLM


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
    from flowrl_operators.models_vl import VL_MODELS

    return list(BUILTIN_MODELS) + list(VL_MODELS)


def _fingerprint(name: str) -> str:
    from flowrl_operators import models_vl

    model = models_vl.spec(name) if name in models_vl.VL_MODELS else BUILTIN_MODELS[name]
    spec = {"recipe": RECIPE, "seed": SEED, "model": model, "chars": CHARACTERS,
            "special": SPECIAL_TOKENS, "template": CHAT_TEMPLATE}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


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


def build_tokenizer(extra_special: list[str] | None = None, chat_template: str = CHAT_TEMPLATE):
    """A character-level `PreTrainedTokenizerFast`: one token per character, specials first
    (`extra_special` tokens, e.g. a VL family's vision tokens, go after the characters so that text
    ids stay those of the text built-ins).

    It is written as a byte-level BPE without merges (the pipeline of Qwen2/Llama-3 tokenizers):
    transformers 5 loads any `qwen2` checkpoint through `Qwen2Tokenizer`, which rebuilds exactly
    that pipeline from the saved vocabulary, so the tokenizer must already have that shape to
    survive a reload. With no merges every character is its own token. Characters outside
    CHARACTERS (non-ASCII) have no token and are dropped by the encoder.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    symbol = _byte_symbols()
    extra = list(extra_special or [])
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + [symbol[ord(c)] for c in CHARACTERS] + extra)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False, byte_fallback=False))
    core.normalizer = normalizers.NFC()
    core.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        unk_token=UNK,
        eos_token=EOS,
        additional_special_tokens=[IM_START, IM_END, *extra],
        chat_template=chat_template,
        clean_up_tokenization_spaces=False,
    )


# The word-splitting regex of Qwen2's tokenizer (transformers, models/qwen2): Qwen2Tokenizer rebuilds
# with it on load. With no merges it changes no ids; it is here so both loaders agree exactly.
_QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def _byte_symbols() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level tokenizers."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    symbols, extra = {}, 0
    for b in range(256):
        if b in printable:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + extra)
            extra += 1
    return symbols


def build_model(name: str, folder: Path) -> None:
    """Write the built-in model `name` (config, weights, tokenizer) into `folder`."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    from flowrl_operators.models_vl import VL_MODELS, build_vl_model

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
