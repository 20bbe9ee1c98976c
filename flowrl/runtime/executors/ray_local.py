"""How flowrl gets a Ray cluster: the user's, named by `run.ray_address` or `RAY_ADDRESS` (the
key wins), or a local one of its own.

Attached to the user's cluster, flowrl is one more driver of it: `ray.shutdown()` at the end
disconnects that driver and leaves the cluster, its nodes and other jobs running. Only the local
cluster flowrl started itself ends with the run.

A local cluster listens on loopback only. Ray resolves a node's address to the machine's
outward-facing IP and binds its servers (GCS, raylet, workers) there, unless multi-node
clusters are switched off (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`, as Ray does on laptops), when
it uses 127.0.0.1. Ray's own authentication (token auth by default) is left as the user set it:
`RAY_AUTH_MODE=disabled` in the environment turns it off, flowrl never does.
"""

from __future__ import annotations

import os
import socket

LOCAL_ONLY = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
# How long the head of a named cluster has to accept a connection. Ray itself retries an address that
# does not answer for minutes, deaf to SIGTERM meanwhile.
CONNECT_TIMEOUT_S = 10.0
START_HINT = ("start one with `ray start --head` (its address is printed), or unset run.ray_address and "
              "RAY_ADDRESS to let flowrl start a local cluster")


class ClusterError(RuntimeError):
    """The Ray cluster a run names cannot be reached."""


def check_reachable(address: str, where: str, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """A ClusterError, within `timeout` seconds, when `address` ("host:port", "ray://host:port";
    "auto" and "local" are Ray's to resolve) does not accept a TCP connection."""
    target = address.removeprefix("ray://")
    if target in ("auto", "local"):
        return
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        raise ClusterError(f"{where}: {address!r} is not a Ray address: give host:port of the head node "
                           "(e.g. 10.0.0.5:6379), ray://host:port, or auto")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            pass
    except OSError as e:
        why = f"no answer within {timeout:g} s" if isinstance(e, TimeoutError) else f"{type(e).__name__}: {e}"
        raise ClusterError(f"{where}: no Ray cluster answers at {address} ({why}); {START_HINT}") from None


def init_ray(address: str | None = None, **options: object) -> bool:
    """`ray.init` with `options`: attach to `address` (else `RAY_ADDRESS`) if set, else start a
    loopback-only cluster. True if it attached to a cluster that was running already."""
    import ray

    if address or os.environ.get("RAY_ADDRESS"):
        where = "run.ray_address" if address else "RAY_ADDRESS"
        check_reachable(address or os.environ["RAY_ADDRESS"], where)
        try:  # the user's cluster, exposed (or not) as they set it up
            ray.init(address=address or None, **options)
        except ConnectionError as e:  # e.g. "auto" with no cluster running on this machine
            raise ClusterError(f"{where}: cannot attach to the Ray cluster: {e}; {START_HINT}") from None
        return True
    from ray._private import ray_constants

    # Ray reads the switch when it is imported; set both, so that this process and the
    # processes it starts agree on the node's address.
    os.environ[LOCAL_ONLY] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    ray.init(_node_ip_address="127.0.0.1", **options)
    return False
