"""How the embedded engine takes a new version: stage every tensor aside, check the whole, swap it in.

Names are the checkpoint's (`model.layers.0.mlp.up_proj.weight`); a tied head's `lm_head.weight` is
the embedding. Two more kinds of name carry LoRA adapters (what a train node with `lora: {sync:
adapter}` sends): `<module>.lora_A.weight` [r, in] and `<module>.lora_B.weight` [out, r], the
scale alpha / r folded into B, for a linear module of the model. The engine keeps its base weights
and adds (x A^T) B^T to that module's output (`model.Linear`), which equals the merged model's
output up to rounding. A version must carry both halves of every adapter it names.

Staging copies each tensor to the engine's device and dtype, unless the stream owns its tensors
(`Stream.owned`: nobody changes them after this version) and they are right already: then the
tensor itself is kept. Applying swaps the staged tensors in (`param.data = tensor`, adapters set
as attributes): no copy, the old tensors are freed, and the engine never writes into a tensor it
holds, so one tensor may serve several engines of the same version.
"""

from __future__ import annotations

import torch

from flowrl_operators.engine.embedded.model import CausalLM, Linear

ADAPTER_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


def _adapter(model: CausalLM, name: str) -> tuple[str, Linear, int] | None:
    """(module name, module, 0 for A / 1 for B) when `name` names an adapter half, else None."""
    for half, suffix in enumerate(ADAPTER_SUFFIXES):
        if name.endswith(suffix):
            module_name = name[: -len(suffix)]
            try:
                module = model.get_submodule(module_name)
            except AttributeError:
                module = None
            if not isinstance(module, Linear):
                raise KeyError(f"weight update names an adapter {name!r} for {module_name!r}, which is not "
                               "a linear layer of this model")
            return module_name, module, half
    return None


def stage(model: CausalLM, bucket, device: torch.device, owned: bool = False) -> dict[str, torch.Tensor]:
    """Check one bucket of (name, tensor) against the model and set it aside (see the module docs).
    Raises on an unknown name or a wrong shape; touches nothing live."""
    params = dict(model.named_parameters())
    dtype = model.model.embed_tokens.weight.dtype
    staged = {}
    for name, tensor in bucket:
        if name == "lm_head.weight" and model.tied:
            name = model.embed_name  # a tied head is the embedding (trainers send both)
        tensor = torch.as_tensor(tensor).detach()
        adapter = _adapter(model, name)
        if adapter is not None:
            _, module, half = adapter
            want = module.in_features if half == 0 else module.out_features
            if tensor.ndim != 2 or tensor.shape[1 - half] != want:
                raise ValueError(f"adapter {name} has shape {tuple(tensor.shape)}; expected "
                                 f"{'[r, ' + str(want) + ']' if half == 0 else '[' + str(want) + ', r]'}")
            target = dtype
        elif name not in params:
            raise KeyError(f"weight update names {name!r}, which this model does not have "
                           f"(expected HF names such as {next(iter(params))!r})")
        else:
            target = params[name].dtype
            if tuple(tensor.shape) != tuple(params[name].shape):
                raise ValueError(f"weight update for {name} has shape {tuple(tensor.shape)}, "
                                 f"the model has {tuple(params[name].shape)}")
        keep = owned and tensor.device == device and tensor.dtype == target and tensor.is_contiguous()
        staged[name] = tensor if keep else tensor.to(device, target, copy=True)
    return staged


def check(model: CausalLM, staged: dict[str, torch.Tensor]) -> None:
    """A whole version's adapters come in pairs of one rank each; raises before anything changes."""
    halves: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in staged.items():
        adapter = _adapter(model, name)
        if adapter is not None:
            halves.setdefault(adapter[0], {})[adapter[2]] = tensor
    for module, pair in halves.items():
        if len(pair) != 2:
            raise ValueError(f"weight update carries only {module}{ADAPTER_SUFFIXES[next(iter(pair))]}; "
                             "an adapter needs its lora_A and lora_B together")
        if pair[0].shape[0] != pair[1].shape[1]:
            raise ValueError(f"adapter of {module}: lora_A has rank {pair[0].shape[0]}, lora_B {pair[1].shape[1]}")


@torch.no_grad()
def apply(model: CausalLM, staged: dict[str, torch.Tensor]) -> None:
    """Swap a checked version in (between two engine steps)."""
    params = dict(model.named_parameters())
    for name, tensor in staged.items():
        adapter = _adapter(model, name)
        if adapter is None:
            params[name].data = tensor
        elif adapter[2] == 0:
            adapter[1].lora_a = tensor
        else:
            adapter[1].lora_b = tensor
