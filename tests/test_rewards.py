"""Reward node: sync/async, per-sample/batched user functions; raising and hanging functions are
isolated, counted and handled by on_error. Judge grade parsing. Dynamic sampling."""

from __future__ import annotations

import asyncio
import threading
import time

import msgspec
import numpy as np
import pytest
import torch

from flowrl.data.trajectory import Group, Trajectory, Turn
from flowrl.operator import OperatorContext
from flowrl_operators.config import RewardConfig
from flowrl_operators.filters import DynamicSampling, DynamicSamplingConfig
from flowrl_operators.judge import UngradedReply, parse_grade
from flowrl_operators.reward import Reward, RewardFailed

# --- user reward functions (resolved as test_rewards:<name>) -----------------------------------------


def length_reward(t: Trajectory) -> float:
    return len(t.metadata["text"]) / 10


async def async_length_reward(t: Trajectory) -> float:
    await asyncio.sleep(0)
    return len(t.metadata["text"]) / 10


def raises_on_bad(t: Trajectory) -> float:
    if "bad" in t.metadata["text"]:
        raise ValueError("cannot score this")
    return 1.0


def hangs_on_slow(t: Trajectory) -> float:
    if "slow" in t.metadata["text"]:
        time.sleep(2.0)  # a sync function stuck past its timeout: abandoned in its thread
    return 1.0


async def async_hangs_on_slow(t: Trajectory) -> float:
    if "slow" in t.metadata["text"]:
        await asyncio.sleep(30)
    return 1.0


THREADS: list[int] = []


def records_thread(t: Trajectory) -> float:
    THREADS.append(threading.get_ident())
    return 1.0


def takes_a_while(t: Trajectory) -> float:
    time.sleep(0.1)
    return 1.0


def per_turn(t: Trajectory) -> list[float]:
    return [0.5] * len(t.turns)


def as_dict(t: Trajectory) -> dict:
    return {"token_rewards": [0.25] * len(t.response_ids)}


def batched_rank(ts: list[Trajectory]) -> list[float]:
    return [float(i) for i in range(len(ts))]


def wrong_type(t: Trajectory) -> str:
    return "high"


def group(texts: list[str], gid: str = "0:0", rewards: list[float | None] | None = None) -> Group:
    trajectories = [
        Trajectory(id=f"{gid}/{i}", group_id=gid, sample_id=gid, prompt_ids=[1], response_ids=[2, 3],
                   loss_mask=[1, 1], behaviour_logprobs=[-1.0, -1.0], versions=[0, 0], turns=[Turn(0, 2)],
                   reward=None if rewards is None else rewards[i], metadata={"text": text})
        for i, text in enumerate(texts)]
    return Group(id=gid, step=0, trajectories=trajectories)


async def make(fn: str, **config) -> Reward:
    op = Reward(msgspec.convert({"fn": fn, **config}, RewardConfig), OperatorContext(node="score"))
    await op.setup()
    return op


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("fn", ["test_rewards:length_reward", "test_rewards:async_length_reward"])
def test_sync_and_async_functions(fn):
    async def main():
        op = await make(fn)
        out = await op.process({"trajectories": group(["ab", "abcd"])})
        await op.close()
        return out, op.metrics()

    out, metrics = run(main())
    assert [t.reward for t in out["trajectories"].trajectories] == [0.2, 0.4]
    assert metrics["reward/calls"] == 2 and metrics["reward/errors"] == 0
    assert metrics["reward/mean"] == pytest.approx(0.3)


def test_return_shapes_turns_tokens_batched_builtin():
    turns = run(_one("test_rewards:per_turn", group(["a"])))
    assert turns.trajectories[0].turn_rewards == [0.5] and turns.trajectories[0].reward == 0.5
    tokens = run(_one("test_rewards:as_dict", group(["a"])))
    assert tokens.trajectories[0].token_rewards == [0.25, 0.25] and tokens.trajectories[0].reward is None
    batched = run(_one("test_rewards:batched_rank", group(["a", "b", "c"]), batched=True))
    assert [t.reward for t in batched.trajectories] == [0.0, 1.0, 2.0]
    digits = group(["4321", "4300"])
    for t in digits.trajectories:
        t.metadata["sample"] = {"target": "4321"}
    assert [t.reward for t in run(_one("builtin:reverse_digits", digits)).trajectories] == [1.0, 0.5]


async def _one(fn: str, g: Group, **config) -> Group:
    op = await make(fn, **config)
    out = await op.process({"trajectories": g})
    await op.close()
    return out["trajectories"]


def test_raising_function_zero_policy_counts_and_continues():
    async def main():
        op = await make("test_rewards:raises_on_bad", on_error="zero")
        first = await op.process({"trajectories": group(["ok", "bad", "ok"])})
        second = await op.process({"trajectories": group(["ok", "ok"], "0:1")})
        return first, second, op.metrics(), op.last_error

    first, second, metrics, last_error = run(main())
    assert [t.reward for t in first["trajectories"].trajectories] == [1.0, 0.0, 1.0]
    assert [t.reward for t in second["trajectories"].trajectories] == [1.0, 1.0]
    assert metrics["reward/errors"] == 1 and metrics["reward/exceptions"] == 1 and metrics["reward/zeroed"] == 1
    assert "cannot score this" in last_error and "0:0/1" in last_error


def test_raising_function_drop_policy_drops_the_group():
    async def main():
        op = await make("test_rewards:raises_on_bad", on_error="drop")
        dropped = await op.process({"trajectories": group(["ok", "bad"])})
        kept = await op.process({"trajectories": group(["ok"], "0:1")})
        return dropped, kept, op.metrics()

    dropped, kept, metrics = run(main())
    assert dropped == {} and kept["trajectories"].trajectories[0].reward == 1.0
    assert metrics["reward/dropped_groups"] == 1 and metrics["reward/errors"] == 1


def test_fail_policy_and_max_errors_stop_the_run():
    async def fail_now():
        op = await make("test_rewards:raises_on_bad", on_error="fail")
        await op.process({"trajectories": group(["bad"])})

    with pytest.raises(RewardFailed, match="cannot score this"):
        run(fail_now())

    async def threshold():
        op = await make("test_rewards:raises_on_bad", on_error="zero", max_errors=3)
        await op.process({"trajectories": group(["bad", "bad"])})
        assert op.metrics()["reward/errors"] == 2
        await op.process({"trajectories": group(["bad"], "0:1")})

    with pytest.raises(RewardFailed, match="3 reward errors"):
        run(threshold())


@pytest.mark.parametrize("fn", ["test_rewards:hangs_on_slow", "test_rewards:async_hangs_on_slow"])
def test_hanging_function_times_out_and_the_rest_is_scored(fn):
    async def main():
        op = await make(fn, timeout_s=0.3, on_error="zero")
        start = time.perf_counter()
        out = await op.process({"trajectories": group(["ok", "slow", "ok"])})
        elapsed = time.perf_counter() - start
        await op.close()
        return out, op.metrics(), elapsed

    out, metrics, elapsed = run(main())
    assert [t.reward for t in out["trajectories"].trajectories] == [1.0, 0.0, 1.0]
    assert metrics["reward/timeouts"] == 1 and metrics["reward/errors"] == 1
    assert elapsed < 1.5  # the hung call did not hold the group
    if fn.endswith(":hangs_on_slow"):
        assert metrics["reward/abandoned"] == 1


def test_sync_function_scores_a_group_in_one_thread_and_survives_two_hangs():
    async def main():
        THREADS.clear()
        op = await make("test_rewards:records_thread")
        await op.process({"trajectories": group(["a", "b", "c", "d"])})
        await op.close()
        hung = await make("test_rewards:hangs_on_slow", timeout_s=0.2, on_error="zero")
        out = await hung.process({"trajectories": group(["slow", "ok", "slow", "ok"])})
        await hung.close()
        return out, hung.metrics()

    out, metrics = run(main())
    assert len(THREADS) == 4 and len(set(THREADS)) == 1 and THREADS[0] != threading.get_ident()
    assert [t.reward for t in out["trajectories"].trajectories] == [0.0, 1.0, 0.0, 1.0]
    assert metrics["reward/abandoned"] == 2 and metrics["reward/timeouts"] == 2 and metrics["reward/calls"] == 4


def test_queued_groups_wait_for_a_busy_pool_but_not_for_a_hung_one():
    async def main():
        busy = await make("test_rewards:takes_a_while", timeout_s=0.25, concurrency=1)
        # One thread, two groups of three 0.1 s calls: the second group waits 0.3 s in the queue,
        # past timeout_s, while the first one's calls keep finishing: nothing times out.
        queued = await asyncio.gather(*(busy.process({"trajectories": group(["a"] * 3, f"0:{g}")}) for g in range(2)))
        await busy.close()
        hung = await make("test_rewards:hangs_on_slow", timeout_s=0.2, concurrency=1, on_error="zero")
        # The only thread is stuck in an abandoned call: the queued group's calls time out.
        stuck = await asyncio.gather(hung.process({"trajectories": group(["slow"], "1:0")}),
                                     hung.process({"trajectories": group(["ok", "ok"], "1:1")}))
        await hung.close()
        return queued, busy.metrics(), stuck, hung.metrics()

    queued, busy, stuck, hung = run(main())
    assert [t.reward for out in queued for t in out["trajectories"].trajectories] == [1.0] * 6
    assert busy["reward/timeouts"] == 0
    assert [t.reward for out in stuck for t in out["trajectories"].trajectories] == [0.0, 0.0, 0.0]
    assert hung["reward/timeouts"] == 3 and hung["reward/abandoned"] == 1


def test_bad_return_value_is_an_isolated_error():
    async def main():
        op = await make("test_rewards:wrong_type")
        out = await op.process({"trajectories": group(["a"])})
        return out, op.metrics(), op.last_error

    out, metrics, last_error = run(main())
    assert out["trajectories"].trajectories[0].reward == 0.0 and metrics["reward/invalid"] == 1
    assert metrics["reward/exceptions"] == 0 and metrics["reward/errors"] == 1
    assert "return a float" in last_error and "Traceback" not in last_error


VALUES: dict[str, object] = {}  # what `returns_value` gives for a trajectory's text


def returns_value(t: Trajectory) -> object:
    return VALUES[t.metadata["text"]]


async def async_returns_value(t: Trajectory) -> object:
    return VALUES[t.metadata["text"]]


def batched_returns_values(ts: list[Trajectory]) -> list[object]:
    return [VALUES[t.metadata["text"]] for t in ts]


def _scored(value: object, fn: str = "test_rewards:returns_value", **config) -> tuple[Group | None, dict, str]:
    """One group of two: "ok" scores 1.0, "v" scores `value`."""
    VALUES.clear()
    VALUES.update({"ok": 1.0, "v": value})

    async def main():
        op = await make(fn, **config)
        out = await op.process({"trajectories": group(["ok", "v"])})
        await op.close()
        return out.get("trajectories"), op.metrics(), op.last_error or ""

    return run(main())


@pytest.mark.parametrize("value, expected", [
    (np.float32(0.5), 0.5), (np.float64(-0.25), -0.25), (np.int64(2), 2.0), (np.array(1.5), 1.5),
    (torch.tensor(0.75), 0.75), (torch.tensor(3, dtype=torch.int32), 3.0), (7, 7.0),
])
@pytest.mark.parametrize("fn", ["test_rewards:returns_value", "test_rewards:async_returns_value",
                                "test_rewards:batched_returns_values"])
def test_numpy_and_torch_scalars_are_floats(value, expected, fn):
    out, metrics, _ = _scored(value, fn, batched=fn.endswith("values"))
    assert [t.reward for t in out.trajectories] == [1.0, expected]
    assert all(type(t.reward) is float for t in out.trajectories)
    assert metrics["reward/errors"] == 0


INVALID = [
    (float("nan"), "reward is nan"), (float("inf"), "reward is inf"), (-np.inf, "reward is -inf"),
    (np.float32("nan"), "reward is nan"), (torch.tensor(float("inf")), "reward is inf"),
    (None, "reward returned NoneType None"), ("0.5", "reward returned str '0.5'"),
    (True, "reward is a bool (True)"), (False, "reward is a bool (False)"), (np.bool_(True), "is a bool"),
    (torch.tensor(True), "is a bool"), (torch.tensor([1.0, 2.0]), "shape (2,)"), (object(), "return a float"),
    ([0.5, 0.5], "turn_rewards has 2 values for 1 turns"), ([float("nan")], "turn_rewards[0] is nan"),
    ({"reward": float("nan")}, "reward is nan"), ({"turn_rewards": [True]}, "turn_rewards[0] is a bool"),
    ({"token_rewards": [1.0, None]}, "token_rewards[1] is NoneType"), ({"token_rewards": [1.0]}, "1 values for 2"),
    ({"token_rewards": np.array([1.0, 2.0])}, "give a list"), ({"reward": None}, "all None"),
    ({"score": 1.0}, "keys ['score']"),
]


@pytest.mark.parametrize("value, message", INVALID, ids=[m for _, m in INVALID])
def test_invalid_values_are_reward_errors(value, message):
    """NaN, inf, non-numbers and bools are refused like a raising function: zeroed, counted, reported."""
    out, metrics, last_error = _scored(value)
    ok, bad = out.trajectories
    assert ok.reward == 1.0 and bad.reward == 0.0 and bad.turn_rewards is None and bad.token_rewards is None
    assert metrics["reward/invalid"] == metrics["reward/errors"] == metrics["reward/zeroed"] == 1
    assert metrics["reward/exceptions"] == 0 and metrics["reward/mean"] == 0.5
    assert message in last_error and "0:0/1" in last_error and "Traceback" not in last_error


@pytest.mark.parametrize("fn", ["test_rewards:returns_value", "test_rewards:async_returns_value",
                                "test_rewards:batched_returns_values"])
def test_invalid_values_follow_on_error(fn):
    batched = fn.endswith("values")
    out, metrics, _ = _scored(float("nan"), fn, batched=batched, on_error="drop")
    assert out is None and metrics["reward/dropped_groups"] == 1 and metrics["reward/invalid"] == 1
    with pytest.raises(RewardFailed, match="invalid reward: reward is nan"):
        _scored(float("nan"), fn, batched=batched, on_error="fail")
    VALUES["v"] = True
    with pytest.raises(RewardFailed, match="2 reward errors.*is a bool"):
        run(_twice(fn, batched))


async def _twice(fn: str, batched: bool) -> None:
    op = await make(fn, batched=batched, max_errors=2)
    for i in range(2):
        await op.process({"trajectories": group(["v"], f"0:{i}")})


def test_unknown_function_is_a_clear_error():
    with pytest.raises(ValueError, match="no attribute 'nope'"):
        run(make("test_rewards:nope"))
    with pytest.raises(ValueError, match="known: builtin:"):
        run(make("builtin:nope"))


# --- judge parsing ----------------------------------------------------------------------------------


@pytest.mark.parametrize("reply, grade", [
    ("Score: 7", 0.7), ("score=10", 1.0), ("**Grade:** 9", 0.9), ("Rating: 8/10", 0.8),
    ("I'd give it a score of 3 out of 5.", 0.6), ("The answer is \\boxed{4}", 0.4), ("7/10, decent", 0.7),
    ("after thinking about 2 issues, 6", 0.6), ("Score: 15", 1.0), ("score: -3", 0.0),
    ("first 2, final Score: 5 and Score: 8", 0.8), ("Score: 2.5", 0.25),
])
def test_parse_grade(reply, grade):
    assert parse_grade(reply, 10) == pytest.approx(grade)


@pytest.mark.parametrize("reply", ["", "no idea", "score: unknown", "0/0"])
def test_parse_grade_without_a_grade_raises(reply):
    with pytest.raises(UngradedReply):
        parse_grade(reply, 10)


# --- dynamic sampling -------------------------------------------------------------------------------


def test_dynamic_sampling_drops_uniform_groups_and_declares_oversampling():
    async def main():
        op = DynamicSampling(DynamicSamplingConfig(oversample=2.0, max_oversample=3.0),
                             OperatorContext(node="filter"))
        await op.setup()
        outs = [await op.process({"trajectories": group(["a"] * 4, f"0:{i}", rewards=r)})
                for i, r in enumerate([[1, 1, 1, 1], [0, 1, 0, 0], [0.0, 0.0, 0.0, 0.0], [0.5, 0.5, 0.5, 0.25]])]
        return op, outs

    op, outs = run(main())
    assert [bool(o) for o in outs] == [False, True, False, True]
    assert outs[1]["trajectories"].id == "0:1"
    m = op.metrics()
    assert m["dynamic_sampling/dropped"] == 2 and m["dynamic_sampling/keep_rate"] == 0.5
    assert DynamicSampling.oversampling(DynamicSamplingConfig(oversample=2.0, max_oversample=3.0)) == (2.0, 3.0)


# --- judge on a real engine -------------------------------------------------------------------------


def test_judge_grades_with_its_own_engine_and_with_a_generate_nodes_endpoint(tmp_path):
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from flowrl_operators.config import GenerateConfig
    from flowrl_operators.generate import Generate
    from flowrl_operators.judge import Judge, JudgeConfig

    model = {"path": "builtin:tiny-qwen2"}

    def expected(replies: list[str]) -> list[float]:
        out = []
        for reply in replies:
            try:
                out.append(parse_grade(reply, 10))
            except UngradedReply:
                out.append(0.0)  # on_error zero
        return out

    async def main():
        own = Judge(msgspec.convert({"template": "Rate {response} for {prompt}. Score:"}, JudgeConfig),
                    OperatorContext(node="judge", model=model))
        await own.setup()
        g = group(["12", "345", "6"])
        for t in g.trajectories:
            t.metadata["sample"] = {"prompt": "reverse 21", "target": "12"}
        out = await own.process({"trajectories": g})
        own_result = ([t.reward for t in out["trajectories"].trajectories], list(own.replies), own.metrics())
        await own.close()

        rollout = Generate(msgspec.convert({"serve_openai": True}, GenerateConfig),
                           OperatorContext(node="rollout", model=model, run_dir=tmp_path))
        await rollout.setup()
        remote = Judge(msgspec.convert({"node": "rollout"}, JudgeConfig),
                       OperatorContext(node="judge", model=model, run_dir=tmp_path))
        await remote.setup()
        out = await remote.process({"trajectories": group(["a", "b"])})
        remote_result = ([t.reward for t in out["trajectories"].trajectories], list(remote.replies), remote.metrics())
        await remote.close()
        await rollout.close()
        return own_result, remote_result

    for rewards, replies, metrics in asyncio.run(main()):
        assert len(replies) == len(rewards) and rewards == expected(replies)
        assert metrics["reward/calls"] == len(rewards)
        assert metrics["reward/errors"] == sum(1 for r in replies if not _grades(r))
        assert all(0.0 <= r <= 1.0 for r in rewards)


def _grades(reply: str) -> bool:
    try:
        parse_grade(reply, 10)
        return True
    except UngradedReply:
        return False


def test_isolated_failures_are_handed_to_the_runtime_once_with_the_users_frames():
    # Operator.errors(): what the node isolated since the last call, drained by the call; the
    # zeroed trajectory is marked invalid (a step of only such trajectories trained nothing).
    from flowrl.data.trajectory import INVALID
    from flowrl.operator import Operator

    async def main():
        op = await make("test_rewards:raises_on_bad", on_error="zero")
        out = await op.process({"trajectories": group(["ok", "bad"])})
        return out["trajectories"], op.errors(), op.errors()

    scored, first, second = run(main())
    assert len(first) == 1 and second == []
    assert "0:0/1" in first[0] and "test_rewards.py" in first[0] and "in raises_on_bad" in first[0]
    assert "ValueError: cannot score this" in first[0] and "reward.py" not in first[0]
    assert INVALID not in scored.trajectories[0].metadata and INVALID in scored.trajectories[1].metadata
    assert Operator.errors(Operator.__new__(Operator)) == []  # the default: nothing isolated

