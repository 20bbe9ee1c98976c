"""Built-in tasks: deterministic sources, disjoint held-out splits, rewards and environments."""

from __future__ import annotations

import asyncio

import pytest

from flowrl.data.source import load_source
from flowrl.data.trajectory import Trajectory, Turn
from flowrl_operators.tasks import (
    TASKS,
    CalculatorEnv,
    GuessNumberEnv,
    calculator,
    copy_digits,
    guess_number,
    positions_correct,
    reverse_digits,
)
from flowrl_operators.tasks.calculator import evaluate
from flowrl_operators.tasks.common import held_out
from flowrl_operators.tasks.digits import position_rewards


def trajectory(text: str, sample: dict, turn_rewards: list[float] | None = None) -> Trajectory:
    turns = [Turn(0, 1)] * len(turn_rewards or [])
    return Trajectory(id="t", group_id="g", sample_id="s", prompt_ids=[1], response_ids=[2], loss_mask=[1],
                      behaviour_logprobs=[0.0], versions=[0], turns=turns, turn_rewards=turn_rewards,
                      metadata={"text": text, "sample": sample})


@pytest.mark.parametrize("name", sorted(TASKS))
def test_sources_are_pure_functions_of_seed_step_index(name):
    a, b = load_source({"source": f"builtin:{name}"}, seed=5), load_source({"source": f"builtin:{name}"}, seed=5)
    other = load_source({"source": f"builtin:{name}"}, seed=6)
    draws = [a.sample(s, i) for s in range(3) for i in range(8)]
    assert draws == [b.sample(s, i) for s in range(3) for i in range(8)]
    assert draws != [other.sample(s, i) for s in range(3) for i in range(8)]
    assert a.sample(2, 3) == a.sample(2, 3)  # re-issue after a crash gives the same sample
    assert len({repr(d) for d in draws}) >= 6  # and they vary


def test_eval_split_is_held_out():
    train = reverse_digits(seed=0)
    evaluation = reverse_digits(seed=0, split="eval")
    train_digits = {train.sample(s, i)["digits"] for s in range(50) for i in range(16)}
    eval_digits = {evaluation.sample(0, i)["digits"] for i in range(200)}
    assert eval_digits and train_digits
    assert not train_digits & eval_digits
    assert all(held_out(d) for d in eval_digits) and not any(held_out(d) for d in train_digits)
    assert [train.eval_sample(i) for i in range(5)] == [reverse_digits(seed=9).eval_sample(i) for i in range(5)]
    assert held_out(train.eval_sample(0)["digits"])


def test_digit_formats_and_options():
    s = reverse_digits(seed=1, min_digits=4, max_digits=4).sample(0, 0)
    assert s["prompt"] == "<" + s["digits"] + ">" and s["target"] == s["digits"][::-1] and len(s["digits"]) == 4
    c = copy_digits(seed=1).sample(0, 0)
    assert c["prompt"] == "<" + c["digits"] + "=" and c["target"] == c["digits"]
    bare = copy_digits(seed=1, start="", marker=">").sample(0, 0)
    assert bare["prompt"] == bare["digits"] + ">"
    chat = reverse_digits(seed=1, chat=True).sample(0, 0)
    assert chat["messages"] == [{"role": "user", "content": "<" + chat["digits"] + ">"}] and "prompt" not in chat
    with pytest.raises(ValueError, match="min_digits"):
        reverse_digits(min_digits=5, max_digits=3)


def test_positions_correct_is_dense_and_penalises_length():
    assert positions_correct("4321", "4321") == 1.0
    assert positions_correct("4301", "4321") == 0.75
    assert positions_correct("43", "4321") == 0.5
    assert positions_correct("432100", "4321") == 4 / 6
    assert positions_correct("", "4321") == 0.0
    assert positions_correct(" 4321\n", "4321") == 1.0
    sample = reverse_digits(seed=0).sample(0, 0)
    assert reverse_digits.reward(trajectory(sample["target"], sample)) == 1.0
    assert copy_digits.reward(trajectory("x", {"target": "12"})) == 0.0


def test_position_rewards_credit_each_token_and_a_misplaced_end_costs():
    def scored(text: str, target: str, ended: bool = True) -> dict:
        t = Trajectory(id="t", group_id="g", sample_id="s", prompt_ids=[1], response_ids=[5] * (len(text) + ended),
                       loss_mask=[1] * (len(text) + ended), behaviour_logprobs=[0.0] * (len(text) + ended),
                       versions=[0] * (len(text) + ended), finish_reason="stop" if ended else "length",
                       metadata={"text": text, "sample": {"target": target}})
        return position_rewards(t)

    assert scored("4321", "4321") == {"reward": 1.0, "token_rewards": [1.0, 1.0, 1.0, 1.0, 1.0]}
    assert scored("4301", "4321")["token_rewards"] == [1.0, 1.0, 0.0, 1.0, 1.0]
    # Stopping two digits early: the end token pays for the missing positions.
    assert scored("43", "4321") == {"reward": 0.5, "token_rewards": [1.0, 1.0, -1.0]}
    # Past the end: extra characters and the late end token are -1; cut off by the length limit, no end token.
    assert scored("43210", "4321")["token_rewards"] == [1.0, 1.0, 1.0, 1.0, -1.0, -1.0]
    assert scored("432100", "4321", ended=False)["token_rewards"] == [1.0, 1.0, 1.0, 1.0, -1.0, -1.0]
    # One response token for four characters (a special token sampled mid-answer, say): all wrong.
    assert position_rewards(trajectory("4321", {"target": "4321"})) == {"reward": 1.0, "token_rewards": [-1.0]}


def test_guess_number_environment_answers_higher_lower_correct():
    env = GuessNumberEnv()
    sample = {"secret": 11, "low": 1, "high": 16, "prompt": "Guess my number, 1 to 16."}
    assert env.reset(sample) == sample["prompt"]
    steps = [asyncio.run(env.step(a)) for a in ("8", "I say 14", "banana", "11")]
    assert [s.observation for s in steps[:3]] == ["higher", "lower", "say a number from 1 to 16"]
    assert [s.reward for s in steps] == [0.0, 0.0, -0.1, pytest.approx(0.7)]
    assert [s.done for s in steps] == [False, False, False, True]
    assert steps[-1].info == {"solved": True, "turns_to_solve": 4}
    fresh = GuessNumberEnv()
    fresh.reset({**sample, "secret": 3})
    assert asyncio.run(fresh.step("3")).reward == 1.0  # state is per episode: a new env starts at turn 0
    src = guess_number(seed=2, low=1, high=8)
    assert all(1 <= src.sample(0, i)["secret"] <= 8 for i in range(32))
    assert guess_number.reward(trajectory("", {}, [0.0, -0.1, 0.8])) == pytest.approx(0.7)


def test_calculator_tool_and_answer():
    assert evaluate("23*17+4") == 395 and evaluate("(1+2)*-3") == -9 and float(evaluate("7/2")) == 3.5
    for bad in ("__import__('os')", "2**8", "1/0", "x+1"):
        with pytest.raises(ValueError):
            evaluate(bad)
    sample = calculator(seed=3).sample(0, 0)
    assert sample["answer"] == evaluate(sample["expression"])
    env = CalculatorEnv()
    assert "calc:" in env.reset(sample)
    tool = asyncio.run(env.step(f"calc: {sample['expression']}"))
    assert tool.observation == {"role": "tool", "content": str(sample["answer"])} and not tool.done
    assert asyncio.run(env.step("calc: 2**9")).observation["content"].startswith("error:")
    assert asyncio.run(env.step("hmm")).observation.startswith("reply with")
    final = asyncio.run(env.step(f"answer: {sample['answer']}"))
    assert final.done and final.reward == 1.0 and final.info == {"solved": True, "tool_calls": 2}
    wrong = CalculatorEnv()
    wrong.reset(sample)
    assert asyncio.run(wrong.step("answer: 1")).reward == 0.0
