"""Multi-turn graphs through the runtime (in-process executor) with the shipped generate, reward and
sync operators: guess-the-number end to end with real weight updates, and a run that survives an
environment raising mid-episode, a reward raising and a reward hanging past its timeout."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any, ClassVar

import msgspec
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from flowrl.data.trajectory import Group  # noqa: E402
from flowrl.graph.compile import compile_file  # noqa: E402
from flowrl.operator import POLICY, TRAJECTORIES, Operator, Resources, TrainResult  # noqa: E402
from flowrl.runtime.run import run  # noqa: E402
from flowrl_operators.tasks import GuessNumberEnv  # noqa: E402

SPEC = Path(__file__).parent / "pipelines_wf" / "guess_number.yaml"
SEEN: list[dict[str, Any]] = []  # what the learner received, per step (in-process executor)


class LearnerConfig(msgspec.Struct, forbid_unknown_fields=True):
    optim: dict[str, Any] = {}  # accepted (the spec's train keys), unused


class Learner(Operator):
    """Stands in for the train node: checks every trajectory and publishes the policy's weights
    nudged by a step-dependent amount, so each version really changes the engine."""

    kind = "train"
    Config = LearnerConfig
    inputs: ClassVar = {"trajectories": TRAJECTORIES}
    outputs: ClassVar = {"policy": POLICY}
    resources = Resources(cpus=0.1)

    async def setup(self) -> None:
        from safetensors.torch import load_file

        from flowrl_operators.models import resolve_model

        torch.set_num_threads(1)
        # The checkpoint's tensors as a state dict (no transformers import: actors start faster).
        self.weights = load_file(resolve_model(self.context.model["path"]) / "model.safetensors")

    async def train(self, groups: list[Group], *, step: int) -> TrainResult:
        rows = []
        for group in groups:
            for t in group.trajectories:
                t.validate()
                rows.append({"id": t.id, "versions": sorted(set(t.versions)), "turns": len(t.turns),
                             "reward": t.reward, "masked": sum(t.loss_mask), "n": len(t.response_ids)})
        SEEN.append({"step": step, "rows": rows})
        if self.context.run_dir is not None:  # for runs in other processes (Ray executor)
            with open(Path(self.context.run_dir) / "learner.jsonl", "a") as f:
                for group in groups:
                    for t in group.trajectories:
                        f.write(json.dumps({"step": step, "id": t.id, "prompt_ids": t.prompt_ids,
                                            "response_ids": t.response_ids, "loss_mask": t.loss_mask,
                                            "logprobs": t.behaviour_logprobs, "versions": t.versions,
                                            "turns": [[u.start, u.end] for u in t.turns], "reward": t.reward,
                                            "pid": os.getpid()}) + "\n")
        for tensor in self.weights.values():
            tensor.add_(0.01 * (step + 1))
        rewards = [r["reward"] for r in rows]
        return TrainResult(policy=self.weights, metrics={"groups": float(len(groups)),
                                                       "reward": sum(rewards) / max(1, len(rewards))})


class FlakyGuess(GuessNumberEnv):
    """Guess-the-number whose simulator crashes on the first answer of every third episode (after the
    model's tokens: a later turn would be never reached by an episode that guessed right at once)."""

    created = 0

    def reset(self, sample: dict[str, Any]) -> str:
        FlakyGuess.created += 1
        self.crash = FlakyGuess.created % 3 == 0
        return super().reset(sample)

    async def step(self, action: str):
        if self.crash and self.turn == 0:
            raise ConnectionError("simulator went away")
        return await super().step(action)


def flaky_reward(trajectory) -> float:
    """Raises for episode 0 of sample index 1, hangs for episode 1 of sample index 0."""
    index, episode = int(trajectory.sample_id.split(":")[1]), trajectory.metadata["episode"]
    if (index, episode) == (1, 0):
        raise ArithmeticError("reward bug")
    if (index, episode) == (0, 1):
        time.sleep(3)
    return float(trajectory.reward or 0.0) + 1.0


def compiled(tmp_path: Path, *overrides: str):
    return compile_file(str(SPEC), ["nodes.learner.op=test_workflows_pipeline:Learner", *overrides])


def test_guess_number_graph_end_to_end(tmp_path):
    SEEN.clear()
    # A seed under which every episode holds both model tokens and masked observation tokens (the
    # untrained model sometimes ends its reply at once); the sampler's draws decide it.
    plan = compiled(tmp_path, "run.seed=3").plan
    result = run(plan, run_dir=tmp_path / "run", progress=False)
    assert result.status == "done" and result.steps == 2
    assert [s["step"] for s in SEEN] == [0, 1]
    for s in SEEN:
        assert len(s["rows"]) == 4  # 2 samples x group of 2
        for row in s["rows"]:
            assert 1 <= row["turns"] <= 3 and 0 < row["masked"] < row["n"]
            assert row["versions"] == [s["step"]]  # sync edge: generated by the policy it trains
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "step" in r][-2:] == [0, 1]


from flowrl_operators.train import Train  # noqa: E402


class RecordingTrain(Train):
    """The shipped train node, noting the loss-masked tokens of each batch it trains on."""

    async def train(self, groups: list[Group], *, step: int) -> TrainResult:
        SEEN.append({"step": step, "model_tokens": sum(sum(t.loss_mask) for g in groups for t in g.trajectories),
                     "all_tokens": sum(len(t.response_ids) for g in groups for t in g.trajectories)})
        return await super().train(groups, step=step)


def test_guess_number_graph_trains_with_the_train_node(tmp_path):
    SEEN.clear()
    plan = compile_file(str(SPEC), ["nodes.learner.op=test_workflows_pipeline:RecordingTrain"]).plan
    result = run(plan, run_dir=tmp_path / "run", progress=False)
    assert result.status == "done" and result.steps == 2
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if r.get("node") == "learner"]
    assert len(trained) == 2
    for row, seen in zip(trained, SEEN, strict=True):
        # The trainer's loss covered exactly the model's tokens, none of the environment's.
        assert row["train"]["tokens"] == seen["model_tokens"] < seen["all_tokens"]
        assert row["train"]["grad_norm"] > 0


def test_failures_are_isolated_and_counted(tmp_path, monkeypatch):
    """The run finishes although an environment, a reward function and a hanging reward fail."""
    from flowrl.runtime import stage
    from flowrl.runtime.executors.inprocess import InProcessExecutor

    monkeypatch.setattr(stage, "REPORT_EVERY_S", 0.0)  # stages report their counters before every wait

    FlakyGuess.created = 0
    plan = compiled(tmp_path, "nodes.rollout.workflow=test_workflows_pipeline:FlakyGuess",
                    "nodes.score.fn=test_workflows_pipeline:flaky_reward", "nodes.score.timeout_s=0.5",
                    "nodes.score.on_error=zero").plan

    async def main():
        ex = InProcessExecutor(plan, tmp_path, time.time())
        await ex.start(2, None, None, None)
        reason = await ex.wait()
        failures = await ex.join(10)
        ops = {s.node.name: s.op for s in ex.stages}
        metrics = {name: op.metrics() for name, op in ops.items() if hasattr(op, "metrics")}
        errors = (ops["rollout"].last_error, ops["score"].last_error)
        await ex.call("finish")
        await ex.shutdown()
        return reason, failures, metrics, errors

    SEEN.clear()
    reason, failures, metrics, errors = asyncio.run(main())
    assert reason == "done" and failures == []
    gen, score = metrics["rollout"], metrics["score"]
    assert gen["generate/episodes"] == 8 and gen["generate/episode_errors"] == 2  # episodes 3 and 6
    assert "simulator went away" in errors[0]
    trained = [row["id"] for s in SEEN[-2:] for row in s["rows"]]
    assert len(trained) == 6  # 8 episodes minus the 2 crashed ones; the rest all reached the learner
    raised = sum(i.split(":")[1] == "1/0" for i in trained)  # sample index 1, episode 0
    hung = sum(i.split(":")[1] == "0/1" for i in trained)  # sample index 0, episode 1
    assert raised + hung >= 2  # crashes removed at most 2 of the 4 targeted episodes
    assert score["reward/exceptions"] == raised and score["reward/timeouts"] == hung
    assert score["reward/zeroed"] == raised + hung == score["reward/errors"]
    assert score["reward/calls"] == 6
    # The same counts reach metrics.jsonl (operators.<node>) with the step that trained on them.
    last = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()][-1]
    assert last["operators"]["rollout"]["generate/episode_errors"] == 2
    for key in ("reward/exceptions", "reward/timeouts", "reward/errors", "reward/calls"):
        assert last["operators"]["score"][key] == score[key]


def test_dynamic_sampling_between_reward_and_train(tmp_path):
    """Groups whose rewards are all equal never reach the learner; the runtime counts them filtered."""
    spec = tmp_path / "dapo.yaml"
    spec.write_text(SPEC.read_text().replace(
        "  learner:\n", "  keep:\n    op: flowrl_operators.filters:DynamicSampling\n  learner:\n").replace(
        "  - score -> learner\n", "  - score -> keep\n  - keep -> learner\n").replace(
        "group_size: 2", "group_size: 4").replace("batch_size: 2", "batch_size: 4"))
    SEEN.clear()
    plan = compile_file(str(spec), ["nodes.learner.op=test_workflows_pipeline:Learner", "run.seed=3"]).plan
    result = run(plan, run_dir=tmp_path / "run", progress=False)
    assert result.status == "done"
    trained = [row for s in SEEN for row in s["rows"]]
    groups: dict[str, list[float]] = {}
    for row in trained:
        groups.setdefault(row["id"].split("/")[0], []).append(row["reward"])
    assert all(len(set(rewards)) > 1 for rewards in groups.values())  # only informative groups
    # Over the sync edge every dropped group is replaced by an extra sample of its step (runtime/quota.py),
    # so both steps still train on full batches of 4 informative groups.
    assert len(groups) == 8
    assert result.counters["filtered"] >= 1  # this seed ties at least one group
    assert result.counters["oversampled"] == result.counters["filtered"]


def agent_plan(tmp_path: Path, executor: str = "inprocess"):
    """The guess-the-number graph with the episodes played by an openai-client agent (test_proxy)."""
    spec = tmp_path / "agent.yaml"
    spec.write_text(SPEC.read_text().replace("workflow: builtin:guess_number", "workflow: agent").replace(
        "workflow_args: {max_turns: 3}", "workflow_args: {agent: test_proxy:guess_agent, turns: 2}"))
    return compile_file(str(spec), ["nodes.learner.op=test_workflows_pipeline:Learner",
                                    f"run.executor={executor}"]).plan


def test_agent_graph_through_the_proxy(tmp_path):
    SEEN.clear()
    result = run(agent_plan(tmp_path), run_dir=tmp_path / "run", progress=False)
    assert result.status == "done" and result.steps == 2
    for s in SEEN:
        assert len(s["rows"]) == 4
        for row in s["rows"]:
            assert 1 <= row["turns"] <= 2 and row["versions"] == [s["step"]] and row["reward"] in (0.0, 1.0)
