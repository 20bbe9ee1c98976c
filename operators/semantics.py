"""Semantic checks of one phase's plan: configurations that compile, run, and silently train
nothing, or train wrongly. `flowrl validate` runs them (entry-point group `flowrl.checks`,
flowrl/spec/semantics.py) on every phase before any weight loads; each finding is a (key path from
the spec's root, message) pair, located at that key of the file.

- a decaying learning rate whose horizon ends before the phase does: lr 0 for the rest (keras
  #18722 refuses a schedule that decays to 0 rather than "silently training"; NeMo #14186 lost runs
  to a horizon the scheduler did not know), or a warm-up the phase never finishes;
- a linear / cosine schedule in a phase bounded only by seconds, without `total_steps` (the train
  node would refuse it in setup, after the weights load);
- `dynamic_sampling` after a generate node whose groups hold one trajectory: every group has a
  spread of 0 and is dropped, so no step is ever filled (SkyRL #1609: a batch silently truncated to 0);
- an async edge (or partial rollout) into a train node whose loss never reads the behaviour policy
  and has no correction: stale samples train as if on-policy (miles #1829: staleness ignored);
- `max_new_tokens` that cuts most reference answers of the first rows (the tokenizer loads
  without weights), for a source whose rows carry a reference answer (flowrl_operators.probe).
"""

from __future__ import annotations

from typing import Any

import msgspec

from flowrl import registry
from flowrl.graph.plan import Plan
from flowrl.spec.phases import UNBOUNDED_STEPS

Found = list[tuple[tuple[str | int, ...], str]]
TOKEN_ROWS = 32  # rows whose reference answers are tokenised against max_new_tokens


def check(plan: Plan, probe: bool = False) -> Found:
    """Every finding of the checks above for one phase's plan; with `probe`, also the reward probe."""
    from flowrl_operators import probe as probing

    found: Found = []
    for name, node in plan.nodes.items():
        if node.kind == "train" and _is(node.op, "train"):
            found += _train(plan, name)
        if node.kind == "transform" and _is(node.op, "dynamic_sampling"):
            found += _filter(plan, name)
        if _is(node.op, "critic"):
            found += _schedule(plan, ("nodes", name, "optim"), node.config.get("optim") or {}, 1)
    found += probing.answer_lengths(plan, TOKEN_ROWS)
    if probe and not found:
        found += probing.probe(plan)
    return found


def _is(op: str, name: str) -> bool:
    """Whether the node's `op` is the built-in operator `name` (by name or by its module:attr)."""
    try:
        return registry.resolve(op) is registry.resolve(name)
    except registry.OperatorError:
        return False


def _train(plan: Plan, name: str) -> Found:
    from flowrl_operators.config import TrainConfig

    config = msgspec.convert(plan.nodes[name].config, TrainConfig)
    optim = msgspec.to_builtins(config.optim)
    return _schedule(plan, ("nodes", name, "optim"), optim, config.epochs) + _stale_loss(plan, name, config)


def _schedule(plan: Plan, at: tuple[str, ...], optim: dict[str, Any], epochs: int) -> Found:
    """The learning rate over the phase: a decay that ends early, a warm-up that never ends."""
    steps, schedule = int(plan.run.get("steps") or 0), optim.get("schedule", "constant")
    total, warmup = optim.get("total_steps"), int(optim.get("warmup_steps") or 0)
    bounded = steps != UNBOUNDED_STEPS
    if schedule != "constant" and total is None and not bounded:
        return [((*at, "schedule"), f"schedule {schedule} decays over the phase's steps, but this phase is "
                 "bounded only by seconds: set optim.total_steps (its horizon in train steps)")]
    if schedule != "constant" and total is not None and bounded and total < steps:
        return [((*at, "total_steps"), f"the {schedule} schedule reaches lr 0 after {total} train steps, and "
                 f"the phase has {steps}: its last {steps - total} steps would train with lr 0; set "
                 f"total_steps >= {steps} or remove it (default: the phase's steps)")]
    horizon = (total or steps) * epochs
    if warmup and bounded and warmup >= horizon:
        return [((*at, "warmup_steps"), f"warm-up of {warmup} optimizer steps never ends in this phase "
                 f"({horizon} optimizer steps: {total or steps} train steps x {epochs} epochs), so the lr "
                 f"never reaches {optim.get('lr')}; lower warmup_steps")]
    return []


def _stale_loss(plan: Plan, name: str, config: Any) -> Found:
    """A loss that ignores the behaviour policy, fed samples another policy version produced."""
    from flowrl_operators.training import objective

    try:
        loss = objective.loss_config(config.loss)
    except Exception:  # noqa: BLE001 - a wrong loss is reported by the train node's check_graph
        return []
    if loss.supervised or objective.needs_proximal(loss) or loss.reads_behaviour:
        return []
    why = _off_policy(plan, name)
    if why is None:
        return []
    at = ("nodes", name, "loss", "kind") if isinstance(config.loss, dict) else ("nodes", name, "loss")
    return [(at, f"loss {loss.kind} never reads the behaviour policy's logprobs, and {why}: stale tokens "
             "would train as if the current policy had sampled them. Add correction: {kind: tis} (or mis) "
             "to the loss, use a ratio loss (ppo_clip), or make the edge sync")]


def _off_policy(plan: Plan, train: str) -> str | None:
    """Why the train node's samples may come from an older policy version, or None."""
    gens = plan.facts.nodes[train].generators if plan.facts else []
    ancestors = _ancestors(plan, train)
    for edge in plan.edges:
        if edge.kind == "data" and edge.mode == "async" and edge.dst in ancestors | {train} \
                and edge.max_staleness >= 1:
            return f"edge '{edge.label}' is async (max_staleness {edge.max_staleness})"
    for g in gens:
        if plan.nodes[g].config.get("partial_rollout"):
            return f"generate node '{g}' has partial_rollout: true (episodes span policy versions)"
    return None


def _ancestors(plan: Plan, node: str) -> set[str]:
    seen, todo = set(), [node]
    while todo:
        here = todo.pop()
        for e in plan.edges:
            if e.kind == "data" and e.dst == here and e.src not in seen:
                seen.add(e.src)
                todo.append(e.src)
    return seen


def _filter(plan: Plan, name: str) -> Found:
    """dynamic_sampling keeps groups whose rewards differ: a group of one never does."""
    gens = plan.facts.nodes[name].generators if plan.facts else []
    out: Found = []
    for g in gens:
        config = plan.nodes[g].config
        size = int(config.get("group_size", 1)) + bool(config.get("greedy_baseline"))
        if size < 2:
            out.append((("nodes", g, "group_size"), f"dynamic_sampling node '{name}' drops every group whose "
                        "rewards are all equal, and a group of 1 trajectory always is: no step would ever fill. "
                        "Set group_size >= 2, or remove the filter"))
    return out
