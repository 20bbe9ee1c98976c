"""A group's shared prefix computed once (training/prefix.py) gives each row's own logprobs,
entropies and gradients: against the full-logits path on padded rows, with groups whose rows share
a prompt, a first response token, all of a row, or nothing; groups sharing a system prompt; LoRA;
eager attention; and units split when one would be too wide."""

import pytest
import torch
from test_training_head import full_logits, gradients

from flowrl.data.trajectory import SamplingSpan, Trajectory
from flowrl_operators.config import LoraSpec
from flowrl_operators.training.batch import pack
from flowrl_operators.training.head import PACK_TOKENS, lay_out, loss_token_logprobs, shared_prefixes
from flowrl_operators.training.kernels import token_logprobs
from flowrl_operators.training.prefix import MIN_SYSTEM, row_cost, saving, shared_rows, trees, units
from flowrl_operators.training.trainer import Trainer, TrainerConfig

torch.set_num_threads(1)


def grouped_batch(seed: int = 0):
    """Three groups: four rows on one prompt (two of them with the same first response token, one
    the whole of another), three on another prompt, and one row alone."""
    g = torch.Generator().manual_seed(seed)

    def tokens(n: int) -> list[int]:
        return torch.randint(5, 60, (n,), generator=g).tolist()

    def row(i: int, group: str, prompt: list[int], response: list[int], spans: bool = False) -> Trajectory:
        n = len(response)
        return Trajectory(id=str(i), group_id=group, sample_id=group, prompt_ids=prompt, response_ids=response,
                          loss_mask=[int(t != 1) if i == 2 else 1 for t in range(n)], behaviour_logprobs=[-1.0] * n,
                          versions=[0] * n, reward=float(i % 2),
                          sampling=[SamplingSpan(0, n, 0.7, 0.9, -1)] if spans else [])
    a, b = tokens(9), tokens(6)
    shared_start = tokens(3)
    rows = [row(0, "a", a, shared_start + tokens(4), spans=True), row(1, "a", a, shared_start + tokens(2)),
            row(2, "a", a, tokens(5)), row(3, "a", a, shared_start[:2]),
            row(4, "b", b, tokens(3)), row(5, "b", b, tokens(7)), row(6, "b", b, tokens(2)),
            row(7, "c", tokens(4), tokens(3))]
    return pack(rows)


def test_units_share_each_groups_common_prefix():
    batch = grouped_batch()
    found = units(batch, attention_width=float("inf"))
    by_rows = {tuple(sorted(u.rows)): u for u in found}
    assert by_rows[(0, 1, 2, 3)].prefix == 9  # the prompt; row 2 starts its response otherwise
    assert by_rows[(4, 5, 6)].prefix == 6 and by_rows[(7,)].prefix == 7
    lengths = batch.lengths.tolist()
    assert sum(u.width for u in found) == sum(lengths) - 3 * 9 - 2 * 6
    assert 0 < saving(batch) < 1


@pytest.mark.parametrize(("attention", "lora"), [
    ("sdpa", None),
    ("eager", None),
    ("sdpa", LoraSpec(r=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"])),
])
def test_shared_prefix_equals_each_rows_own_forward(attention, lora):
    trainer = Trainer("builtin:tiny-qwen2", TrainerConfig(lr=1e-3, lora=lora, gradient_checkpointing=lora is not None))
    trainer.model.config._attn_implementation = attention
    batch = grouped_batch()
    shared = shared_prefixes(trainer.model, batch, attention_width=6 * 64)
    assert shared is not None and shared.computed < int(batch.lengths.sum())
    weights = torch.randn(batch.loss_mask.shape, generator=torch.Generator().manual_seed(1)) * batch.loss_mask
    new, old = trainer._forward(batch), full_logits(trainer.model, batch)
    for key in ("logprobs", "entropy"):
        torch.testing.assert_close(new[key], old[key], atol=1e-5, rtol=1e-5)
    # Row 3 lies inside row 0 (its prompt and its two tokens): its logprobs are read from row 0's states.
    assert new["logprobs"][3].abs().sum() > 0
    g_new, g_old = gradients(trainer.model, new, weights), gradients(trainer.model, old, weights)
    assert g_new.keys() == g_old.keys() and g_new
    worst = max(float((g_new[n] - g_old[n]).abs().max() / g_old[n].abs().max().clamp(min=1e-12)) for n in g_new)
    assert worst <= 2e-5, worst
    torch.testing.assert_close(trainer.compute_logprobs(batch), old["logprobs"].detach(), atol=1e-5, rtol=1e-5)


def test_a_wide_group_is_split_into_units_each_with_the_prefix():
    batch = grouped_batch()
    narrow = units(batch, attention_width=1.0)  # attention dear: another copy of the prefix pays off
    group_a = [u for u in narrow if set(u.rows) <= {0, 1, 2, 3}]
    assert len(group_a) > 1 and sorted(r for u in group_a for r in u.rows) == [0, 1, 2, 3]
    assert all(u.prefix == 9 for u in group_a)
    # Each branch went where it added least, or alone when alone cost less.
    assert sum(row_cost(u.width, 1.0) for u in group_a) < row_cost(28, 1.0)
    trainer = Trainer("builtin:tiny-qwen2", TrainerConfig(lr=1e-3))
    layout = shared_rows(batch, narrow, lambda w: lay_out(w, PACK_TOKENS, 1.0))
    out = loss_token_logprobs(trainer.model, batch, pack=False)
    rows, cols = (batch.loss_mask > 0).nonzero(as_tuple=True)
    with torch.no_grad():
        hidden = trainer.model(input_ids=layout.input_ids, position_ids=layout.position_ids,
                               attention_mask=layout.attention_mask, use_cache=False).logits
    logits = hidden[layout.place_row[rows, cols], layout.place_col[rows, cols]]
    expected, _ = token_logprobs(logits, batch.input_ids[rows, cols + 1], **batch.sampling_inputs(rows, cols))
    torch.testing.assert_close(out["logprobs"][rows, cols].detach(), expected, atol=1e-5, rtol=1e-5)


def test_no_shared_prefix_keeps_the_packed_rows():
    trainer = Trainer("builtin:tiny-qwen2", TrainerConfig(lr=1e-3))
    batch = grouped_batch()
    alone = batch.select([0, 4, 7])  # one row of each group: nothing to share
    assert shared_prefixes(trainer.model, alone, 6 * 64) is None
    trainer.model.config._attn_implementation = "flash_attention_2"  # takes no explicit mask
    assert shared_prefixes(trainer.model, batch, 6 * 64) is None


def test_micro_batches_of_shared_groups_equal_one_micro_batch():
    """The trainer's split keeps a sharing group whole (counted at its shared tokens); the loss and
    gradients equal one micro-batch's."""
    from flowrl_operators.training.advantages import AdvantageConfig, compute_advantages
    from flowrl_operators.training.losses import LossConfig, policy_loss

    batch = compute_advantages(grouped_batch(), AdvantageConfig(estimator="grpo"))
    loss_fn = policy_loss(LossConfig(kind="ppo_clip"))
    results = []
    for budget in (1 << 20, 30):
        trainer = Trainer("builtin:tiny-qwen2", TrainerConfig(lr=1e-3, micro_batch_tokens=budget))
        assert trainer.shared
        plan = trainer._plan(batch)[0]
        metrics = trainer.forward_backward(batch, loss_fn)
        results.append((plan, metrics["loss"], {n: p.grad.clone() for n, p in trainer.model.named_parameters()}))
    (one, loss_one, g_one), (split, loss_split, g_split) = results
    assert len(one) == 1 and len(split) > 1
    assert any({4, 5, 6} <= set(rows) for rows in split)  # group b: 6 + 3 + 7 + 2 = 18 tokens shared
    assert abs(loss_one - loss_split) < 1e-6
    for name, grad in g_one.items():
        torch.testing.assert_close(g_split[name], grad, atol=1e-6, rtol=1e-5)


def system_batch(seed: int = 0):
    """Three groups opening with one 20-token system prompt (three rows, two rows, one row), and a
    group of two rows on a prompt of its own."""
    g = torch.Generator().manual_seed(seed)

    def tokens(n: int) -> list[int]:
        return torch.randint(5, 60, (n,), generator=g).tolist()

    system = tokens(20)
    prompts = {"a": system + [61] + tokens(4), "b": system + [62] + tokens(3), "c": system + [63] + tokens(5),
               "d": tokens(8)}
    rows = []
    for i, group in enumerate("aaabbcdd"):
        response = tokens(2 + i % 4)
        rows.append(Trajectory(id=str(i), group_id=group, sample_id=group, prompt_ids=prompts[group],
                               response_ids=response, loss_mask=[1] * len(response),
                               behaviour_logprobs=[-1.0] * len(response), versions=[0] * len(response),
                               reward=float(i % 2)))
    return pack(rows)


def test_groups_sharing_a_system_prompt_form_one_tree():
    batch = system_batch()
    found = trees(batch, units(batch, float("inf")), float("inf"))
    [tree] = [t for t in found if len(t.units) > 1]
    assert tree.system == 20 >= MIN_SYSTEM
    assert sorted(r for u in tree.units for r in u.rows) == [0, 1, 2, 3, 4, 5]
    # The three groups' units hold the system prompt three times, the tree once.
    assert sum(t.width for t in found) == sum(u.width for u in units(batch, float("inf"))) - 2 * 20
    # Attention dear (width 1): a group joins while one row holding it costs less than a row of its own.
    narrow = trees(batch, units(batch, 1.0), 1.0)
    [tree] = [t for t in narrow if len(t.units) > 1]
    alone = next(t for t in narrow if t.units[0].rows == [5])
    assert len(tree.units) == 2 and alone.system == 0
    grown = tree.width + alone.width - 20
    assert row_cost(grown, 1.0) > row_cost(tree.width, 1.0) + row_cost(alone.width, 1.0)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_shared_system_prompt_equals_each_rows_own_forward(attention):
    trainer = Trainer("builtin:tiny-qwen2", TrainerConfig(lr=1e-3))
    trainer.model.config._attn_implementation = attention
    batch = system_batch()
    shared = shared_prefixes(trainer.model, batch, attention_width=6 * 64)
    per_group = sum(u.width for u in units(batch, 6 * 64))
    assert shared is not None and shared.computed < per_group  # the system prompt once, not three times
    weights = torch.randn(batch.loss_mask.shape, generator=torch.Generator().manual_seed(1)) * batch.loss_mask
    new, old = trainer._forward(batch), full_logits(trainer.model, batch)
    for key in ("logprobs", "entropy"):
        torch.testing.assert_close(new[key], old[key], atol=1e-5, rtol=1e-5)
    g_new, g_old = gradients(trainer.model, new, weights), gradients(trainer.model, old, weights)
    worst = max(float((g_new[n] - g_old[n]).abs().max() / g_old[n].abs().max().clamp(min=1e-12)) for n in g_new)
    assert worst <= 2e-5, worst
    # Single rows sharing only the system prompt (group c alone, one row of a) are shared too.
    pair = batch.select([0, 5])
    assert shared_prefixes(trainer.model, pair, 6 * 64) is not None
    torch.testing.assert_close(trainer._forward(pair)["logprobs"], full_logits(trainer.model, pair)["logprobs"],
                               atol=1e-5, rtol=1e-5)
