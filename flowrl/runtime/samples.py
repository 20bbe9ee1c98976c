"""Where samples come from: the role of generate nodes.

A generate replica asks for work and is handed, in this order:
1. weights, when its weights input has a newer version than the replica has loaded (they are not
   held: a replica that dies simply loads them again);
2. nothing, after a resume, until it has loaded the restored policy (snapshot.py);
3. a sample handed back by a replica that died (`reissue`), admitted again at the replica's version;
4. the next sample its `Admission` (admission.py) allows, drawn from the data source.
Samples (3, 4) go only to a replica with no more samples in flight than the node's other replicas:
the engines of a node with `replicas: N` share the work by load.
The version a sample is admitted at is the lower of the replica's loaded weights and the clock
(the clock alone for a generate node without a weights input).

A generate node finishes step s once every sample of s it was handed has completed and its
admission wants no replacement for a lost one (quota.py).
"""

from __future__ import annotations

from typing import Any

from flowrl.data import images
from flowrl.data.source import load_source
from flowrl.runtime.admission import Admission
from flowrl.runtime.channel import Record, Work
from flowrl.runtime.quota import Quota
from flowrl.runtime.role import CoordinatorView, Role


class Samples(Role):
    def __init__(self, coord: CoordinatorView) -> None:
        super().__init__(coord)
        plan, facts = coord.plan, coord.plan.facts
        if coord.run_dir is not None:  # a file source stores its rows' images as it draws them
            images.use_store(coord.run_dir / "images")
        self.source = load_source(plan.data, plan.seed, plan.model) if facts.generate else None
        self.admission: dict[str, Admission] = {}
        for g, f in facts.generate.items():
            filter_node = f.oversampling
            quota = Quota(coord.batch_size, plan.nodes[filter_node].oversampling if filter_node else None,
                          refills=not f.credited, filter_node=filter_node)
            self.admission[g] = Admission(coord.batch_size, coord.steps, f.budget, f.credited, quota)
        self.reissue: dict[str, list[Work]] = {g: [] for g in facts.generate}
        self.weights_in = {g: next((e for e in plan.edges if e.dst == g and e.kind == "weights"), None)
                           for g in facts.generate}
        self.latest_weights: dict[str, Record] = {}  # weights edge label -> its newest record
        self.loaded: dict[tuple[str, int], int] = {}  # (node, replica) -> the version it has loaded
        self.required: dict[str, int] = {}  # after a resume: the version a replica must load first
        # Per node: the generate nodes that wait for replacements of samples lost at (or before) it.
        self.refilled_by = {n: [g for g in f.generators if self.admission[g].quota.refills]
                            for n, f in facts.nodes.items()}
        self.trains = bool(facts.trains)  # the run has train nodes

    def attach(self, node: str, replica: int, version: int) -> None:
        if version < 0:  # it died (Ray restarts it): no share of new work until it attaches again
            self.loaded.pop((node, replica), None)
        else:
            self.loaded[(node, replica)] = version

    def take(self, node: str, replica: int) -> Work | None:
        edge = self.weights_in[node]
        have = self.loaded.get((node, replica), 0)
        if edge is not None and edge.label in self.latest_weights:
            latest = self.latest_weights[edge.label]
            if latest.version > have:
                return Work(latest.id, "weights", latest.step, latest.version, latest.value)
        if edge is not None and have < self.required.get(node, 0):
            return None  # resumed: the engine must hold the restored policy first
        version = min(have, self.coord.clock) if edge is not None else self.coord.clock
        if not self._least_loaded(node, replica):
            return None  # another engine of this node has fewer samples in flight: it takes next
        if self.reissue[node]:
            work = self.reissue[node].pop(0)
            work.version = version
            self.coord.ledger.write("reissue", f"data -> {node}", work.id, work.step, version, replica=replica)
            return self.coord.hold(node, replica, work)
        admission = self.admission[node]
        credit = admission.credit
        issued = admission.issue(version, self.coord.ended[node])
        if issued is None:
            return None
        step, index, beyond = issued
        if beyond:
            self.coord.count("oversampled")
        work = Work(f"{step}:{index}", "sample", step, version, self.source.sample(step, index))
        self.coord.ledger.write("issue", f"data -> {node}", work.id, step, version, admitted_version=version,
                                budget=admission.budget, credit=credit, replica=replica)
        return self.coord.hold(node, replica, work)

    def _least_loaded(self, node: str, replica: int) -> bool:
        """Whether `replica` has no more samples in flight than any other replica of `node` that
        attached: requests are balanced by load over a node's engines (a sample is one group, so a
        group's requests all go to one engine, which shares their prompt's prefill)."""
        counts = {r: 0 for n, r in self.loaded if n == node} | {replica: 0}
        for r, _ in self.coord.held[node].values():
            counts[r] = counts.get(r, 0) + 1
        return counts[replica] <= min(counts.values())

    def loaded_weights(self, node: str, replica: int, version: int) -> None:
        self.loaded[(node, replica)] = version
        edge = self.weights_in[node]
        self.coord.ledger.write("consume", edge.label if edge else node, f"v{version}@{replica}", version,
                                version, weights=True)

    def final_eval_pending(self, steps: int) -> bool:
        """With `data.eval` (and its `final`), a run that trained all its steps ends once replica 0
        of each generate node fed by weights (the one that evaluates) has loaded, and so evaluated,
        the final policy."""
        spec = self.coord.plan.data.get("eval")
        if not self.trains or not spec or not spec.get("final", True):
            return False
        return any(self.loaded.get((g, 0), 0) < steps for g, edge in self.weights_in.items() if edge is not None)

    def completed(self, node: str, work: Work, version: int | None, metrics: dict[str, Any]) -> tuple[int, str]:
        return (version if version is not None else work.version), work.id

    def withheld(self, node: str, work: Work) -> bool:
        self.coord.count("rejected")
        self.coord.lose(node, work.id)
        return True

    def advance(self, node: str) -> None:
        held = self.coord.held[node].values()
        busy = {w.step for _, w in held} | {w.step for w in self.reissue[node]}
        admission, ended = self.admission[node], self.coord.ended[node]
        for s in sorted(set(range(admission.cursor[0])) - ended - busy):
            if admission.settle(s):
                self.coord.end(node, s)

    def hand_back(self, node: str, work: Work) -> None:
        self.reissue[node].append(work)

    # ---- what other roles ask ----------------------------------------------------------------

    def lose(self, node: str, sample_id: str, arrived: bool) -> None:
        """Sample `sample_id` will not reach the train nodes after `node` (coordinator.lose)."""
        for g in self.coord.plan.facts.nodes[node].generators:
            self.admission[g].lose(sample_id, arrived)

    def arrived(self, node: str, step: int) -> None:
        """A record of `step` was put on the input of train node `node`."""
        for g in self.refilled_by[node]:
            self.admission[g].arrived(step)

    def more_may_come(self, gens: list[str], version: int) -> bool:
        """Whether any of `gens` may still be handed a sample before train step `version` ends."""
        return any(self.admission[g].more_may_come(version) or self.reissue[g] for g in gens)

    def issued(self, gens: list[str]) -> int:
        return sum(self.admission[g].issued for g in gens)

    def oversampled(self, gens: list[str]) -> bool:
        """Whether a filter asks any of `gens` for more samples than batch_size (quota.py)."""
        return any(self.admission[g].quota.declared for g in gens)

    def starved(self, gens: list[str]) -> None:
        """An async batch found nothing and nothing more may come: credit another cap's worth."""
        for g in gens:
            if self.admission[g].quota.declared:
                self.admission[g].quota.starved()

    # ---- checkpoint --------------------------------------------------------------------------

    def state(self, reissue: dict[str, list[Work]]) -> dict[str, Any]:
        """What a checkpoint keeps; `reissue`: the samples to hand out again on resume (those in
        flight included, snapshot.outstanding)."""
        parts = {g: a.state() for g, a in self.admission.items()}
        return {"cursor": {g: p["cursor"] for g, p in parts.items()}, "lost": {g: p["lost"] for g, p in parts.items()},
                "quota": {g: p["quota"] for g, p in parts.items()},
                "reissue": reissue}

    def restore(self, state: dict[str, Any]) -> None:
        for g, admission in self.admission.items():
            admission.restore({"cursor": state["cursor"][g], "lost": state["lost"][g], "quota": state["quota"][g]})
        self.reissue = state["reissue"]
        for g, edge in self.weights_in.items():
            if edge is not None:  # engines are rebuilt at version 0: they load the restored policy first
                self.required[g] = self.coord.clock
