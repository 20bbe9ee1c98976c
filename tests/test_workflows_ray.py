"""An agent in its own Ray actor process plays an episode over loopback HTTP through the proxy of a
generate node that is itself a Ray actor (a third process); the recorded ids are the engine's."""

from __future__ import annotations

import os

import msgspec
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from test_proxy import MODEL, guess_agent, tap  # noqa: E402

from flowrl.operator import OperatorContext  # noqa: E402
from flowrl_operators.config import GenerateConfig  # noqa: E402
from flowrl_operators.generate import Generate  # noqa: E402
from flowrl_operators.tasks import guess_number  # noqa: E402
from flowrl_operators.workflows.proxy import Call  # noqa: E402

# --- across processes: generate node and agent are separate Ray actors ----------------------------------


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 * 1024**2,
                 ignore_reinit_error=True, log_to_driver=False)
    return ray


async def remote_agent(base_url: str, sample: dict, actor_name: str) -> float:
    """Hands the episode to an agent living in another process (a named Ray actor)."""
    import ray

    return await ray.get_actor(actor_name).play.remote(base_url, sample)


def test_agent_in_another_process_through_ray(ray_cluster):
    ray = ray_cluster

    @ray.remote(num_cpus=0.1)
    class Agent:
        async def play(self, base_url: str, sample: dict) -> float:
            import os

            self.pid = os.getpid()
            return await guess_agent(base_url, sample)

        def where(self) -> int:
            return self.pid

    @ray.remote(num_cpus=0.1)
    class Rollout:
        async def setup(self) -> int:
            import os

            import torch

            torch.set_num_threads(1)
            config = msgspec.convert({"group_size": 2, "workflow": "agent",
                                      "workflow_args": {"agent": "test_workflows_ray:remote_agent", "actor_name": "agent-7"},
                                      "sampling": {"temperature": 1.0, "max_new_tokens": 4}}, GenerateConfig)
            self.op = Generate(config, OperatorContext(node="rollout", model={"path": MODEL}, seed=5))
            await self.op.setup()
            proxy = self.op.services["proxy"]
            self.calls: list[Call] = []
            close = proxy.close_session

            def keep(session_id):
                calls = close(session_id)
                self.calls.extend(calls)
                return calls

            proxy.close_session = keep
            self.produced = tap(self.op.engine)
            return os.getpid()

        async def generate(self, sample: dict):
            return await self.op.generate(sample, step=0, sample_id="0:0")

        async def records(self) -> tuple[list, list]:
            return [(c.prompt_ids, c.output_ids, c.logprobs) for c in self.calls], self.produced

        async def close(self) -> None:
            await self.op.close()

    # The workers import this test module (the agent function): put tests/ on their path.
    env = {"env_vars": {"PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]),
                        "HF_HUB_OFFLINE": "1"}}
    agent = Agent.options(name="agent-7", runtime_env=env).remote()
    rollout = Rollout.options(runtime_env=env).remote()
    rollout_pid = ray.get(rollout.setup.remote(), timeout=120)
    sample = guess_number(seed=2).sample(0, 1)
    group = ray.get(rollout.generate.remote(sample), timeout=120)
    assert ray.get(agent.where.remote()) not in (rollout_pid, os.getpid())  # three processes
    assert len(group.trajectories) == 2
    calls, produced = ray.get(rollout.records.remote(), timeout=60)
    assert calls and sorted(calls) == sorted(produced)  # recorded = what the engine produced
    recorded = [output for _, output, _ in calls]
    for t in group.trajectories:
        for turn in t.turns:
            assert t.response_ids[turn.start:turn.end] in recorded
        assert t.loss_mask.count(1) == sum(turn.end - turn.start for turn in t.turns)
    ray.get(rollout.close.remote())
    ray.kill(agent)
    ray.kill(rollout)
