"""What a trainer is configured by (`TrainerConfig`: the train node's `optim` keys and their kin), its
learning-rate schedule (`lr_factor`), and the error that stops a run of non-finite steps. The
trainer is trainer.py, which names these too."""

from __future__ import annotations

import math
from typing import Any, Literal

import msgspec


class TrainerConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The train node's `optim` keys plus `micro_batch_tokens` and `max_nonfinite_steps` (same names
    as flowrl_operators.config); `total_steps` comes from the run length for a decaying schedule."""

    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    warmup_steps: int = 0  # linear warm-up from lr / warmup_steps to lr
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    total_steps: int | None = None  # the decay horizon of linear / cosine
    min_lr_ratio: float = 0.0
    grad_clip: float | None = 1.0
    gac_max_cos: float | None = None  # gradient alignment control (training/alignment.py); None: off
    # Tokens per micro-batch: packed rows (the policy's forward on llama / qwen2) count their tokens
    # and are balanced by them; padded rows count rows x the longest (a longer row runs alone).
    micro_batch_tokens: int = 8192
    max_nonfinite_steps: int = 3  # consecutive skipped (non-finite) steps before the run stops
    mixed_precision: bool = True  # bf16 compute on GPU; CPU always runs fp32
    gradient_checkpointing: bool = False
    freeze: list[str] = []  # fnmatch patterns of parameters that do not train (training/tuning.py)
    lora: Any = None  # a flowrl_operators.config.LoraSpec: train peft adapters instead
    seed: int = 0

    def __post_init__(self) -> None:
        if self.schedule != "constant" and not self.total_steps:
            raise ValueError(f"schedule {self.schedule!r} needs total_steps")
        if self.lr <= 0 or self.micro_batch_tokens <= 0 or self.max_nonfinite_steps < 1:
            raise ValueError("trainer lr and micro_batch_tokens must be > 0 and max_nonfinite_steps >= 1")


class NonFiniteError(RuntimeError):
    """Too many consecutive steps had a non-finite loss or gradient."""


def lr_factor(step: int, config: TrainerConfig) -> float:
    """Multiplier of the base lr at optimizer step `step` (0-based)."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    if config.schedule == "constant":
        return 1.0
    progress = min(1.0, (step - config.warmup_steps) / max(1, config.total_steps - config.warmup_steps))
    shape = 1 - progress if config.schedule == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    return config.min_lr_ratio + (1 - config.min_lr_ratio) * shape
