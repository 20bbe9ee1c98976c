"""The trainer's head on the loss positions only (training/head.py) equals the full-logits path:
logprobs, entropies and gradients, with sampling spans, LoRA, and prompts of different lengths."""

import pytest
import torch

from flowrl.data.trajectory import SamplingSpan, Trajectory
from flowrl_operators.config import LoraSpec
from flowrl_operators.training.batch import SAMPLING_FIELDS, pack
from flowrl_operators.training.head import (
    head_rows,
    loss_token_logprobs,
    output_head,
    pack_rows,
    packing_supported,
)
from flowrl_operators.training.kernels import token_logprobs
from flowrl_operators.training.trainer import Trainer, TrainerConfig

torch.set_num_threads(1)


def make_batch(seed: int = 0, spans: bool = True):
    """Rows with prompts of 2-9 tokens and responses of 2-6 (padding both ways), some tokens off the
    loss mask, and temperature / top-p / top-k spans on some rows."""
    g = torch.Generator().manual_seed(seed)
    trajectories = []
    for i in range(6):
        p, n = 2 + (5 * i) % 8, 2 + (3 * i) % 5
        mask = [1] * n if i % 3 else [int(t != 1) for t in range(n)]
        sampling = [SamplingSpan(0, n, 0.7, 0.9, -1)] if spans and i % 2 else []
        if spans and i == 4:
            sampling = [SamplingSpan(0, 2, 1.3, 1.0, 5), SamplingSpan(2, n, 0.0)]
        trajectories.append(Trajectory(
            id=str(i), group_id="g", sample_id="s", prompt_ids=torch.randint(5, 60, (p,), generator=g).tolist(),
            response_ids=torch.randint(5, 60, (n,), generator=g).tolist(), loss_mask=mask,
            behaviour_logprobs=[-1.0] * n, versions=[0] * n, reward=float(i % 2), sampling=sampling))
    return pack(trajectories)


def full_logits(model, mb):
    """Today's computation: the head over every position, the kernel over every position, masked."""
    logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids,
                   use_cache=False).logits[:, :-1]
    sampling = {n: getattr(mb, n) for n in SAMPLING_FIELDS if getattr(mb, n) is not None}
    logprobs, entropy = token_logprobs(logits, mb.input_ids[:, 1:], **sampling)
    keep = mb.loss_mask > 0
    return {"logprobs": torch.where(keep, logprobs, 0.0), "entropy": torch.where(keep, entropy, 0.0)}


def gradients(model, output, weights):
    model.zero_grad(set_to_none=True)
    ((output["logprobs"] * weights).sum() + (output["entropy"] * weights.flip(1)).sum()).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(("model", "lora", "spans"), [
    ("builtin:tiny-qwen2", None, True),
    ("builtin:tiny-llama", None, False),
    ("builtin:tiny-qwen2", LoraSpec(r=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"]), True),
])
def test_loss_positions_only_equal_the_full_logits(model, lora, spans):
    # LoRA with gradient checkpointing: the adapters and the recomputed layers see the packed rows too.
    trainer = Trainer(model, TrainerConfig(lr=1e-3, lora=lora, gradient_checkpointing=lora is not None))
    batch = make_batch(spans=spans)
    assert packing_supported(trainer.model)  # the policy's forward packs these families (LoRA-wrapped too)
    assert bool((batch.loss_mask == 0).any()) and int(batch.lengths.min()) < int(batch.lengths.max())
    assert spans == (batch.top_p is not None)
    weights = torch.randn(batch.loss_mask.shape, generator=torch.Generator().manual_seed(1)) * batch.loss_mask
    new, old = trainer._forward(batch), full_logits(trainer.model, batch)
    padded = loss_token_logprobs(trainer.model, batch, pack=False)  # the same rows, not packed
    for key in ("logprobs", "entropy"):
        torch.testing.assert_close(new[key], old[key], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(padded[key], old[key], atol=1e-5, rtol=1e-5)
        assert new[key].abs().sum() > 0
    g_new, g_old = gradients(trainer.model, new, weights), gradients(trainer.model, old, weights)
    assert g_new.keys() == g_old.keys() and g_new
    if lora is not None:
        assert all("lora_" in name for name in g_new)
    # Float tolerance: packed rows and a head over fewer rows sum in another order.
    worst = max(float((g_new[n] - g_old[n]).abs().max() / g_old[n].abs().max().clamp(min=1e-12)) for n in g_new)
    assert worst <= 2e-5, worst
    # compute_logprobs (proximal / reference / teacher) reads the same positions.
    torch.testing.assert_close(trainer.compute_logprobs(batch), old["logprobs"].detach(), atol=1e-5, rtol=1e-5)


def test_families_not_checked_for_packed_boundaries_get_padded_rows():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    tiny = Gemma2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=8, sliding_window=4)
    assert not packing_supported(Gemma2ForCausalLM(tiny))  # a sliding window: not packed


def test_the_head_sees_only_the_kept_positions_and_is_restored():
    trainer = Trainer("builtin:tiny-qwen2", TrainerConfig(lr=1e-3, gradient_checkpointing=True))
    batch, shapes = make_batch(spans=False), []
    head = output_head(trainer.model)
    handle = head.register_forward_hook(lambda _m, args, _out: shapes.append(tuple(args[0].shape)))
    rows, cols = (batch.loss_mask > 0).nonzero(as_tuple=True)
    with head_rows(head, rows, cols):
        trainer.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
    trainer.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
    handle.remove()
    hidden = trainer.model.config.hidden_size
    assert shapes == [(len(rows), hidden), (*batch.input_ids.shape, hidden)]
    # A micro-batch with no loss token (a greedy baseline row) still runs and gives zeros.
    empty = batch.select([0])
    empty.loss_mask = torch.zeros_like(empty.loss_mask)
    out = trainer._forward(empty)
    assert out["logprobs"].shape == empty.loss_mask.shape and not out["logprobs"].any()
    (out["logprobs"].sum() + out["entropy"].sum()).backward()  # joins backward with zero gradients


def test_pack_rows_lays_sequences_end_to_end_with_their_own_positions():
    batch = make_batch(spans=False)
    lengths = batch.lengths.tolist()
    input_ids, position_ids, row, offset = pack_rows(batch, target=20)
    assert input_ids.shape[0] < batch.size and input_ids.shape[1] < 2 * max(lengths)  # fewer rows, short ones
    assert input_ids.numel() <= batch.input_ids.numel()
    # What the trainer does with tiny-qwen2 (hidden 128): packed rows, so the tests above compare the
    # packed forward. With attention as dear as a linear layer at a few positions, the padded layout
    # (one row per sequence) wins.
    assert pack_rows(batch, attention_width=6 * 128)[0].shape[0] <= 2
    assert pack_rows(batch, attention_width=1.0)[0].shape == (batch.size, max(lengths))
    for r, n in enumerate(lengths):
        o = int(offset[r])
        assert input_ids[row[r], o : o + n].tolist() == batch.input_ids[r, :n].tolist()
        assert position_ids[row[r], o : o + n].tolist() == list(range(n))
    spans = sorted((int(row[r]), int(offset[r]), int(offset[r]) + n) for r, n in enumerate(lengths))
    assert all(a[2] <= b[1] for a, b in zip(spans, spans[1:], strict=False) if a[0] == b[0])  # no overlap
