"""The Ray executor: each stage replica is a Ray actor running the same Stage code as in-process;
the coordinator is an async actor the stages call through `RemoteCoordinator` (ray_stage.py).

Placement (ray_placement.py): a placement group per node, with a bundle per replica sized from the
node's resources (fractional CPUs, so a 2-core machine hosts a whole pipeline), its custom
resources and labels, and its `placement` strategy; where each replica went is written to
placement.json. A generate actor
that dies is restarted by Ray (`plan.run["max_restarts"]`, default 3); on restart it attaches to
the coordinator again, which re-issues the samples the dead actor had in flight (ledger
`reissue`), and it receives the latest weights before new work. A train actor whose process dies
while its machine stays up (kill -9, out of memory) stops the run, and run.py restarts the whole
run from its last checkpoint (`lost_train`; the train group's other ranks cannot go on without it).
Any other actor's death, or a generate actor out of restarts, stops the run like an operator exception.

A node with `resources.replicas: N > 1` gets N actors. Each gets the environment of
torch.distributed's `env://` rendezvous (MASTER_ADDR and MASTER_PORT at replica 0's host, RANK,
WORLD_SIZE, LOCAL_RANK) before its operator's setup(), and all replicas set up concurrently, so
an operator may call `init_process_group(init_method="env://")` there. Replicas of a train node
form one group: every rank gets the same batch and the step completes when all ranks have
(see the coordinator).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgspec
import ray
from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from flowrl.blame import UserCodeFailed
from flowrl.graph.plan import Plan
from flowrl.runtime.coordinator import Coordinator
from flowrl.runtime.executors import ray_placement as placement
from flowrl.runtime.executors.executor import task_error
from flowrl.runtime.executors.ray_local import init_ray
from flowrl.runtime.executors.ray_stage import StageActor
from flowrl.runtime.failures import StageFailed
from flowrl.spec.errors import UserError


class RayExecutor:
    def __init__(self, plan: Plan, run_dir: Path | None, origin: float) -> None:
        self.plan = plan
        self.run_dir = str(run_dir) if run_dir else None
        self.origin = origin
        self.connected = False  # this executor called ray.init, and disconnects at the end
        self.attached = False  # to a cluster that was running already (left running)
        self.coord: Any = None
        self.actors: dict[tuple[str, int], Any] = {}
        self.where: dict[tuple[str, int], dict[str, Any]] = {}  # pid, Ray node id and address per actor
        self.tasks: dict[asyncio.Task, tuple[str, int]] = {}
        self.pgs: dict[str, Any] = {}  # node -> its placement group
        self.max_restarts = int(plan.run.get("max_restarts", 3))
        # (node, replica) of a train actor whose process died on a machine still up: run.py then
        # restarts the run from its last checkpoint.
        self.lost_train: tuple[str, int] | None = None

    async def start(self, steps: int, stop_at: int | None, state: bytes | None, checkpoint: Path | None) -> None:
        if not ray.is_initialized():
            # run.ray_address's or RAY_ADDRESS's cluster, or a loopback-only one of our own.
            self.attached = init_ray(self.plan.run.get("ray_address"), include_dashboard=False)
            self.connected = True
        placement.check({n: self.plan.nodes[n].resources for n in self.plan.nodes}, ray.nodes())
        # On this (the driver's) node: the coordinator writes the run's records into run_dir.
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self.coord = ray.remote(Coordinator).options(num_cpus=0, scheduling_strategy=here).remote(
            self.plan, self.run_dir, steps, stop_at, self.origin, state)
        names = self.plan.order + [n for n in self.plan.nodes if n not in self.plan.order]
        self.pgs = {name: placement.group(name, self.plan.nodes[name].resources) for name in names}
        await asyncio.gather(*(pg.ready() for pg in self.pgs.values()))
        for name in names:
            res = self.plan.nodes[name].resources
            for r in range(res.replicas):
                self.actors[(name, r)] = ray.remote(StageActor).options(
                    num_cpus=res.cpus, num_gpus=res.gpus, resources=dict(res.custom),
                    scheduling_strategy=PlacementGroupSchedulingStrategy(self.pgs[name], placement_group_bundle_index=r),
                    max_restarts=self.max_restarts if self.plan.nodes[name].kind == "generate" else 0,
                    max_task_retries=0,  # a call that killed its actor must not be retried (it would again)
                ).remote(msgspec.json.encode(self.plan), name, r, self.run_dir, self.origin)
        env = {}
        for name in names:
            size = self.plan.nodes[name].resources.replicas
            if size > 1:  # torch.distributed's env:// rendezvous, at replica 0's host
                host, port = await self.actors[(name, 0)].address.remote()
                for r in range(size):
                    env[(name, r)] = {"MASTER_ADDR": host, "MASTER_PORT": str(port), "RANK": str(r),
                                      "WORLD_SIZE": str(size), "LOCAL_RANK": str(r)}
        # Started together: the ranks of a group meet in their operators' setup().
        try:
            where = await asyncio.gather(*(
                actor.start.remote(self.coord, str(checkpoint / name / f"r{r}") if checkpoint else None,
                                   env.get((name, r)))
                for (name, r), actor in self.actors.items()))
        except RayTaskError as e:  # a user's mistake (a checkpoint it cannot load): its own message
            if isinstance(e.cause, UserError):
                raise e.cause from None
            if isinstance(e.cause, UserCodeFailed):  # a setup() that raised: named with its node
                raise StageFailed(str(e.cause)) from None
            raise
        self.where = dict(zip(self.actors, where, strict=True))
        placement.write(self.run_dir, self.where, self.attached)
        self.tasks = {asyncio.get_running_loop().create_task(self._supervise(key)): key for key in self.actors}

    async def _supervise(self, key: tuple[str, int]) -> str | None:
        """Run a stage actor; restart a dead generate actor (Ray restarts the process)."""
        name, replica = key
        actor, restarts, starting = self.actors[key], 0, False
        while True:
            try:
                if starting:
                    # The restarted actor sets up again and attaches to the coordinator, which
                    # re-issues the samples the dead one held.
                    self.where[key] = await actor.start.remote(self.coord, None)
                    placement.write(self.run_dir, self.where, self.attached)  # Ray may have put it on another node
                    starting = False
                return await actor.run.remote()
            except ActorUnavailableError:  # still restarting: ask again shortly
                await asyncio.sleep(0.2)
                starting = True
            except RayActorError as e:
                stopping, kind = (await self.call("status"))["stopping"], self.plan.nodes[name].kind
                if kind == "train" and stopping in (None, "error") and self._machine_alive(key):
                    self.lost_train = (name, replica)  # its process died, not its machine
                if stopping:  # e.g. its group's other rank failed first, on losing it
                    return None
                if kind != "generate" or restarts >= self.max_restarts:
                    message = f"node '{name}' (replica {replica}): its actor died ({restarts} restarts):\n{e}"
                    await self.call("fail", name, replica, message)
                    return message
                # Its samples go back now, and the node's other engines stop leaving it a share.
                await self.call("attach", name, replica, -1)
                restarts += 1
                starting = True

    def _machine_alive(self, key: tuple[str, int]) -> bool:
        """Whether the Ray node a dead actor ran on is still up (Ray marks a lost machine dead
        before it reports the death of the actors it hosted)."""
        node_id = self.where.get(key, {}).get("node_id")
        return any(n["NodeID"] == node_id and n.get("Alive") for n in ray.nodes())

    async def call(self, method: str, *args: Any) -> Any:
        return await self.coord.request.remote(method, *args)

    async def wait(self) -> str:
        stopping = asyncio.get_running_loop().create_task(self.call("wait_stopping"))
        done, _ = await asyncio.wait([stopping, *self.tasks], return_when=asyncio.FIRST_COMPLETED)
        if not stopping.done():  # an actor's run ended first: its reply may have overtaken the coordinator's
            stopping.cancel()
            for task in done:
                await self.call("stage_ended", *self.tasks[task], task_error(task))
        return (await self.call("status"))["stopping"]

    async def join(self, timeout: float) -> list[tuple[str, str]]:
        done, pending = await asyncio.wait(self.tasks, timeout=timeout)
        for task in pending:
            ray.kill(self.actors[self.tasks[task]], no_restart=True)
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        failures = []
        for task in done:
            error = task_error(task)
            if error:
                failures.append((self.tasks[task][0], error))
        return failures

    async def save(self, directory: Path) -> None:
        keys = list(self.actors)
        results = await asyncio.gather(*(self.actors[(name, r)].save.remote(str(directory / name / f"r{r}"))
                                         for name, r in keys), return_exceptions=True)
        for (name, r), result in zip(keys, results, strict=True):
            if isinstance(result, RayActorError):  # its process or machine is gone: say which
                raise StageFailed(f"the checkpoint could not be written: node '{name}' (replica {r}) is "
                                  f"unreachable (its actor died, or its machine was lost):\n{result}")
            if isinstance(result, BaseException):
                raise result

    async def shutdown(self) -> list[tuple[str, str]]:
        """Close and remove every actor; returns (node, error) for those whose close failed."""
        closing = {asyncio.ensure_future(_quiet(actor.close.remote())): name for (name, _), actor in self.actors.items()}
        if closing:
            await asyncio.wait(closing, timeout=10)
        failures = [(name, error) for task, name in closing.items() if task.done() and (error := task.result())]
        for actor in self.actors.values():
            ray.kill(actor, no_restart=True)
        if self.coord is not None:
            ray.kill(self.coord, no_restart=True)
        for pg in self.pgs.values():
            remove_placement_group(pg)
        if self.connected:
            ray.shutdown()  # stops only a cluster of our own; from one we attached to it only disconnects
        return failures


async def _quiet(ref: Any) -> str | None:
    """A close call's error, if its actor was alive to raise one."""
    try:
        await ref
    except RayActorError:  # closing a dead actor: nothing left to release
        return None
    except Exception as e:
        return str(e)
    return None
