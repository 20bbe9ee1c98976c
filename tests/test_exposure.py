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
from flowrl.runtime.executors.ray_local import init_ray
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


def test_proxy_binds_loopback_unless_remote_is_allowed() -> None:
    import asyncio

    from flowrl_operators.models import load_tokenizer
    from flowrl_operators.workflows.proxy import Proxy

    tok = load_tokenizer("builtin:tiny-qwen2")
    for host in ("0.0.0.0", "192.0.2.7", "example.org"):
        with pytest.raises(ValueError, match="loopback addresses only"):
            Proxy(engine=None, tokenizer=tok, host=host)
    assert Proxy(engine=None, tokenizer=tok, host="0.0.0.0", allow_remote=True).host == "0.0.0.0"

    async def serve() -> str:
        proxy = Proxy(engine=None, tokenizer=tok, host="localhost")
        url = await proxy.start()
        await proxy.close()
        return url

    assert asyncio.run(serve()).startswith("http://localhost:")


def test_validate_refuses_a_remote_proxy_host_unless_allowed(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(BASE), "nodes.rollout.proxy_host=0.0.0.0"]) == 1
    err = capsys.readouterr().err
    assert "nodes.rollout.proxy_host" in err and "proxy_allow_remote: true" in err
    assert main(["validate", str(BASE), "nodes.rollout.proxy_host=0.0.0.0", "nodes.rollout.proxy_allow_remote=true"]) == 0


def test_environment_values_are_redacted_from_run_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    secret = "sk-test-0123456789abcdef"
    monkeypatch.setenv("FLOWRL_TEST_SECRET", secret)
    spec = tmp_path / "pipeline.yaml"
    spec.write_text(BASE.read_text() + "description: 'key ${oc.env:FLOWRL_TEST_SECRET}'\n")
    plan = compile_file(str(spec), ["name=${oc.env:FLOWRL_TEST_SECRET}"]).plan
    assert plan.name == secret and plan.environment == ["FLOWRL_TEST_SECRET"]  # the run itself sees the value
    record = plan.record().decode()
    assert secret not in record
    assert json.loads(record)["name"] == "${oc.env:FLOWRL_TEST_SECRET}"
    assert main(["inspect", str(spec), "name=${oc.env:FLOWRL_TEST_SECRET}", "--format", "json"]) == 0
    out = capsys.readouterr().out
    assert secret not in out and '"name": "${oc.env:FLOWRL_TEST_SECRET}"' in out


@pytest.mark.parametrize("name", ["../../x", "/etc/x", "a/b", ".hidden", "x" * 200])
def test_run_name_cannot_leave_the_runs_folder(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = tmp_path / "pipeline.yaml"
    spec.write_text(BASE.read_text().replace("name: bad", f"name: '{name}'"))
    assert main(["validate", str(spec)]) == 1
    err = capsys.readouterr().err
    assert f"{spec}:2:7 name: " in err and "cannot name a folder" in err
    phased = tmp_path / "phased.yaml"
    phased.write_text(BASE.read_text() + f"phases:\n  - {{name: '{name}', steps: 1}}\n")
    assert main(["validate", str(phased)]) == 1
    assert "phases[0].name: " in capsys.readouterr().err
