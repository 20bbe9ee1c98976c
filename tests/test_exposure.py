"""What flowrl exposes: a Ray cluster it starts listens on loopback only and keeps Ray's auth;
the OpenAI proxy refuses other addresses unless allowed; environment values stay out of run
files; a run's name cannot leave the runs folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flowrl.cli import main
from flowrl.graph.compile import compile_file

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "tests/specs/good/base.yaml"

# Lists the TCP sockets that this process and its descendants listen on, from /proc.
LISTENERS = r'''
import os, socket
def descendants(root):
    kids = {}
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            ppid = int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
        kids.setdefault(ppid, []).append(int(d))
    out, todo = [], [root]
    while todo:
        pid = todo.pop(); out.append(pid); todo += kids.get(pid, [])
    return out
def listening():
    inodes = set()
    for pid in descendants(os.getpid()):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    found = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in open(f"/proc/net/{table}").read().splitlines()[1:]:
            parts = line.split()
            if parts[3] == "0A" and parts[9] in inodes:  # LISTEN
                raw = bytes.fromhex(parts[1].split(":")[0])
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                found.append(socket.inet_ntop(family, raw))
    return found
'''

PROBE = LISTENERS + r'''
import ray  # imported first, as a program using flowrl may have done
from flowrl.runtime.ray_local import init_ray
init_ray(include_dashboard=False, num_cpus=1, log_to_driver=False)
@ray.remote
def ping():
    return 1
assert ray.get(ping.remote()) == 1
print(json.dumps({"listening": listening(), "auth": os.environ.get("RAY_AUTH_MODE")}))
ray.shutdown()
'''


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads /proc")
def test_local_ray_cluster_listens_on_loopback_only_and_keeps_auth() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    proc = subprocess.run([sys.executable, "-c", "import json\n" + PROBE], capture_output=True, text=True,
                          timeout=180, env={**env, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["listening"], "Ray started no servers?"
    loopback = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}
    assert set(found["listening"]) <= loopback, found["listening"]
    assert found["auth"] != "disabled"  # unset, Ray turns its token auth on; flowrl never turns it off


def test_no_flowrl_code_turns_ray_auth_off() -> None:
    for folder in ("flowrl", "operators"):
        for file in (ROOT / folder).rglob("*.py"):
            assert "RAY_AUTH_MODE\", \"disabled" not in file.read_text(), file
