"""PPO with a critic (GAE) improves the reward of a toy task at the trainer level.

Task: after a fixed prompt, sample 3 tokens; the reward is the fraction of them inside a target set
of 10 token ids (about 10% at random initialisation), given at the end of the sequence.
"""

import torch

from flowrl.data.trajectory import Trajectory
from flowrl_operators.training.advantages import compute_advantages
from flowrl_operators.training.batch import pack
from flowrl_operators.training.losses import ValueLossConfig, policy_loss, value_loss
from flowrl_operators.training.trainer import Critic, Trainer, TrainerConfig

torch.set_num_threads(1)
MODEL = "builtin:tiny-qwen2"
PROMPT, TARGET, ROWS, LENGTH = [5, 6, 7], set(range(20, 30)), 32, 3


@torch.no_grad()
def sample(model, generator):
    ids = torch.tensor([PROMPT] * ROWS)
    logprobs = []
    for _ in range(LENGTH):
        logp = torch.log_softmax(model(input_ids=ids).logits[:, -1].float(), -1)
        token = torch.multinomial(logp.exp(), 1, generator=generator)
        logprobs.append(logp.gather(1, token))
        ids = torch.cat([ids, token], 1)
    return ids[:, len(PROMPT):].tolist(), torch.cat(logprobs, 1).tolist()


def test_ppo_with_critic_improves_reward():
    policy = Trainer(MODEL, TrainerConfig(lr=3e-3, seed=1))
    critic = Critic(MODEL, TrainerConfig(lr=3e-3, seed=1))
    generator = torch.Generator().manual_seed(0)
    policy_fn = policy_loss({"clip_low": 0.2, "clip_high": 0.28})
    critic_fn = value_loss(ValueLossConfig(value_clip=0.5))
    rewards = []
    for step in range(14):
        responses, logprobs = sample(policy.model, generator)
        trajectories = [
            Trajectory(
                id=f"{step}-{i}", group_id=f"{step}-{i}", sample_id="p", prompt_ids=PROMPT, response_ids=r,
                loss_mask=[1] * LENGTH, behaviour_logprobs=lp, versions=[policy.policy_version] * LENGTH,
                reward=sum(t in TARGET for t in r) / LENGTH,
            )
            for i, (r, lp) in enumerate(zip(responses, logprobs, strict=True))
        ]
        rewards.append(sum(t.reward for t in trajectories) / ROWS)
        batch = pack(trajectories)
        batch.values = critic.compute_values(batch)
        compute_advantages(batch, {"estimator": "gae", "gamma": 1.0, "lam": 0.95})
        for _ in range(2):  # two PPO epochs over the batch: the ratio moves, clipping matters
            policy.forward_backward(batch, policy_fn)
            policy.step()
            critic.forward_backward(batch, critic_fn)
            critic.step()
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.25, rewards
