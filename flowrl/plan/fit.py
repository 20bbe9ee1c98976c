"""Cost models of each stage, fitted on a run's spans (`flowrl plan`).

- Generation: the engine decodes one token for every admitted row per iteration, with the slots
  its node declares (`CostShape.slots`, flowrl/plan/shapes.py; rows beyond wait, first come first served). An iteration with n rows costs
  a + b*n seconds; one that admits rows prefills their prompts too (a forward of its own: p more),
  and every row admitted costs r (its request's bookkeeping between iterations). A group's rows
  need as many iterations as their model tokens (from the rollout store). (a, b) are the
  least-squares fit, both >= 0, of each busy period of each engine replica (a stretch with a group
  in flight) against the iterations (each weighted 1 + p/a where it admits, plus r/a per row
  admitted) and row-iterations the same slot model counts for that period's groups, queued at its
  start (exact for a sync run, where every group of a step is handed out at once; an approximation
  where groups arrive spread out). Where every period's iterations held nearly the same rows
  (< 5 % relative spread: slots always full) a cannot be told from b and b = 0 (time per
  iteration, as for the train's c and k below). p/a and r/a, which the periods cannot tell apart
  (a step admits about the same share of its iterations and rows each time), are the engine's own
  counts (`step_shares`: the embedded engine's `engine/` metrics); an engine that reports none
  (SGLang) has p = r = 0, its iterations taking all.
- Groups: the pool of the run's groups (their rows' token counts; a multi-turn group's wait on its
  environment: `group_pool`), resampled by the stand-ins (stages.py), so the distribution of
  lengths and waits and its tail are the measured ones.
- Train: seconds = c + k * tokens of the batch, least squares, both >= 0; where the batches' token
  counts hardly vary (< 5 % relative spread) c cannot be told from k and c = 0 (time proportional
  to tokens).
- Other nodes (reward, reference, user transforms): the measured seconds per group, resampled.
- Sync and weight loads: their mean measured seconds (they scale with the model's bytes).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from flowrl.plan.records import WARMUP, Baseline, Span
from flowrl.plan.shapes import declared, engine_cores, processes, shapes, train_cores
from flowrl.plan.shapes import slots as slots_of
from flowrl.plan.solo import solo_work
from flowrl.plan.threads import MAX_TOKENS, Probe
from flowrl.spec.errors import UserError

FLAT = 0.05  # relative spread of a feature below which its intercept is not identifiable


@dataclass
class EngineCost:
    slots: int
    a: float  # seconds per iteration
    b: float  # seconds per row per iteration
    update_s: float  # one weight load
    periods: int  # busy periods fitted
    cores: float = 1.0  # the cores its per-row work ran over in the fitted run (shapes.engine_cores)
    p: float = 0.0  # seconds more for an iteration that prefills (rows admitted, or retracted ones again)
    r: float = 0.0  # seconds per row admitted (its request's bookkeeping)
    wait_lock: float = 0.0  # multi-turn: the share of a group's wait its engine decodes (wait_share)
    eval_s: float = 0.0  # a greedy evaluation (data.eval) on replica 0, beyond the weight load it follows
    eval_every: int = 0  # the versions between evaluations (0: none seen)


@dataclass
class Costs:
    engines: dict[str, EngineCost]
    groups: dict[str, list[tuple[list[int], float]]]  # generate node -> groups: (tokens per row, wait)
    process: dict[str, list[float]]  # other node -> seconds per group
    train: tuple[float, float]  # (c, k): c + k * tokens
    sync_s: dict[str, float]
    flush_s: float  # the run's own work after each train step (writing its records)
    group_size: dict[str, int]  # generate node -> its group_size in the fitted run
    train_lock: float = 1.0  # the fraction of a train step that holds the interpreter lock (cpu.py)
    handoff: float = 1.0  # the speed of lock-bound jobs of one process beside each other against in turns (cpu.py)
    train_cores: float = 1.0  # the cores a train step ran over in the fitted run (shapes.train_cores)
    train_passes: float | None = None  # its passes over the tokens in the fitted run (CostShape.passes)
    notes: list[str] = field(default_factory=list)
    model: str | None = None  # the run's model.path, which threads.py times where a what-if changes threads
    probes: dict[str, Probe] = field(default_factory=dict)  # node -> the pass threads.py times for it
    parallel: dict[str, float] = field(default_factory=dict)  # node -> its parallel fraction, once measured
    # Where the run's overlaps could not tell train_lock: (its mean train step's seconds, its lock
    # probe's share or None), until lock.measure learns it.
    untold: tuple[float, float | None] | None = None


def fit(base: Baseline, cores: float, train_lock: float = 1.0, scatter: bool = False, handoff: float = 1.0) -> Any:
    """Every stage's cost on `base`, as work alone (solo.py) on a machine of `cores` cores, a
    train step holding the interpreter lock `train_lock` of its time, the lock handed over at
    `handoff` (cpu.py). With `scatter`: (costs, the relative scatter of the engine's and the train's
    spans about their fits, summed)."""
    plan, notes, spread = base.plan, [], []
    steady = _steady(base)
    generated = {name: [s for s in steady if s.node == name and s.name == "generate"]
                 for name, node in plan.nodes.items() if node.kind == "generate"}
    groups = {name: group_pool(base, name, spans, notes) for name, spans in generated.items()}
    waits = {name for name, pool in groups.items() if any(wait > 0 for _, wait in pool)}
    decoding = {name: share for name in waits for share in [wait_share(base, name, steady)] if share}
    work = _work(base, steady, cores, train_lock, waits, handoff, decoding)
    for name in decoding:  # the waits as they would have been alone: the engine's share of them slowed
        groups[name] = [(rows, work[s]) for (rows, _), s in zip(groups[name], generated[name], strict=True)]
    engines, process, sync_s = {}, {}, {}
    for name, node in plan.nodes.items():
        spans = [s for s in work if s.node == name]
        if node.kind == "generate":
            engines[name] = fit_engine(base, name, work, notes, name in waits, spread, decoding.get(name, 0.0))
            engines[name].cores = engine_cores(plan, name, cores)
        elif node.kind == "sync":
            sync_s[name] = _mean([work[s] for s in spans if s.name == "sync"])
        elif node.kind != "train":
            process[name] = [work[s] for s in spans if s.name == "process"] or [0.0]
    flush = _mean([work[s] for s in work if s.node == "runtime" and s.name == "flush"])
    known = shapes(plan)
    sizes = {n: shape.group_size for n, shape in known.items() if plan.nodes[n].kind == "generate"}
    train = plan.facts.trains[0]
    costs = Costs(engines, groups, process, fit_train(base, train, work, notes, spread), sync_s, flush, sizes, train_lock,
                  handoff, train_cores(plan, train, cores, known), known[train].passes, notes, plan.model.get("path"),
                  probes(base, train, engines))
    return (costs, sum(spread)) if scatter else costs


def probes(base: Baseline, train: str, engines: dict[str, EngineCost]) -> dict[str, Probe]:
    """The passes threads.py times, shaped like the run's: a train step over a batch's rows (their
    mean count and tokens, prompt included; MAX_TOKENS at most), an engine iteration over as many
    rows as its slots hold of a batch, one token each."""
    rows = batch_rows(base)
    nodes, length = base.plan.nodes, max(round(base.row_length), 1)
    out = {train: Probe(nodes[train].op, max(1, min(rows, MAX_TOKENS // length)), length)}
    out.update({name: Probe(nodes[name].op, min(engine.slots, rows), 1) for name, engine in engines.items()})
    return out


def batch_rows(base: Baseline) -> int:
    """The mean rows (trajectories) of the run's train batches."""
    return round(statistics.mean(sum(len(base.rows_of.get(g, [])) for g in ids) for ids in base.batches.values())
                 if base.batches else 1)


CPU_SPANS = {"generate", "process", "train", "sync", "update_weights", "flush"}


def _steady(base: Baseline) -> list[Span]:
    """The spans that use the cores, from the end of the warm-up steps on."""
    begin = base.rows[WARMUP - 1]["time"]
    return [s for s in base.spans if s.name in CPU_SPANS and s.start >= begin]


def _work(base: Baseline, spans: list[Span], cores: float, train_lock: float, waits: set[str],
          handoff: float = 1.0, decoding: dict[str, float] | None = None) -> dict[Span, float]:
    """The work (solo.py) of each steady span that uses the cores; a generate replica's busy periods
    count once each (one engine), as a span named `period`. A node whose groups wait on their
    environments (`waits`: multi-turn) has no periods: its busy stretches are mostly those waits,
    not work. Where its engine counted its steps, each group's span is a wait whose share
    `decoding[node]` (wait_share) is its engine's, one thread for all the groups of a replica
    (stages.py: what the simulation runs); else the simulation gives its engine no work, and
    counting the waits as work that held the lock would shrink what overlapped them."""
    from flowrl.plan.cpu import MAIN, Load

    own = processes(base.plan)
    periods = []
    for node, replica in sorted({(s.node, s.replica) for s in spans if s.name == "generate" and s.node not in waits}):
        mine = [s for s in spans if (s.node, s.replica, s.name) == (node, replica, "generate")]
        periods += [Span(node, replica, "period", p[0].start, max(s.end for s in p), None, None)
                    for p in busy_periods(mine)]
    decoding = decoding or {}
    waiting = [s for s in spans if s.name == "generate" and s.node in decoding]
    loads = {s: Load(s.node if s.node in own else MAIN, train_lock if s.name == "train" else 1.0)
             for s in [s for s in spans if s.name != "generate"] + periods}
    for s in waiting:
        share = decoding[s.node]
        loads[s] = Load(MAIN, share, share, share, waits_thread(s.node, s.replica))
    amounts = solo_work([(load, s.start, s.end) for s, load in loads.items()], cores, handoff)
    work = dict(zip(loads, amounts, strict=True))
    for s in spans:
        if s.name == "generate" and s not in work:
            work[s] = s.seconds  # a group's span is its wait in the engine too; the period holds the work
    return work


def waits_thread(node: str, replica: int) -> str:
    """The thread a multi-turn node's replica decodes its groups' turns on (cpu.Load.thread)."""
    return f"{node}/{replica}"


def wait_share(base: Baseline, node: str, steady: list[Span]) -> float | None:
    """The share of a multi-turn node's group waits its engine spent decoding: the seconds of its
    steps (its counters, as step_shares reads them) over the seconds of the groups' steady spans in
    the same steps; None where the engine counts none."""
    counted = engine_counts(base, node, ("step_seconds",))
    if counted is None:
        return None
    waits = sum(s.seconds for s in steady if s.node == node and s.name == "generate" and s.end <= base.rows[-1]["time"])
    return min(1.0, counted[0] / waits) if waits > 0 else None


def engine_counts(base: Baseline, node: str, keys: tuple[str, ...]) -> list[float] | None:
    """How much each of the engine's counters `engine/KEY` (the generate node's metrics, summed over
    replicas) grew over the steady steps; None where it reports any of them not."""
    first, last = (row.get("operators", {}).get(node, {}) for row in (base.rows[WARMUP - 1], base.rows[-1]))
    names = [f"engine/{k}" for k in keys]
    if not all(n in first and n in last for n in names):
        return None
    return [last[n] - first[n] for n in names]


def group_pool(base: Baseline, node: str, spans: list[Span], notes: list[str]) -> list[tuple[list[int], float]]:
    """The run's groups as (tokens of each trajectory, wait). A group with more trajectories than
    group_size is multi-turn (one trajectory per turn): its episodes wait between turns on their
    environment, so its wait is its measured span (the engine's work for it runs alongside); a
    single-turn group waits on nothing but the engine (wait 0)."""
    size = declared(base.plan.nodes[node]).group_size
    trained = list(base.rows_of.values())
    if not trained or not spans:
        raise UserError(f"{base.directory}: no groups of node '{node}' after the first {WARMUP} steps in both "
                        "trace.json and the rollout store")
    # A group that never reached the trainer (dropped: often the slowest) is not in the store: its
    # wait still counts, with a trained group's tokens standing in, or the tail would be cut.
    pool = [(base.rows_of.get(s.sample) or trained[i % len(trained)], s.seconds) for i, s in enumerate(spans)]
    if not pool:
        raise UserError(f"{base.directory}: no groups of node '{node}' after the first {WARMUP} steps in both "
                        "trace.json and the rollout store")
    if not any(len(rows) > size for rows, _ in pool):
        return [(rows, 0.0) for rows, _ in pool]
    waits = sorted(w for _, w in pool)
    notes.append(f"{node}: multi-turn groups: waits p50 {waits[len(waits) // 2]:.2f} s, "
                 f"p90 {waits[int(len(waits) * 0.9)]:.2f} s, max {waits[-1]:.2f} s (resampled)")
    return pool


def iterations(groups: list[list[int]], slots: int) -> tuple[int, int, int]:
    """(iterations, row-iterations, admitting iterations) the slot model takes for `groups` queued
    at once, in order."""
    waiting = [t for rows in groups for t in rows]
    active: list[int] = []
    count = rows = admits = 0
    while waiting or active:
        room = slots - len(active)
        admits += bool(room and waiting)
        active, waiting = active + waiting[:room], waiting[room:]
        count, rows = count + 1, rows + len(active)
        active = [t - 1 for t in active if t > 1]
    return count, rows, admits


def step_shares(base: Baseline, node: str, busy: float) -> tuple[float, float] | None:
    """(p/a, r/a): what an iteration that prefills costs beyond one that only decodes, and an
    admitted row's bookkeeping, each over a decoding iteration, from the engine's own counters
    over the steady steps (the embedded engine's `engine/` metrics, summed over replicas) and its
    replicas' `busy` seconds meanwhile (what of them no step took is the rows' bookkeeping). None
    where the engine reports none."""
    counted = engine_counts(base, node, ("steps", "prefill_steps", "admitted", "step_seconds", "prefill_step_seconds"))
    if counted is None:
        return None
    steps, prefills, admitted, seconds, prefill_s = counted
    if steps <= prefills or seconds <= prefill_s:  # no decoding step, or none that took time: nothing to divide by
        return None
    decode = (seconds - prefill_s) / (steps - prefills)
    prefill = max(0.0, prefill_s / prefills / decode - 1.0) if prefills else 0.0
    row = max(0.0, (busy - seconds) / admitted / decode) if admitted else 0.0
    return prefill, row


def fit_engine(base: Baseline, node: str, work: dict[Span, float], notes: list[str],
               multi_turn: bool = False, spread: list[float] | None = None, decoding: float = 0.0) -> EngineCost:
    slots = slots_of(declared(base.plan.nodes[node]))
    update, evaluation, every = weight_loads(base, node, work)
    if evaluation:
        notes.append(f"{node}: a weight load {update * 1e3:.2f} ms, an evaluation {evaluation * 1e3:.1f} ms more "
                     f"every {every} versions (replica 0)")
    if multi_turn:  # a busy period is mostly waits on the environment: no iterations to fit
        notes.append(f"{node}: the engine's work is inside the groups' measured waits: " + (
            f"decoding {decoding:.1%} of each (the engine's counts), on one thread a replica" if decoding else
            "not told apart (the engine counts none)"))
        return EngineCost(slots, 0.0, 0.0, update, 0, wait_lock=decoding, eval_s=evaluation, eval_every=every)
    generate = [s for s in work if s.node == node and s.name == "generate" and s.sample in base.rows_of]
    periods = [s for s in work if s.node == node and s.name == "period"]
    counted = step_shares(base, node, sum(s.seconds for s in periods if s.end <= base.rows[-1]["time"]))
    prefill, row = counted or (0.0, 0.0)
    points = []  # (work, iterations weighted as above, iterations, row-iterations)
    for period in periods:
        inside = sorted((s for s in generate if s.replica == period.replica and period.start <= s.start < period.end),
                        key=lambda s: s.start)
        if inside:
            groups = [base.rows_of[s.sample] for s in inside]
            count, rows, admits = iterations(groups, slots)
            points.append((work[period], count + prefill * admits + row * sum(map(len, groups)), count, rows))
    if not points:
        raise UserError(f"{base.directory / 'trace.json'}: node '{node}' has no generate spans after the first "
                        f"{WARMUP} steps; plan needs them to fit its engine")
    fill = [p[3] / p[2] for p in points]  # rows per iteration of each period
    told = ""
    if statistics.pstdev(fill) < FLAT * statistics.mean(fill):
        # Periods of nearly one fill (slots always full): iterations and row-iterations are nearly
        # proportional, so a least-squares corner would pick a or b by the spans' timing noise and
        # a prediction with other slots would flip between runs. The iteration takes the cost: it
        # decodes all its rows in one pass, whose fixed part is what more slots share.
        a, b = sum(p[0] for p in points) / max(sum(p[1] for p in points), 1), 0.0
        told = "; iterations nearly equally full: no per-row part fitted"
    else:
        a, b = nonneg_fit([(p[1], p[3]) for p in points], [p[0] for p in points])
    if spread is not None:
        spread.append(relative_scatter([a * p[1] + b * p[3] for p in points], [p[0] for p in points]))
    shares = (f", {prefill * a * 1e3:.3f} ms more where it prefills and {row * a * 1e3:.3f} ms per row admitted "
              "(the engine's counts)" if counted else ", prefills and admissions inside (the engine counts none)")
    notes.append(f"{node}: an engine iteration {a * 1e3:.3f} ms + {b * 1e6:.2f} us per row{shares} ({slots} slots; "
                 f"{len(points)} busy periods{told})")
    return EngineCost(slots, a, b, update, len(points), p=prefill * a, r=row * a, eval_s=evaluation, eval_every=every)


def weight_loads(base: Baseline, node: str, work: dict[Span, float]) -> tuple[float, float, int]:
    """(one weight load, one evaluation beyond it, the versions between evaluations) of `node`'s
    update_weights spans. Replica 0 evaluates inside the load that brings a version eval.jsonl
    holds (operators/generate.py): every few steps a load ~20x the others, which a mean over all
    loads would spread over every step, where the run stalls its rollouts once in a while."""
    loads = [s for s in work if s.node == node and s.name == "update_weights"]
    evals = {s for s in loads if s.replica == 0 and s.version is not None and s.version in base.evaluated}
    plain = [s for s in loads if s not in evals] or loads
    versions = sorted(base.evaluated)
    gaps = [b - a for a, b in zip(versions, versions[1:], strict=False) if b > a]
    if not evals or not gaps:
        return _mean([work[s] for s in loads]), 0.0, 0
    update = _mean([work[s] for s in plain])
    return update, max(0.0, _mean([work[s] for s in evals]) - update), statistics.mode(gaps)


def busy_periods(spans: list[Span]) -> list[list[Span]]:
    """Spans grouped into stretches where one at least is in flight."""
    periods: list[list[Span]] = []
    reach = float("-inf")
    for s in sorted(spans, key=lambda s: s.start):
        if s.start > reach:
            periods.append([])
        periods[-1].append(s)
        reach = max(reach, s.end)
    return periods


def fit_train(base: Baseline, train: str, work: dict[Span, float], notes: list[str],
              spread: list[float] | None = None) -> tuple[float, float]:
    points = [(work[s], sum(sum(base.rows_of.get(g, [])) for g in base.batches[s.step]))
              for s in work if s.node == train and s.name == "train" and s.step in base.batches]
    if not points:
        raise UserError(f"{base.directory / 'trace.json'}: node '{train}' has no train spans after the first "
                        f"{WARMUP} steps")
    tokens = [p[1] for p in points]
    if statistics.pstdev(tokens) < FLAT * statistics.mean(tokens):
        c, k = 0.0, sum(p[0] for p in points) / max(sum(tokens), 1)
        notes.append(f"{train}: {k * 1e6:.2f} us per token (batches of nearly one size: no fixed part fitted)")
    else:
        c, k = nonneg_fit([(1.0, t) for t in tokens], [p[0] for p in points])
        notes.append(f"{train}: {c * 1e3:.2f} ms + {k * 1e6:.2f} us per token")
    if spread is not None:
        spread.append(relative_scatter([c + k * t for t in tokens], [p[0] for p in points]))
    return c, k


def relative_scatter(fitted: list[float], seen: list[float]) -> float:
    """Root mean square of (seen - fitted), over the mean seen."""
    mean = sum(seen) / len(seen)
    return (sum((s - f) ** 2 for s, f in zip(seen, fitted, strict=True)) / len(seen)) ** 0.5 / max(mean, 1e-12)


def nonneg_fit(x: list[tuple[float, float]], y: list[float]) -> tuple[float, float]:
    """Least squares y ~ p*x0 + q*x1 with p, q >= 0 (two unknowns: the corners are tried)."""
    s00 = sum(u * u for u, _ in x)
    s11 = sum(v * v for _, v in x)
    s01 = sum(u * v for u, v in x)
    t0 = sum(u * w for (u, _), w in zip(x, y, strict=True))
    t1 = sum(v * w for (_, v), w in zip(x, y, strict=True))
    det = s00 * s11 - s01 * s01
    if det > 1e-12 * s00 * s11:
        p, q = (t0 * s11 - t1 * s01) / det, (t1 * s00 - t0 * s01) / det
        if p >= 0 and q >= 0:
            return p, q
    candidates = [(t0 / s00 if s00 else 0.0, 0.0), (0.0, t1 / s11 if s11 else 0.0)]
    return min(candidates, key=lambda pq: sum((pq[0] * u + pq[1] * v - w) ** 2 for (u, v), w in zip(x, y, strict=True)))


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0
