"""How flowrl gets a Ray cluster: the user's, named by `RAY_ADDRESS`, or a local one of its own.

A local cluster listens on loopback only. Ray resolves a node's address to the machine's
outward-facing IP and binds its servers (GCS, raylet, workers) there, unless multi-node
clusters are switched off (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`, as Ray does on laptops), when
it uses 127.0.0.1. Ray's own authentication (token auth by default) is left as the user set it:
`RAY_AUTH_MODE=disabled` in the environment turns it off, flowrl never does.
"""

from __future__ import annotations

import os

LOCAL_ONLY = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def init_ray(**options: object) -> None:
    """`ray.init` with `options`: attach to `RAY_ADDRESS` if set, else start a loopback-only cluster."""
    import ray

    if os.environ.get("RAY_ADDRESS"):
        ray.init(**options)  # the user's cluster, exposed (or not) as they set it up
        return
    from ray._private import ray_constants

    # Ray reads the switch when it is imported; set both, so that this process and the
    # processes it starts agree on the node's address.
    os.environ[LOCAL_ONLY] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    ray.init(_node_ip_address="127.0.0.1", **options)
