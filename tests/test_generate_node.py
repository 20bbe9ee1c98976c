"""The Generate operator on the embedded engine: groups, per-token versions across weight updates
(whole and partial rollout), isolated environment failures, greedy evaluation, served endpoint."""

from __future__ import annotations

import asyncio
import os

import msgspec
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from flowrl.operator import OperatorContext  # noqa: E402
from flowrl_operators.config import GenerateConfig  # noqa: E402
from flowrl_operators.generate import Generate, TooManyEpisodeErrors  # noqa: E402
from flowrl_operators.tasks import reverse_digits  # noqa: E402

MODEL = "builtin:tiny-qwen2"


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def make(loop, run_dir=None, **config) -> Generate:
    torch.set_num_threads(1)
    op = Generate(msgspec.convert(config, GenerateConfig),
                  OperatorContext(node="rollout", model={"path": MODEL}, seed=11, run_dir=run_dir))
    loop.run_until_complete(op.setup())
    return op


@pytest.fixture(scope="module")
def gen(loop):
    op = make(loop, group_size=4, sampling={"max_new_tokens": 8})
    yield op
    loop.run_until_complete(op.close())


def perturbed(engine, scale: float = 0.5) -> list:
    g = torch.Generator().manual_seed(0)
    return [[(name, p.detach() + scale * torch.randn(p.shape, generator=g)) for name, p in engine.named_parameters()]]


def test_group_of_single_turn_episodes(loop, gen):
    sample = reverse_digits(seed=0).sample(0, 1)
    group = loop.run_until_complete(gen.generate(sample, step=3, sample_id="3:1"))
    assert group.id == "3:1" and group.step == 3 and len(group.trajectories) == 4
    assert [t.id for t in group.trajectories] == ["3:1/0", "3:1/1", "3:1/2", "3:1/3"]
    for i, t in enumerate(group.trajectories):
        assert (t.group_id, t.sample_id, t.step, t.metadata["episode"]) == ("3:1", "3:1", 3, i)
        assert t.metadata["sample"] == sample
        assert t.metadata["text"] == gen.tokenizer.decode(t.response_ids, skip_special_tokens=True)
        assert t.versions == [0] * len(t.response_ids) and len(t.response_ids) <= 8
    again = loop.run_until_complete(gen.generate(sample, step=3, sample_id="3:1"))
    assert [t.response_ids for t in again.trajectories] == [t.response_ids for t in group.trajectories]
    assert len({tuple(t.response_ids) for t in group.trajectories}) > 1  # episodes draw differently


def test_update_weights_stamps_new_version(loop):
    op = make(loop, group_size=2, sampling={"temperature": 0.0, "max_new_tokens": 6})
    try:
        sample = reverse_digits(seed=0).sample(0, 0)
        before = loop.run_until_complete(op.generate(sample, step=0, sample_id="0:0"))
        loop.run_until_complete(op.update_weights(perturbed(op.engine), 1))
        after = loop.run_until_complete(op.generate(sample, step=1, sample_id="0:0"))
        assert all(t.versions == [1] * len(t.response_ids) for t in after.trajectories)
        assert before.trajectories[0].response_ids != after.trajectories[0].response_ids
        assert op.metrics()["generate/weight_updates"] == 1
        with pytest.raises(Exception, match="not a weights record"):
            loop.run_until_complete(op.update_weights(object(), 2))
        from flowrl_operators.transport import InProcessSender

        record = InProcessSender().send(perturbed(op.engine, 0.1), 2)  # what a sync node sends
        loop.run_until_complete(op.update_weights(record, 2))
        assert op.engine.version == 2 and op.metrics()["sync/version"] == 2
    finally:
        loop.run_until_complete(op.close())


@pytest.mark.parametrize("mode", ["retract", "abort"])
def test_partial_rollout_mixes_versions_within_a_trajectory(loop, mode):
    op = make(loop, group_size=6, partial_rollout=True, pause_mode=mode, sampling={"max_new_tokens": 400})

    async def main():
        task = asyncio.ensure_future(op.generate({"prompt": "7"}, step=0, sample_id="0:0"))
        while op.engine.stats()["running"] < 6:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)
        await op.pause()
        await op.update_weights(perturbed(op.engine, 0.05), 1)
        await op.resume()
        return await task

    try:
        group = loop.run_until_complete(main())
    finally:
        loop.run_until_complete(op.close())
    mixed = [t for t in group.trajectories if 0 in t.versions and 1 in t.versions]
    assert mixed, [t.versions for t in group.trajectories]
    for t in mixed:
        switch = t.versions.index(1)
        assert t.versions == [0] * switch + [1] * (len(t.versions) - switch)  # old tokens first, then new
        assert t.oldest_version == 0 and len(t.turns) == 1 and t.turns[0].end == len(t.response_ids)


class BrokenOnSecondTurn:
    instances = 0

    def reset(self, sample):
        BrokenOnSecondTurn.instances += 1
        self.fail = sample.get("fail_every") and BrokenOnSecondTurn.instances % sample["fail_every"] == 0
        self.turn = 0
        return "go"

    async def step(self, action):
        self.turn += 1
        if self.turn == 2 and self.fail:
            raise RuntimeError("simulator crashed mid-episode")
        return "again", 0.5, self.turn >= 3


class HangsOnSecondTurn(BrokenOnSecondTurn):
    async def step(self, action):
        self.turn += 1
        if self.turn == 2 and self.fail:
            await asyncio.sleep(3600)  # a simulator that never answers
        return "again", 0.5, self.turn >= 3


def test_environment_that_hangs_is_cancelled_and_counted(loop):
    op = make(loop, group_size=2, workflow="test_generate_node:HangsOnSecondTurn", episode_timeout_s=1.0,
              sampling={"max_new_tokens": 3})
    try:
        BrokenOnSecondTurn.instances = 0
        group = loop.run_until_complete(op.generate({"fail_every": 2}, step=0, sample_id="0:0"))
        assert len(group.trajectories) == 1
        m = op.metrics()
        assert m["generate/episode_timeouts"] == 1 and m["generate/episode_errors"] == 1
        assert "episode_timeout_s" in op.last_error
        assert op.engine.stats()["running"] == 0 and op.engine.stats()["waiting"] == 0
    finally:
        loop.run_until_complete(op.close())


def test_greedy_evaluation_takes_its_own_token_budget(loop, gen):
    """data.eval.max_new_tokens reaches the engine for greedy answers only: the untrained model
    writes all 8 tokens of the sampling budget greedily, and 2 under a budget of 2."""
    sample = reverse_digits(seed=0).eval_sample(0)
    whole = loop.run_until_complete(gen.generate(sample, step=-1, sample_id="e:0", greedy=True))
    cut = loop.run_until_complete(gen.generate(sample, step=-1, sample_id="e:0", greedy=True, max_new_tokens=2))
    sampled = loop.run_until_complete(gen.generate(sample, step=0, sample_id="0:0", max_new_tokens=2))
    assert len(whole.trajectories[0].response_ids) == 8 and len(cut.trajectories[0].response_ids) == 2
    assert cut.trajectories[0].response_ids == whole.trajectories[0].response_ids[:2]
    assert max(len(t.response_ids) for t in sampled.trajectories) > 2  # sampling keeps its own budget


def test_environment_that_raises_mid_episode_is_isolated_and_counted(loop):
    op = make(loop, group_size=4, workflow="test_generate_node:BrokenOnSecondTurn", max_episode_errors=3,
              sampling={"max_new_tokens": 3})
    try:
        BrokenOnSecondTurn.instances = 0
        group = loop.run_until_complete(op.generate({"fail_every": 2}, step=0, sample_id="0:0"))
        assert len(group.trajectories) == 2  # two of four episodes crashed; the others are whole
        assert all(len(t.turns) == 3 and t.turn_rewards == [0.5] * 3 for t in group.trajectories)
        m = op.metrics()
        assert m["generate/episode_errors"] == 2 and m["generate/episodes"] == 4
        assert "simulator crashed mid-episode" in op.last_error
        with pytest.raises(TooManyEpisodeErrors, match="simulator crashed"):
            loop.run_until_complete(op.generate({"fail_every": 1}, step=0, sample_id="0:1"))
    finally:
        loop.run_until_complete(op.close())


def test_all_episodes_failing_rejects_the_sample(loop):
    op = make(loop, group_size=2, workflow="test_generate_node:BrokenOnSecondTurn", sampling={"max_new_tokens": 2})
    try:
        assert loop.run_until_complete(op.generate({"fail_every": 1}, step=0, sample_id="0:0")) is None
        assert op.metrics()["generate/rejected_samples"] == 1
        greedy = loop.run_until_complete(op.generate({}, step=0, sample_id="0:1", greedy=True))
        assert len(greedy.trajectories) == 1
    finally:
        loop.run_until_complete(op.close())


def test_serve_openai_writes_endpoint(loop, tmp_path):
    import openai

    op = make(loop, tmp_path, serve_openai=True, sampling={"max_new_tokens": 4})
    try:
        url = (tmp_path / "endpoints" / "rollout.url").read_text()
        assert url.startswith("http://127.0.0.1:") and url.endswith("/v1")

        async def ask():
            client = openai.AsyncOpenAI(base_url=url, api_key="x")
            reply = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
            await client.close()
            return reply

        reply = loop.run_until_complete(ask())
        assert reply.usage.completion_tokens <= 4 and isinstance(reply.choices[0].message.content, str)
    finally:
        loop.run_until_complete(op.close())


def test_generate_over_the_sglang_adapter(loop, tmp_path):
    """The same node with `engine: {kind: sglang, url: ...}` against flowrl's SGLang-compatible
    server: multi-turn episodes, per-token versions after a weight update by tensor."""
    from flowrl_operators.engine.embedded.engine import EmbeddedEngine
    from flowrl_operators.engine.server.server import start_server
    from flowrl_operators.tasks import guess_number

    server_engine = EmbeddedEngine(MODEL, max_slots=8, threads=1)
    runner, port = loop.run_until_complete(start_server(server_engine))
    op = make(loop, group_size=2, workflow="builtin:guess_number", workflow_args={"max_turns": 2},
              engine={"kind": "sglang", "url": f"http://127.0.0.1:{port}"}, sampling={"max_new_tokens": 3})
    try:
        sample = guess_number(seed=0).sample(0, 0)
        group = loop.run_until_complete(op.generate(sample, step=0, sample_id="0:0"))
        assert len(group.trajectories) == 2 and all(len(t.turns) >= 1 for t in group.trajectories)
        loop.run_until_complete(op.update_weights(perturbed(server_engine, 0.1), 1))
        assert server_engine.version == 1
        after = loop.run_until_complete(op.generate(sample, step=1, sample_id="0:0"))
        for t in after.trajectories:
            masked = [v for v, m in zip(t.versions, t.loss_mask, strict=True) if m]
            assert masked and set(masked) == {1}
    finally:
        loop.run_until_complete(op.close())
        loop.run_until_complete(runner.cleanup())
        loop.run_until_complete(server_engine.close())


def test_attached_server_is_loaded_with_the_pipelines_model(loop, tmp_path):
    """A server started from another checkpoint (and already at version 5) serves the pipeline's
    model.path as version 0 once the node attaches: what a later phase starting from an exported
    policy needs. With load_on_attach false it keeps its own weights."""
    from flowrl_operators.engine.embedded.engine import EmbeddedEngine
    from flowrl_operators.engine.server.server import start_server
    from flowrl_operators.engine.sglang.weights import write_checkpoint
    from flowrl_operators.models import resolve_model

    server_engine = EmbeddedEngine(MODEL, max_slots=4, threads=1, version=5)
    policy = {name: t.clone() for name, t in perturbed(server_engine)[0]}
    write_checkpoint(resolve_model(MODEL), tmp_path, dict(policy))
    runner, port = loop.run_until_complete(start_server(server_engine))
    url = f"http://127.0.0.1:{port}"
    try:
        kept = Generate(msgspec.convert({"engine": {"kind": "sglang", "url": url, "load_on_attach": False}},
                                        GenerateConfig), OperatorContext(node="rollout", model={"path": str(tmp_path)}))
        loop.run_until_complete(kept.setup())
        loop.run_until_complete(kept.engine.start())  # the adapter reads the served version on connect
        assert kept.engine.version == 5 and server_engine.version == 5
        loop.run_until_complete(kept.close())
        op = Generate(msgspec.convert({"engine": {"kind": "sglang", "url": url}}, GenerateConfig),
                      OperatorContext(node="rollout", model={"path": str(tmp_path)}))
        loop.run_until_complete(op.setup())
        assert op.engine.version == 0 and server_engine.version == 0
        served = dict(server_engine.named_parameters())
        for name, tensor in policy.items():
            assert torch.equal(served[name], tensor), name
        loop.run_until_complete(op.close())
    finally:
        loop.run_until_complete(runner.cleanup())
        loop.run_until_complete(server_engine.close())


def test_bad_engine_config_is_a_clear_error(loop):
    op = Generate(msgspec.convert({"engine": {"kind": "embedded", "engines": 2}}, GenerateConfig),
                  OperatorContext(node="rollout", model={"path": MODEL}))
    with pytest.raises(ValueError, match="replicas"):
        loop.run_until_complete(op.setup())
    op = Generate(GenerateConfig(), OperatorContext(node="rollout"))
    with pytest.raises(ValueError, match="model.path"):
        loop.run_until_complete(op.setup())
