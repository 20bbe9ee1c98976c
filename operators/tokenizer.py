"""The built-in models' tokenizer, and the Hugging Face helpers every model module shares.

The ground floor of models.py (the text built-ins, checkpoint folders), models_vl.py (the
vision-language built-ins) and vision.py (a VL checkpoint's image facts): it imports none of them.
"""

from __future__ import annotations

import string
import threading

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
