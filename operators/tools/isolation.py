"""How one sandboxed call is started: the command line (bubblewrap or bare), the Python prelude that
applies the limits inside, the per-slot user ids, and the sweeps of processes and folders left over.

Each call runs `python3 -I -u -c PRELUDE` in a fresh folder. The prelude sets the rlimits (CPU,
address space, file size, open files, no core dumps), drops to the worker slot's own user id when
the service runs as root (RLIMIT_NPROC does not apply to root, so without the drop a fork bomb is
bounded only by the CPU limit and the wall-time kill), writes its monotonic clock on a pipe (the
moment the user's code starts, by the system-wide clock the service reads too: process start and
code time are measured apart, whenever the service's loop gets to read it), then runs `main.py`. An
uncaught exception's class name follows on that pipe, so "memory" is told from other errors reliably.

Each slot's user id is unique to the service process (`slot_uid`): after a call in rlimit mode every
process of that uid is killed (a child that left the process group with setsid() included), and a
later service kills the processes and removes the folders of a service that is gone.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

UID_BASE = 1_000_000  # far above login and system users; a slot's uid is UID_BASE + pid * 256 + slot
SLOTS_PER_SERVICE = 256
ROOT_PREFIX = "flowrl-sandbox-"  # <tmp>/flowrl-sandbox-<service pid>-<random>/call-<n>
OPEN_FILES = 64
SANDBOX_HOME = "/tmp"  # where a call's folder is mounted under bwrap (a path that exists on any root)
FILE_BYTES = 16 << 20  # the largest file a call may write (RLIMIT_FSIZE)

PRELUDE = r"""
import os, resource as R, sys, time
cpu, mem, nproc, fsize, files, uid, pdeath, fd = map(int, sys.argv[1:9])
del sys.argv[1:9]
src = open("main.py", encoding="utf-8", errors="replace").read()
for k, v in ((R.RLIMIT_CPU, (cpu, cpu + 1)), (R.RLIMIT_AS, (mem, mem)), (R.RLIMIT_FSIZE, (fsize, fsize)),
             (R.RLIMIT_NOFILE, (files, files)), (R.RLIMIT_CORE, (0, 0))):
    R.setrlimit(k, v)
if uid >= 0:
    os.setgroups([]); os.setresgid(uid, uid, uid); os.setresuid(uid, uid, uid)
    R.setrlimit(R.RLIMIT_NPROC, (nproc, nproc))
if pdeath:
    import ctypes, signal
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)
    if os.getppid() != pdeath:
        os._exit(137)
os.write(fd, b"%r\n" % time.monotonic())
try:
    exec(compile(src, "main.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
except SystemExit:
    raise
except BaseException as e:
    try:
        os.write(fd, type(e).__name__.encode())
    except OSError:
        pass
    try:
        import traceback
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)
    except BaseException:
        sys.stderr.write(f"{type(e).__name__}: {e}\n")
    sys.exit(1)
"""


def python_path() -> str:
    """The interpreter calls run: the system's python3 where there is one (world-readable, so the
    dropped uid can still import the standard library), else this one."""
    return "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable


def slot_uid(slot: int, service_pid: int | None = None) -> int:
    return UID_BASE + (service_pid or os.getpid()) * SLOTS_PER_SERVICE + slot  # pids stay below 2**22


def command(python: str, bwrap: bool, workdir: Path, *, cpu_s: int, memory_mb: int, processes: int,
            uid: int, service_pid: int, marker_fd: int) -> tuple[list[str], str]:
    """(argv, cwd) of one call. bwrap: a read-only root, fresh /dev and /proc, the call's folder as
    the only writable place (mounted as /tmp, its working directory), no network, its own pid, ipc and uts namespaces, and
    killed with its parent (the service); its pid namespace dies with it, children included."""
    limits = [str(cpu_s), str(memory_mb << 20), str(processes), str(FILE_BYTES), str(OPEN_FILES), str(uid),
              "0" if bwrap else str(service_pid), str(marker_fd)]
    py = [python, "-I", "-u", "-c", PRELUDE, *limits]
    if not bwrap:
        return py, str(workdir)
    box = ["bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
           "--bind", str(workdir), SANDBOX_HOME, "--chdir", SANDBOX_HOME, "--unshare-net", "--unshare-pid",
           "--unshare-ipc", "--unshare-uts", "--die-with-parent", "--new-session", "--"]
    return box + py, "/"


def environment(home: str) -> dict[str, str]:
    """A call's whole environment: nothing of the service's (no tokens, no paths of the run)."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8",
            "PYTHONIOENCODING": "utf-8"}


def processes_of(uids: set[int] | None = None, above: int | None = None) -> dict[int, int]:
    """{pid: uid} of the processes whose uid is in `uids` (or at least `above`)."""
    found = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        uid = real_uid(entry.name)
        if uid is None:
            continue  # gone meanwhile
        if (uids is not None and uid in uids) or (above is not None and uid >= above):
            found[int(entry.name)] = uid
    return found


def real_uid(pid: str) -> int | None:
    """A live process's real uid, from its status (its /proc folder's owner is root once a setuid
    made it undumpable); None for a zombie (dead, waiting for its parent to collect it) or none."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"State:") and line.split()[1] in (b"Z", b"X"):
                    return None
                if line.startswith(b"Uid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def become_subreaper() -> bool:
    """Orphans of the calls (children whose parent ended) become this process's children, so that it
    can collect their exit: uncollected, they would still count against their slot's RLIMIT_NPROC."""
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def reap_orphans(keep: set[int]) -> int:
    """Collects the dead children of this process but those in `keep` (the calls' own processes,
    which asyncio collects): the calls' orphans, whatever their uid. Under bwrap that includes
    bwrap's own process in the call's pid namespace (root's, not the slot's), orphaned when the call
    is killed: uncollected, every call would keep a pid until the service ends. The number collected."""
    me, reaped = str(os.getpid()).encode(), 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) in keep:
            continue
        try:
            with open(f"/proc/{entry.name}/status", "rb") as f:
                fields = dict(line.split(b":", 1) for line in f if b":" in line)
            if fields[b"State"].split()[0] != b"Z" or fields[b"PPid"].strip() != me:
                continue
            os.waitpid(int(entry.name), os.WNOHANG)
            reaped += 1
        except (OSError, KeyError, ValueError, IndexError):
            continue
    return reaped


def kill_uids(uids: set[int], rounds: int = 20) -> int:
    """SIGKILL every process of `uids` until none is left (a process being killed cannot fork;
    RLIMIT_NPROC bounds how many there are). The number killed."""
    killed = 0
    for _ in range(rounds):
        found = processes_of(uids)
        if not found:
            return killed
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except OSError:
                pass
        time.sleep(0.002)
    return killed


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


UIDS_FILE = "uids.json"  # in a service's root folder: the slot uids its calls ran as


def sweep_stale(tmp: str | None = None) -> dict[str, int]:
    """Kill the sandbox processes and remove the folders of services that are gone (a service
    killed with SIGKILL could clean up neither). Only the uids a dead service recorded in its own
    folder are swept: never a uid this service did not hand out."""
    killed = removed = 0
    for folder in Path(tmp or tempfile.gettempdir()).glob(ROOT_PREFIX + "*"):
        pid = folder.name[len(ROOT_PREFIX):].split("-")[0]
        if not pid.isdigit() or alive(int(pid)):
            continue
        try:
            uids = {int(u) for u in json.loads((folder / UIDS_FILE).read_text()) if int(u) >= UID_BASE}
        except (OSError, ValueError, TypeError):
            uids = set()
        killed += kill_uids(uids) if uids else 0
        shutil.rmtree(folder, ignore_errors=True)
        removed += 1
    return {"processes": killed, "folders": removed}


def unused_uid(uid: int) -> bool:
    """Whether no account of this machine has `uid` (a directory service can hand out uids this high)."""
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return True
    return False
