"""Records passed on one at a time: joins (the role of reward, reference and transform nodes) and
policies (the role of sync nodes).

A join takes the records of one sample id once every data input has its copy (group integrity
across a diamond), at the clock's version: a stale copy is dropped or kept as its edge says
(coordinator.deliver), and the fresh copies of a sample with a dropped partner are dropped as
"unjoined". It finishes step s when its inputs have finished s and it holds no record of s; copies
of s whose partner will never come (filtered or dropped upstream) are then dropped as unjoined.
A None output is a filtered sample: counted, and lost to the train nodes after it.

A sync node takes its train node's policy records in order (never stale: each is the newest
version when it is published) and turns each into a weights record of the same version.
"""

from __future__ import annotations

from typing import Any

from flowrl.runtime.channel import Work
from flowrl.runtime.role import Role


class Joins(Role):
    def take(self, node: str, replica: int) -> Work | None:
        coord = self.coord
        edges = coord.ins[node]
        channels = [coord.channels[e.label] for e in edges]
        first = channels[0]
        for rid in list(first.records):
            if rid not in first.records or not all(rid in c.records for c in channels[1:]):
                continue
            records = [c.pop(rid) for c in channels]
            fresh = [coord.deliver(c, r, coord.clock) for c, r in zip(channels, records, strict=True)]
            if not all(fresh):
                for c, r, ok in zip(channels, records, fresh, strict=True):
                    if ok:
                        coord.drop(c, r, "unjoined")
                continue
            work = Work(rid, "record", records[0].step, min(r.version for r in records),
                        {e.dst_port: r.value for e, r in zip(edges, records, strict=True)},
                        {e.label: [r] for e, r in zip(edges, records, strict=True)}, at=coord.clock)
            return coord.hold(node, replica, work)
        return None

    def completed(self, node: str, work: Work, version: int | None, metrics: dict[str, Any]) -> tuple[int, str]:
        return work.version, work.id

    def withheld(self, node: str, work: Work) -> bool:
        self.coord.count("filtered")
        self.coord.lose(node, work.id)
        return True

    def advance(self, node: str) -> None:
        coord = self.coord
        channels = [coord.channels[e.label] for e in coord.ins[node]]
        for s in sorted(set.intersection(*(c.ended for c in channels)) - coord.ended[node]):
            if any(w.step == s for _, w in coord.held[node].values()):
                continue
            if any(c.has_step(s) for c in channels):
                copies = [{r.id for r in c.of_step(s)} for c in channels]
                if set.intersection(*copies):
                    continue  # joinable records of s still wait to be taken
                for c in channels:  # a join partner was filtered or dropped upstream
                    for r in c.of_step(s):
                        coord.drop(c, c.pop(r.id), "unjoined")
            coord.end(node, s)


class Policies(Role):
    def take(self, node: str, replica: int) -> Work | None:
        ch = self.coord.channels[self.coord.ins[node][0].label]
        if not ch.records:
            return None
        record = ch.pop(next(iter(ch.records)))
        return self.coord.hold(node, replica, Work(record.id, "policy", record.step, record.version,
                                                   record.value, {ch.edge.label: [record]}))

    def completed(self, node: str, work: Work, version: int | None, metrics: dict[str, Any]) -> tuple[int, str]:
        return work.version, f"v{work.version}"
