"""reinforce_bypass with a correction (verl bypass mode with rollout_rs): the learner's no-grad pass
of the current policy runs before every epoch, so the correction's weights and rejection, and the
kept-token count the loss divides by, are the current policy's at each update (the loss's values
against verl's: tests/test_peer_definitions.py, `loss:reinforce_bypass`). Real trainer, tiny model."""

from __future__ import annotations

import pytest
import torch

from flowrl.data.trajectory import Trajectory
from flowrl_operators.train import Learner
from flowrl_operators.training.objective import advantage_config, loss_config
from flowrl_operators.training.trainer import TrainerConfig

MODEL = "builtin:tiny-qwen2"
REJECT = {"kind": "tis", "threshold": 2.0, "normalise": "kept",
          "reject": [{"check": "token_k1", "threshold": 1.5, "floor": 0.6}]}


def trajectories() -> list[Trajectory]:
    out = []
    for i in range(4):
        response = [5 + i, 9, 12 + i, 7, 3]
        out.append(Trajectory(id=str(i), group_id="g", sample_id="g", prompt_ids=[1, 2, 3 + i],
                              response_ids=response, loss_mask=[1] * 5, behaviour_logprobs=[-5.0, -4.0, -5.0, -6.5, -5.0],
                              versions=[0] * 5, reward=float(i % 2)))
    return out


@pytest.mark.parametrize("kind,passes", [("reinforce_bypass", 3), ("ppo_clip", 1)])
def test_the_current_policy_pass_runs_before_every_epoch_for_bypass_only(kind, passes):
    torch.set_num_threads(1)
    learner = Learner("fsdp2", MODEL, TrainerConfig(lr=0.002), loss_config({"kind": kind, "correction": REJECT}),
                      advantage_config("grpo"), epochs=3)
    seen: list[torch.Tensor] = []
    compute = learner.trainer.compute_logprobs

    def recorded(batch):
        seen.append(compute(batch))
        return seen[-1]

    learner.trainer.compute_logprobs = recorded
    metrics, _ = learner.train(trajectories())
    assert len(seen) == passes and metrics["skipped"] == 0.0
    if passes > 1:  # each pass is the policy of its epoch: it moved in between
        assert all(not torch.equal(a, b) for a, b in zip(seen[:-1], seen[1:], strict=True))
    # The policy's logprobs are about -4.6 to -5: token_k1 rejects the tokens at -4 and -6.5.
    assert 0.0 < metrics["masked_by_correction"] < 1.0 and metrics["policy_loss"] != 0.0
