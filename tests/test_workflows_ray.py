"""Under the Ray executor (every stage an actor), an agent in yet another Ray actor process plays
guess-the-number over loopback HTTP through the generate node's proxy; the trajectories the learner
receives hold exactly the ids and logprobs the engine produced."""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from test_proxy import guess_agent  # noqa: E402

TESTS = os.path.dirname(os.path.abspath(__file__))
RUNTIME_ENV = {"env_vars": {"PYTHONPATH": os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]),
                            "HF_HUB_OFFLINE": "1"}}


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    # Workers import the test modules (agents, the stand-in learner) by name.
    os.environ["PYTHONPATH"] = os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")])
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 * 1024**2,
                 ignore_reinit_error=True, log_to_driver=False)
    return ray


async def remote_agent(base_url: str, sample: dict, actor_name: str) -> float:
    """Hands the episode to an agent living in another process (a named Ray actor)."""
    import ray

    return await ray.get_actor(actor_name).play.remote(base_url, sample)


class TappedAgent:
    """The agent workflow, plus a tap that logs what the engine returned for every request."""

    needs_proxy = True

    def __init__(self, tap_dir: str, **args) -> None:
        from flowrl_operators.workflows import AgentWorkflow

        self.inner = AgentWorkflow("test_workflows_ray:remote_agent", **args)
        self.tap_dir = tap_dir
        self.tapped = False

    async def __call__(self, ctx, sample):
        if not self.tapped:
            self.tapped = True
            generate = ctx.engine.generate
            path = os.path.join(self.tap_dir, f"engine-{os.getpid()}.jsonl")

            async def tapped(request):
                result = await generate(request)
                with open(path, "a") as f:
                    f.write(json.dumps({"input_ids": list(request.input_ids), "output_ids": result.output_ids,
                                        "logprobs": result.logprobs, "pid": os.getpid()}) + "\n")
                return result

            ctx.engine.generate = tapped
        return await self.inner(ctx, sample)


def test_agent_episodes_under_the_ray_executor(ray_cluster, tmp_path):
    import test_workflows_pipeline as pipeline

    from flowrl.graph.compile import compile_file
    from flowrl.runtime.run import run

    ray = ray_cluster

    @ray.remote(num_cpus=0)
    class Agent:
        async def play(self, base_url: str, sample: dict) -> float:
            self.pid = os.getpid()
            return await guess_agent(base_url, sample, turns=2)

        def where(self) -> int:
            return self.pid

    agent = Agent.options(name="agent-9", runtime_env=RUNTIME_ENV).remote()
    spec = tmp_path / "agent.yaml"
    spec.write_text(pipeline.SPEC.read_text().replace("workflow: builtin:guess_number",
                                                      "workflow: test_workflows_ray:TappedAgent").replace(
        "workflow_args: {max_turns: 3}", f"workflow_args: {{tap_dir: '{tmp_path}', actor_name: agent-9}}"))
    plan = compile_file(str(spec), ["nodes.learner.op=test_workflows_pipeline:Learner", "run.executor=ray"]).plan
    result = run(plan, run_dir=tmp_path / "run", progress=False)
    assert result.status == "done" and result.steps == 2
    produced = [json.loads(line) for p in tmp_path.glob("engine-*.jsonl") for line in p.read_text().splitlines()]
    rows = [json.loads(line) for line in (tmp_path / "run" / "learner.jsonl").read_text().splitlines()]
    assert len(rows) == 8 and produced
    generate_pid, learner_pid = produced[0]["pid"], rows[0]["pid"]
    assert len({generate_pid, learner_pid, ray.get(agent.where.remote()), os.getpid()}) == 4
    for row in rows:  # every model span is an engine output for exactly the context before it
        full = row["prompt_ids"] + row["response_ids"]
        for start, end in row["turns"]:
            context = full[:len(row["prompt_ids"]) + start]
            match = [p for p in produced if p["input_ids"] == context and p["output_ids"] == row["response_ids"][start:end]]
            assert match and match[0]["logprobs"] == row["logprobs"][start:end]
            assert row["loss_mask"][start:end] == [1] * (end - start)
        assert sum(row["loss_mask"]) == sum(end - start for start, end in row["turns"])
        assert set(row["versions"]) == {row["step"]}
    ray.kill(agent)
