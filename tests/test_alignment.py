"""cos(g_t, g_{t-1}) in the train metrics, and gradient alignment control (training/alignment.py)."""

from __future__ import annotations

import math

import msgspec
import pytest
import torch
from test_training import MODEL, make_batch

from flowrl_operators.config import GACConfig, OptimConfig
from flowrl_operators.train import trainer_config
from flowrl_operators.training.alignment import GradientAlignment
from flowrl_operators.training.losses import LossConfig, policy_loss
from flowrl_operators.training.trainer import Trainer, TrainerConfig

torch.set_num_threads(1)


def params(*grads: list[float]) -> list[torch.nn.Parameter]:
    out = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros(len(g)))
        p.grad = torch.tensor(g)
        out.append(p)
    return out


def flat(ps: list[torch.nn.Parameter]) -> torch.Tensor:
    return torch.cat([p.grad for p in ps])


def same(values: list[float]) -> list[float]:
    return values  # one rank: the sums are the local ones


def test_cosine_of_consecutive_gradients_over_all_parameters():
    a = GradientAlignment()
    assert a.apply(params([1.0, 0.0], [0.0]), same) == {}  # no previous gradient yet
    ps = params([1.0, 1.0], [1.0])
    out = a.apply(ps, same)
    assert out["grad_cos_prev"] == pytest.approx(1 / math.sqrt(3))
    assert torch.equal(flat(ps), torch.tensor([1.0, 1.0, 1.0]))  # off: the gradient is untouched
    assert a.apply(params([-1.0, -1.0], [-1.0]), same)["grad_cos_prev"] == pytest.approx(-1.0)


def test_gac_projects_the_aligned_component_out_and_keeps_the_rest():
    a = GradientAlignment(max_cos=0.0)
    a.apply(params([1.0, 0.0, 0.0]), same)
    ps = params([2.0, 3.0, 0.0])
    out = a.apply(ps, same)
    assert out["grad_cos_prev"] == pytest.approx(2 / math.sqrt(13)) and out["gac_projected"] == 1.0
    assert torch.allclose(flat(ps), torch.tensor([0.0, 3.0, 0.0]))
    # The next step compares with the gradient as computed ([2, 3, 0]), not as projected.
    ps = params([-1.0, 0.0, 0.0])
    out = a.apply(ps, same)
    assert out["grad_cos_prev"] == pytest.approx(-2 / math.sqrt(13)) and out["gac_projected"] == 0.0
    assert torch.equal(flat(ps), torch.tensor([-1.0, 0.0, 0.0]))  # anti-aligned: kept


def test_gac_caps_the_aligned_component_at_max_cos():
    a = GradientAlignment(max_cos=0.5)
    a.apply(params([0.0, 2.0]), same)
    ps = params([1.0, 1.0])  # along u = (0, 1): 1.0, cap 0.5 * sqrt(2)
    a.apply(ps, same)
    assert flat(ps)[1].item() == pytest.approx(0.5 * math.sqrt(2)) and flat(ps)[0].item() == 1.0
    with pytest.raises(ValueError, match="max_cos"):
        GradientAlignment(max_cos=1.0)


def test_trainer_reports_grad_cos_prev_and_gac_changes_the_update():
    loss = policy_loss(LossConfig())
    weights = {}
    for max_cos in (None, 0.0):
        trainer = Trainer(MODEL, TrainerConfig(lr=1e-3, gac_max_cos=max_cos))
        rows = []
        for step in range(3):
            trainer.forward_backward(make_batch(step % 2), loss)
            rows.append(trainer.step())
        assert "grad_cos_prev" not in rows[0] and all(-1.0 <= r["grad_cos_prev"] <= 1.0 for r in rows[1:])
        assert ("gac_projected" in rows[1]) == (max_cos is not None)
        weights[max_cos] = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
    assert not torch.equal(weights[None], weights[0.0])


def test_optim_gac_is_a_typed_key_read_by_the_trainer_config():
    optim = msgspec.convert({"lr": 1e-3, "gac": {"max_cos": 0.2}}, OptimConfig)
    assert optim.gac == GACConfig(max_cos=0.2)
    assert trainer_config(optim, 8192, 3, 1, 0).gac_max_cos == 0.2
    assert trainer_config(OptimConfig(), 8192, 3, 1, 0).gac_max_cos is None  # off by default
    with pytest.raises(msgspec.ValidationError, match="max_cos"):
        msgspec.convert({"gac": {"max_cos": 1.5}}, OptimConfig)
    with pytest.raises(msgspec.ValidationError, match="max_co"):
        msgspec.convert({"gac": {"max_co": 0.1}}, OptimConfig)


def test_off_the_cosine_of_a_large_gradient_is_read_on_a_sample_and_keeps_no_full_copy():
    torch.manual_seed(0)
    n = 1 << 20  # over WHOLE: sampled
    g0, noise = torch.randn(n), torch.randn(n)
    g1 = 0.6 * g0 + 0.8 * noise
    exact = float(torch.nn.functional.cosine_similarity(g0, g1, dim=0))
    a = GradientAlignment()
    a.apply(params(g0.tolist()), same)
    kept = sum(q.numel() for q in a.previous)
    assert kept == n // 16  # 1/16 of the coordinates, not a copy of the gradient
    assert a.apply(params(g1.tolist()), same)["grad_cos_prev"] == pytest.approx(exact, abs=0.005)
    on = GradientAlignment(max_cos=0.5)  # gac needs all of it
    on.apply(params(g0.tolist()), same)
    assert sum(q.numel() for q in on.previous) == n
