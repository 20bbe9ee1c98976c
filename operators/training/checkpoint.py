"""Checkpoints of a Trainer: torch DCP, written atomically; and Hugging Face export.

A checkpoint directory holds
    dcp/             model and optimizer state, sharded (torch.distributed.checkpoint)
    trainer.pt       scheduler state, step, policy version, skipped-step counters (rank 0)
    rng_rank{r}.pt   each rank's RNG state (torch CPU, CUDA, python `random`)
    meta.json        step and policy version, for people and tools

Atomicity: everything is written into `.{name}.tmp` next to the target, then renamed into place by
rank 0. Replacing an existing checkpoint moves it to `.{name}.old` first and deletes it after the
rename; `load` falls back to `.{name}.old` when a crash fell between those two renames. So a crash
at any point leaves the last good checkpoint loadable. All ranks must see the same filesystem.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from flowrl_operators.training.trainer import Trainer

# Files of a source checkpoint that describe weights; everything else (tokenizer, generation
# config, chat template) is copied into an export.
_WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".index.json")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace(tmp: Path, target: Path) -> None:
    """Move `tmp` to `target`, keeping the old `target` until the new one is in place."""
    old = target.parent / f".{target.name}.old"
    if target.exists():
        shutil.rmtree(old, ignore_errors=True)
        target.rename(old)
    tmp.rename(target)
    _fsync_dir(target.parent)
    shutil.rmtree(old, ignore_errors=True)


def _prepare_tmp(trainer: Trainer, target: Path) -> Path:
    tmp = target.parent / f".{target.name}.tmp"
    if trainer.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # the leftover of a crashed save
        tmp.mkdir(parents=True)
    trainer.barrier()
    return tmp


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _state(trainer: Trainer, with_optim: bool) -> dict:
    # Imported here: torch.distributed.checkpoint takes ~1.5 s to import, which a run's set-up
    # need not wait for (the first checkpoint pays it).
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    # get_state_dict initialises an empty optimizer state with a zero-lr step (its step counter
    # then reads 1), so the optimizer is only touched when its state is to be saved or loaded.
    if with_optim:
        model_state, optim_state = get_state_dict(trainer.model, trainer.optimizer)
        return {"model": model_state, "optim": optim_state}
    return {"model": get_model_state_dict(trainer.model)}


def save(trainer: Trainer, target: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    target = target.absolute()
    tmp = _prepare_tmp(trainer, target)
    with_optim = trainer.optimizer is not None and bool(trainer.optimizer.state)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is")  # one process, no group
        dcp.save(_state(trainer, with_optim), checkpoint_id=str(tmp / "dcp"))
    torch.save(_rng_state(), tmp / f"rng_rank{trainer.rank}.pt")
    if trainer.rank == 0:
        counters = {
            "step": trainer.step_count,
            "policy_version": trainer.policy_version,
            "skipped_steps": trainer.skipped_steps,
            "nonfinite_in_row": trainer.nonfinite_in_row,
            "world_size": trainer.world_size,
            "with_optim": with_optim,
        }
        scheduler = trainer.scheduler.state_dict() if trainer.scheduler else None
        torch.save(counters | {"scheduler": scheduler}, tmp / "trainer.pt")
        (tmp / "meta.json").write_text(json.dumps(counters, indent=1))
    trainer.barrier()
    if trainer.rank == 0:
        _replace(tmp, target)
    trainer.barrier()
    return target


def _existing(target: Path) -> Path:
    if (target / "trainer.pt").is_file():
        return target
    old = target.parent / f".{target.name}.old"
    if (old / "trainer.pt").is_file():
        return old
    raise FileNotFoundError(f"no checkpoint at {target} (expected {target / 'trainer.pt'})")


def load(trainer: Trainer, target: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    source = _existing(target.absolute())
    counters = torch.load(source / "trainer.pt", weights_only=True)
    with_optim = counters["with_optim"] and trainer.optimizer is not None
    state = _state(trainer, with_optim)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is")
        dcp.load(state, checkpoint_id=str(source / "dcp"))
    if with_optim:
        set_state_dict(
            trainer.model, trainer.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
    else:
        set_model_state_dict(trainer.model, state["model"])
    if trainer.scheduler and counters["scheduler"] is not None:
        trainer.scheduler.load_state_dict(counters["scheduler"])
    trainer.step_count = counters["step"]
    trainer.policy_version = counters["policy_version"]
    trainer.skipped_steps = counters["skipped_steps"]
    trainer.nonfinite_in_row = counters["nonfinite_in_row"]
    # With another world size, ranks beyond the saved ones take rank 0's RNG state.
    rng = source / f"rng_rank{trainer.rank}.pt"
    _set_rng_state(torch.load(rng if rng.is_file() else source / "rng_rank0.pt", weights_only=False))
    trainer.barrier()


def export_hf(trainer: Trainer, target: Path) -> Path:
    """Full weights as safetensors with the model's config and the source's tokenizer files."""
    target = target.absolute()
    # Collective; rank 0 holds the tensors. Written before the trainer's next call: no copy needed.
    full = trainer.state_dict_full(copy=False)
    tmp = _prepare_tmp(trainer, target)
    if trainer.rank == 0:
        model = trainer.model
        model.config.save_pretrained(tmp)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        _save_safetensors(model, full, tmp)
        for item in trainer.model_path.iterdir():
            skip = item.name.endswith(_WEIGHT_FILES) or item.name.startswith("flowrl_") or (tmp / item.name).exists()
            if item.is_file() and not skip:
                shutil.copy2(item, tmp / item.name)
        _replace(tmp, target)
    trainer.barrier()
    return target


def _save_safetensors(model: torch.nn.Module, full: dict[str, torch.Tensor], folder: Path) -> None:
    from safetensors.torch import save_file

    # safetensors refuses shared storage: keep one name of each tied weight (HF reties on load).
    from flowrl_operators.training.tuning import hf_name

    tied_away = {hf_name(k) for k, _ in model.named_parameters(remove_duplicate=False)} - {
        hf_name(k) for k, _ in model.named_parameters()
    }
    tensors = {name: t.contiguous() for name, t in full.items() if name not in tied_away}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def max_abs_diff(recorded: Path, replayed: Path) -> float | None:
    """The largest |difference| of any parameter between two Hugging Face exports of a policy (the
    recorded run's and its replay's, `Train.export_difference`); None where `recorded` holds none.
    Raises ValueError where they hold different parameters."""
    from safetensors.torch import load_file

    files = sorted(recorded.glob("*.safetensors"))
    if not files:
        return None
    worst = 0.0
    for file in files:
        mine, theirs = load_file(str(replayed / file.name)), load_file(str(file))
        if mine.keys() != theirs.keys():
            raise ValueError(f"{replayed / file.name} and {file} hold different parameters")
        for name, tensor in theirs.items():
            worst = max(worst, (mine[name].double() - tensor.double()).abs().max().item())
    return worst
