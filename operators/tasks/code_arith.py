"""Arithmetic through a code tool (pipelines/smollm2_code.yaml): products of two-digit numbers,
asked in words, which a small model cannot work out in its head but can write as Python and run in
the sandbox service.

An episode, played by `agent` (an `openai`-client agent, through the generate node's proxy) in the
code-interpreter style, where the answer is what the code prints:
1. the user asks "What is 47 times 38 plus 12? Answer with a Python code block that prints it.";
2. a ```python block in the reply runs in the sandbox service (`tools: {sandbox: ...}`, reached at
   the proxy's `/tools/sandbox`); if it prints something, that output is the answer and the episode
   ends;
3. otherwise (an error, no output, no code block) the model reads what happened (the traceback's
   end, "[no output]", ...) and tries again, for up to `max_turns` replies.

Why this form: measured on SmolLM2-135M-Instruct before training (greedy, one reply, 12 problems
each unless said): in its head it answers none of 24 right. After reading a printed result it
restates it for none of 32 sampled episodes (it writes the code again), so a reward on a restated
answer gives GRPO nothing. "What is 47 * 38 + 12?" it copies into `print(...)`: 0.78 of 32 right
through the pipeline, too little left to learn. Word problems ("buys 47 boxes with 38 apples in
each...") it turns into code that prints nothing: 0 of 32. In words ("47 times 38 plus 12") its
code prints the exact value alone for 2 of 12, and often prints it inside a sentence: between the
two, with room to learn.

The reward reads the final printed output: the value written in it as a whole number (`reward`:
"The result is 1798" counts, so the computation is scored, not the wording), or the value alone
(`exact`, the evaluation's second score).
"""

from __future__ import annotations

import random
import re
from typing import Any

import msgspec

from flowrl.data.trajectory import Trajectory
from flowrl_operators.tasks.common import Split, TaskSource, draw, response_text, sample_of
from flowrl_operators.tools.client import ToolResult, observation

FIRST = "{question} Answer with a Python code block that prints it."
RETRY = "The code did not print an answer:\n{output}\nWrite a corrected Python code block that prints the number."
NO_CODE = "Answer with a Python code block that prints the number."
_CODE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)(?:```|$)", re.S)


def code_block(text: str) -> str | None:
    """The first fenced code block of a reply (an unclosed one runs to the end), or None."""
    match = _CODE.search(text)
    return match.group(1) if match and match.group(1).strip() else None


async def agent(base_url: str, sample: dict[str, Any], max_turns: int = 2, timeout_s: float | None = None) -> dict:
    """One episode (module docs). Returns the final printed output for the reward node (`reward:
    None`) and what the episode did: `tool_calls`, `tool_errors` (runs that printed nothing or failed)."""
    import httpx
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key="flowrl", max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": sample["prompt"]}]
    final, calls, errors = "", 0, 0
    async with httpx.AsyncClient(timeout=None) as http:
        for _ in range(max_turns):
            reply = await client.chat.completions.create(model="policy", messages=messages)
            text = reply.choices[0].message.content or ""
            messages.append({"role": "assistant", "content": text})
            code = code_block(text)
            if code is None:
                messages.append({"role": "user", "content": NO_CODE})
                continue
            response = await http.post(f"{base_url}/tools/sandbox", json={"code": code, "timeout_s": timeout_s})
            response.raise_for_status()
            result = msgspec.convert(response.json(), ToolResult)
            calls += 1
            if result.ok and result.stdout.strip():
                final = result.stdout.strip()
                break
            errors += 1
            messages.append({"role": "user", "content": RETRY.format(output=observation(result))})
    await client.close()
    return {"reward": None, "final": final, "tool_calls": calls, "tool_errors": errors}


def _final(trajectory: Trajectory) -> str:
    """The answer: the agent's `info.final` (what the code printed); a trajectory without it (one
    reply, e.g. `flowrl validate --probe`'s) is its whole response text."""
    final = (trajectory.metadata.get("info") or {}).get("final")
    return (final if isinstance(final, str) else response_text(trajectory)).replace(",", "")


# Products of two-digit numbers written in words, which the model must turn into code: (question,
# value) from a, b, c.
KINDS = {
    "plus": (lambda a, b, c: f"What is {a} times {b} plus {c}?", lambda a, b, c: a * b + c),
    "minus": (lambda a, b, c: f"What is {a} times {b} minus {c}?", lambda a, b, c: a * b - c),
}


class code_arith(TaskSource):  # noqa: N801 - the name users write: builtin:code_arith
    """Two-digit products in words ("47 times 38 plus 12"), answered with code (module docs)."""

    name = "code_arith"

    def __init__(self, seed: int = 0, split: Split = "train", low: int = 11, high: int = 99) -> None:
        super().__init__(seed, split)
        if not 2 <= low <= high:
            raise ValueError(f"code_arith needs 2 <= low <= high, got low={low}, high={high}")
        self.low, self.high = low, high

    def make(self, rng: random.Random, split: str) -> dict[str, Any]:
        def problem(r: random.Random) -> tuple[str, int, int, int]:
            return r.choice(sorted(KINDS)), r.randint(self.low, self.high), r.randint(self.low, self.high), \
                r.randint(10, 99)

        kind, a, b, c = draw(problem, rng, split, lambda p: ":".join(map(str, p)))
        text, value = KINDS[kind]
        question = text(a, b, c)
        return {"question": question, "answer": str(value(a, b, c)), "kind": kind,
                "prompt": FIRST.format(question=question)}

    @staticmethod
    def reference(sample: dict[str, Any]) -> str:
        """The right final answer (`flowrl validate --probe`)."""
        return sample["answer"]

    @staticmethod
    def reward(trajectory: Trajectory) -> float:
        """1.0 when the value appears in the answer as a whole number ("The result is 1798" counts;
        "11798" does not), else 0.0: the computation is scored, not the format of what is printed."""
        answer = re.escape(sample_of(trajectory)["answer"])
        return 1.0 if re.search(rf"(?<![\d.-]){answer}(?!\d|\.\d)", _final(trajectory)) else 0.0


def exact(trajectory: Trajectory) -> float:
    """1.0 when the answer is the value alone (the evaluation's second score: the format too)."""
    return 1.0 if _final(trajectory).strip() == sample_of(trajectory)["answer"] else 0.0
