"""The sandbox service's lifecycle, for real: nothing outlives a run killed with SIGKILL, a stale
service's folders are swept, the bwrap-or-rlimits choice, the YAML key on a generate node."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from flowrl.cli import main
from flowrl_operators.tools import SandboxService
from flowrl_operators.tools.isolation import ROOT_PREFIX, alive, processes_of

BASE = Path(__file__).resolve().parent / "specs/good/base.yaml"

RUN = """
import json, sys, threading, urllib.request
from flowrl_operators.tools import SandboxService
service = SandboxService({"workers": 1, "wall_s": 60, "cpu_s": 60})
service.start()
def call():
    body = json.dumps({"code": "import time; time.sleep(60)"}).encode()
    urllib.request.urlopen(urllib.request.Request(service.url + "/run", body), timeout=120)
threading.Thread(target=call, daemon=True).start()
print(json.dumps({"server": service.pid, "url": service.url, "health": service.health}), flush=True)
threading.Event().wait()
"""


def _until(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def _listening(url: str) -> bool:
    port = int(url.rsplit(":", 1)[1])
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_a_run_killed_with_sigkill_leaves_no_process_folder_or_port():
    run = subprocess.Popen([sys.executable, "-c", RUN], stdout=subprocess.PIPE, text=True)
    try:
        facts = json.loads(run.stdout.readline())
        root, uids = Path(facts["health"]["root"]), {u for u in facts["health"]["uids"] if u >= 0}
        # the call is running: its folder exists (and, with a per-slot uid, its process)
        assert _until(lambda: any(root.glob("call-*")) and (not uids or processes_of(uids)), 20)
        assert alive(facts["server"]) and _listening(facts["url"])
    finally:
        run.send_signal(signal.SIGKILL)
        run.wait()
    assert _until(lambda: not alive(facts["server"]), 5), "the server outlived the run"
    assert _until(lambda: not root.exists(), 5), "the service's folder outlived the run"
    assert not _listening(facts["url"])
    if uids:
        assert processes_of(uids) == {}, "a sandboxed process outlived the run"


def test_a_dead_services_folder_is_swept_at_the_next_start():
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = Path(tempfile.gettempdir()) / f"{ROOT_PREFIX}{int(dead.stdout)}-test"
    (stale / "call-0").mkdir(parents=True)
    with SandboxService({"workers": 1}) as service:
        assert not stale.exists() and service.health["swept_at_start"]["folders"] >= 1
    assert not Path(service.health["root"]).exists()


def test_isolation_falls_back_to_rlimits_or_fails_as_asked_where_bwrap_is_missing(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # the server finds no bwrap
    with SandboxService({"workers": 1}) as service:
        assert service.health["isolation"] == "rlimits"
        assert any("bwrap is not installed" in note for note in service.health["notes"])
    with pytest.raises(RuntimeError, match="isolation: bwrap does not work here: bwrap is not installed"):
        SandboxService({"workers": 1, "isolation": "bwrap"}).start()


@pytest.mark.parametrize(("override", "message"), [
    ("nodes.rollout.tools.sandbox.workers=0", "nodes.rollout.tools.sandbox.workers: expected `int` >= 1"),
    ("nodes.rollout.tools.sandbox.wal_s=3", "unknown key 'wal_s'; did you mean 'wall_s'?"),
    ("nodes.rollout.tools.sandbox.isolation=docker", "nodes.rollout.tools.sandbox.isolation: invalid enum value"),
    ("nodes.rollout.tools.sandbox.memory_mb=8", "nodes.rollout.tools.sandbox.memory_mb: expected `int` >= 64"),
])
def test_a_bad_sandbox_key_is_one_located_message(override, message, capsys):
    assert main(["validate", str(BASE), override]) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_every_sandbox_key_reaches_the_service():
    config = {"workers": 3, "cpu_s": 2, "memory_mb": 200, "wall_s": 1.5, "output_bytes": 100, "processes": 5,
              "isolation": "rlimits"}
    assert main(["validate", str(BASE)] + [f"nodes.rollout.tools.sandbox.{k}={v}" for k, v in config.items()]) == 0
    with SandboxService(config) as service:
        health = service.health
        assert health["limits"] == config and health["workers"] == 3 and len(health["uids"]) == 3
        assert health["isolation"] == "rlimits"
        assert "RLIMIT_CPU 2 s" in health["enforced"]["cpu_time"] and "200 MiB" in health["enforced"]["memory"]
        assert "1.5 s" in health["enforced"]["wall_time"] and "100 bytes" in health["enforced"]["output"]
        if health["uids"][0] >= 0:
            assert "RLIMIT_NPROC 5" in health["enforced"]["processes"]
    assert os.path.exists(health["root"]) is False


def test_a_generate_node_starts_the_sandbox_for_its_workflows_and_stops_it():
    import asyncio

    import msgspec

    from flowrl.operator import OperatorContext
    from flowrl_operators.config import GenerateConfig
    from flowrl_operators.generate import Generate

    async def life() -> tuple[str, dict]:
        config = msgspec.convert({"tools": {"sandbox": {"workers": 1}}, "sampling": {"max_new_tokens": 4}}, GenerateConfig)
        node = Generate(config, OperatorContext(node="rollout", model={"path": "builtin:tiny-qwen2"}, seed=1))
        await node.setup()
        try:
            result = await node.services["sandbox"].run("print(47 * 38 + 12)")  # what ctx.services holds
            return result.stdout, node.sandbox.health
        finally:
            await node.close()

    stdout, health = asyncio.run(life())
    assert stdout == "1798\n" and not alive(health["pid"]) and not Path(health["root"]).exists()
