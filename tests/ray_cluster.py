"""A multi-node Ray cluster on this machine, for tests: a head and worker nodes, each started with
`ray start --block` at 127.0.0.1 in a session of its own.

It is stopped by signalling the processes of those sessions only (`ray stop` would stop every
Ray process of the user on the machine, other people's clusters included). Raylets put their
workers in process groups of their own, so the processes are found by session id, which they keep.
Each node gets a small object store; worker nodes get a custom resource and a node label each, so
that a test can place stages on them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

OBJECT_STORE_BYTES = 100 * 2**20
RAY = str(Path(sys.executable).with_name("ray"))
COMMON = ["--node-ip-address", "127.0.0.1", "--block", "--disable-usage-stats"]


class LocalCluster:
    def __init__(self, workers: dict[str, int], head_cpus: int = 1, store_bytes: int = OBJECT_STORE_BYTES) -> None:
        """workers: name -> CPUs. Worker `x` offers the custom resource `flowrl_node_x` (1 unit)
        and carries the labels `flowrl_node=x` and `flowrl_pool=workers` (the head carries none).
        store_bytes: each node's object store."""
        self.workers, self.head_cpus = workers, head_cpus
        self.common = [*COMMON, "--object-store-memory", str(store_bytes)]
        # Ray's socket paths must stay short: a directory of its own under /tmp, not pytest's tmp_path.
        self.temp = tempfile.mkdtemp(prefix="flowrl-ray-")
        self.address = f"127.0.0.1:{_free_port()}"
        self.sessions: list[subprocess.Popen] = []  # every `ray start` process, for stop()
        self.live: dict[str, subprocess.Popen] = {}  # worker name -> its session

    def start(self, timeout: float = 180) -> LocalCluster:
        port = self.address.split(":")[1]
        deadline = time.time() + timeout
        self._spawn([RAY, "start", "--head", "--port", port, "--num-cpus", str(self.head_cpus),
                     "--include-dashboard", "false", "--temp-dir", self.temp, *self.common], "head")
        self._wait(1, deadline)
        for name in self.workers:
            self._start_worker(name, deadline)
        return self

    def _start_worker(self, name: str, deadline: float) -> None:
        # One at a time, each retried: `ray start` gives a node 30 s to register with the GCS,
        # which a loaded 2-core machine does not always manage with several nodes starting at once.
        nodes = self.alive_nodes() + 1
        for _ in range(3):
            self._spawn([RAY, "start", "--address", self.address, "--num-cpus", str(self.workers[name]),
                         "--resources", json.dumps({f"flowrl_node_{name}": 1}), "--labels",
                         f"flowrl_node={name},flowrl_pool=workers", *self.common], name)
            if self._wait(nodes, deadline):
                self.live[name] = self.sessions[-1]
                return
        self.stop(keep_logs=True)
        raise RuntimeError(f"worker node {name} of the test Ray cluster did not come up; logs in {self.temp}")

    def kill(self, name: str) -> None:
        """End worker node `name`, all its processes at once (a lost machine)."""
        for pid in _pids([self.live.pop(name)]):
            _signal(pid, signal.SIGKILL)

    def revive(self, name: str, timeout: float = 120) -> None:
        """Start worker node `name` again after kill()."""
        deadline = time.time() + timeout
        while self.alive_nodes() > len(self.live) + 1:  # until Ray has noticed the loss
            if time.time() > deadline:
                raise RuntimeError(f"Ray still counts worker node {name} alive")
            time.sleep(1)
        self._start_worker(name, deadline)

    def _wait(self, nodes: int, deadline: float) -> bool:
        """Wait until `nodes` nodes are alive (True), or the newest `ray start` has exited (False)."""
        while self.alive_nodes() < nodes:
            if time.time() > deadline or self.sessions[0].poll() is not None:
                self.stop(keep_logs=True)
                raise RuntimeError(f"the test Ray cluster did not come up; logs in {self.temp}")
            if self.sessions[-1].poll() is not None:  # its raylet may live on: end it before a retry
                _end([self.sessions.pop()])
                return False
            time.sleep(1)
        return True

    def _spawn(self, command: list[str], name: str) -> None:
        # Ray's workers import the test modules (runtime_ops) by name: PYTHONPATH as `ray start` had it.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
        log = open(Path(self.temp) / f"{name}.out", "a")  # noqa: SIM115 - the process keeps it
        self.sessions.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                              start_new_session=True))

    def alive_nodes(self) -> int:
        """Alive nodes, as `ray status` (a driver of its own) sees them; 0 if it cannot connect."""
        out = subprocess.run([RAY, "status", "--address", self.address], capture_output=True, text=True,
                             timeout=60)
        if out.returncode != 0:
            return 0
        active = out.stdout.split("Active:", 1)[-1].split("Pending:", 1)[0]
        return sum(1 for line in active.splitlines() if "node_" in line)

    def stop(self, keep_logs: bool = False) -> None:
        """End every process of this cluster's sessions (and nothing else): SIGTERM, then SIGKILL;
        then remove its temp dir (Ray's logs), unless `keep_logs`."""
        _end(self.sessions)
        if not keep_logs:
            shutil.rmtree(self.temp, ignore_errors=True)


def _end(sessions: list[subprocess.Popen]) -> None:
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        for pid in _pids(sessions):
            _signal(pid, sig)
        deadline = time.time() + wait
        while _pids(sessions) and time.time() < deadline:
            time.sleep(0.2)
    for p in sessions:
        p.wait(timeout=5)


def _pids(sessions: list[subprocess.Popen]) -> list[int]:
    """The live processes of these sessions (raylets put their workers in process groups of
    their own, but a session id is kept)."""
    ids = {p.pid for p in sessions}
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) in ids and fields[0] != "Z":  # fields: state ppid pgrp session ...
            found.append(int(stat.parent.name))
    return found


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
