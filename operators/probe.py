"""`flowrl validate --probe`: the reward node's own function on a few rows, before any weight loads.

For the first PROBE_ROWS rows of a phase's data source, each reward node scores three answers to
the row's prompt: the row's reference answer, a nonsense answer and an empty one. It goes through
the real `Reward` node (`setup`, `process`: the same isolation and value checks a run applies);
an episode of a built-in environment task is played for one turn with each answer, so the
environment scores it as in a run. The probe fails where

- the reference and the nonsense answer score the same on a row: the reward does not read the
  answer (a constant, a wrong key, a field the workflow never fills), or
- the reference scores below another answer of its row: the task's best score, known as the best
  the probe's answers reach, is not the reference's (a reward that prefers empty answers, a
  reference column that is not the answer).

Where a row's reference answer comes from: a source's `reference(sample)` (the built-in tasks), or
a column of the row named as in REFERENCE_COLUMNS (a dataset file). A source with neither cannot be
probed; nor can a reward node other than `reward` (an LLM judge needs its engine): the probe says so
on stderr and passes.
"""

from __future__ import annotations

import asyncio
import inspect
import sys
from typing import Any

import msgspec

from flowrl import registry
from flowrl.data.trajectory import INVALID, Group, Trajectory, Turn
from flowrl.graph.plan import Plan
from flowrl_operators.config import RewardConfig

PROBE_ROWS = 8
REFERENCE_COLUMNS = ("answer", "target", "reference", "solution", "ground_truth", "label")
NONSENSE = "qzx vbk"  # no digit, no word of any task: an answer no reasonable reward credits
Found = list[tuple[tuple[str | int, ...], str]]


def note(message: str) -> None:
    """What the probe could not check, said once on stderr (validate is otherwise silent)."""
    print(f"flowrl validate --probe: {message}", file=sys.stderr)


def rows(plan: Plan, count: int) -> tuple[list[tuple[dict[str, Any], str]], Any, str | None]:
    """The first `count` training rows with a reference answer, the source, and why none (None: some)."""
    from flowrl.data.source import batch_size, load_source

    source = load_source(plan.data, plan.seed, plan.model)
    size = batch_size(plan.data)
    samples = [source.sample(k // size, k % size) for k in range(min(count, _length(source, count)))]
    found = [(s, ref) for s in samples if (ref := reference(source, s)) is not None]
    if not found:
        what = plan.data.get("source")
        return [], source, (f"data.source {what if isinstance(what, str) else what.get('file')} gives no "
                            f"reference answers (a source's reference(sample), or a column named "
                            f"{', '.join(REFERENCE_COLUMNS)})")
    return found, source, None


def _length(source: Any, count: int) -> int:
    try:
        return len(source)
    except TypeError:
        return count


def reference(source: Any, sample: dict[str, Any]) -> str | None:
    """The reference answer of a row: the source's `reference(sample)`, else a reference column."""
    method = getattr(source, "reference", None)
    if callable(method):
        value = method(sample)
        return None if value is None else str(value)
    for column in REFERENCE_COLUMNS:
        value = sample.get(column)
        if isinstance(value, str | int | float) and not isinstance(value, bool):
            return str(value)
    return None


def answer_lengths(plan: Plan, count: int) -> Found:
    """Generate nodes whose `max_new_tokens` is shorter than most (over three quarters) of the first
    rows' reference answers: no complete answer could earn the reward for them."""
    sampled = [(n, p) for n, p in plan.nodes.items() if p.kind == "generate"
               and p.config.get("workflow", "single_turn") != "supervised"]
    if not sampled:
        return []
    try:
        found, _, _ = rows(plan, count)
        if not found:
            return []
        from flowrl.data.models import load_tokenizer

        tokenizer = load_tokenizer(plan.model["path"])
    except Exception:  # noqa: BLE001 - a source or model that does not load is reported by its own check
        return []
    lengths = [len(tokenizer.encode(ref, add_special_tokens=False)) for _, ref in found]
    out: Found = []
    for name, node in sampled:
        limit = int((node.config.get("sampling") or {}).get("max_new_tokens", 64))
        cut = [i for i, n in enumerate(lengths) if n > limit]
        if len(cut) * 4 > len(lengths) * 3:  # most, over three quarters: a test may cut some on purpose
            i = cut[0]
            out.append((("nodes", name, "sampling", "max_new_tokens"),
                        f"max_new_tokens {limit} cuts {len(cut)} of the first {len(lengths)} rows' reference "
                        f"answers (row {i}: {found[i][1]!r:.60} is {lengths[i]} tokens); no answer that long "
                        f"could be complete: raise it to at least {max(lengths)}"))
    return out


def probe(plan: Plan) -> Found:
    """Each reward node's function on PROBE_ROWS rows (module docs)."""
    from flowrl_operators.reward import Reward

    nodes = [n for n, p in plan.nodes.items() if p.kind == "reward"]
    if not nodes or _supervised(plan):
        return []
    found, source, why = rows(plan, PROBE_ROWS)
    if why is not None:
        note(f"phase of {plan.name}: {why}; the reward is not probed")
        return []
    out: Found = []
    for name in nodes:
        op = registry.resolve(plan.nodes[name].op)
        if not issubclass(op, Reward):
            note(f"node '{name}' ({plan.nodes[name].op}) is not a reward function node; it is not probed")
            continue
        out += asyncio.run(_probe_node(plan, name, op, found, source))
    return out


def _supervised(plan: Plan) -> bool:
    """Whether every train node learns by a supervised loss, which reads no reward (a warm-up phase)."""
    from flowrl_operators.training.objective import loss_config

    trains = [p for p in plan.nodes.values() if p.kind == "train"]
    try:
        return bool(trains) and all(loss_config(p.config.get("loss") or {}).supervised for p in trains)
    except Exception:  # noqa: BLE001 - a plugin train node's own loss keys: probe its reward
        return False


async def _probe_node(plan: Plan, name: str, op: type, found: list, source: Any) -> Found:
    from flowrl.operator import OperatorContext

    config = msgspec.convert(plan.nodes[name].config, op.Config)
    if isinstance(config, RewardConfig):  # the probe judges the function, not a control arm's draws
        config = msgspec.structs.replace(config, control=None)
    node = op(config, OperatorContext(node=name, seed=plan.seed, model=plan.model, data=plan.data))
    tokenizer = _tokenizer(plan)
    try:
        await node.setup()
        table = []
        for index, (sample, ref) in enumerate(found):
            answers = [ref, NONSENSE, ""]
            group = Group(id=f"probe:{index}", step=0, trajectories=[
                await _trajectory(plan, source, sample, text, f"probe:{index}/{k}", tokenizer)
                for k, text in enumerate(answers)])
            await node.process({"trajectories": group})
            table.append((sample, answers, [_score(t) for t in group.trajectories]))
    finally:
        await node.close()
    return _verdict(name, config.fn, table)


def _verdict(name: str, fn: str, table: list) -> Found:
    at = ("nodes", name, "fn")
    failed = [(i, answers[0], scores) for i, (_, answers, scores) in enumerate(table)
              if isinstance(scores[0], str)]
    if failed:
        i, ref, scores = failed[0]
        return [(at, f"reward {fn} failed on the reference answer {ref!r:.60} of row {i}: {scores[0][:300]}")]
    ties = [(i, answers[0], scores) for i, (_, answers, scores) in enumerate(table) if scores[0] == scores[1]]
    if ties:
        i, ref, scores = ties[0]
        return [(at, f"reward {fn} scores the reference answer and a nonsense answer ({NONSENSE!r}) the same "
                 f"on {len(ties)} of {len(table)} probed rows (row {i}: {ref!r:.60} and {NONSENSE!r} both "
                 f"{_shown(scores[0])}): it does not read the answer; check the function and the keys it reads")]
    low = [(i, answers, scores) for i, (_, answers, scores) in enumerate(table)
           if any(isinstance(s, float) and s > scores[0] for s in scores[1:])]
    if low:
        i, answers, scores = low[0]
        best = max(range(len(scores)), key=lambda k: scores[k] if isinstance(scores[k], float) else -1e300)
        return [(at, f"reward {fn} gives the reference answer {answers[0]!r:.60} of row {i} "
                 f"{_shown(scores[0])}, less than {answers[best]!r} gets ({_shown(scores[best])}), on "
                 f"{len(low)} of {len(table)} probed rows: the best answer should score best")]
    return []


def _shown(score: Any) -> str:
    return f"{score:g}" if isinstance(score, float) else str(score)


def _score(t: Trajectory) -> float | str:
    """The trajectory's score as training reports it, or why the reward node could not give one."""
    if t.metadata.get(INVALID) is not None:  # the reward's error, on one line (its frame's carets left out)
        lines = (part.strip() for part in str(t.metadata[INVALID]).splitlines())
        return " ".join(part for part in lines if part and not set(part) <= set("~^ "))
    if t.reward is not None:
        return float(t.reward)
    for values in (t.turn_rewards, t.token_rewards):
        if values is not None:
            return float(sum(values))
    return "no reward was set"


def _tokenizer(plan: Plan) -> Any:
    from flowrl.data.models import load_tokenizer

    try:
        return load_tokenizer(plan.model["path"])
    except Exception:  # noqa: BLE001 - a model without a loadable tokenizer: one token per character
        return None


async def _trajectory(plan: Plan, source: Any, sample: dict[str, Any], text: str, tid: str,
                      tokenizer: Any) -> Trajectory:
    """A one-turn trajectory answering `sample` with `text`, as the generate node would store it;
    a built-in environment task plays the turn so that the environment scores it."""
    ids = tokenizer.encode(text, add_special_tokens=False) if tokenizer is not None else [1] * len(text)
    end = getattr(tokenizer, "eos_token_id", None)
    response = [*ids, end] if end is not None else ids
    n = len(response)
    turn_sample = getattr(source, "turn_sample", None)
    shown = turn_sample(sample) if callable(turn_sample) else sample
    t = Trajectory(id=tid, group_id=tid.split("/")[0], sample_id=tid.split("/")[0], prompt_ids=[0],
                   response_ids=response, loss_mask=[1] * n, behaviour_logprobs=[0.0] * n, versions=[0] * n,
                   finish_reason="stop", metadata={"text": text, "sample": shown})
    env = _environment(plan, source)
    if env is not None:
        reset = env.reset(shown)
        if inspect.isawaitable(reset):
            await reset
        result = env.step(text)
        if inspect.isawaitable(result):
            result = await result
        from flowrl_operators.workflows.environment import as_step

        step = as_step(result)
        t.turns, t.turn_rewards, t.reward = [Turn(0, n)], [float(step.reward)], float(step.reward)
    return t


def _environment(plan: Plan, source: Any) -> Any:
    """A fresh environment of the generate node's built-in environment task, or None."""
    from flowrl_operators.workflows.environment import EnvironmentWorkflow

    for node in plan.nodes.values():
        workflow = node.config.get("workflow", "") if node.kind == "generate" else ""
        factory = getattr(type(source), "workflow", None)
        if isinstance(workflow, str) and workflow.startswith("builtin:") and callable(factory):
            built = factory(**(node.config.get("workflow_args") or {}))
            if isinstance(built, EnvironmentWorkflow):
                return built.make_env()
    return None
