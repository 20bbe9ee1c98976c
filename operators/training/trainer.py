"""The trainer: one per rank, holding a Hugging Face model sharded with FSDP2.

    trainer = Trainer(model_path, TrainerConfig(lr=1e-5))    # inside each rank's process
    batch = shard(pack(trajectories), trainer.rank, trainer.world_size, trainer.shared)
    batch.proximal_logprobs = trainer.compute_logprobs(batch)  # when the loss needs them
    metrics = trainer.forward_backward(batch, policy_loss(loss_config))
    metrics |= trainer.step()
    for bucket in trainer.named_weights(64 << 20): ...          # rank 0 yields, others only join
    trainer.save(run_dir / "step_4"); trainer.load(...); trainer.export_hf(out_dir)

Ranks: with torch.distributed initialised (gloo on CPU, NCCL on GPU; on GPU call
`torch.cuda.set_device(local_rank)` first) and more than one rank the
model is sharded with `fully_shard` per decoder layer and then the root, on an explicit 1-D mesh;
with one rank (or no process group) it is a plain module. Every method is collective: all ranks
call it in the same order. Each rank passes its own rows (`batch.shard`); the ranks may hold
different numbers of rows and micro-batches (a rank with fewer joins the collectives with
zero-weight micro-batches), and the loss normaliser is summed over the ranks, so the update does not
depend on how the batch was split.

`Reference` (frozen initial policy, `compute_logprobs` only) and `Critic` (value head on the same
backbone family, `compute_values`, trained with `value_loss`) are the same class with another head.
Its configuration and learning-rate schedule: trainer_config.py; how its model is loaded: model_load.py.
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist

from flowrl_operators.training import checkpoint, tuning
from flowrl_operators.training.alignment import GradientAlignment
from flowrl_operators.training.batch import (
    SAMPLING_DEFAULTS,
    TOKEN_FIELDS,
    Batch,
    Normaliser,
    micro_batch_rows,
)
from flowrl_operators.training.engine import EngineEntry
from flowrl_operators.training.head import loss_token_logprobs, packing_supported, shares_prefixes
from flowrl_operators.training.losses import LossFn
from flowrl_operators.training.model_load import checkpoint_layers, disable_dropout, load_model, own_storage
from flowrl_operators.training.trainer_config import NonFiniteError, TrainerConfig, lr_factor
from flowrl_operators.training.vl_inputs import shard_units, vl_inputs


class Trainer:
    """One rank of a (possibly sharded) policy: forward/backward, optimizer step, weights, checkpoints."""

    head: Literal["policy", "value"] = "policy"
    trainable: bool = True

    def __init__(self, model_path: str | Path, config: TrainerConfig | None = None) -> None:
        from flowrl_operators.memory import configure
        from flowrl_operators.models import resolve_model
        from flowrl_operators.tokenizer import BUILD_LOCK


        self.config = config or TrainerConfig()
        self.model_path = resolve_model(model_path)
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if distributed else 0
        self.world_size = dist.get_world_size() if distributed else 1
        if torch.cuda.is_available():
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        self.bf16 = self.device.type == "cuda" and self.config.mixed_precision
        with BUILD_LOCK, torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.config.seed)  # the same fresh heads on every rank
            self.model = load_model(self.model_path, self.head).to(self.device)
            if self.device.type == "cpu":
                own_storage(self.model)
        # Large blocks as their own mappings: freed memory leaves the process (memory.py; not for a small model).
        configure(sum(p.numel() * p.element_size() for p in self.model.parameters()))
        disable_dropout(self.model)
        if self.config.gradient_checkpointing:  # non-reentrant: also right when the inputs need no grad
            checkpoint_layers(self.model)
        if self.trainable:
            self.model = tuning.prepare(self.model, self.config.freeze, self.config.lora)
        # Whether the forward packs sequences (training/head.py): micro-batches are then balanced by tokens.
        self.packed = self.head == "policy" and packing_supported(self.model)
        self.shared = self.packed and shares_prefixes(self.model)  # micro-batches keep such a group whole
        self.sharded = self.world_size > 1
        if self.sharded:
            self._shard()
        self.step_count = 0  # optimizer steps applied
        self.policy_version = 0
        self.skipped_steps = 0
        self.nonfinite_in_row = 0
        self._nonfinite_loss = False
        self.alignment = GradientAlignment(self.config.gac_max_cos)
        if self.trainable:
            self.model.train()
            self.optimizer = torch.optim.AdamW(  # frozen parameters get no optimizer state
                [p for p in self.model.parameters() if p.requires_grad],
                lr=self.config.lr,
                betas=self.config.betas,
                eps=self.config.eps,
                weight_decay=self.config.weight_decay,
            )
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(
                self.optimizer, lambda step: lr_factor(step, self.config)
            )
        else:
            self.model.eval()
            self.model.requires_grad_(False)
            self.optimizer = self.scheduler = None

    def _shard(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        self.mesh = init_device_mesh(self.device.type, (self.world_size,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if self.bf16 else None
        kwargs = {"mesh": self.mesh} | ({"mp_policy": mp} if mp else {})
        hf = self.model.get_base_model() if tuning.is_peft(self.model) else self.model
        for layer in shard_units(hf):  # decoder layers (and a VL model's vision blocks)
            fully_shard(layer, **kwargs)
        fully_shard(self.model, **kwargs)

    # --- collectives over the ranks ------------------------------------------------------------

    def _all_reduce(self, values: list[float], op=None) -> list[float]:
        if self.world_size == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
        return t.tolist()

    def all_reduce(self, values: list[float]) -> list[float]:
        """Sums of `values` over the ranks (collective)."""
        return self._all_reduce(values)

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    # --- forward ---------------------------------------------------------------------------------

    def _autocast(self):
        if self.bf16 and not self.sharded:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _forward(self, mb: Batch) -> dict[str, torch.Tensor]:
        mb = mb.to(self.device)
        if self.head == "value":
            inputs = {"input_ids": mb.input_ids, "attention_mask": mb.attention_mask, "position_ids": mb.position_ids}
            with self._autocast(), vl_inputs(self.model, mb, inputs) as inputs:
                out = self.model(**inputs, use_cache=False)
            return {"values": out.logits[:, :-1, 0].float()}
        # The LM head and the logprob kernel run on the loss-mask positions only (training/head.py);
        # logprobs are under each token's sampling distribution (temperature, top-k / top-p), as the
        # engine's.
        return loss_token_logprobs(self.model, mb, self._autocast())

    def _plan(self, batch: Batch) -> tuple[list[list[int]], int]:
        """This rank's micro-batch rows and the number of micro-batches every rank will run."""
        rows = micro_batch_rows(batch, self.config.micro_batch_tokens, self.packed, self.shared)
        return rows, int(self._all_reduce([float(len(rows))], dist.ReduceOp.MAX)[0])

    def forward_backward(self, batch: Batch, loss_fn: LossFn) -> dict[str, float]:
        """Accumulate the gradient of this rank's rows; returns metrics summed over all micro-batches
        and ranks, except those named `*_max`, which take the maximum."""
        if not self.trainable:
            raise RuntimeError("this model is frozen (a Reference); it has no backward pass")
        counts = Normaliser.of(batch)
        tokens, sequences, weighted, weighted_rows = self._all_reduce(
            [counts.tokens, counts.sequences, counts.weighted_tokens, counts.weighted_sequences])
        normaliser = Normaliser(tokens=tokens, sequences=sequences, weighted_tokens=weighted,
                                weighted_sequences=weighted_rows)
        rows, count = self._plan(batch)
        metrics: dict[str, float] = defaultdict(float)
        peaks: dict[str, float] = defaultdict(lambda: -math.inf)
        nonfinite = 0.0
        for k in range(count):
            real = k < len(rows)
            mb = batch.select(rows[k]) if real else _placeholder(batch)
            if self.sharded:
                # Reduce-scatter gradients once, after the last micro-batch.
                self.model.set_requires_gradient_sync(k == count - 1)
            output = self._forward(mb)
            loss, values = loss_fn(output, mb.to(self.device), normaliser)
            if not torch.isfinite(loss.detach()).all():
                nonfinite = 1.0
            # FSDP averages gradients over ranks; the loss is already globally normalised, so the
            # ranks' gradients must add up: scale by the world size.
            (loss * (self.world_size if real else 0.0)).backward()
            for key, value in values.items():  # every rank gets the same keys, placeholders too
                if key.endswith("_max"):
                    peaks[key] = max(peaks[key], value if real else -math.inf)
                else:
                    metrics[key] += value if real else 0.0
        keys, peak_keys = sorted(metrics), sorted(peaks)
        totals = self._all_reduce([metrics[k] for k in keys] + [nonfinite])
        maxima = self._all_reduce([peaks[k] for k in peak_keys], dist.ReduceOp.MAX)
        self._nonfinite_loss = self._nonfinite_loss or totals[-1] > 0
        return (dict(zip(keys, totals[:-1], strict=True)) | dict(zip(peak_keys, maxima, strict=True))
                | {"tokens": tokens, "sequences": sequences})

    def step(self) -> dict[str, float]:
        """Clip, check and apply the accumulated gradient; a non-finite one is dropped and counted."""
        max_norm = self.config.grad_clip if self.config.grad_clip is not None else math.inf
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        norm = float(norm)
        lr = self.optimizer.param_groups[0]["lr"]
        if self._nonfinite_loss or not math.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)
            self._nonfinite_loss = False
            self.skipped_steps += 1
            self.nonfinite_in_row += 1
            if self.nonfinite_in_row >= self.config.max_nonfinite_steps:
                raise NonFiniteError(
                    f"{self.nonfinite_in_row} consecutive training steps had a non-finite loss or gradient "
                    f"(max_nonfinite_steps={self.config.max_nonfinite_steps}); the weights were left untouched. "
                    "Lower the learning rate, check the rewards and advantages for nan/inf, or raise max_nonfinite_steps."
                )
            return {"skipped": 1.0, "skipped_steps": float(self.skipped_steps), "grad_norm": norm, "lr": lr}
        aligned = self.alignment.apply(self.model.parameters(), self._all_reduce)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.nonfinite_in_row = 0
        self.step_count += 1
        self.policy_version += 1
        return {"skipped": 0.0, "skipped_steps": float(self.skipped_steps), "grad_norm": norm, "lr": lr} | aligned

    @torch.no_grad()
    def _per_token(self, batch: Batch, key: str) -> torch.Tensor:
        out = torch.zeros(batch.size, max(batch.input_ids.shape[1] - 1, 0))
        rows, count = self._plan(batch)
        for k in range(count):
            real = k < len(rows)
            mb = batch.select(rows[k]) if real else _placeholder(batch)
            mb.top_ids = mb.top_logprobs = None  # a top-K loss reads the current policy's, in its own forward
            values = self._forward(mb)[key].float().cpu()
            if real:  # a micro-batch's rows need not be consecutive
                out[torch.as_tensor(rows[k])[:, None], torch.arange(values.shape[1])] = torch.where(
                    mb.loss_mask > 0, values, 0.0)
        return out

    def compute_logprobs(self, batch: Batch) -> torch.Tensor:
        """Logprobs of this rank's rows under the current weights (proximal or reference), (B, T)."""
        logprobs = self._per_token(batch, "logprobs")
        if self.sharded:
            # FSDP2 keeps the root's parameters gathered after a forward without backward; gathered
            # weights that the policy snapshot then reads could not be freed again ("Trying to resize
            # storage that is not resizable" at the next step, two ranks under Ray).
            self.model.reshard()
        return logprobs

    # --- weights ---------------------------------------------------------------------------------

    def _named_tensors(self, changed_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        if changed_only:
            yield from tuning.changed_tensors(self.model, self.config.lora)
            return
        if tuning.is_peft(self.model):
            yield from tuning.merged_state(self.model).items()
            return
        # named_parameters() lists a tied weight once (under its first name, e.g. the embedding).
        yield from self.model.named_parameters()
        persistent = set(self.model.state_dict().keys())
        for name, buffer in self.model.named_buffers():
            if name in persistent:
                yield name, buffer

    def named_weights(
        self, bucket_bytes: int = 64 << 20, dtype: torch.dtype | None = None, *, changed_only: bool = False
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full tensors with Hugging Face names, in buckets of about `bucket_bytes`; with
        `changed_only`, only what a train step can change (training/tuning.py: no frozen parameter;
        with LoRA the adapters or the merged adapted weights).

        Collective: every rank must iterate it to the end (each sharded parameter is gathered with
        `full_tensor()`, one at a time, in the same order on every rank); only rank 0 yields. With
        one rank the tensors alias the live parameters (unless `dtype` casts them): copy them
        before the next step.
        """
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name, tensor in self._named_tensors(changed_only):
            full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            if self.rank != 0:
                continue
            full = full.detach() if dtype is None else full.detach().to(dtype)
            bucket.append((name, full))
            size += full.numel() * full.element_size()
            if size >= bucket_bytes:
                yield bucket
                bucket, size = [], 0
        if bucket and self.rank == 0:
            yield bucket

    def state_dict_full(self, copy: bool = True) -> dict[str, torch.Tensor]:
        """The whole model as full CPU tensors on rank 0 (`{}` elsewhere); collective. `copy=False`
        (one rank): the live CPU tensors, for a caller that is done with them before the next step."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if tuning.is_peft(self.model):  # the adapters merged, under checkpoint names
            return {k: v.to("cpu", copy=copy) for k, v in tuning.merged_state(self.model).items()}
        if not self.sharded:  # a copy, so that it stays a snapshot while training goes on
            return {k: v.detach().to("cpu", copy=copy) for k, v in self.model.state_dict().items()}
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self.model, options=options)

    # --- checkpoints -----------------------------------------------------------------------------

    def save(self, path: str | Path) -> Path:
        """Sharded DCP checkpoint of model, optimizer, scheduler, RNG, step and version; atomic."""
        return checkpoint.save(self, Path(path))

    def load(self, path: str | Path) -> None:
        checkpoint.load(self, Path(path))

    def export_hf(self, path: str | Path) -> Path:
        """A Hugging Face directory (safetensors, config, tokenizer) that `from_pretrained` loads."""
        return checkpoint.export_hf(self, Path(path))


def _placeholder(batch: Batch) -> Batch:
    """A one-row micro-batch of zeros with the same fields as `batch`, for ranks with no rows left."""
    fields = {}
    for name, value in vars(batch).items():
        if value is None:
            fields[name] = None
        elif name == "images":
            fields[name] = [[]]
        elif name in ("group_index", "baseline"):
            fields[name] = torch.zeros(1, dtype=value.dtype)
        elif name == "lengths":
            fields[name] = torch.full((1,), 2, dtype=value.dtype)
        elif name in SAMPLING_DEFAULTS:
            fields[name] = torch.full((1, 1), SAMPLING_DEFAULTS[name], dtype=value.dtype)
        elif name in TOKEN_FIELDS:  # top_ids / top_logprobs keep their K
            fields[name] = torch.zeros(1, 1, *value.shape[2:], dtype=value.dtype)
        else:
            fields[name] = torch.zeros(1, 2, dtype=value.dtype)
    fields["attention_mask"] = torch.ones(1, 2, dtype=torch.long)
    fields["position_ids"] = torch.arange(2)[None]
    return Batch(**fields)


class Reference(Trainer):
    """The frozen initial policy: `compute_logprobs(batch)` gives the reference logprobs."""

    trainable = False


class Critic(Trainer):
    """A value model (token head with one output on the policy's backbone), trained with `value_loss`."""

    head = "value"

    def compute_values(self, batch: Batch) -> torch.Tensor:
        """V(s_t) for each target-aligned token of this rank's rows, (B, T), zero off the loss mask."""
        return self._per_token(batch, "values")



def _build(model_path: str, config: TrainerConfig, role: str) -> Trainer:
    return {"policy": Trainer, "reference": Reference, "value": Critic}[role](model_path, config)


FSDP2 = EngineEntry("fsdp2", _build)  # registered as `fsdp2` (pyproject.toml, flowrl.training_engines)
