"""How a trainer's model is loaded and made ready (trainer.py): the Hugging Face model for its head,
each parameter in its own allocation, dropout off, and gradient checkpointing."""

from __future__ import annotations

from pathlib import Path

import torch

from flowrl_operators.models import is_vl
from flowrl_operators.training.vl_inputs import vl_value_model


def own_storage(model: torch.nn.Module) -> None:
    """Each parameter in its own fresh allocation. Loaded from a folder, the weights lie wherever the
    loader put them, at an alignment that changes from one process to the next, and MKL's float
    sums follow the alignment: two runs of a phase that starts from an export (the quickstart's
    GRPO phase) differed by ~1e-6, and `flowrl replay` could not reproduce them. With this they are
    equal bit for bit (the allocator aligns every block)."""
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.data = parameter.data.clone()


def load_model(path: Path, head: str):
    from transformers import AutoModelForTokenClassification

    from flowrl_operators.models import auto_class
    from flowrl_operators.tokenizer import silence_hf

    silence_hf()
    if head == "value" and is_vl(path):
        return vl_value_model(path)
    if head == "value":
        # verl's critic shape: the backbone with a 1-output token head (initialised from the seed).
        return AutoModelForTokenClassification.from_pretrained(
            str(path), num_labels=1, local_files_only=True, dtype=torch.float32
        )
    # AutoModelForCausalLM, or a vision-language policy's AutoModelForImageTextToText
    return auto_class(path).from_pretrained(str(path), local_files_only=True, dtype=torch.float32)


def disable_dropout(model: torch.nn.Module) -> None:
    """RL needs the trainer's logprobs and values to be the engine's function of the weights; dropout
    (e.g. the 0.1 before a token-classification head) would make them random."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    if hasattr(model.config, "attention_dropout"):
        model.config.attention_dropout = 0.0


def checkpoint_layers(model: torch.nn.Module) -> None:
    """Recompute each decoder layer in backward (transformers 5 renamed the method)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
