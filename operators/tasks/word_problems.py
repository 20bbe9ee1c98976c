"""Arithmetic word problems for a real chat model (pipelines/smollm2_math.yaml).

The rows are generated once by `tools/make_word_problems.py` and shipped as parquet, so the pipeline
reads them as any user's dataset file would (`data.source: {file: ...}`). The reward checks the
response's final answer with `math-verify` (the `math` extra), as verl's and AReaL's math rewards do.
"""

from __future__ import annotations

import random
import re
from typing import Any

from flowrl.data.trajectory import Trajectory
from flowrl_operators.tasks.common import response_text

INSTRUCTION = "Reply with only the final number."
NAMES = ["Sam", "Mia", "Leo", "Ava", "Noah", "Zoe", "Omar", "Lena", "Ravi", "Ines"]
THINGS = ["apples", "marbles", "stickers", "books", "coins", "pencils", "cards", "shells"]


def make_problem(rng: random.Random) -> dict[str, Any]:
    """One problem: a chat prompt and its answer (an integer, as text)."""
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    kind = rng.choice(["add", "sub", "mul", "add2"])
    a, b, c = rng.randint(2, 40), rng.randint(2, 20), rng.randint(2, 9)
    if kind == "add":
        text, answer = f"{name} has {a} {thing} and gets {b} more. How many {thing} does {name} have now?", a + b
    elif kind == "sub":
        a = a + b  # never negative
        text, answer = f"{name} has {a} {thing} and gives away {b}. How many {thing} are left?", a - b
    elif kind == "mul":
        text, answer = f"{name} buys {c} boxes with {b} {thing} in each box. How many {thing} is that?", b * c
    else:
        text = f"{name} has {a} {thing}, finds {b} more, then loses {c}. How many {thing} does {name} have?"
        answer = a + b - c
    return {"messages": [{"role": "user", "content": f"{text} {INSTRUCTION}"}], "answer": str(answer), "kind": kind}


def make_sum(rng: random.Random) -> dict[str, Any]:
    """One two-digit sum (pipelines/smollm2_sums.yaml): SmolLM2-135M-Instruct answers about 3 in 10
    right greedily, in a dozen tokens, so a CPU sees GRPO move it within minutes."""
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    text = f"What is {a} + {b}? Reply with only the number."
    return {"messages": [{"role": "user", "content": text}], "answer": str(a + b), "kind": "sum"}


def final_answer(trajectory: Trajectory) -> float:
    """1.0 when the response's last number equals the row's `answer` (math-verify), else 0.0."""
    from math_verify import parse, verify

    # math-verify's own timeouts use signal.alarm, which only works in the main thread; the reward
    # node runs rewards in threads and times them out itself (`timeout`).
    gold = parse(str(trajectory.metadata["sample"]["answer"]), parsing_timeout=None)
    guess = parse(response_text(trajectory), parsing_timeout=None)
    return 1.0 if guess and verify(gold, guess, timeout_seconds=None) else 0.0


def last_integer(trajectory: Trajectory) -> float:
    """1.0 when the response's last integer, as written, equals the row's `answer`, else 0.0.

    Stricter than `final_answer` on purpose: math-verify reads "To find 67 + 91, we" as the
    expression 67 + 91 and so scores a reply that only restates a sum as right; GRPO on sums
    learned exactly that (sampled reward 0.19 -> 0.63 in 3 steps, eval "0.97"). Here a number
    the model did not write earns nothing.
    """
    numbers = re.findall(r"-?\d+", response_text(trajectory).replace(",", ""))
    return 1.0 if numbers and numbers[-1] == str(trajectory.metadata["sample"]["answer"]).strip() else 0.0


def number_anywhere(trajectory: Trajectory) -> float:
    """1.0 when the row's `answer` appears as a whole number anywhere in the response, else 0.0.

    A second reading of a sum's reply for the evaluation (`data.eval.options.also`): `last_integer`
    also rewards the format (the answer must come last), so a gain under it alone could be the model
    learning to stop after the sum. This one ignores where the sum is written; "85" inside "185" or
    "8.5" does not count. Thousands separators are dropped first, as `last_integer` does.
    """
    answer = str(trajectory.metadata["sample"]["answer"]).strip()
    text = response_text(trajectory).replace(",", "")
    # Not preceded by a digit, a decimal point or a minus sign, nor followed by a digit or a decimal part.
    return 1.0 if re.search(rf"(?<![\d.-]){re.escape(answer)}(?!\d|\.\d)", text) else 0.0
