"""The sandbox tool service (flowrl_operators.tools), run for real: a server process, real calls in
bubblewrap where it works here (else those tests skip, saying so) and in the rlimit-only mode
explicitly. Every hostile input comes back as a structured result, the service keeps answering,
and nothing of a call outlives it."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import time
from pathlib import Path

import pytest

from flowrl_operators.tools import SandboxService, ToolResult, observation
from flowrl_operators.tools.isolation import processes_of

LIMITS = {"workers": 2, "cpu_s": 1, "memory_mb": 128, "wall_s": 3.0, "output_bytes": 4096, "processes": 8}


class Running:
    """A started service and one event loop to call it from (its client lives on that loop)."""

    def __init__(self, **config: object) -> None:
        self.loop = asyncio.new_event_loop()
        self.service = SandboxService(LIMITS | config)
        self.client = self.loop.run_until_complete(self.service.astart())
        self.health = self.service.health

    def run(self, code: str, timeout_s: float | None = None) -> ToolResult:
        return self.loop.run_until_complete(self.client.run(code, timeout_s))

    def close(self) -> None:
        self.loop.run_until_complete(self.service.astop())
        self.loop.close()

    @property
    def bwrap(self) -> bool:
        return self.health["isolation"] == "bwrap"

    def leftovers(self) -> dict[int, int]:
        """Processes still running under the service's slot uids (none when it drops no privileges)."""
        return processes_of({u for u in self.health["uids"] if u >= 0})

    def zombies(self) -> list[int]:
        """The service's dead children it has not collected: each holds a pid until the service ends
        (bwrap's own process in the call's pid namespace, orphaned when the call is killed, is one)."""
        found = []
        for entry in Path("/proc").iterdir():
            try:
                status = dict(line.split(":", 1) for line in (entry / "status").read_text().splitlines() if ":" in line)
            except (OSError, ValueError):
                continue
            if status["PPid"].strip() == str(self.service.process.pid) and status["State"].split()[0] == "Z":
                found.append(int(entry.name))
        return found


@pytest.fixture(scope="module")
def auto():
    running = Running()
    yield running
    running.close()


@pytest.fixture(scope="module")
def bare():
    running = Running(isolation="rlimits")
    yield running
    running.close()


@pytest.fixture(params=["auto", "rlimits"])
def sandbox(request, auto, bare):
    if request.param == "auto" and not auto.bwrap:
        pytest.skip(f"bubblewrap does not work here ({auto.health['notes']}): the auto mode is the rlimit one")
    return auto if request.param == "auto" else bare


def test_a_clean_call_returns_its_output_and_measured_timing(sandbox):
    r = sandbox.run("print(47 * 38 + 12)")
    assert (r.ok, r.stdout, r.stderr, r.exit_code, r.error) == (True, "1798\n", "", 0, None)
    assert 0 < r.timing.start_s < 5 and 0 < r.timing.run_s < 5 and r.timing.queue_s >= 0
    assert observation(r) == "1798"
    assert sandbox.zombies() == []  # the call's processes, collected as it ends


def test_health_says_what_is_enforced_in_each_mode(auto, bare):
    assert bare.health["isolation"] == "rlimits"
    assert {"network", "filesystem"} <= set(bare.health["not_enforced"])
    for running in (auto, bare):
        assert {"cpu_time", "memory", "wall_time", "output", "working_dir"} <= set(running.health["enforced"])
        dropped = running.health["uids"][0] >= 0
        assert ("processes" in running.health["enforced"]) == dropped
        assert ("processes" in running.health["not_enforced"]) == (not dropped)
    if auto.bwrap:
        assert {"network", "filesystem", "namespaces"} <= set(auto.health["enforced"])


HOSTILE = {
    "syntax error": ("print(", {"exception"}, "SyntaxError"),
    "raises": ("1 / 0", {"exception"}, "ZeroDivisionError"),
    "reads stdin": ("input()", {"exception"}, "EOFError"),
    "memory hog": ("x = bytearray(1 << 30)", {"memory"}, "MemoryError"),
    "segfault": ("import ctypes; ctypes.string_at(0)", {"crash"}, "SIGSEGV"),
    "aborts": ("import os; os.abort()", {"crash"}, "SIGABRT"),
    "exit code": ("import sys; sys.exit(3)", {"exit"}, "exit code 3"),
    # CPU-bound: the CPU limit (1 s) ends it, or the wall limit on a machine too busy to give it 1 s in 3
    "infinite loop": ("while True: pass", {"cpu_time", "timeout"}, ""),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_code_is_a_structured_error(sandbox, name):
    code, errors, detail = HOSTILE[name]
    r = sandbox.run(code)
    assert not r.ok and r.error in errors and detail in (r.detail or "") + r.stderr, r
    assert detail in observation(r) and observation(r) != "[no output]"  # what the model reads names it
    assert sandbox.run("print('still here')").stdout == "still here\n"


def test_a_sleeping_call_is_stopped_at_its_timeout(sandbox):
    started = time.monotonic()
    r = sandbox.run("import time\nprint('before', flush=True)\ntime.sleep(30)", timeout_s=0.5)
    assert r.error == "timeout" and r.stdout == "before\n" and time.monotonic() - started < 5
    assert "timed out" in observation(r)


def test_huge_output_is_cut_while_read(sandbox):
    r = sandbox.run("while True:\n    print('x' * 1000)")
    assert r.error == "output_limit" and len(r.stdout) == LIMITS["output_bytes"] and set(r.stdout) <= {"x", "\n"}
    assert "too much output" in observation(r)


def test_a_fork_bomb_is_bounded_and_leaves_nothing(sandbox):
    r = sandbox.run("import os\nwhile True:\n    os.fork()")
    assert not r.ok and r.error in {"exception", "cpu_time", "timeout"}
    if "processes" in sandbox.health["enforced"]:  # RLIMIT_NPROC: fork fails fast
        assert r.error == "exception" and "BlockingIOError" in r.stderr
    assert sandbox.leftovers() == {}
    assert sandbox.run("print(1)").ok


def test_a_child_that_leaves_the_process_group_is_killed_with_the_call(sandbox):
    if sandbox.health["uids"][0] < 0 and not sandbox.bwrap:
        pytest.skip("no per-slot uid (the service is not root) and no bwrap: a setsid() child can escape")
    code = "import os, time\nif os.fork() == 0:\n    os.setsid(); time.sleep(60)\nprint(os.getpid())"
    r = sandbox.run(code)
    assert r.ok and r.stdout.strip().isdigit() and sandbox.leftovers() == {}


def test_network_is_cut_under_bwrap_and_reachable_without(sandbox):
    """A listener on the host's loopback: unreachable from a call under bwrap (its own network
    namespace), reachable in the rlimit mode, as /health says."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        r = sandbox.run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('connected')")
    if sandbox.bwrap:
        assert r.error == "exception" and "ConnectionRefusedError" in r.stderr and "network" in sandbox.health["enforced"]
    else:
        assert r.ok and r.stdout == "connected\n" and "network" in sandbox.health["not_enforced"]


@pytest.fixture
def outside_dir():
    """A folder of the service's user, outside /tmp (which a bwrap call sees as its own folder)."""
    folder = Path(__file__).parent / f".sandbox-outside-{os.getpid()}"
    folder.mkdir(mode=0o755)
    yield folder
    shutil.rmtree(folder)


def test_writes_stay_in_the_calls_own_folder_which_is_removed(sandbox, outside_dir: Path):
    if not sandbox.bwrap and sandbox.health["uids"][0] < 0:
        pytest.skip("neither bwrap nor a per-slot uid: the code may write wherever the service's user may")
    outside = outside_dir / "outside.txt"
    r = sandbox.run(f"open({str(outside)!r}, 'w').write('x')")
    # Under bwrap the folder is read-only, or not there at all when it lies below /tmp (a checkout
    # under /tmp: the call's own folder is mounted over /tmp); without it the slot's uid may not write.
    expected = ("Read-only file system", "No such file or directory") if sandbox.bwrap else ("PermissionError",)
    assert r.error == "exception" and any(e in r.stderr for e in expected) and not outside.exists(), r
    r = sandbox.run("import os\nopen('mine.txt', 'w').write('x')\nprint(sorted(os.listdir('.')))")
    assert r.ok and "mine.txt" in r.stdout
    assert list(Path(sandbox.health["root"]).glob("call-*")) == []  # each call's folder is gone after it


def test_a_burst_of_200_calls_waits_in_the_queue_with_bounded_concurrency(auto):
    """Each call records when its code ran (one clock for all namespaces); never more than `workers`
    overlap, every call is answered, and the queue waits are measured."""
    code = "import time\na = time.time()\ntime.sleep(0.005)\nprint(a, time.time())"

    async def burst() -> list[ToolResult]:
        return await asyncio.gather(*(auto.client.run(code) for _ in range(200)))

    before = auto.loop.run_until_complete(auto.client.stats())["calls"]
    results = auto.loop.run_until_complete(burst())
    assert all(r.ok for r in results), [r for r in results if not r.ok][:2]
    events = sorted([(float(a), 1) for r in results for a in r.stdout.split()[:1]]
                    + [(float(b), -1) for r in results for b in r.stdout.split()[1:]], key=lambda e: (e[0], e[1]))
    running = peak = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    assert 1 <= peak <= LIMITS["workers"]
    waits = sorted(r.timing.queue_s for r in results)
    assert waits[-1] > 1.0 and sum(w > 0.01 for w in waits) > 150  # most waited for a worker
    stats = auto.loop.run_until_complete(auto.client.stats())
    assert stats["calls"] - before == 200 and stats["max_running"] <= LIMITS["workers"]
    assert stats["latency"]["queue_s"]["p99"] >= stats["latency"]["queue_s"]["median"] > 0
    assert auto.zombies() == []  # a long run makes calls by the million: each would keep a pid


def test_a_bad_request_is_a_400_naming_it(auto):
    import aiohttp

    async def post(body: object) -> tuple[int, dict]:
        async with aiohttp.ClientSession() as s, s.post(auto.service.url + "/run", json=body) as r:
            return r.status, await r.json()

    assert auto.loop.run_until_complete(post({"cod": "1"})) == (400, {"error": "bad_request", "detail": "missing key 'code'"})
    status, body = auto.loop.run_until_complete(post({"code": "1", "timeout_s": -1}))
    assert status == 400 and "timeout_s" in body["detail"]
