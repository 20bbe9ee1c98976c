"""The judge reward node: asks a language model to grade each response.

    judge: {op: judge, model: builtin:tiny-qwen2}          # its own embedded engine
    judge: {op: judge, url: http://127.0.0.1:8000/v1}      # any OpenAI-compatible server
    judge: {op: judge, node: rollout}                      # the policy's own engine (the generate
                                                           # node named `rollout` serves it)

The grade is read from the judge's reply by `parse_grade` (tolerant of the many ways models write
a score) and scaled to [0, 1]. A reply without a grade, a failed call or a timeout is a reward
error, handled like any reward node's (`on_error`, `max_errors`, counted in `metrics()`).
"""

from __future__ import annotations

import asyncio
import math
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from flowrl.data.trajectory import Trajectory
from flowrl.operator import OperatorContext
from flowrl.spec.refs import check_with
from flowrl_operators import checks
from flowrl_operators.config import ModelPath, PositiveInt, SamplingConfig, Strict
from flowrl_operators.reward import Reward

DEFAULT_TEMPLATE = (
    "Grade the answer from 0 to {max_score}.\nQuestion: {prompt}\nReference: {reference}\n"
    "Answer: {response}\nReply with: Score: <number>"
)


class JudgeConfig(Strict):
    model: ModelPath | None = None  # an embedded engine of its own (default: the pipeline's model)
    url: str | None = None  # an OpenAI-compatible base URL (ending in /v1)
    node: str | None = None  # a generate node whose engine grades (it serves an endpoint)
    template: Annotated[str, check_with(checks.judge_template)] = DEFAULT_TEMPLATE  # fields: {prompt} {response} {reference} {max_score}
    max_score: Annotated[float, Meta(gt=0)] = 10.0
    sampling: SamplingConfig = msgspec.field(default_factory=lambda: SamplingConfig(temperature=0.0,
                                                                                     max_new_tokens=32))
    timeout_s: Annotated[float, Meta(gt=0)] = 60.0
    on_error: Literal["zero", "drop", "fail"] = "zero"
    max_errors: PositiveInt = 100
    concurrency: PositiveInt = 16
    batched: bool = False  # fixed: the judge grades one trajectory per call


class UngradedReply(ValueError):
    """The judge's reply holds no grade."""


_LABELLED = re.compile(r"(?:score|grade|rating)\s*(?:is|of|[:=])?\s*\**\s*(-?\d+(?:\.\d+)?)(?:\s*(?:/|out of)\s*(\d+(?:\.\d+)?))?",
                       re.I)
_BOXED = re.compile(r"\\boxed\{\s*(-?\d+(?:\.\d+)?)\s*\}")
_FRACTION = re.compile(r"(-?\d+(?:\.\d+)?)\s*(?:/|out of)\s*(\d+(?:\.\d+)?)", re.I)
_NUMBER = re.compile(r"(?<![\w.])(-?\d+(?:\.\d+)?)(?![\w.])")


def parse_grade(text: str, max_score: float = 10.0) -> float:
    """A grade in [0, 1] from a judge's reply; raises UngradedReply if there is none.

    Looks, in order, for a labelled score (`Score: 7`, `rating = 8/10`, `**Grade:** 9`), a boxed
    number, a fraction (`7/10`, `3 out of 5`), then the last plain number. A denominator, if written,
    replaces `max_score`; the result is clamped to [0, 1].
    """
    for pattern in (_LABELLED, _BOXED, _FRACTION):
        matches = pattern.findall(text)
        if matches:
            last = matches[-1]
            value, scale = (last, None) if isinstance(last, str) else (last[0], last[1] or None)
            return _scaled(float(value), float(scale) if scale else max_score)
    numbers = _NUMBER.findall(text)
    if numbers:
        return _scaled(float(numbers[-1]), max_score)
    raise UngradedReply(f"no grade in the judge's reply {text[:80]!r}")


def _scaled(value: float, scale: float) -> float:
    if not math.isfinite(value) or scale <= 0:
        raise UngradedReply(f"unusable grade {value} / {scale}")
    return min(1.0, max(0.0, value / scale))


class Judge(Reward):
    """Grades responses with a language model (its own engine, a URL, or a generate node's)."""

    Config = JudgeConfig  # kind, ports and resources are the reward node's
    config: JudgeConfig

    def __init__(self, config: JudgeConfig, context: OperatorContext) -> None:
        super().__init__(config, context)
        self.engine: Any = None  # its own engine, or an HTTP session to a URL (close() may follow a failed setup)
        self.session: Any = None

    async def setup(self) -> None:
        from flowrl_operators.models import load_tokenizer

        c = self.config
        if sum(x is not None for x in (c.model, c.url, c.node)) > 1:
            raise ValueError("give the judge one of model, url, node")
        self.setup_counters()
        self.fn, self.is_async = self.grade, True
        path = c.model or self.context.model.get("path")
        self.tokenizer = load_tokenizer(path)
        self.replies: list[str] = []  # the latest replies, for inspection
        if c.url or c.node:
            import aiohttp

            self.url = c.url or await self._node_url(c.node)
            self.session = aiohttp.ClientSession()
        else:
            from flowrl_operators.engine.embedded.engine import EmbeddedEngine

            self.engine = EmbeddedEngine(path, max_slots=c.concurrency, threads=1, seed=self.context.seed)

    async def _node_url(self, node: str) -> str:
        """The endpoint the generate node `node` wrote into the run directory (waits for it)."""
        if self.context.run_dir is None:
            raise ValueError("judge.node needs a run directory to find the node's endpoint; give url instead")
        path = Path(self.context.run_dir) / "endpoints" / f"{node}.url"
        for _ in range(600):
            if path.exists():
                return path.read_text().strip()
            await asyncio.sleep(0.1)
        raise TimeoutError(f"generate node {node!r} wrote no endpoint to {path} within 60 s; set its "
                           "serve_openai: true")

    def messages(self, trajectory: Trajectory) -> list[dict[str, str]]:
        sample = trajectory.metadata.get("sample") or {}
        prompt = sample.get("prompt") or self.tokenizer.decode(trajectory.prompt_ids, skip_special_tokens=True)
        reference = sample.get("target", sample.get("answer", ""))
        response = trajectory.metadata.get("text") or self.tokenizer.decode(trajectory.response_ids,
                                                                            skip_special_tokens=True)
        text = self.config.template.format(prompt=prompt, response=response, reference=reference,
                                           max_score=f"{self.config.max_score:g}")
        return [{"role": "user", "content": text}]

    async def grade(self, trajectory: Trajectory) -> float:
        reply = await self.ask(self.messages(trajectory))
        self.replies = (self.replies + [reply])[-16:]
        return parse_grade(reply, self.config.max_score)

    async def ask(self, messages: list[dict[str, str]]) -> str:
        s = self.config.sampling
        if self.engine is not None:
            from flowrl_operators.chat.template import chat_ids
            from flowrl_operators.inference import GenerateRequest, SamplingParams

            self.counts["requests"] = self.counts.get("requests", 0) + 1
            request = GenerateRequest(
                request_id=f"judge-{self.counts['requests']}", input_ids=chat_ids(self.tokenizer, messages),
                sampling=SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                        max_new_tokens=s.max_new_tokens, stop_token_ids=list(s.stop_token_ids)))
            result = await self.engine.generate(request)
            if result.error:
                raise RuntimeError(f"the judge engine rejected the request: {result.error}")
            return self.tokenizer.decode(result.output_ids, skip_special_tokens=True)
        body = {"model": "judge", "messages": messages, "temperature": s.temperature, "top_p": s.top_p,
                "max_tokens": s.max_new_tokens}
        async with self.session.post(self.url.rstrip("/") + "/chat/completions", json=body) as response:
            answer = await response.json()
            if response.status != 200:
                raise RuntimeError(f"judge endpoint answered {response.status}: {answer}")
        return answer["choices"][0]["message"]["content"] or ""

    async def close(self) -> None:
        await super().close()
        if self.session is not None:
            await self.session.close()
        if self.engine is not None:
            await self.engine.close()
