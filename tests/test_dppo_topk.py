"""DPPO's top-K approximation end to end: the generate node records the behaviour policy's top
tokens (`sampling.top_logprobs`), the trajectory carries them, pack places them, the trainer
gathers its own policy's logprobs of the same ids, and the loss masks by their divergence (the
loss's values against TRL's definition: tests/test_peer_definitions.py). Real engine, real tiny
model, real trainer; `flowrl validate` refuses the loss without the records."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import msgspec
import pytest
import torch

from flowrl.cli import main
from flowrl.data.trajectory import Trajectory, decode_group, encode_group
from flowrl.operator import OperatorContext
from flowrl_operators.config import GenerateConfig
from flowrl_operators.generate import Generate
from flowrl_operators.tasks.digits import reverse_digits
from flowrl_operators.training.advantages import compute_advantages
from flowrl_operators.training.batch import pack
from flowrl_operators.training.losses import policy_loss
from flowrl_operators.training.trainer import Trainer, TrainerConfig

MODEL = "builtin:tiny-qwen2"
ROOT = Path(__file__).resolve().parents[1]
BASE = (ROOT / "tests/specs/good/base.yaml").read_text()


@pytest.fixture(scope="module")
def group():
    torch.set_num_threads(1)
    loop = asyncio.new_event_loop()
    config = msgspec.convert({"group_size": 3, "sampling": {"temperature": 0.8, "max_new_tokens": 6, "top_logprobs": 4}},
                             GenerateConfig)
    op = Generate(config, OperatorContext(node="rollout", model={"path": MODEL}, seed=3))
    loop.run_until_complete(op.setup())
    found = loop.run_until_complete(op.generate(reverse_digits(seed=0).sample(0, 1), step=0, sample_id="0:1"))
    evaluated = loop.run_until_complete(op.generate(reverse_digits(seed=0).sample(0, 1), step=0, sample_id="0:1",
                                                    greedy=True))
    loop.run_until_complete(op.close())
    loop.close()
    assert Generate.knobs(config).provides == frozenset({"top_logprobs"})
    return found, evaluated


def test_the_trajectories_carry_the_top_tokens(group):
    found, evaluated = group
    for t in found.trajectories:
        assert len(t.top_ids) == len(t.top_logprobs) == len(t.response_ids)
        assert all(len(ids) == 4 for ids in t.top_ids)
        # the sampled token is often the most likely one; its logprob is never above the best one's
        assert all(lp <= lps[0] + 1e-6 for lp, lps in zip(t.behaviour_logprobs, t.top_logprobs, strict=True))
    assert decode_group(encode_group(found)) == found  # plain data on the wire
    assert all(t.top_ids is None for t in evaluated.trajectories)  # evaluation records none


def test_pack_places_them_and_the_trainer_gathers_the_same_on_policy(group):
    found, _ = group
    trajectories = [msgspec.structs.replace(t, reward=r) for t, r in zip(found.trajectories, [1.0, 0.0, 0.5],
                                                                         strict=True)]
    batch = pack(trajectories)
    t = trajectories[0]
    p, n = len(t.prompt_ids), len(t.response_ids)
    assert batch.top_ids.shape[-1] == 4 and batch.top_ids[0, p - 1 : p - 1 + n].tolist() == t.top_ids
    assert not torch.isfinite(batch.top_logprobs[0, : p - 1]).any()  # prompt columns: no record
    trainer = Trainer(MODEL, TrainerConfig(lr=1e-3))
    output = trainer._forward(batch)
    on = batch.loss_mask > 0
    # the same weights: the trainer's logprobs of the engine's top tokens are the engine's
    assert (output["top_logprobs"][on] - batch.top_logprobs[on]).abs().max() < 1e-4
    compute_advantages(batch, "grpo")
    metrics = trainer.forward_backward(batch, policy_loss({"kind": "dppo_kl_topk", "delta_high": 1e-3})) | trainer.step()
    assert metrics["clip_fraction"] == 0.0 and math.isfinite(metrics["policy_loss"]) and metrics["skipped"] == 0.0
    # After a large step the policy has moved: a tight trust region now masks some tokens.
    trainer.optimizer.param_groups[0]["lr"] = 0.5
    for _ in range(2):
        trainer.forward_backward(batch, policy_loss({"kind": "dppo_tv_topk"}))
        trainer.step()
    moved = trainer.forward_backward(batch, policy_loss({"kind": "dppo_tv_topk", "delta_low": 1e-4,
                                                         "delta_high": 1e-4}))
    assert moved["clip_fraction"] > 0.0


def _spec(tmp_path: Path, loss: str, sampling: str = "{temperature: 1.0, max_new_tokens: 8}") -> Path:
    spec = tmp_path / "topk.yaml"
    spec.write_text(BASE.replace("    optim: {lr: 1.0e-3}", f"    optim: {{lr: 1.0e-3}}\n    loss: {loss}")
                    .replace("sampling: {temperature: 1.0, max_new_tokens: 8}", f"sampling: {sampling}"))
    return spec


def test_validate_refuses_a_top_k_loss_without_the_records(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    spec = _spec(tmp_path, "{kind: dppo_tv_topk, delta_high: 0.1}")
    assert main(["validate", str(spec)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"{spec}:19:") and "nodes.learner.loss.kind" in err, err
    assert "sampling.top_logprobs" in err and "dppo_tv_topk" in err and "Traceback" not in err
    spec = _spec(tmp_path, "{kind: dppo_kl_topk, correction: {kind: tis}}",
                 "{temperature: 1.0, max_new_tokens: 8, top_logprobs: 4}")
    assert main(["validate", str(spec)]) == 1
    assert "behaviour policy" in capsys.readouterr().err
    spec = _spec(tmp_path, "{kind: dppo_tv_topk}", "{temperature: 1.0, max_new_tokens: 8, top_logprobs: 4}")
    assert main(["validate", str(spec)]) == 0, capsys.readouterr().err


def test_a_tiny_run_trains_with_a_top_k_loss(tmp_path: Path):
    spec = _spec(tmp_path, "{kind: dppo_tv_topk, delta_low: 0.05, delta_high: 0.05}",
                 "{temperature: 1.0, max_new_tokens: 6, top_logprobs: 5}")
    out = tmp_path / "run"
    assert main(["run", str(spec), "run.steps=3", "--run-dir", str(out), "--quiet"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows:
        train = row["train"]
        assert train["tokens"] > 0 and math.isfinite(train["policy_loss"]) and 0.0 <= train["clip_fraction"] <= 1.0


def _trajectory(top_ids, top_logprobs, n=3, prompt=(1, 2)):
    return Trajectory(id="t", group_id="g", sample_id="g", prompt_ids=list(prompt), response_ids=[5] * n,
                      loss_mask=[1] * n, behaviour_logprobs=[-1.0] * n, versions=[0] * n, reward=1.0,
                      top_ids=top_ids, top_logprobs=top_logprobs)


def test_pack_pads_shorter_and_missing_records_with_no_mass():
    one = _trajectory([[5, 7], [5], []], [[-0.1, -2.5], [-0.2], []])  # an environment-like token: no record
    other = _trajectory(None, None, n=2, prompt=(1, 2, 3))
    batch = pack([one, other])
    assert batch.top_ids.shape == (2, 4, 2)
    assert batch.top_ids[0, 1:4].tolist() == [[5, 7], [5, 0], [0, 0]]
    assert batch.top_logprobs[0, 1:3].tolist() == [[pytest.approx(-0.1), -2.5], [pytest.approx(-0.2), -math.inf]]
    assert not torch.isfinite(batch.top_logprobs[0, 3]).any() and not torch.isfinite(batch.top_logprobs[1]).any()
    with pytest.raises(ValueError, match="top_ids / top_logprobs need one equal-length list per response token"):
        _trajectory([[5], [5]], [[-0.1], [-0.2]]).validate()
    with pytest.raises(ValueError, match="set together"):
        _trajectory([[5]] * 3, None).validate()
