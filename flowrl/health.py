"""Learning health: the conditions in a run's metrics stream that stall RL, each with the step it began.

`Health` reads metrics.jsonl rows one at a time (the coordinator feeds it every train step, so its
events reach metrics.jsonl with the row of the step that found them; `flowrl inspect` replays it on
runs recorded before it existed) and returns events: `{"condition", "event": "began" | "ended",
"step" (where it began / ended), "at" (the step that found it), "message"}`. Conditions:

- `entropy_collapse`: the policy's mean token entropy stays at or below ENTROPY_RATIO of its start:
  it samples almost greedily, stops exploring, and learning stalls with it.
- `tied_groups`: at least TIED_SHARE of the groups have rewards that all tie (zero variance): a
  group-relative estimator (GRPO, RLOO, ...) gives them zero advantage, no learning signal.
- `reward_plateau`: the batch reward's block means stop rising for PLATEAU_BLOCKS blocks.
- `mismatch_growth`: the train/inference mismatch (mean |trainer - engine| logprob per token) grows
  to MISMATCH_GROWTH times its start and above MISMATCH_FLOOR.
- `high_clip`: the PPO clip fraction stays at or above CLIP_HIGH.

Entropy collapse, tied groups and a plateau are not judged while the run is near solved (its batch
reward SOLVED_SHARE of the way from its start to the best trajectory's reward, the row's
`reward_max`): a converged policy shows the same signs. It reads these keys of a row: `step`,
`reward`, `reward_max`, and of `train` the metrics its node declares for each role
(`Operator.metric_roles`, flowrl.operator.MetricRoles: entropy, tied groups, clip fraction,
mismatch); a run recorded before nodes declared them is read with the built-in train operator's
names (BUILTIN_ROLES), and a node that declares none is not judged. Only policy-gradient steps are
judged: those whose train metrics carry the declared `policy_gradient` metric (the built-in's
`mismatch_logprob_mean`, which a supervised step, with no behaviour policy, never reports); a
supervised step drives entropy down and its reward to a ceiling by design. A condition that clears for as many steps as it took to begin
ends; it may begin again later. Pure and small: no flowrl_operators import, no I/O; its state is
plain data (`state()` / `restore()`, kept in checkpoints so a resumed run judges as an uninterrupted one).
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

from flowrl.operator import MetricRoles

# Why each value: these name conditions, they do not stop a run, so each errs toward a condition
# that has clearly set in, over a window long enough that one noisy batch cannot raise it.
REFERENCE_STEPS = 5  # a run's "start" of entropy and mismatch: the mean of its first 5 policy-gradient steps
# Entropy at a fifth of its start: in the quickstart's stalled runs entropy fell from 0.021 to 0.0036
# (0.17x) as the greedy eval froze at 0.80; entropy falling by 5x means most sampled positions no
# longer try an alternative (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs":
# performance saturates as entropy is exhausted).
ENTROPY_RATIO = 0.2
ENTROPY_STEPS = 10
# Half the groups tied: the batch carries under half its nominal signal, the gradient's noise at
# least doubles; DAPO's dynamic sampling (flowrl_operators.filters) exists to refill such batches.
TIED_SHARE = 0.5
TIED_STEPS = 10
# Reward plateau: block means of 25 steps; no block for 6 blocks (150 steps) above the best one by
# PLATEAU_GAIN of the way it rose so far (at least PLATEAU_MIN_GAIN, for rewards on a 0..1 scale,
# one percentage point). The quickstart's 600 flat steps at 0.80-0.83 are four such plateaus long,
# while its rise (0.23 -> 0.73 in 250 steps) gains more than that every block.
PLATEAU_BLOCK = 25
PLATEAU_BLOCKS = 6
PLATEAU_GAIN = 0.05
PLATEAU_MIN_GAIN = 0.01
# Mismatch: fp32 engine and trainer agree to ~1e-5 nats a token, bf16 ones to ~1e-3; at 0.01 the
# importance ratio of a typical token is off by 1%, and doubling from the start means it is drifting
# (stale weights, a kernel that diverges as the policy sharpens), not noise.
MISMATCH_GROWTH = 2.0
MISMATCH_FLOOR = 0.01
MISMATCH_STEPS = 20
# Clip fraction: with one epoch on fresh samples the ratio starts at ~1 and few tokens clip; a fifth
# of the tokens clipped for 20 steps in a row means steps too large for the trust region (learning
# rate, staleness) and those tokens get no gradient. PPO practice treats 0.1-0.2 as the upper edge.
CLIP_HIGH = 0.2
CLIP_STEPS = 20
# Solved: a converged run shows the signs of a stalled one (entropy spent, groups tied because every
# sample is right, a flat reward), so those three are not judged while the batch reward has come
# SOLVED_SHARE of the way from its start (the first REFERENCE_STEPS steps) to the best reward any
# single trajectory reached (`reward_max` of the rows). Measured on two whole runs of the quickstart
# (sampled rewards, temperature 1; both reached a trajectory reward of 1.0 from a start of ~0.2):
# seed 0 converged (greedy eval 0.92-0.93) at 84-92% of the way over its last 550 steps, seed 9
# stalled (eval 0.78-0.80) at 68-74%.
SOLVED_SHARE = 0.8
SOLVED_CONDITIONS = ("entropy_collapse", "tied_groups", "reward_plateau")

CONDITIONS = ("entropy_collapse", "tied_groups", "reward_plateau", "mismatch_growth", "high_clip")
HINTS = {
    "entropy_collapse": "the policy samples almost greedily and stops exploring: raise the entropy bonus "
                        "(loss.entropy_coef) or lower the learning rate",
    "tied_groups": "no sample in them did better than another, so they carry no learning signal: sample more "
                   "per group, use harder or easier prompts, or drop them (op: dynamic_sampling)",
    "reward_plateau": "the batch reward stopped rising",
    "mismatch_growth": "the trainer and the engine disagree more and more on the sampled tokens' logprobs "
                       "(behind an async edge this includes how far the policy moved over the staleness)",
    "high_clip": "steps leave the trust region: lower the learning rate or the staleness",
}


# The built-in train operator's names (flowrl_operators.training.reported.ROLES; test_health_declared.py
# holds the two equal): how a run recorded before operators declared their metrics is read.
BUILTIN_ROLES = MetricRoles(entropy="entropy", clip_fraction="clip_fraction", mismatch="mismatch_logprob_mean",
                            tied_groups="tied_group_fraction", policy_kl="policy_kl", grad_norm="grad_norm",
                            policy_gradient="mismatch_logprob_mean")
# Where each judged role's values are kept in the detector's state: the built-in names, which
# checkpoints written before roles were declared hold.
KEYS = {"entropy": "entropy", "tied_groups": "tied_group_fraction", "clip_fraction": "clip_fraction",
        "mismatch": "mismatch_logprob_mean"}


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


class Streak:
    """Consecutive steps a predicate held (or failed, once begun); plain data for `Health.state`."""

    def __init__(self, steps: int) -> None:
        self.steps, self.run, self.first, self.active = steps, 0, None, False

    def update(self, step: int, holds: bool) -> str | None:
        """'began' when it has held `steps` steps in a row, 'ended' when it then failed as long."""
        if holds != self.active:
            self.run += 1
            self.first = step if self.run == 1 else self.first
        else:
            self.run, self.first = 0, None
        if self.run >= self.steps:
            self.active, self.run = not self.active, 0
            return "began" if self.active else "ended"
        return None


class Health:
    """The health of one train node's run, step by step, reading its metrics by the roles it declared."""

    def __init__(self, roles: MetricRoles = BUILTIN_ROLES) -> None:
        self.roles = roles
        self.steps = 0  # policy-gradient steps seen
        self.reference: dict[str, list[float]] = {"entropy": [], "mismatch_logprob_mean": []}
        self.streaks = {"entropy_collapse": Streak(ENTROPY_STEPS), "tied_groups": Streak(TIED_STEPS),
                        "mismatch_growth": Streak(MISMATCH_STEPS), "high_clip": Streak(CLIP_STEPS)}
        self.block: list[float] = []
        self.blocks: list[float] = []  # block means of the reward
        self.best: tuple[float, int] | None = None  # (best block mean, the step after that block)
        self.plateau = False
        self.last: dict[str, float] = {}  # each judged value at the latest step, for messages
        self.start: list[float] = []  # the batch reward of the first REFERENCE_STEPS steps
        self.top: float | None = None  # the best single trajectory's reward so far (rows' reward_max)

    def update(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        train = row.get("train") or {}
        gate = self.roles.policy_gradient
        if gate is not None and _number(train.get(gate)) is None:
            return []  # not a policy-gradient step
        judged = self._judged(train)
        step = int(row["step"])
        self.steps += 1
        for key, values in self.reference.items():
            if len(values) < REFERENCE_STEPS and judged.get(key) is not None:
                values.append(judged[key])
        reward, best = _number(row.get("reward")), _number(row.get("reward_max"))
        if reward is not None and len(self.start) < REFERENCE_STEPS:
            self.start.append(reward)
        if best is not None:
            self.top = best if self.top is None else max(self.top, best)
        events = []
        for condition, holds in self._holds(judged).items():
            if holds and condition in SOLVED_CONDITIONS and self.solved(reward):
                holds = False
            streak = self.streaks[condition]
            what = streak.update(step, holds) if holds is not None else None
            if what is not None:
                events.append(self._event(condition, what, streak.first, step))
        events += self._plateau(step, reward)
        return events

    def solved(self, reward: float | None) -> bool:
        """Whether `reward` is near the best this run has seen a trajectory reach (SOLVED_SHARE of
        the way from its start): there the signs of a stall are those of a solved task."""
        if reward is None or self.top is None or len(self.start) < REFERENCE_STEPS:
            return False
        start = sum(self.start) / len(self.start)
        return self.top > start and reward - start >= SOLVED_SHARE * (self.top - start)

    def _judged(self, train: dict[str, Any]) -> dict[str, float | None]:
        """The step's value of each judged role, under the detector's keys (KEYS); None: not reported."""
        names = self.roles.names()
        return {key: _number(train.get(names[role])) if role in names else None for role, key in KEYS.items()}

    def _holds(self, judged: dict[str, float | None]) -> dict[str, bool | None]:
        """Whether each windowed condition holds at this step (None: not measurable)."""
        entropy, tied = judged["entropy"], judged["tied_group_fraction"]
        clip, mismatch = judged["clip_fraction"], judged["mismatch_logprob_mean"]
        self.last.update({k: v for k, v in judged.items() if v is not None})
        start_entropy, start_mismatch = self._reference("entropy"), self._reference("mismatch_logprob_mean")
        return {
            "entropy_collapse": None if entropy is None or start_entropy is None
            else entropy <= ENTROPY_RATIO * start_entropy,
            "tied_groups": None if tied is None else tied >= TIED_SHARE,
            "mismatch_growth": None if mismatch is None or start_mismatch is None
            else mismatch >= max(MISMATCH_FLOOR, MISMATCH_GROWTH * start_mismatch),
            "high_clip": None if clip is None else clip >= CLIP_HIGH,
        }

    def _reference(self, key: str) -> float | None:
        values = self.reference[key]
        return sum(values) / len(values) if len(values) >= REFERENCE_STEPS else None

    def _plateau(self, step: int, reward: float | None) -> list[dict[str, Any]]:
        if reward is None:
            return []
        self.block.append(reward)
        if len(self.block) < PLATEAU_BLOCK:
            return []
        mean, self.block = sum(self.block) / len(self.block), []
        self.blocks.append(mean)
        self.last["reward"] = mean
        gain = max(PLATEAU_GAIN * (self.best[0] - self.blocks[0]), PLATEAU_MIN_GAIN) if self.best else 0.0
        if self.best is None or mean > self.best[0] + gain:
            self.best = (mean, step + 1)
            if self.plateau:
                self.plateau = False
                return [self._event("reward_plateau", "ended", step, step)]
            return []
        if self.plateau and self.solved(mean):
            self.plateau = False
            return [self._event("reward_plateau", "ended", step, step)]
        if not self.plateau and (step + 1 - self.best[1]) >= PLATEAU_BLOCKS * PLATEAU_BLOCK \
                and not self.solved(mean):
            self.plateau = True
            return [self._event("reward_plateau", "began", self.best[1], step)]
        return []

    def _event(self, condition: str, what: str, since: int | None, step: int) -> dict[str, Any]:
        since = step if since is None else since
        return {"condition": condition, "event": what, "step": since, "at": step,
                "message": self._message(condition, what, since)}

    def _message(self, condition: str, what: str, since: int) -> str:
        name = condition.replace("_", " ")
        if what == "ended":
            return f"{name} ended at step {since}"
        last = self.last
        facts = {
            "entropy_collapse": lambda: f"entropy {last.get('entropy', 0):.3g}, under {ENTROPY_RATIO:g}x its "
                                        f"start {self._reference('entropy') or 0:.3g}",
            "tied_groups": lambda: f"{last.get('tied_group_fraction', 0):.0%} of groups tied (zero reward variance)",
            "reward_plateau": lambda: f"reward {last.get('reward', 0):.3f} over the last {PLATEAU_BLOCK} steps, "
                                      f"best {self.best[0] if self.best else 0:.3f}",
            "mismatch_growth": lambda: f"mismatch {last.get('mismatch_logprob_mean', 0):.3g} nats a token, "
                                       f"{self._reference('mismatch_logprob_mean') or 0:.3g} at the start",
            "high_clip": lambda: f"clip fraction {last.get('clip_fraction', 0):.2f}",
        }
        return f"{name} from step {since}: {facts[condition]()}; {HINTS[condition]}"

    def state(self) -> dict[str, Any]:
        return {"steps": self.steps, "reference": self.reference, "block": self.block, "blocks": self.blocks,
                "best": self.best, "plateau": self.plateau, "last": self.last, "start": self.start, "top": self.top,
                "streaks": {k: vars(s) for k, s in self.streaks.items()}}

    def restore(self, state: dict[str, Any]) -> None:
        for key in ("steps", "reference", "block", "blocks", "best", "plateau", "last"):
            setattr(self, key, state[key])
        self.start, self.top = list(state.get("start", [])), state.get("top")  # absent: a checkpoint from before
        for key, values in state["streaks"].items():
            vars(self.streaks[key]).update(values)


def replay(rows: list[dict[str, Any]], roles: dict[str, MetricRoles] | None = None) -> list[dict[str, Any]]:
    """Every event of a metrics stream, as the run would have recorded them (one detector per node):
    each node judged by the roles it declared (`roles`, as the run recorded them: a node missing is
    not judged), or, for a run recorded before nodes declared them (None), by BUILTIN_ROLES."""
    detectors: dict[str, Health] = {}
    events = []
    for row in rows:
        node = str(row.get("node"))
        declared = BUILTIN_ROLES if roles is None else roles.get(node)
        if declared is not None:
            events += [e | {"node": node} for e in detectors.setdefault(node, Health(declared)).update(row)]
    return events


def recorded_roles(value: Any) -> dict[str, MetricRoles] | None:
    """The roles a run recorded (meta.json `metric_roles`: node -> MetricRoles as JSON), None where
    it recorded none (a run from before operators declared them)."""
    if not isinstance(value, dict):
        return None
    return {node: msgspec.convert(roles, MetricRoles) for node, roles in value.items() if isinstance(roles, dict)}


def recorded(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events a run wrote into its rows (`row["health"]`)."""
    return [event for row in rows for event in row.get("health") or []]


def active(events: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The conditions still on after these events, by name: the event each began with."""
    on: dict[str, dict[str, Any]] = {}
    for event in events:
        if event["event"] == "began":
            on[event["condition"]] = event
        else:
            on.pop(event["condition"], None)
    return on
