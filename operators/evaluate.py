"""Periodic greedy evaluation on held-out samples, declared as `data.eval` in the spec:

    data: {source: builtin:reverse_digits, batch_size: 16, eval: {every: 5, samples: 64}}

The generate node runs it with its own engine whenever it has loaded a policy version that is a
multiple of `every`, once before training, and with the final policy (the run waits for that one):
one greedy episode per held-out sample (`source.eval_sample(i)`), scored by the task's reward (`source.reward`, or `data.eval.options.reward:
module:attr`). Each evaluation appends a row to `RUN_DIR/eval.jsonl`:
`{"version", "eval_reward", "samples", "time", "seconds"}` with `time` in seconds since the run's
origin (when the evaluation ended) and `seconds` the time the evaluation took.

`data.eval.options.also: {name: module:attr, ...}` scores the same answers with more functions, so
that a gain can be checked against a second reading of the replies (one that does not reward a
format alone); each one's mean over the evaluation goes into the row as `scores: {name: value}`.
`data.eval.max_new_tokens` gives the greedy answers a budget of their own (default: the generate
node's `sampling.max_new_tokens`), so an evaluation can read past the training budget.

A sync reward runs on a daemon thread (flowrl_operators.threads), never on the event loop; a call
that takes over `REWARD_TIMEOUT_S`, or a value that is not a finite number
(flowrl_operators.reward_values), fails the evaluation with a message, as a raising reward does.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from pathlib import Path
from typing import Any

from flowrl import records
from flowrl.data.source import load_source
from flowrl.records import EvalRow, RunDir
from flowrl_operators.reward_values import as_reward
from flowrl_operators.threads import DaemonExecutor, call_in_thread
from flowrl_operators.workflows.base import is_async_callable

REWARD_TIMEOUT_S = 60.0  # one eval reward call
ALSO = "also"  # data.eval.options key: more scores of the same answers


class EvalProblem(ValueError):
    """Why `data.eval` cannot run: `key` is the offending key path under `data`."""

    def __init__(self, key: tuple[str, ...], message: str) -> None:
        self.key = key
        super().__init__(message)


def eval_parts(data: dict[str, Any], seed: int, tokenizer: Any = None, model: dict[str, Any] | None = None,
               source: Any = None) -> tuple[Any, Any]:
    """(held-out source, reward) of `data.eval`, built and checked as a run builds them; `flowrl
    validate` calls this too, so a source without held-out samples or a reward is found before
    weights load. `source`: the training source already built, used when the eval names no other
    source and no options of its own. Raises EvalProblem (or the source's own error)."""
    spec = data["eval"]
    options = dict(spec.get("options") or {})
    reward = options.pop("reward", None)
    options.pop(ALSO, None)  # the evaluation's own, not the source's (also_scores)
    where = ("eval", "source") if spec.get("source") else ("eval", "options") if options else ("source",)
    if spec.get("source") or options or source is None:
        options = {**(data.get("options") or {}), **options}
        source = load_source({**data, "source": spec.get("source") or data["source"], "options": options},
                             seed, model, tokenizer=tokenizer)
    if not callable(getattr(source, "eval_sample", None)):
        raise EvalProblem(where, f"data.eval needs a source with eval_sample(index) (held-out samples); "
                                 f"{type(source).__name__} has none: set data.eval.source to one that has")
    samples = int(spec.get("samples", 64))
    try:
        source.eval_sample(samples - 1)  # a source with fewer held-out samples says so now
    except Exception as e:  # noqa: BLE001 - the user's source may raise anything; say where
        detail = str(e) if isinstance(e, ValueError) else (f"eval_sample({samples - 1}) failed: {type(e).__name__}: "
                                                           f"{e}; lower data.eval.samples")
        raise EvalProblem(("eval", "samples"), detail) from None
    if reward is not None:
        from flowrl_operators.reward import load_reward

        return source, load_reward(reward)
    if callable(getattr(source, "reward", None)):
        return source, source.reward
    raise EvalProblem(("eval",), "data.eval needs a reward: the source has no reward(trajectory); "
                                 "set data.eval.options.reward: module:attr")


def also_problems(options: dict[str, Any]) -> list[tuple[tuple[str, ...], str]]:
    """What is wrong with `data.eval.options.also` (key path under it, message), found before any
    weights load: a mapping of score names to functions of one trajectory."""
    also = options.get(ALSO)
    if also is None:
        return []
    if not isinstance(also, dict) or not also:
        return [((), f"{ALSO} maps score names to reward functions, e.g. {{anywhere: my_rewards:anywhere}}; "
                     f"got {also!r}")]
    from flowrl.spec.refs import callable_path

    out: list[tuple[tuple[str, ...], str]] = []
    for name, fn in also.items():
        if not isinstance(fn, str) or not fn:
            out.append(((str(name),), f"a score is a reward function as module:attr or builtin:<task>; got {fn!r}"))
        elif fn.startswith("builtin:"):
            out += _builtin_problem(str(name), fn)
        elif problem := callable_path(fn, arguments=1):
            out.append(((str(name),), problem))
    return out


def _builtin_problem(name: str, fn: str) -> list[tuple[tuple[str, ...], str]]:
    from flowrl_operators.reward import load_reward

    try:
        load_reward(fn)
    except ValueError as e:
        return [((name,), str(e))]
    return []


def also_scores(options: dict[str, Any]) -> dict[str, Any]:
    """`data.eval.options.also` loaded: score name -> function. Raises EvalProblem at the first
    problem (a run that skipped `flowrl validate` still stops with the key named)."""
    problems = also_problems(options)
    if problems:
        where, message = problems[0]
        raise EvalProblem(("eval", "options", ALSO, *where), message)
    from flowrl_operators.reward import load_reward

    return {str(name): load_reward(fn) for name, fn in (options.get(ALSO) or {}).items()}


class Evaluator:
    def __init__(self, data: dict[str, Any], seed: int, run_dir: Path | None, tokenizer: Any = None,
                 final: int | None = None) -> None:
        spec = data["eval"]
        self.final = final  # the run's last policy version: evaluated whether or not `every` divides it
        self.every, self.samples = int(spec.get("every", 10)), int(spec.get("samples", 64))
        self.source, self.reward = eval_parts(data, seed, tokenizer)
        self.also = also_scores(spec.get("options") or {})
        self.max_new_tokens = spec.get("max_new_tokens")  # None: the node's sampling budget
        self.run_dir = run_dir
        self.origin = time.time()
        if run_dir is not None and RunDir(run_dir).has("meta.json"):
            self.origin = RunDir(run_dir).meta().origin
        self.done: set[int] = set()
        # The held-out samples, drawn once: drawing them again for every evaluation cost the
        # quickstart ~30 ms each time (its eval runs every 5 steps).
        self.held_out: list[dict[str, Any]] = []
        self.thread = DaemonExecutor(1, "flowrl-eval")

    def due(self, version: int) -> bool:
        return (version % self.every == 0 or version == self.final) and version not in self.done

    async def run(self, generate: Any, version: int) -> dict[str, Any]:
        """Greedy episodes of every held-out sample through `generate` (a Generate operator)."""
        self.done.add(version)
        started = time.time()
        if not self.held_out:
            self.held_out = [self.source.eval_sample(i) for i in range(self.samples)]
        groups = await asyncio.gather(*(
            generate.generate(sample, step=-1, sample_id=f"eval{version}:{i}", greedy=True,
                              max_new_tokens=self.max_new_tokens)
            for i, sample in enumerate(self.held_out)))
        reward, also = 0.0, dict.fromkeys(self.also, 0.0)  # sums; a rejected sample scores zero on each
        for group in groups:
            if group is None or not group.trajectories:
                continue
            answer = group.trajectories[0]
            reward += await self._score(self.reward, answer, "the eval reward")
            for name, fn in self.also.items():
                also[name] += await self._score(fn, answer, f"the eval score {name!r}")
        n = len(groups)
        row = EvalRow(version=version, eval_reward=reward / n, samples=n, time=round(time.time() - self.origin, 3),
                      seconds=round(time.time() - started, 3))
        if self.also:
            row.scores = {name: total / n for name, total in also.items()}
        if self.run_dir is not None:
            records.append(Path(self.run_dir) / "eval.jsonl", [row])
        return row.as_dict()

    async def _score(self, fn: Any, trajectory: Any, what: str) -> float:
        """`fn(trajectory)` off the event loop, timed out; `what` names the score in a failure."""
        call = fn(trajectory) if is_async_callable(fn) else call_in_thread(self.thread, fn, trajectory)
        try:
            value = await asyncio.wait_for(call, REWARD_TIMEOUT_S)
            if inspect.isawaitable(value):
                value = await asyncio.wait_for(value, REWARD_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise TimeoutError(f"{what} took over {REWARD_TIMEOUT_S} s on {trajectory.id}") from None
        return as_reward(value, f"{what} of {trajectory.id}")


def eval_problems(data: dict[str, Any], seed: int, model: dict[str, Any] | None,
                  built: Any) -> list[tuple[tuple[str, ...], str]]:
    """`data.eval` built as the generate node builds it (its source, held-out samples and reward),
    for `flowrl validate` (Generate.check_data): (key path from the spec's root, message)."""
    spec = data["eval"]
    reward = (spec.get("options") or {}).get("reward")
    if isinstance(reward, str) and not reward.startswith("builtin:"):
        from flowrl.spec.refs import callable_path

        problem = callable_path(reward, arguments=1)
        if problem:
            return [(("data", "eval", "options", "reward"), problem)]
    also = [(("data", "eval", "options", ALSO, *where), message)
            for where, message in also_problems(spec.get("options") or {})]
    if also:
        return also
    try:
        eval_parts(data, seed, model=model, source=built)
    except EvalProblem as e:
        return [(("data", *e.key), str(e))]
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the user's factory may raise anything; report it at the key
        own = set(spec.get("options") or {}) - {"reward", ALSO}  # options the eval passes its source
        where = ("data", "eval", "source") if spec.get("source") else ("data", "eval", "options") if own else ("data", "eval")
        return [(where, str(e) if isinstance(e, ValueError) else f"building the eval source failed: "
                                                                 f"{type(e).__name__}: {e}")]
    return []
