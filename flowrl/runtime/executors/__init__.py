"""Executors: what runs a plan's stages, behind the `Executor` protocol run.py drives.

- executor.py      the protocol (tests/test_executor_contract.py holds both executors to it)
- inprocess.py     every stage an asyncio task in this process (debugging, tests)
- ray_executor.py  every stage replica a Ray actor, the coordinator an async actor
- ray_stage.py     the stage actor, and the coordinator proxy that passes policies as object refs
- ray_placement.py a placement group per node (custom resources, labels, strategy); placement.json
- ray_local.py     the cluster: the user's (run.ray_address, RAY_ADDRESS), or a loopback one of its own
"""
