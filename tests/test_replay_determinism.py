"""A train step is a function of its inputs: the same step on the same weights, with the same torch
thread count, gives the same gradient bit for bit, which `flowrl replay` needs (flowrl/replay.py).

The quickstart's replay drifted (max |diff| 0.2 after 800 GRPO steps) because the head's row pick
`hidden[rows, cols]` (training/head.py `head_rows`) summed a repeated position's gradient (a shared
prompt's last token, read once per sample: training/prefix.py) with atomic adds from 2 threads in a
varying order. These run with 2 threads, as the quickstart's trainer does.
"""

from __future__ import annotations

import contextlib

import torch

from flowrl.data.trajectory import Trajectory
from flowrl_operators.training.advantages import compute_advantages
from flowrl_operators.training.batch import pack
from flowrl_operators.training.head import head_rows
from flowrl_operators.training.losses import policy_loss
from flowrl_operators.training.objective import advantage_config, loss_config
from flowrl_operators.training.trainer import Trainer, TrainerConfig


@contextlib.contextmanager
def threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def test_the_head_sums_a_repeated_position_in_a_fixed_order():
    """The head's input gradient where a position is picked many times (`head_rows`). Every third
    pick is one position, so both threads add into it at once: with `hidden[rows, cols]` 97 and 99
    of 100 backward passes here differed from the first (2 cores)."""
    g = torch.Generator().manual_seed(0)
    rows, cols = torch.randint(0, 8, (3000,), generator=g), torch.randint(0, 300, (3000,), generator=g)
    rows[::3], cols[::3] = 5, 17
    hidden, upstream = torch.randn(8, 300, 64, generator=g), torch.randn(3000, 10, generator=g)
    head = torch.nn.Linear(64, 10).requires_grad_(False)
    grads = []
    with threads(2), head_rows(head, rows, cols):
        for _ in range(100):
            h = hidden.clone().requires_grad_(True)
            logits = head(h)
            logits.backward(upstream)
            grads.append(h.grad)
    assert torch.equal(logits, head(hidden[rows, cols]))
    assert all(torch.equal(grads[0], x) for x in grads[1:])
    plain = torch.zeros(8, 300, 64, dtype=torch.float64).index_put_(
        (rows, cols), upstream.double() @ head.weight.double(), accumulate=True)
    torch.testing.assert_close(grads[0], plain.float(), rtol=1e-3, atol=1e-3)  # 1,000 float32 adds


def grpo_batch(groups: int = 4, size: int = 16):
    """The quickstart's shape: groups of samples sharing a prompt, 8-token responses."""
    g = torch.Generator().manual_seed(1)
    trajectories = []
    for k in range(groups):
        prompt = torch.randint(5, 60, (6 + k,), generator=g).tolist()
        for i in range(size):
            n = 3 + (i % 6)
            trajectories.append(Trajectory(
                id=f"{k}/{i}", group_id=str(k), sample_id=str(k), prompt_ids=prompt,
                response_ids=torch.randint(5, 60, (n,), generator=g).tolist(), loss_mask=[1] * n,
                behaviour_logprobs=[-3.0] * n, versions=[0] * n, reward=float((i * 7 + k) % 3 == 0)))
    batch = pack(trajectories)
    compute_advantages(batch, advantage_config({"estimator": "grpo"}))
    return batch


def test_the_same_train_step_gives_the_same_gradient():
    """forward_backward on the packed, prefix-sharing forward (the quickstart's), 20 times from the
    same weights: every parameter's gradient bit-identical. A guard on the step as a whole; the old
    pick raced here too rarely to be caught (0 of 40 tries), which is why the test above exists."""
    trainer = Trainer("builtin:tiny-qwen2", TrainerConfig(lr=1e-3))
    assert trainer.shared  # the prompt is computed once per group: its last token's hidden state is read 16 times
    batch, loss = grpo_batch(), policy_loss(loss_config({"kind": "ppo_clip", "entropy_coef": 0.01}))
    first = None
    with threads(2):
        for _ in range(20):
            trainer.optimizer.zero_grad(set_to_none=True)
            trainer.forward_backward(batch, loss)
            grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
            first = first or grads
            assert all(torch.equal(first[n], grads[n]) for n in first)
