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

LOCAL_ONLY = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def init_ray(address: str | None = None, **options: object) -> bool:
    """`ray.init` with `options`: attach to `address` (else `RAY_ADDRESS`) if set, else start a
    loopback-only cluster. True if it attached to a cluster that was running already."""
    import ray

    if address or os.environ.get("RAY_ADDRESS"):
        ray.init(address=address or None, **options)  # the user's cluster, exposed (or not) as they set it up
        return True
    from ray._private import ray_constants

    # Ray reads the switch when it is imported; set both, so that this process and the
    # processes it starts agree on the node's address.
    os.environ[LOCAL_ONLY] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    ray.init(_node_ip_address="127.0.0.1", **options)
    return False
