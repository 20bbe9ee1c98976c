"""`python -m flowrl_operators.engine.server --model PATH [--port N]`: the engine server (server.py)."""

from flowrl_operators.engine.server.server import main

main()
