"""The typed records that flow on edges.

A `Trajectory` is one generated sequence (one episode of one sample). Trajectories of one prompt
form a group (`group_id`); channels move whole groups so group-relative advantages always see the
complete group. Records are msgspec Structs: cheap to encode on the wire and in the ledger, and
packed into tensors only at the trainer.
"""

from __future__ import annotations

from typing import Any

import msgspec

from flowrl.data.images import ImageRef

INVALID = "invalid"  # Trajectory.metadata key: why its reward is a stand-in (flowrl/runtime/untrained.py)
# Trajectory.metadata key: an extra greedy sample of its group (generate's `greedy_baseline`), the
# baseline of ReMax; the train node masks it out of the loss.
GREEDY_BASELINE = "greedy_baseline"


class Turn(msgspec.Struct, array_like=True):
    """A span `[start, end)` of response tokens produced by the model in one turn."""

    start: int
    end: int


class SamplingSpan(msgspec.Struct, array_like=True, frozen=True):
    """Response tokens `[start, end)` were drawn from softmax(logits / temperature) restricted to the
    `top_k` most likely tokens (all if <= 0), then to the smallest head of those whose mass reaches
    `top_p`, as the engine samples (flowrl_operators.sampling). Temperature 0 is greedy: the
    engine reports the logprob at temperature 1 over the full vocabulary, and so does the trainer."""

    start: int
    end: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1


class Trajectory(msgspec.Struct, kw_only=True):
    id: str
    group_id: str
    sample_id: str
    prompt_ids: list[int]
    response_ids: list[int]
    # 1 for tokens the model produced (trained on), 0 for environment / tool tokens.
    loss_mask: list[int]
    # Logprob of each response token under the distribution the engine sampled from.
    behaviour_logprobs: list[float]
    # Policy version that produced each response token (partial rollout mixes versions).
    versions: list[int]
    turns: list[Turn] = []
    # Images whose placeholder tokens appear in prompt_ids + response_ids, in order (the prompt's,
    # then each observation's); pixels are in the run's image store (flowrl.data.images).
    images: list[ImageRef] = []
    # How the model tokens were sampled, one span per engine call (merged while the parameters stay
    # the same). The trainer and the reference compute logprobs under these distributions; a
    # response token outside every span counts as temperature 1, full vocabulary. The generate node
    # stamps its own sampling over a trajectory whose workflow recorded none.
    sampling: list[SamplingSpan] = []
    # Rewards at three granularities. Training credits the finest one set (token, else turn, else
    # sequence); `reward` next to finer rewards is their total, for metrics and filters.
    reward: float | None = None
    turn_rewards: list[float] | None = None
    token_rewards: list[float] | None = None
    finish_reason: str = "stop"
    # Filled by downstream nodes.
    reference_logprobs: list[float] | None = None
    # The behaviour policy's K most likely tokens at each response token, most likely first, and
    # their logprobs (generate `sampling.top_logprobs: K`; see engine SamplingParams): one list per
    # response token, empty where none was recorded (environment tokens); None when none was.
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
    values: list[float] | None = None
    # The data step this trajectory was generated for.
    step: int = 0
    # INVALID (a key) -> why a node could not score it (its reward stands in, e.g. zeroed after the
    # user's reward raised); a train step whose every trajectory is invalid trained nothing.
    metadata: dict[str, Any] = {}

    @property
    def oldest_version(self) -> int:
        """The oldest policy version among the model's tokens (what a record's staleness is measured from)."""
        model_versions = [v for v, m in zip(self.versions, self.loss_mask, strict=True) if m]
        return min(model_versions) if model_versions else (min(self.versions) if self.versions else 0)

    def validate(self) -> None:
        n = len(self.response_ids)
        for name in ("loss_mask", "behaviour_logprobs", "versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"trajectory {self.id}: {name} has {len(getattr(self, name))} entries, response has {n}"
                )
        if (self.top_ids is None) != (self.top_logprobs is None):
            raise ValueError(f"trajectory {self.id}: top_ids and top_logprobs are set together")
        if self.top_ids is not None and (len(self.top_ids) != n or len(self.top_logprobs) != n or any(
                len(i) != len(lp) for i, lp in zip(self.top_ids, self.top_logprobs, strict=True))):
            raise ValueError(f"trajectory {self.id}: top_ids / top_logprobs need one equal-length list per "
                             f"response token ({n})")
        if self.token_rewards is not None and len(self.token_rewards) != n:
            raise ValueError(f"trajectory {self.id}: token_rewards length != response length")
        if any(not 0 <= s.start <= s.end <= n for s in self.sampling):
            raise ValueError(f"trajectory {self.id}: a sampling span lies outside the response ({n} tokens)")
        if self.turn_rewards is not None and len(self.turn_rewards) != len(self.turns):
            raise ValueError(f"trajectory {self.id}: turn_rewards length != number of turns")


class Group(msgspec.Struct, kw_only=True):
    """The trajectories of one sample: the unit a channel moves (group integrity)."""

    id: str
    step: int
    trajectories: list[Trajectory]

    @property
    def oldest_version(self) -> int:
        return min((t.oldest_version for t in self.trajectories), default=0)


_encoder = msgspec.msgpack.Encoder()
_group_decoder = msgspec.msgpack.Decoder(Group)


def encode_group(group: Group) -> bytes:
    return _encoder.encode(group)


def decode_group(data: bytes) -> Group:
    return _group_decoder.decode(data)
