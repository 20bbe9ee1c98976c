"""A run's trackers (`run.trackers`, flowrl/trackers/) and the sample rows they and samples.jsonl get.

`Tracking` opens each tracker at the first flush that has rows (so a run that fails to set up
leaves no tracker run behind), then hands it every flush's metrics and sample rows, in the same
flush that appends them to metrics.jsonl and samples.jsonl.

Resume. `trackers.json` in the run directory keeps, per tracker, the state its `open` returned
(wandb's and mlflow's run ids) and the last step of each train node it was sent. It is not cut
back to the checkpoint as the record streams are: a resumed run opens the same tracker run again
and sends only the steps after those, so a tracker keeps the values it got first for a step
that the resumed run computes again (metrics.jsonl holds the resumed run's). A crash between a
tracker's `log` and the rewrite of trackers.json can repeat that one flush's steps in it; one
before a tracker's own files hold what it was sent (wandb: within 0.5 s) loses them in it. A
tracker whose files are cut back with the streams (`rewound = True`: TensorBoard's event files,
flowrl/runtime/durability/streams.py) is sent everything after the checkpoint again.

A tracker that raises, or whose call does not return within `run.tracker_timeout_s` (a hung
`log`, a wandb or mlflow server that does not answer), is warned about and dropped for the rest of
the run; metrics.jsonl and samples.jsonl stay complete. Each call runs on a daemon thread the run
waits for that long at most (a thread cannot be killed: a hung one is abandoned, and does not keep
the process alive at exit), so a tracker never holds up the run, its checkpoints or SIGTERM for more.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import warnings
from pathlib import Path
from typing import Any

import msgspec

from flowrl.records import RunDir, TrackerEntry, encode
from flowrl.records.rundir import TRACKERS
from flowrl.trackers import Tracker, TrackerContext, resolve

TIMEOUT_S = 30.0  # run.tracker_timeout_s


class Tracking:
    def __init__(self, names: list[str], run_dir: Path, name: str, origin: float, config: dict[str, Any],
                 timeout: float = TIMEOUT_S) -> None:
        self.names = list(names)
        self.timeout = timeout
        self.run_dir, self.name, self.origin, self.config = run_dir, name, origin, config
        self.open: dict[str, Tracker] | None = None  # None until the first flush with rows
        self.saved = RunDir(run_dir).trackers()

    def log(self, rows: list[dict[str, Any]], samples: list[dict[str, Any]]) -> None:
        if not rows or not self.names:
            return
        if self.open is None:
            self.open = {}
            for name in self.names:
                self._call(name, self._open, name)
        for name, tracker in list(self.open.items()):
            sent = self.saved[name].steps
            new = [r for r in rows if r["step"] > sent.get(r["node"], -1)]
            if new and self._call(name, tracker.log, new, [s for s in samples if s["step"] > sent.get(s["node"], -1)]):
                for r in new:
                    sent[r["node"]] = max(sent.get(r["node"], -1), r["step"])
        self._write()  # once a flush, after every tracker has had it

    def close(self) -> None:
        for name, tracker in list((self.open or {}).items()):
            self._call(name, tracker.close)
        self.open = {}

    def _open(self, name: str) -> None:
        cls = resolve(name)
        tracker = cls()
        entry = self.saved.get(name) or TrackerEntry()
        phased = self.run_dir.parent.name == "phases"  # runs/<run>/phases/<i>-<phase> (flowrl/spec/phases.py)
        group = self.run_dir.parent.parent.name if phased else None
        label = f"{group}/{self.run_dir.name}" if phased else self.run_dir.name
        state = tracker.open(TrackerContext(self.run_dir, self.name, label, group, self.origin, self.config,
                                            entry.state, self.timeout))
        state = state or {}
        try:  # trackers.json must keep it: state that JSON cannot hold drops the tracker, not the run
            if not isinstance(state, dict):
                raise TypeError(f"it is {type(state).__name__}, not a dict")
            json.dumps(state)
        except (TypeError, ValueError) as e:
            with contextlib.suppress(Exception):  # it did open: let it end what it began
                tracker.close()
            raise TypeError(f"{cls.__name__}.open() returned state that trackers.json cannot keep ({e}); "
                            "return a dict of JSON values (a run id, say) or None") from None
        assert self.open is not None
        self.open[name] = tracker
        # A rewound tracker's files were cut back to the checkpoint: it gets the later steps again.
        steps = {} if getattr(cls, "rewound", False) else entry.steps
        self.saved[name] = TrackerEntry(state=state, steps=steps)

    def _call(self, name: str, fn: Any, *args: Any) -> bool:
        problem = bounded(fn, args, self.timeout)
        if problem is None:
            return True
        # The run's own files keep everything; the run goes on without this tracker.
        warnings.warn(f"tracker '{name}' failed and is dropped for the rest of the run: {problem}", stacklevel=2)
        if self.open is not None:
            self.open.pop(name, None)
        return False

    def _write(self) -> None:
        path = self.run_dir / TRACKERS
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(msgspec.json.format(encode(self.saved), indent=1))
        os.replace(tmp, path)


def bounded(fn: Any, args: tuple[Any, ...], timeout: float) -> str | None:
    """Run `fn(*args)` on a daemon thread for at most `timeout` seconds: None if it returned, else
    what went wrong (what it raised, SystemExit included, or that it did not return in time)."""
    failure: list[str] = []

    def call() -> None:
        try:
            fn(*args)
        except BaseException as e:  # noqa: BLE001 - a tracker's exit or error ends its own calls only
            failure.append(f"{type(e).__name__}: {e}")

    thread = threading.Thread(target=call, name=f"flowrl-tracker-{getattr(fn, '__name__', 'call')}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        return (f"{getattr(fn, '__qualname__', fn)}() did not return within {timeout:g} s "
                "(run.tracker_timeout_s); it is left running, unwaited")
    return failure[0] if failure else None


def sample_rows(node: str, step: int, trajectories: list[Any], n: int) -> list[dict[str, Any]]:
    """Up to `n` trajectories of a trained batch as table rows: the first of each group in group
    order, then the second of each, and so on (so `n` groups are shown before any group twice).

    Text is what the records carry: the response as the generate node decoded it
    (`metadata["text"]`), the prompt from the data sample (`metadata["sample"]`: its `prompt`, or
    its chat `messages` as `role: content` lines). A record without them (a workflow or operator
    that sets none) gets its token ids instead (`prompt_ids`, `response_ids`); the coordinator
    loads no tokenizer."""
    rank: dict[str, int] = {}
    order = []
    for t in sorted(trajectories, key=lambda t: (t.group_id, t.id)):
        order.append((rank.get(t.group_id, 0), t.group_id, t.id, t))
        rank[t.group_id] = rank.get(t.group_id, 0) + 1
    return [_row(node, step, t) for *_, t in sorted(order, key=lambda o: o[:3])[:n]]


def _row(node: str, step: int, t: Any) -> dict[str, Any]:
    meta = t.metadata or {}
    prompt, response = _prompt_text(meta.get("sample")), meta.get("text")
    row: dict[str, Any] = {"step": step, "node": node, "id": t.id, "version": t.oldest_version,
                           "reward": t.reward, "prompt": prompt, "response": response}
    if prompt is None:
        row["prompt_ids"] = list(t.prompt_ids)
    if response is None:
        row["response_ids"] = list(t.response_ids)
    return row


def _prompt_text(sample: Any) -> str | None:
    if not isinstance(sample, dict):
        return None
    if isinstance(sample.get("prompt"), str):
        return sample["prompt"]
    messages = sample.get("messages")
    if isinstance(messages, list) and all(isinstance(m, dict) for m in messages):
        return "\n".join(f"{m.get('role', '')}: {m.get('content', '')}" for m in messages)
    return None
