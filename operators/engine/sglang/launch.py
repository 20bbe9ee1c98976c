"""Launching SGLang servers: one `python -m sglang.launch_server` per engine, each in a Ray actor on
its own placement-group bundle (its GPUs), bound to 127.0.0.1 on a free port, returned once `/health`
answers (`make_engine`, in engine/factory.py, builds the engine an `EngineConfig` asks for).

Only the command building and the process / health handling run in flowrl's CI (against flowrl's
own server, which starts the same way); launching real SGLang needs GPUs and the `sglang` extra.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flowrl_operators.engine.sglang.weights import ServerError, free_port

# --- launching servers ---------------------------------------------------------------------------------

RESERVED_ARGS = {"host", "port", "model_path", "model"}


def server_command(model_path: str, port: int, server_args: dict[str, Any] | None = None, *,
                   module: str = "sglang.launch_server", python: str = sys.executable) -> list[str]:
    """`python -m sglang.launch_server --model-path M --host 127.0.0.1 --port P` plus `server_args`:
    {"tp_size": 2} -> --tp-size 2; true -> a bare flag; false/None -> left out; a list -> its values."""
    args = [python, "-m", module, "--model-path", str(model_path), "--host", "127.0.0.1", "--port", str(port)]
    for key, value in (server_args or {}).items():
        flag = key.replace("_", "-").lstrip("-")
        if flag.replace("-", "_") in RESERVED_ARGS:
            raise ValueError(f"engine.server_args.{key}: flowrl sets the model path, host and port itself; "
                             "remove it (use the pipeline's model.path)")
        if value is None or value is False:
            continue
        if value is True:
            args.append(f"--{flag}")
        elif isinstance(value, list | tuple):
            args += [f"--{flag}", *map(str, value)]
        elif isinstance(value, dict):
            args += [f"--{flag}", json.dumps(value)]
        else:
            args += [f"--{flag}", str(value)]
    return args


class ServerProcess:
    """One server process on 127.0.0.1: started by `start`, healthy when `start` returns."""

    def __init__(self, command: list[str], port: int, log_path: str | os.PathLike,
                 env: dict[str, str] | None = None) -> None:
        self.command, self.port, self.log_path = command, port, Path(log_path)
        self.url = f"http://127.0.0.1:{port}"
        self.env = env
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 900.0) -> str:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child owns it for its lifetime
        self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                        env=dict(os.environ, **(self.env or {})), start_new_session=True)
        log.close()
        wait_healthy(self.url, timeout_s, self)
        return self.url

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def wait_healthy(url: str, timeout_s: float, process: ServerProcess | None = None) -> None:
    """Poll `url`/health until it answers 200; fail early, with the log's tail, if the process exits."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while True:
        if process is not None and process.process is not None and process.process.poll() is not None:
            raise ServerError(f"the server process exited with code {process.process.returncode} before "
                              f"{url}/health answered; last lines of {process.log_path}:\n{process.log_tail()}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            tail = process.log_tail() if process is not None else ""
            raise ServerError(f"{url}/health did not answer 200 within {timeout_s:.0f} s\n{tail}")
        time.sleep(0.5)


class ServerActor:
    """A Ray actor holding one server process; Ray's GPU assignment reaches it through the environment."""

    def __init__(self, command: list[str], port: int, log_path: str) -> None:
        self.server = ServerProcess(command, port, log_path)

    def start(self, timeout_s: float) -> str:
        return self.server.start(timeout_s)

    def stop(self) -> None:
        self.server.stop()


class LaunchedServer:
    """The adapter's handle on a launched actor: `stop()` ends the process, then the actor."""

    def __init__(self, actor, group=None) -> None:
        self.actor, self.group = actor, group

    def stop(self) -> None:
        import ray

        try:
            ray.get(self.actor.stop.remote(), timeout=60)
        finally:
            ray.kill(self.actor)
            if self.group is not None:
                ray.util.remove_placement_group(self.group)


def launch_servers(model_path: str, engines: int, server_args: dict[str, Any] | None = None, *,
                   gpus: float | None = None, command: Callable[..., list[str]] = server_command,
                   log_dir: str | None = None, timeout_s: float = 900.0) -> list[tuple[str, LaunchedServer]]:
    """Start `engines` servers, each a Ray actor on its own bundle of `gpus` GPUs (default: the
    server's tp_size) on 127.0.0.1 and a free port; returns (url, handle) pairs once all are healthy.
    `command(model_path, port, server_args)` builds each command line (SGLang's by default)."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    args = dict(server_args or {})
    if gpus is None:
        gpus = float(args.get("tp_size", args.get("tp", 1)))
    bundle = {"CPU": 1.0, **({"GPU": gpus} if gpus else {})}
    if not ray.is_initialized():  # e.g. the in-process executor: a local Ray for the server actors
        from flowrl.runtime.executors.ray_local import init_ray

        init_ray(include_dashboard=False)
    have = ray.cluster_resources().get("GPU", 0.0)
    if gpus and have < gpus * engines:  # a placement group would wait for them forever
        raise RuntimeError(f"engine: sglang launches {engines} server(s) on {gpus:g} GPU(s) each, but the Ray "
                           f"cluster has {have:g} GPUs; attach to running servers with engine.url instead")
    group = placement_group([bundle] * engines, strategy="PACK")
    ray.get(group.ready(), timeout=timeout_s)
    log_dir = log_dir or tempfile.mkdtemp(prefix="flowrl-sglang-logs-")
    remote = ray.remote(ServerActor)
    actors, calls = [], []
    for i in range(engines):
        port = free_port()  # picked here: right for one node (multi-node would pick it in the actor)
        actor = remote.options(num_cpus=1.0, num_gpus=gpus or 0, scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=group, placement_group_bundle_index=i)).remote(
            command(model_path, port, args), port, f"{log_dir}/server-{i}.log")
        actors.append(actor)
        calls.append(actor.start.remote(timeout_s))
    try:
        urls = ray.get(calls)
    except BaseException:
        for actor in actors:
            ray.kill(actor)
        ray.util.remove_placement_group(group)
        raise
    handles = [LaunchedServer(a) for a in actors]
    handles[-1].group = group  # the last handle stopped also frees the placement group
    return list(zip(urls, handles, strict=True))
