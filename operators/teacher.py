"""The teacher node: on-policy distillation as per-token rewards.

The student samples (the generate node), a larger teacher scores every sampled token, and each token
is rewarded by the negative reverse KL estimate to the teacher:

    r_t = coef * (log p_teacher(y_t) - log p_behaviour(y_t))  +  task_coef * (the task's reward at t)

where `log p_behaviour` is the logprob the engine recorded when the student sampled `y_t`. Its
expectation under the student's samples is -KL(student || teacher) at that position: the per-token
reverse KL of on-policy distillation (Agarwal et al. 2024, "On-Policy Distillation of Language
Models", GKD with on-policy data; Thinking Machines' "On-Policy Distillation" post; the Qwen3
technical report's on-policy distillation stage). As token rewards it needs no loss of its own:
every advantage estimator accepts them (`advantage: {estimator: grpo, gamma: 0}` judges each token by
its own reward, as in pipelines/distill.yaml).

The teacher's logprobs are taken under the distribution each token was sampled from, as the
trajectory's sampling spans record it (temperature applied to the teacher's logits; top-k / top-p
keep the set the rule keeps on the teacher's own logits, plus the sampled token), exactly as the
reference node computes its logprobs. Environment and tool tokens (loss mask 0) get no KL reward.

The task reward is the one the trajectory already carries (a reward node before this one), placed
on tokens as training credits it (flowrl_operators.training.batch.credited_rewards): token rewards
on their tokens, a turn's reward on its last token, a sequence reward on the last model token. It
is added after weighting by `task_coef` (0: distillation alone). `reward` is left as the task set
it, so metrics and filters still see the task's score; the credited rewards are `token_rewards`.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Annotated, ClassVar

import msgspec
from msgspec import Meta

from flowrl.data.trajectory import Group, Trajectory
from flowrl.operator import ConfigError, OperatorContext
from flowrl_operators.reference import Reference


class TeacherModel(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    # A local Hugging Face checkpoint folder, builtin:<name>, or phase:<name> (an earlier phase's
    # exported policy). Its tokenizer must be the student's.
    path: str


class TeacherConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: TeacherModel
    coef: Annotated[float, Meta(ge=0.0)] = 1.0  # weight of the distillation reward
    task_coef: Annotated[float, Meta(ge=0.0)] = 0.0  # weight of the task's reward (0: distillation alone)
    micro_batch_tokens: Annotated[int, Meta(ge=1)] = 8192  # tokens per teacher forward (as the train node's)
    # The training engine that holds the frozen teacher (training/engine.py), as the reference node's.
    engine: str = "fsdp2"

    def __post_init__(self) -> None:
        if self.coef == 0 and self.task_coef == 0:
            raise ValueError("coef and task_coef are both 0: the teacher node would credit nothing")


def distill_rewards(trajectory: Trajectory, teacher_logprobs: list[float], coef: float = 1.0,
                    task_coef: float = 0.0) -> list[float]:
    """The token rewards of one trajectory: coef * (teacher - behaviour logprob) on model tokens,
    plus task_coef * the task's credited reward (see the module docstring)."""
    from flowrl_operators.training.batch import credited_rewards

    rewards = [coef * (t - b) if m else 0.0 for t, b, m in
               zip(teacher_logprobs, trajectory.behaviour_logprobs, trajectory.loss_mask, strict=True)]
    if task_coef:
        task, _ = credited_rewards(trajectory)
        rewards = [r + task_coef * x for r, x in zip(rewards, task, strict=True)]
    return rewards


def check_vocabulary(teacher: str, student: str, node: str) -> None:
    """Raise a ConfigError at `nodes.<node>.model.path` unless the teacher's checkpoint exists and
    shares the student's tokenizer: distillation compares their logprobs token id by token id."""
    from flowrl_operators.models import load_config, load_tokenizer, resolve_model

    def refuse(message: str) -> ConfigError:
        return ConfigError(node, ("model", "path"), message)

    try:
        resolve_model(teacher)
    except (FileNotFoundError, ValueError) as e:
        raise refuse(str(e)) from None
    sizes = load_config(teacher).vocab_size, load_config(student).vocab_size
    if sizes[0] != sizes[1]:
        raise refuse(f"the teacher ({teacher}) has a vocabulary of {sizes[0]} ids, the student (model.path "
                     f"{student}) {sizes[1]}; a teacher must use the student's tokenizer")
    ours, theirs = load_tokenizer(teacher), load_tokenizer(student)
    for what in ("get_vocab", "get_added_vocab"):
        a, b = getattr(ours, what)(), getattr(theirs, what)()
        if a != b:
            token = next(iter(sorted(set(a.items()) ^ set(b.items()))))[0]
            raise refuse(f"the teacher ({teacher}) and the student (model.path {student}) tokenize "
                         f"differently (first differing token {token!r}); a teacher must use the student's tokenizer")
    if ours.eos_token_id != theirs.eos_token_id:
        raise refuse(f"the teacher ({teacher}) ends text with token {ours.eos_token_id}, the student with "
                     f"{theirs.eos_token_id}; a teacher must use the student's tokenizer")


class Teacher(Reference):
    """Per-token rewards from a teacher model: the negative reverse KL (on-policy distillation)."""

    Config = TeacherConfig  # kind, ports and resources are the reference node's
    config: TeacherConfig
    provides: ClassVar = frozenset()  # token rewards, not reference logprobs

    def __init__(self, config: TeacherConfig, context: OperatorContext) -> None:
        super().__init__(config, context)
        self.tokens, self.kl_sum = 0, 0.0
        self.recent: deque[tuple[int, float]] = deque(maxlen=64)  # (tokens, KL sum) of the last groups

    def model_path(self) -> str:
        return self.config.model.path

    async def setup(self) -> None:
        await asyncio.to_thread(check_vocabulary, self.model_path(), self.context.model["path"], self.context.node)
        await super().setup()

    def _score(self, group: Group) -> None:
        trajectories = [t for t in group.trajectories if t.response_ids]
        tokens, kl = 0, 0.0
        for traj, teacher in zip(trajectories, self.logprobs(trajectories), strict=True):
            traj.token_rewards = distill_rewards(traj, teacher, self.config.coef, self.config.task_coef)
            for t, b, m in zip(teacher, traj.behaviour_logprobs, traj.loss_mask, strict=True):
                tokens, kl = tokens + m, kl + (b - t if m else 0.0)
        self.tokens, self.kl_sum = self.tokens + tokens, self.kl_sum + kl
        self.recent.append((tokens, kl))

    def metrics(self) -> dict[str, float]:
        """Model tokens scored, and the mean reverse KL estimate (behaviour - teacher logprob) per
        token: since setup, and over the last 64 groups (the trend while the student learns)."""
        if not self.tokens:
            return {}
        recent_tokens = sum(n for n, _ in self.recent)
        return {"teacher/tokens": float(self.tokens), "teacher/reverse_kl": self.kl_sum / self.tokens,
                "teacher/reverse_kl_recent": sum(k for _, k in self.recent) / max(recent_tokens, 1)}
