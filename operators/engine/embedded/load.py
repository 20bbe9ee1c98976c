"""Loading a checkpoint folder into the embedded engine's model: the text decoder (model.py) or,
for a vision-language checkpoint, the decoder with its vision tower (model_vl.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from flowrl_operators.engine.embedded.model import CausalLM
from flowrl_operators.engine.embedded.model_vl import build_vl
from flowrl_operators.tokenizer import BUILD_LOCK


def load_model(folder: Path, dtype: torch.dtype, device: torch.device | str):
    """Build the model for a checkpoint folder and load its safetensors by HF name."""
    from transformers import AutoConfig

    with BUILD_LOCK:  # see BUILD_LOCK: other stages may build theirs in other threads meanwhile
        config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
        if hasattr(config, "vision_config"):  # a vision-language checkpoint
            model = build_vl(folder, config, dtype, device)
        else:
            with torch.device("meta"):
                model = CausalLM(config)
            model = model.to_empty(device=device).to(dtype)
    load_weights(model, folder)
    model.eval()
    return model


def load_weights(model: CausalLM, folder: Path) -> None:
    """Copy the folder's safetensors into the model's parameters, by name; every parameter must come."""
    from safetensors import safe_open

    params = dict(model.named_parameters())
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} has no *.safetensors weights")
    loaded = set()
    for file in files:
        # One tensor at a time (not load_file's whole dict): loading holds the model plus one tensor.
        with safe_open(str(file), "pt") as reader:
            for stored in reader.keys():  # noqa: SIM118 - safe_open has keys(), not iteration
                name = model.live_name(stored)
                if name in params and not (name == "lm_head.weight" and model.tied):
                    _load_one(params[name], reader.get_tensor(stored), name, file)
                    loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"{folder}: checkpoint lacks {len(missing)} parameters, e.g. {missing[:3]}")


def _load_one(param: torch.Tensor, tensor: torch.Tensor, name: str, file: Path) -> None:
    if param.shape != tensor.shape:
        raise ValueError(f"{file.name}: {name} has shape {tuple(tensor.shape)}, "
                         f"the config implies {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(tensor)
