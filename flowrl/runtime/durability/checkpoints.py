"""Checkpoints: when they are taken, how one is written atomically, and what disk they need.

`checkpoints/step-<version>/` holds `coordinator.pkl` (snapshot.py), `streams.json` (how far
every record stream had got, streams.py) and `<node>/r<replica>/` per stage (Stage.save). It is
written as `step-<version>.tmp/` and renamed, then `checkpoints/latest` is replaced to name it:
a run killed at any moment has either the previous complete checkpoint or the new one, and
`clean_partial` removes what a kill left half-written. Each holds `manifest.json`: the size and
SHA-256 of every other file in it, taken at save and checked before a resume trusts it
(flowrl/runtime/durability/resume.py). Rotation removes only checkpoints older than the one just written:
one a resumed run has not reached yet (it resumed from an older one) stays. Periodic checkpoints (`run.checkpoint_every`
versions, `run.checkpoint_seconds`) are taken while the run goes on: train nodes wait (their state
must stay at the checkpoint's version), the other stages keep working.
"""

from __future__ import annotations

import asyncio
import hashlib
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flowrl.records import Checkpoint, Manifest, RecordError
from flowrl.records.checkpoint import MANIFEST
from flowrl.runtime.durability import faults

if TYPE_CHECKING:  # an annotation only: the executors' room imports this one, not the reverse
    from flowrl.runtime.executors.executor import Executor

MARGIN_BYTES = 64 * 2**20  # room for the record streams between checkpoints
DEFAULT_KEEP = 2
DEFAULT_SECONDS = 1800.0  # a run with neither key still checkpoints every half hour


class DiskSpaceError(OSError):
    """Not enough free space for a checkpoint: a user error, reported without a traceback."""


class Pacing:
    """Whether a periodic checkpoint is due: every `every` versions and/or every `seconds`."""

    def __init__(self, every: int | None, seconds: float | None, now: float | None = None) -> None:
        self.every = every
        self.seconds = seconds if seconds is not None else (None if every else DEFAULT_SECONDS)
        self.last = time.time() if now is None else now
        self.due: int | None = None
        self.since = self.last  # when `due` was set

    def step(self, version: int, now: float | None = None) -> None:
        """A train step published `version` (the clock)."""
        now = time.time() if now is None else now
        if (self.every and version % self.every == 0) or (self.seconds and now - self.last >= self.seconds):
            self.due, self.since = version, now

    def done(self, now: float | None = None) -> None:
        self.due = None
        self.last = time.time() if now is None else now


async def write(ex: Executor, run_dir: Path, version: int, keep: int,
                saved: Callable[[], Awaitable[Any]] | None = None) -> Path:
    """Write checkpoints/step-<version>/ atomically, point `latest` at it, keep the newest `keep`.
    `saved` is awaited once every stage's state is on disk, before the manifest is hashed: the
    train nodes need not wait for that (measured: sha256 at ~0.5 GB/s on a shared 2-core machine)."""
    root = run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    check_space(root, needed(root))
    name = f"step-{version}"
    tmp = root / f"{name}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        taken = await ex.call("snapshot")
        (tmp / "coordinator.pkl").write_bytes(taken["state"])
        Checkpoint(tmp).write_streams(taken["streams"])
        await ex.save(tmp)
        if saved is not None:
            await saved()
        # Hashed off the event loop: the stages go on meanwhile.
        Checkpoint(tmp).write_manifest(await asyncio.to_thread(files, tmp))
    except BaseException:  # e.g. the disk filled up: leave no partial folder behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    faults.reached("checkpoint")
    final = root / name
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    (root / "latest.tmp").write_text(name)
    (root / "latest.tmp").replace(root / "latest")
    _rotate(root, keep, version)
    return final


def latest(run_dir: Path) -> Path | None:
    """The checkpoint `checkpoints/latest` names, if that folder exists (not verified: resume.py)."""
    pointer = run_dir / "checkpoints" / "latest"
    try:
        name = pointer.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    folder = run_dir / "checkpoints" / name
    return folder if name.startswith("step-") and "/" not in name and folder.is_dir() else None


def steps(run_dir: Path) -> list[Path]:
    """The complete `step-<N>` folders, newest first."""
    root = run_dir / "checkpoints"
    found = [p for p in root.glob("step-*") if p.is_dir() and p.name[5:].isdigit()] if root.is_dir() else []
    return sorted(found, key=lambda p: int(p.name[5:]), reverse=True)


def files(folder: Path) -> Manifest:
    """{relative path: (size, sha256)} of every file under `folder` but the manifest itself."""
    out: Manifest = {}
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder).as_posix()
        if path.is_file() and rel != MANIFEST:
            out[rel] = (path.stat().st_size, _sha256(path))
    return out


def damage(folder: Path) -> str | None:
    """Why checkpoint `folder` cannot be trusted (a file missing, cut or changed since it was
    saved, or no readable manifest), or None when every file matches its manifest."""
    try:
        manifest = Checkpoint(folder).manifest()
    except FileNotFoundError:
        return f"{folder / MANIFEST} is missing"
    except RecordError as e:  # names the file and what is wrong in it
        return f"cannot read {e}"
    except OSError as e:
        return f"{folder / MANIFEST} cannot be read: {e}"
    for rel, entry in manifest.items():
        path = folder / rel
        if not path.is_file():
            return f"{path} is missing"
        size, digest = entry
        if path.stat().st_size != size:
            return f"{path} is {path.stat().st_size} bytes, {size} when it was saved"
        if _sha256(path) != digest:
            return f"{path} does not match the checksum taken when it was saved"
    return None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def clean_partial(run_dir: Path) -> None:
    """Remove what a killed checkpoint write left behind."""
    root = run_dir / "checkpoints"
    for path in root.glob("*.tmp") if root.exists() else []:
        shutil.rmtree(path) if path.is_dir() else path.unlink()


def needed(root: Path) -> int:
    """Bytes the next checkpoint is expected to need: as much as the newest one, plus a margin."""
    done = steps(root.parent)
    size = sum(f.stat().st_size for f in done[0].rglob("*") if f.is_file()) if done else 0
    return size + MARGIN_BYTES


def check_space(folder: Path, need: int) -> None:
    free = shutil.disk_usage(folder).free
    if free < need:
        raise DiskSpaceError(f"not enough free disk space in {folder}: a checkpoint needs about "
                             f"{need / 2**20:.0f} MB, {free / 2**20:.0f} MB are free; free some space "
                             "or set run.run_dir to another disk")


def _rotate(root: Path, keep: int, version: int) -> None:
    """Keep the newest `keep` checkpoints up to `version` (the one just written); remove older ones.
    Newer ones (a resumed run started behind them) were not superseded: they stay."""
    older = [p for p in steps(root.parent) if int(p.name[5:]) < version]
    for old in older[max(keep - 1, 0):] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


async def keep_writing(ex: Executor, run_dir: Path, keep: int, flush_s: float, stopped: asyncio.Event) -> None:
    """The driver's side of a running run: write periodic checkpoints when due, and flush the
    record streams every `flush_s` seconds (and once at once: the trace's names, the first samples
    issued), until `stopped` is set. Each train step also flushes them (Coordinator.trained)."""
    await ex.call("flush")
    while not stopped.is_set():
        due = await ex.call("wait_checkpoint", flush_s)
        if stopped.is_set():
            return
        if due is None:
            await ex.call("flush")
            continue
        released = False

        async def release() -> None:  # the stages' state is saved: the train nodes go on
            nonlocal released
            released = True
            await ex.call("checkpoint_done")

        try:
            await write(ex, run_dir, due, keep, release)
        except Exception as e:  # the run cannot go on without its checkpoints
            await ex.call("abort", f"checkpoint at version {due} failed: {e}")
            return
        finally:
            if not released:
                await ex.call("checkpoint_done")
