"""Tool services a run starts and stops with itself. `sandbox`: Python code run in a fresh,
limited process per call (bubblewrap where it works), behind a loopback HTTP API.

    from flowrl_operators.tools import SandboxService, observation
    async with SandboxService({"workers": 2}) as sandbox:
        text = observation(await sandbox.run("print(47 * 38 + 12)"))   # "1798"

A generate node with `tools: {sandbox: {...}}` starts one; its workflows find the client in
`ctx.services["sandbox"]`. The modules: `isolation` (the command line, the prelude, the sweeps),
`execute` (one call), `pool` (the workers and the latency record), `server` (the HTTP process),
`client` (ToolResult, SandboxClient, observation) and `service` (the lifecycle).
"""

from flowrl_operators.tools.client import SandboxClient, SandboxError, Timing, ToolResult, observation
from flowrl_operators.tools.service import SandboxService

__all__ = ["SandboxClient", "SandboxError", "SandboxService", "Timing", "ToolResult", "observation"]
