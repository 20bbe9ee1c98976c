"""How a train node's batch is formed: the role of train nodes.

A train node at version t runs step t and publishes version t+1 with its policy record; it takes
its records from its one data input (the compiler checks there is one: flowrl/graph/rules.py).
- Over a sync edge, step t takes exactly the records of step t, once the producer has finished
  step t (sorted by id, so the batch is deterministic); with an over-sampling filter upstream
  (quota.py) the first batch_size by index, the rest dropped as surplus.
- Over an async edge, step t takes the first `batch_size` deliverable records in arrival order
  (stale ones dropped or kept as the edge says, coordinator.deliver), collected in a buffer across
  takes. If fewer can still come it takes a short batch, possibly empty: nothing is in flight
  towards it (samples issued upstream, less those that arrived and those lost before its input)
  and no generate node upstream may be handed more before the step ends (Admission.more_may_come).
  With an over-sampling filter upstream an empty batch is not taken (it would publish a version
  with no update): the generate nodes get more credit instead (Quota.starved).
- Train groups: the `replicas` of a train node are the ranks of one sharded model. Every rank
  takes the same batch; the step completes when all have, with rank 0's policy and metrics.
- While a periodic checkpoint is due no batch is handed out (the trainer's state must stay at
  the checkpoint's version). After a resume a train node first publishes its restored policy
  again (a `publish` work item, snapshot.py).
"""

from __future__ import annotations

from typing import Any

from flowrl.runtime.channel import Record, Work
from flowrl.runtime.role import CoordinatorView, Role
from flowrl.runtime.samples import Samples


class Batches(Role):
    shared = True

    def __init__(self, coord: CoordinatorView, samples: Samples) -> None:
        super().__init__(coord)
        self.samples = samples  # the generate nodes' admission: whether more samples may come
        plan = coord.plan
        self.input = {n: f.input for n, f in plan.facts.nodes.items() if f.input is not None}
        self.buffers: dict[str, list[Record]] = {t: [] for t in self.input}
        self.group_size = {t: plan.nodes[t].resources.replicas for t in self.input}
        self.group_taken: dict[str, set[int]] = {t: set() for t in self.input}
        self.group_done: dict[str, dict[int, tuple[dict[str, Any], dict[str, Any]]]] = {t: {} for t in self.input}
        self.arrived = {t: 0 for t in self.input}  # records put on the train node's input channel
        self.lost_before: dict[str, set[str]] = {t: set() for t in self.input}  # samples lost on their way
        self.republish: set[str] = set()  # after a resume: publish the restored policy first
        self.resumes = 0  # how often the run has resumed (the id of a republished policy)

    def take(self, node: str, replica: int) -> Work | None:
        coord = self.coord
        t = coord.versions[node]
        if coord.checkpoint_due or replica in self.group_taken[node]:
            return None
        if node in self.republish and not coord.held[node]:
            self.republish.discard(node)
            self.group_taken[node].add(replica)
            return coord.hold(node, replica, Work(f"v{t}:r{self.resumes}", "publish", t - 1, t, None))
        if t >= coord.steps:
            return None
        if coord.held[node]:  # the group's batch for step t, formed when its first rank asked
            self.group_taken[node].add(replica)
            return next(iter(coord.held[node].values()))[1]
        records = self.form(node, t)
        if records is None:
            return None
        self.group_taken[node].add(replica)
        label = self.input[node]
        port = coord.channels[label].edge.dst_port
        work = Work(f"v{t + 1}", "batch", t, t, [{port: r.value} for r in records], {label: records},
                    at=t, lags=[t - r.version for r in records])
        return coord.hold(node, 0, work)

    def form(self, node: str, t: int) -> list[Record] | None:
        """The records of step t's batch, taken from the channel; None if it cannot be formed yet."""
        ch = self.coord.channels[self.input[node]]
        if ch.edge.mode == "sync":
            if t not in ch.ended:
                return None
            records = [ch.pop(r.id) for r in ch.of_step(t)]
            if self.samples.oversampled(self.upstream(node)):  # the rest were not needed
                for record in records[self.coord.batch_size:]:
                    self.coord.drop(ch, record, "surplus")
                records = records[:self.coord.batch_size]
            return records
        buffer = self.buffers[node]
        for rid in list(ch.records):
            if len(buffer) >= self.coord.batch_size:
                break
            record = ch.pop(rid)
            self.coord.notify()  # room in the channel for a waiting producer
            if self.coord.deliver(ch, record, t):
                buffer.append(record)
        if len(buffer) < self.coord.batch_size and self.more_may_come(node, t):
            return None
        if not buffer and self.samples.oversampled(self.upstream(node)):
            self.samples.starved(self.upstream(node))  # wait for more (quota.py)
            self.coord.notify()
            return None
        self.buffers[node] = []
        return buffer

    def more_may_come(self, node: str, t: int) -> bool:
        """Whether records for train step t can still arrive (the module docstring)."""
        gens = self.upstream(node)
        if self.samples.more_may_come(gens, t):
            return True
        return self.samples.issued(gens) - self.arrived[node] - len(self.lost_before[node]) > 0

    def upstream(self, node: str) -> list[str]:
        return self.coord.plan.facts.nodes[node].generators

    def gather(self, node: str, replica: int, outputs: dict[str, Any],
               metrics: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]] | None:
        if self.group_size[node] > 1:  # rank 0 holds the full policy and reports the metrics
            self.group_done[node][replica] = (outputs, metrics)
            if len(self.group_done[node]) < self.group_size[node]:
                return None
            outputs, metrics = self.group_done[node][0]
        self.group_done[node], self.group_taken[node] = {}, set()
        return outputs, metrics

    def completed(self, node: str, work: Work, version: int | None, metrics: dict[str, Any]) -> tuple[int, str]:
        if work.kind == "publish":  # a resumed train node's restored policy, sent again
            return work.version, work.id
        self.coord.trained(node, work, metrics)
        return work.step + 1, f"v{work.step + 1}"

    def advance(self, node: str) -> None:
        step = self.coord.versions[node] - 1  # a train node ends a step when it completes it
        if step >= 0 and step not in self.coord.ended[node]:
            self.coord.end(node, step)

    def released(self, node: str) -> None:
        channel = self.coord.channels[self.input[node]]
        for record in reversed(self.buffers[node]):
            channel.put(record, front=True)
        self.buffers[node] = []
        self.group_taken[node], self.group_done[node] = set(), {}

    def waiting(self) -> dict[str, list[Record]]:
        return {self.input[t]: list(buffer) for t, buffer in self.buffers.items() if buffer}

    # ---- what other roles ask ----------------------------------------------------------------

    def arrive(self, node: str) -> None:
        self.arrived[node] += 1

    def lose(self, node: str, sample_id: str) -> None:
        """Sample `sample_id` was lost at `node`, before the train nodes after it."""
        for t in self.coord.plan.facts.nodes[node].trains:
            self.lost_before[t].add(sample_id)

    # ---- checkpoint --------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        return {"arrived": dict(self.arrived), "lost_before": {t: set(s) for t, s in self.lost_before.items()}}

    def restore(self, state: dict[str, Any], resumes: int) -> None:
        """`resumes`: how often the run has resumed, this time included."""
        self.arrived, self.lost_before = state["arrived"], state["lost_before"]
        self.resumes = resumes
        self.republish = {t for t in self.input if self.coord.versions[t] > 0}
