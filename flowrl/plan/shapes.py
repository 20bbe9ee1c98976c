"""Each node's cost shape as its operator declares it from its config (`Operator.cost_shape`,
flowrl.operator.CostShape: slots, group size, concurrency, a process of its own): the one place
plan learns them, so it reads no config key by name and a plugin's own keys count as the built-ins' do.
"""

from __future__ import annotations

from typing import Any

import msgspec

from flowrl import registry
from flowrl.graph.plan import NodePlan
from flowrl.operator import CostShape
from flowrl.spec.errors import UserError

# Slots of an engine that declares no limit: every admitted row is decoded in the same iteration.
UNLIMITED = 1 << 30


def declared(node: NodePlan) -> CostShape:
    """The cost shape `node`'s operator declares for its config as the plan holds it now. Raises
    UserError where the operator cannot be loaded here or refuses the config (a plugin not
    installed; a config an override broke), and ValueError where the config does not convert."""
    try:
        cls = registry.resolve(node.op)
    except registry.OperatorError as e:
        raise UserError(f"node '{node.name}': plan reads its cost shape from its operator, which cannot be "
                        f"loaded here: {e}") from None
    config = msgspec.convert(node.config, cls.Config)  # a ValidationError is a ValueError
    shape = cls.cost_shape(config)
    if not isinstance(shape, CostShape):
        raise UserError(f"node '{node.name}': its operator's cost_shape() returned {type(shape).__name__}, "
                        "not a flowrl.operator.CostShape")
    return shape


def shapes(plan: Any) -> dict[str, CostShape]:
    """Every node's declared cost shape."""
    out = {}
    for name, node in plan.nodes.items():
        try:
            out[name] = declared(node)
        except ValueError as e:
            raise UserError(f"node '{name}': its config does not convert to its operator's: {e}") from None
    return out


def slots(shape: CostShape) -> int:
    """Rows its engine decodes together; UNLIMITED where it declares no limit."""
    return shape.slots if shape.slots is not None else UNLIMITED


def processes(plan: Any, known: dict[str, CostShape] | None = None) -> dict[str, float]:
    """Nodes whose work runs in a process of its own besides the main one (`process_threads`, e.g. a
    trainer with own_process) -> its threads."""
    known = shapes(plan) if known is None else known
    return {name: float(shape.process_threads) for name, shape in known.items() if shape.process_threads}


def engine_cores(plan: Any, node: str, cores: float, known: dict[str, CostShape] | None = None) -> float:
    """The cores the engine of generate node `node` decodes its rows over: its threads (`threads`,
    None: one), at most the machine's `cores` less the threads of the processes of their own beside
    it (a trainer with own_process keeps its threads), at least one (docs/plan.md, "Engine threads")."""
    known = shapes(plan) if known is None else known
    others = sum(t for name, t in processes(plan, known).items() if name != node)
    return max(1.0, min(float(known[node].threads or 1), cores - others))


def train_cores(plan: Any, node: str, cores: float, known: dict[str, CostShape] | None = None) -> float:
    """The cores train node `node`'s step runs over: its process's threads where it has one of its own
    (`process_threads`); in the run's process, the torch threads its embedded engine set for the whole
    process (the largest `threads` of a generate node there; None: one). At most the machine's
    `cores`, at least one (docs/plan.md, "Engine threads")."""
    known = shapes(plan) if known is None else known
    own = processes(plan, known)
    threads = own.get(node) or max((float(s.threads) for n, s in known.items() if s.threads and n not in own),
                                   default=1.0)
    return max(1.0, min(threads, cores))
