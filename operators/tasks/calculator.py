"""The calculator task: multi-turn with tool calls. The model may call the tool with a line
`calc: <expression>` (the environment answers with a `tool` message holding the value) and ends
with `answer: <number>`. Reward 1 for a correct answer on the turn it is given, else 0.
"""

from __future__ import annotations

import ast
import operator
import random
import re
from fractions import Fraction
from typing import Any

from flowrl.data.trajectory import Trajectory
from flowrl_operators.tasks.common import Split, TaskSource, draw
from flowrl_operators.workflows.environment import EnvironmentWorkflow, StepResult

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_CALL = re.compile(r"calc:\s*([0-9+\-*/(). ]{1,80})")
_ANSWER = re.compile(r"answer:\s*(-?\d+(?:\.\d+)?)")


def evaluate(expression: str) -> Fraction:
    """+ - * / and parentheses over integers, exactly; anything else raises ValueError."""
    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
            return Fraction(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise ValueError("division by zero")
            return _OPS[type(node.op)](left, right)
        raise ValueError(f"unsupported expression element {type(node).__name__}")

    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an expression: {expression!r}") from e
    return walk(tree)


def show(value: Fraction) -> str:
    return str(value.numerator) if value.denominator == 1 else f"{float(value):.6g}"


class CalculatorEnv:
    """One episode: the question's answer, and a calculator tool."""

    def reset(self, sample: dict[str, Any]) -> str:
        self.answer = Fraction(sample["answer"])
        self.tool_calls = 0
        return sample["prompt"]

    async def step(self, action: str) -> StepResult:
        answer = _ANSWER.search(action)
        if answer:
            correct = Fraction(answer.group(1)) == self.answer
            return StepResult("", float(correct), True, {"solved": correct, "tool_calls": self.tool_calls})
        call = _CALL.search(action)
        if call:
            self.tool_calls += 1
            try:
                result = show(evaluate(call.group(1)))
            except ValueError as e:
                result = f"error: {e}"
            return StepResult({"role": "tool", "content": result}, 0.0, False, {"tool_calls": self.tool_calls})
        return StepResult("reply with calc: <expression> or answer: <number>", 0.0, False, {})


class calculator(TaskSource):  # noqa: N801 - the name users write: builtin:calculator
    """Arithmetic questions (`a*b+c`) to answer with the help of a calculator tool."""

    name = "calculator"

    def __init__(self, seed: int = 0, split: Split = "train", max_operand: int = 99) -> None:
        super().__init__(seed, split)
        self.max_operand = max_operand

    def make(self, rng: random.Random, split: str) -> dict[str, Any]:
        def expression(r: random.Random) -> str:
            a, b, c = (r.randint(2, self.max_operand) for _ in range(3))
            return f"{a}*{b}{r.choice('+-')}{c}"

        text = draw(expression, rng, split, lambda e: e)
        return {"expression": text, "answer": int(evaluate(text)),
                "prompt": f"What is {text}? Use calc: <expression>, then answer: <number>."}

    @staticmethod
    def workflow(max_turns: int = 4, **args: Any) -> EnvironmentWorkflow:
        return EnvironmentWorkflow(CalculatorEnv, max_turns=max_turns, **args)

    @staticmethod
    def reference(sample: dict[str, Any]) -> str:
        """The right final answer (`flowrl validate --probe`, flowrl_operators/probe.py)."""
        return f"answer: {sample['answer']}"

    @staticmethod
    def reward(trajectory: Trajectory) -> float:
        """The environment already scored the episode; this reads it back."""
        return float(sum(trajectory.turn_rewards or [])) if trajectory.turn_rewards else (trajectory.reward or 0.0)
