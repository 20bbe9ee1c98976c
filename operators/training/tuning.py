"""Which parameters of a policy train, and what a new version must send to the engines.

Three train-node keys end here: `freeze` (fnmatch patterns over the Hugging Face parameter names;
matched parameters get requires_grad False, so no gradient and no optimizer state), `lora` (peft
adapters on the named linear modules; the base is frozen) and `gradient_checkpointing` (the trainer
enables it on the model).

What a version sends. The engines start from the same `model.path` as the trainer, so a parameter
that never trains already has its value there: a train step publishes only what it can have
changed (`changed_tensors`): the trainable parameters; with LoRA the adapters (`sync: adapter`,
`A` and `scale * B` under `<module>.lora_A.weight` / `<module>.lora_B.weight`, which the embedded
engine adds next to its base weights) or the merged weights of the adapted modules
(`sync: merged`, base + scale * B @ A under the base weight's name, for any engine). A restored
policy publishes everything. Tensors that never change (`frozen_tensors`: frozen parameters, LoRA's
base) need no copy: in one process the first version hands them over as they are, and the embedded
engine adopts them, so trainer and engine hold one copy of them between them. With LoRA the base
is also the reference policy (`base_logprobs`): a KL term needs no reference node.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator
from typing import Any

import torch

PEFT_PREFIX = "base_model.model."
VISION_PREFIX = "model.visual."  # a VL model's vision tower; `freeze: [vision]` (training/vl_inputs.py)
ADAPTER = "default"  # peft's name for the one adapter flowrl trains


def frozen(names: list[str], patterns: list[str]) -> tuple[set[str], list[tuple[tuple, str]]]:
    """The names the patterns match, and a (key path, message) for each pattern that matches none."""
    matched: set[str] = set()
    problems: list[tuple[tuple, str]] = []
    for i, pattern in enumerate(patterns):
        if pattern == "vision":  # the keyword: a vision-language model's vision tower
            if not any(n.startswith(VISION_PREFIX) for n in names):
                problems.append((("freeze", i), "'vision' freezes a vision tower, and this model has none "
                                 "(it is text-only); remove it"))
            pattern = VISION_PREFIX + "*"
        hits = {n for n in names if fnmatch.fnmatchcase(n, pattern)}
        if not hits:
            problems.append((("freeze", i), f"{pattern!r} matches no parameter; names look like "
                             f"{names[min(1, len(names) - 1)]!r} (shell patterns: * ? [0-9])"))
        matched |= hits
    if names and matched == set(names):
        problems.append((("freeze",), "these patterns freeze every parameter; nothing would train"))
    return matched, problems


def check(model_path: str, freeze: list[str], lora: Any) -> list[tuple[tuple, str]]:
    """What is wrong with `freeze` / `lora` for this checkpoint, found on a weightless (meta) model."""
    from flowrl_operators.models import auto_class, load_config

    if freeze and lora is not None:
        return [(("freeze",), "with lora only the adapters train (the base is frozen already); remove freeze")]
    with torch.device("meta"):
        model = auto_class(model_path).from_config(load_config(model_path))
    problems = frozen([n for n, _ in model.named_parameters()], freeze)[1]
    if lora is not None:
        linear = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        for i, target in enumerate(lora.target_modules):
            if target not in linear:
                problems.append((("lora", "target_modules", i), f"{target!r} names no linear module of this "
                                 f"model; it has {', '.join(sorted(linear))}"))
    return problems


def prepare(model: torch.nn.Module, freeze: list[str], lora: Any) -> torch.nn.Module:
    """Freeze by pattern, or wrap the model with LoRA adapters (returns the model to train)."""
    names = [n for n, _ in model.named_parameters()]
    matched, problems = frozen(names, freeze)
    if problems:
        raise ValueError(f"freeze{''.join(f'[{k}]' for k in problems[0][0][1:])}: {problems[0][1]}")
    for name, param in model.named_parameters():
        if name in matched:
            param.requires_grad_(False)
    if lora is None:
        return model
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                        target_modules=list(lora.target_modules), bias="none")
    return get_peft_model(model, config)


def is_peft(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config")


def hf_name(name: str) -> str:
    """A parameter's checkpoint name from its name inside a peft model."""
    return name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


def lora_layers(model: torch.nn.Module) -> Iterator[tuple[str, Any]]:
    """(checkpoint name of the module, peft LoRA layer) for every adapted module."""
    from peft.tuners.lora import LoraLayer

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and ADAPTER in module.lora_A:
            yield name.removeprefix(PEFT_PREFIX), module


@torch.no_grad()
def merged_weight(layer: Any) -> torch.Tensor:
    """base + scale * B @ A of one adapted module, a new tensor."""
    base = layer.get_base_layer().weight
    return base.detach() + layer.get_delta_weight(ADAPTER).to(base.dtype)


@torch.no_grad()
def adapter_tensors(model: torch.nn.Module, sync: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors one LoRA version sends (see the module docs); each a new tensor."""
    for module, layer in lora_layers(model):
        if sync == "merged":
            yield f"{module}.weight", merged_weight(layer)
        else:
            scale = layer.scaling[ADAPTER]
            yield f"{module}.lora_A.weight", layer.lora_A[ADAPTER].weight.detach().clone()
            yield f"{module}.lora_B.weight", layer.lora_B[ADAPTER].weight.detach() * scale


def merged_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model with its adapters merged, under checkpoint names (for export)."""
    merged = {f"{module}.weight": merged_weight(layer) for module, layer in lora_layers(model)}
    state = {}
    for name, tensor in model.state_dict().items():
        if ".lora_" in name:
            continue
        name = hf_name(name)
        state[name] = merged.get(name, tensor.detach())
    return state


def frozen_tensors(model: torch.nn.Module, lora: Any) -> dict[str, torch.Tensor]:
    """Checkpoint name -> live tensor of every parameter that never changes (frozen, or LoRA's base;
    with `sync: merged` not the adapted modules' weights, which the merged ones replace)."""
    adapted = {f"{m}.weight" for m, _ in lora_layers(model)} if lora is not None and lora.sync == "merged" else set()
    out = {}
    for name, param in model.named_parameters():
        name = hf_name(name)
        if not param.requires_grad and name not in adapted:
            out[name] = param.detach()
    return out


def changed_tensors(model: torch.nn.Module, lora: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """What a train step can have changed: adapters (or merged adapted weights), else the trainable
    parameters (live tensors: the caller copies or ships them before the next step)."""
    if lora is not None:
        yield from adapter_tensors(model, lora.sync)
        return
    for name, param in model.named_parameters():
        if param.requires_grad:
            yield name, param


def base_logprobs(trainer: Any, batch: Any) -> torch.Tensor:
    """Logprobs of the batch under the LoRA model's base, its adapters disabled: the initial policy
    (the base never trains), so a KL term needs no reference node and no second copy of the model."""
    with trainer.model.disable_adapter():
        return trainer.compute_logprobs(batch)
