"""The train node: RL updates of the policy (FSDP2), publishing version v+1.

One train step, in the order verl and AReaL use:

    batch = pack(trajectories)                       # rewards placed on tokens
    proximal logprobs  <- trainer (decoupled PPO / TIS / MIS only), then the behaviour weights
    kl penalty in the reward (kl.apply_as: reward)
    advantages         <- the configured estimator (GAE reads the critic's values)
    for epoch: forward_backward(batch, policy_loss) then optimizer step

The trainer's logprobs are under each token's sampling distribution (the trajectory's recorded
temperature / top-k / top-p; flowrl_operators.training.kernels). The train/inference mismatch
metrics (`mismatch_*`, flowrl_operators.training.losses) are those of the first epoch, whose forward
passes all run before the step's update.

The policy record it publishes is the new weights as buckets of (HF name, tensor) copied once after
the step (a `Snapshot`), so the sync node can ship them while the next step already changes the
live weights; no one copies them again: the in-process transport hands them over as they are and
the embedded engine adopts them as its weights. Only what a step can change is sent (frozen
parameters are not; with LoRA the adapters), the whole model when a restored policy is published.
Under Ray it is put into the object store by this node and published as a `StoredSnapshot`.
All of it is the `Learner`'s work; with `own_process: {threads: N}` the Learner lives in a child
process (flowrl_operators.training.process), and the node only passes trajectories and weights.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, ClassVar

import msgspec

from flowrl.blame import UserCodeFailed
from flowrl.data.trajectory import Group
from flowrl.operator import (
    POLICY,
    TRAJECTORIES,
    ConfigError,
    CostShape,
    GraphFacts,
    MetricRoles,
    Operator,
    OperatorContext,
    Resources,
    TrainResult,
)
from flowrl_operators.config import OptimConfig, TrainConfig
from flowrl_operators.timing import train_pass
from flowrl_operators.training.vocabulary import out_of_vocabulary, vocab_size


def trainer_config(optim: OptimConfig, micro_batch_tokens: int, max_nonfinite_steps: int, steps: int, seed: int,
                   **model_keys: Any):
    """The Trainer's config from a node's YAML keys (`model_keys`: the train node's
    gradient_checkpointing, freeze and lora)."""
    from flowrl_operators.training.trainer import TrainerConfig

    return TrainerConfig(
        lr=optim.lr, betas=optim.betas, weight_decay=optim.weight_decay, warmup_steps=optim.warmup_steps,
        schedule=optim.schedule, total_steps=steps, grad_clip=optim.grad_clip,
        gac_max_cos=optim.gac.max_cos if optim.gac is not None else None,
        micro_batch_tokens=micro_batch_tokens, max_nonfinite_steps=max_nonfinite_steps, seed=seed, **model_keys,
    )


def schedule_horizon(optim: OptimConfig, context: OperatorContext, per_step: int) -> int:
    """Optimizer steps a linear / cosine schedule decays over: `optim.total_steps`, else the run's
    (phase's) steps, times the optimizer steps of one train step (its epochs; micro-batches
    accumulate into one step). A constant schedule needs no horizon (1 is returned)."""
    if optim.schedule == "constant":
        return 1
    steps = optim.total_steps or context.steps
    if steps is None:
        raise ValueError(f"node '{context.node}': optim.schedule {optim.schedule!r} decays over the run's steps, but "
                         f"phase '{context.phase}' is bounded only by seconds; set optim.total_steps")
    return steps * per_step


def _reward_means(trajectories: list) -> dict[str, float]:
    """reward_mean over the sampled trajectories; greedy_reward_mean over the greedy baselines
    (generate greedy_baseline: true), which are no samples of the policy's distribution."""
    from flowrl.data.trajectory import GREEDY_BASELINE

    out = {}
    for key, greedy in (("reward_mean", False), ("greedy_reward_mean", True)):
        rewards = [t.reward for t in trajectories if t.reward is not None and bool(t.metadata.get(GREEDY_BASELINE)) == greedy]
        if rewards:
            out[key] = sum(rewards) / len(rewards)
    return out


LOGPROB_SUM = "logprob_sum"  # what _with_logprob_sum adds to the loss's metrics


def _with_logprob_sum(loss_fn: Any) -> Any:
    """The loss, also summing the policy's logprobs over the loss-mask tokens (forward_backward adds
    the micro-batches' and ranks' sums): pi_v's side of `policy_kl`, at no extra forward."""

    def fn(output: Any, mb: Any, normaliser: Any) -> Any:
        loss, values = loss_fn(output, mb, normaliser)
        logprobs = output["logprobs"].detach()
        values[LOGPROB_SUM] = float(logprobs.where(mb.loss_mask > 0, 0.0).sum())
        return loss, values

    return fn


class Learner:
    """The model side of a train step (trainer, loss, advantages), built in the train node's process
    or, with `own_process`, in a child process (flowrl_operators.training.process)."""

    def __init__(self, engine: str, model: str, config: Any, loss: Any, advantage: Any, epochs: int,
                 copy: bool = True, share: bool = False, kl_every: int = 0, threads: int | None = None) -> None:
        from flowrl_operators.training.engine import build
        from flowrl_operators.training.losses import policy_loss

        self.trainer = build(engine, model, config, "policy")
        self.loss, self.advantage, self.epochs = loss, advantage, epochs
        # What a version must send (training/tuning.py): with LoRA always the adapters (or the merged
        # adapted weights) on the engine's own base; with frozen parameters a step sends the rest.
        self.lora = getattr(config, "lora", None) is not None
        self.partial = self.lora or bool(getattr(config, "freeze", None))
        # In a child process (own_process) the reply's pickling copies the tensors before the next
        # call can change them: there a published policy is views, in process a copy. `share`: the
        # engines run in this process, so tensors that never change can be handed over once as they are.
        self.copy, self.share, self.shared = copy, share, False
        self.loss_fn = policy_loss(loss)
        self.kl_every = kl_every  # policy_kl every this many steps (0: never)
        self.threads = threads  # OperatorContext.threads: set in the thread each step runs in (per OS thread)

    def train(self, trajectories: list, step: int = 0) -> tuple[dict[str, float], list]:
        """One step on these trajectories: (metrics, the new weights as buckets of copies)."""
        import torch

        from flowrl_operators.memory import release
        from flowrl_operators.training.advantages import compute_advantages, tied_group_fraction
        from flowrl_operators.training.batch import pack, shard
        from flowrl_operators.training.losses import apply_kl_penalty, needs_proximal, set_behaviour_weights
        from flowrl_operators.training.objective import needs_reference

        if self.threads is not None:  # `flowrl replay`: the recorded run's count, in this very thread
            torch.set_num_threads(self.threads)
        from flowrl_operators.training.tuning import base_logprobs

        supervised = self.loss.supervised
        batch = pack(trajectories, require_reward=not supervised)
        health: dict[str, float] = {}
        if not supervised and (tied := tied_group_fraction(batch)) is not None:
            health["tied_group_fraction"] = tied  # before a KL penalty joins the rewards
        if supervised:  # a supervised target trains the model's own distribution, however it was drawn
            batch.temperature = batch.top_p = batch.top_k = None
        else:  # on the whole batch: group statistics need every member of a group
            if self.lora and needs_reference(self.loss) and batch.reference_logprobs is None:
                batch.reference_logprobs = base_logprobs(self.trainer, batch)  # the base is the reference
            apply_kl_penalty(batch, self.loss)
            compute_advantages(batch, self.advantage)
        # Every rank of a replicated train node gets the same groups and trains on its share of rows.
        batch = shard(batch, self.trainer.rank, self.trainer.world_size, self.trainer.shared)
        if needs_proximal(self.loss):
            batch.proximal_logprobs = self.trainer.compute_logprobs(batch)
            set_behaviour_weights(batch, self.loss, self.trainer.all_reduce)
        metrics: dict[str, float] = {}
        start: dict[str, float] = {}
        # Not for a supervised step: its targets are no samples of the policy, so k1 would not estimate a KL.
        measure = bool(self.kl_every) and step % self.kl_every == 0 and not supervised
        for epoch in range(self.epochs):
            if epoch > 0 and needs_proximal(self.loss) and self.loss.proximal_each_epoch:
                batch.proximal_logprobs = self.trainer.compute_logprobs(batch)  # the current policy
                set_behaviour_weights(batch, self.loss, self.trainer.all_reduce)
            metrics = self.trainer.forward_backward(batch, _with_logprob_sum(self.loss_fn)
                                                    if measure and epoch == 0 else self.loss_fn)
            if epoch == 0:  # before any update: the mismatch (and the policy's logprobs) at the step's start
                start = {k: v for k, v in metrics.items() if k.startswith("mismatch_") or k == LOGPROB_SUM}
            metrics |= self.trainer.step()
        metrics |= start | health
        # The step's float sums depend on the thread count (the in-process engine sets it for the
        # whole process): `flowrl replay` uses the same count to reproduce the step bit for bit.
        metrics["torch_threads"] = float(torch.get_num_threads())
        if measure:
            metrics["policy_kl"] = self._policy_kl(batch, metrics.pop(LOGPROB_SUM), metrics["tokens"])
        metrics.pop(LOGPROB_SUM, None)
        policy = self.policy(changed_only=True)
        release()  # the step's activations and gradients, freed: back to the OS (flowrl_operators.memory)
        return metrics, policy

    def _policy_kl(self, batch: Any, before: float, tokens: float) -> float:
        """KL(pi_v || pi_v+1) on the step's trained tokens, k1 = mean(log pi_v - log pi_v+1): the
        tokens were sampled by (about) pi_v, so this estimates the KL the step moved the policy by.
        pi_v's logprobs are the loss's own of the first epoch; pi_v+1's one forward without gradients."""
        import torch

        after = self.trainer.compute_logprobs(batch)
        local = float(torch.where(batch.loss_mask > 0, after, 0.0).sum())
        reduce = getattr(self.trainer, "all_reduce", None)
        total = reduce([local])[0] if reduce is not None else local
        return (before - total) / max(tokens, 1.0)

    def policy(self, changed_only: bool = False) -> list:
        """The weights as a Snapshot: buckets of tensors of this version alone, copied once here (the
        next step changes the live parameters while sync ships these), never again on the way: the
        embedded engine adopts them as its weights. `changed_only`: what a step can change (no frozen
        parameter; with LoRA the adapters), which the engines, started from the same model, need.
        Tensors that never change go uncopied, in one process once (training/tuning.py)."""
        from flowrl_operators.training.tuning import frozen_tensors
        from flowrl_operators.transport import Snapshot

        changed_only = self.lora or (changed_only and self.partial)
        buckets = self.trainer.named_weights(changed_only=True) if changed_only else self.trainer.named_weights()
        frozen = frozen_tensors(self.trainer.model, self.trainer.config.lora) if self.partial else {}
        # Adapter tensors (or merged weights) are new tensors already; frozen ones never change.
        keep = self.lora or not self.copy
        out = Snapshot([[(n, t.detach() if keep or n in frozen else t.detach().clone()) for n, t in bucket]
                        for bucket in buckets])
        if self.share and frozen and not self.shared:
            sent = {n for bucket in out for n, _ in bucket}
            out.append([(n, t) for n, t in frozen.items() if n not in sent])
            self.shared = True
        return out

    def save(self, path: str) -> None:
        self.trainer.save(path)

    def load(self, path: str) -> None:
        self.trainer.load(path)

    def export_hf(self, path: str) -> None:
        self.trainer.export_hf(path)


class Train(Operator):
    """Updates the policy with an RL loss (FSDP2); publishes policy version v+1."""

    kind = "train"
    Config = TrainConfig
    inputs: ClassVar = {"trajectories": TRAJECTORIES}
    outputs: ClassVar = {"policy": POLICY}
    resources = Resources(cpus=0.5)

    @classmethod
    def reported_metrics(cls, config: TrainConfig) -> frozenset[str] | None:
        from flowrl_operators.training.reported import train_metrics

        return train_metrics(config)

    @classmethod
    def metric_roles(cls, config: TrainConfig) -> MetricRoles:
        from flowrl_operators.training.reported import ROLES

        return ROLES

    @classmethod
    def cost_shape(cls, config: TrainConfig) -> CostShape:
        from flowrl_operators.training.objective import loss_config, step_passes

        threads = config.own_process.threads if config.own_process is not None else None
        passes = step_passes(loss_config(config.loss), config.epochs, config.gradient_checkpointing)
        return msgspec.structs.replace(super().cost_shape(config), process_threads=threads, passes=passes)

    pass_timer = classmethod(train_pass)  # plan's thread gain: a forward and backward pass

    @classmethod
    def export_difference(cls, recorded: Path, replayed: Path) -> float | None:
        from flowrl_operators.training.checkpoint import max_abs_diff

        return max_abs_diff(recorded, replayed)

    @classmethod
    def check_graph(cls, config: TrainConfig, facts: GraphFacts) -> list[tuple[tuple[str, ...], str]]:
        from flowrl_operators.training import objective
        from flowrl_operators.training.engine import check_name

        out = [(("engine",), problem)] if (problem := check_name(config.engine)) else []
        if config.freeze and config.lora is not None:
            out.append((("freeze",), "with lora only the adapters train (the base is frozen already); remove freeze"))
        out += cls._check_tuning_names(config, facts)
        if config.own_process is not None and facts.replicas > 1:
            out.append((("own_process",), f"own_process runs one trainer in a child process; with replicas: "
                        f"{facts.replicas} the ranks are their own processes under Ray already: remove own_process"))
        # Every name and key of the objective, against the registries (a plugin's entries included).
        found = objective.problems(config.loss, config.advantage)
        out += found
        if found:
            return out
        loss, advantage = objective.loss_config(config.loss), objective.advantage_config(config.advantage)
        where = ("advantage", "estimator") if isinstance(config.advantage, dict) else ("advantage",)
        if objective.needs_values(advantage) and "values" not in facts.upstream_provides:
            out.append((where, f"advantage {advantage.estimator} needs value estimates: add a critic "
                        "node (op: critic) between the reward and this node"))
        needs, has = objective.needs_baseline(advantage), "baseline" in facts.upstream_provides
        if needs and not has:
            out.append((where, f"advantage {advantage.estimator} needs a greedy baseline per group: set "
                        "greedy_baseline: true on the generate node"))
        elif has and not needs:
            out.append((where, f"the generate node's greedy_baseline: true adds greedy rows that advantage "
                        f"{advantage.estimator} would count as samples; use advantage remax, or drop the option"))
        if objective.needs_top_logprobs(loss) and "top_logprobs" not in facts.upstream_provides:
            kind = ("loss", "kind") if isinstance(config.loss, dict) else ("loss",)
            out.append((kind, f"loss {loss.kind} compares the policy with the behaviour policy over its top-K "
                        "tokens, which the generate node does not record: set sampling.top_logprobs: K "
                        "(e.g. 8) on the generate node, or use the binary approximation "
                        f"({loss.kind.removesuffix('_topk')})"))
        # With lora the train node scores the reference itself: its base, adapters disabled.
        if objective.needs_reference(loss) and "reference_logprobs" not in facts.upstream_provides \
                and config.lora is None:
            kl = ("loss", "kl", "coef") if isinstance(config.loss, dict) and isinstance(config.loss.get("kl"), dict) \
                else ("loss",)
            coef = objective.kl_config(loss).coef
            out.append((kl, f"a KL term (coef {coef:g}) needs reference logprobs: add a reference node "
                        "(op: reference) before this node (or train with lora, whose base is the reference), "
                        "or set coef: 0"))
        return out

    @classmethod
    def _check_tuning_names(cls, config: TrainConfig, facts: GraphFacts) -> list[tuple[tuple, str]]:
        """LoRA's rank limit and the freeze / lora names against a weightless model (as setup checks)."""
        from flowrl_operators.training.tuning import check

        if config.lora is not None and facts.replicas > 1:
            return [(("lora",), f"LoRA trains on one rank here; this node has replicas: {facts.replicas}: "
                     "use replicas: 1")]
        if not (config.freeze or config.lora is not None) or (config.freeze and config.lora is not None) \
                or not facts.model_path or facts.model_path.startswith("phase:"):
            return []
        try:
            return check(facts.model_path, list(config.freeze), config.lora)
        except Exception:  # noqa: BLE001 - a model path that cannot be read is reported at model.path
            return []

    def __init__(self, config: TrainConfig, context: OperatorContext) -> None:
        super().__init__(config, context)
        # setup() makes one of the two; close() may follow a setup that failed half-way.
        self.learner: Learner | None = None
        self.child: Any = None  # flowrl_operators.training.process.Child
        self.steps_done = 0
        self.vocab = 0  # the model's embedding rows (setup): token ids at or past it cannot train

    async def setup(self) -> None:
        from flowrl_operators.tokenizer import import_transformers
        from flowrl_operators.training.engine import join_group
        from flowrl_operators.training.objective import advantage_config, check_compatible, loss_config
        from flowrl_operators.training.process import Child

        import_transformers()  # before the Learner is built in a thread (the engine may load meanwhile)
        c: TrainConfig = self.config
        if c.own_process is not None and self.context.world_size > 1:
            raise ValueError(f"own_process runs one trainer in a child process; node '{self.context.node}' "
                             f"has replicas: {self.context.world_size}, whose ranks are their own processes "
                             "under the Ray executor already: remove own_process")
        if self.context.world_size > 1:
            join_group(self.context.rank, self.context.world_size)
        loss, advantage = loss_config(c.loss), advantage_config(c.advantage)
        check_compatible(loss, advantage)
        self._check_tuning()
        self.vocab = vocab_size(self.context.model["path"])
        horizon = schedule_horizon(c.optim, self.context, c.epochs)
        config = trainer_config(c.optim, c.micro_batch_tokens, c.max_nonfinite_steps, horizon, self.context.seed,
                                gradient_checkpointing=c.gradient_checkpointing, freeze=list(c.freeze), lora=c.lora)
        in_process = c.own_process is None
        # Under Ray this node puts the policy into the object store (its one copy) before the next
        # step can change the weights (`_published`): the Learner need not copy it first.
        copy = in_process and self.context.executor != "ray"
        args = (c.engine, self.context.model["path"], config, loss, advantage, c.epochs, copy,
                in_process and self.context.executor == "inprocess", c.policy_kl_every, self.context.threads)
        if c.own_process is not None:
            self.child = await asyncio.to_thread(Child, Learner, args, threads=c.own_process.threads,
                                                 name=f"flowrl-train-{self.context.node}")
        else:
            self.learner = await asyncio.to_thread(Learner, *args)

    def _check_tuning(self) -> None:
        """freeze patterns and lora targets against the model's names, before any weight loads."""
        from flowrl_operators.training.tuning import check

        c: TrainConfig = self.config
        if c.lora is not None and self.context.world_size > 1:
            raise ConfigError(self.context.node, ("lora",), f"LoRA trains on one rank here; node "
                              f"'{self.context.node}' has replicas: {self.context.world_size}: use replicas: 1")
        if c.freeze or c.lora is not None:
            problems = check(self.context.model["path"], list(c.freeze), c.lora)
            if problems:
                raise ConfigError(self.context.node, *problems[0])

    def _call_now(self, method: str, *args: Any) -> Any:
        """A Learner method, here or in the child process."""
        return self.child.call(method, *args) if self.child is not None else getattr(self.learner, method)(*args)

    async def _call(self, method: str, *args: Any) -> Any:
        return await asyncio.to_thread(self._call_now, method, *args)

    async def train(self, groups: list[Group], *, step: int) -> TrainResult:
        trajectories = [t for g in groups for t in g.trajectories]
        if not trajectories:
            return TrainResult(policy=None, metrics={"trajectories": 0.0})
        if self.vocab and (problem := out_of_vocabulary(trajectories, self.vocab)):
            raise UserCodeFailed(f"node '{self.context.node}': {problem}")
        metrics, policy = await self._call("train", trajectories, step)
        self.steps_done += 1
        every = self.config.export_every
        if every and (step + 1) % every == 0 and self.context.run_dir is not None:
            # Named like the checkpoints (step-<version>); the final export stays export/<node>.
            folder = Path(self.context.run_dir) / "export" / f"{self.context.node}-step-{step + 1}"
            await self._call("export_hf", str(folder))
        metrics |= _reward_means(trajectories)
        metrics["trajectories"] = float(len(trajectories))
        return TrainResult(policy=await self._published(policy), metrics=metrics)

    async def publish(self) -> TrainResult:
        return TrainResult(policy=await self._published(await self._call("policy")))

    async def _published(self, policy: Any) -> Any:
        """The policy record: the Snapshot itself in one process. Under Ray rank 0 puts it into the
        object store here, its one copy, before the next step can change the weights, and publishes
        the small StoredSnapshot (the runtime carries it opaque; the sync node hands its refs on);
        the other ranks publish nothing, as the runtime keeps rank 0's policy only."""
        if policy is None or self.context.executor != "ray":
            return policy
        if self.context.rank > 0:
            return None
        from flowrl_operators.transport import StoredSnapshot

        return await asyncio.to_thread(StoredSnapshot.put, policy)

    def save(self, path: Path) -> None:
        self._call_now("save", self._trainer_dir(path))

    def load(self, path: Path) -> None:
        self._call_now("load", self._trainer_dir(path))

    def _trainer_dir(self, path: Path) -> str:
        """The ranks of a group write one collective checkpoint (training/checkpoint.py): all into
        rank 0's folder of the run's checkpoint (`<node>/r0/trainer`), which rank 0 renames into place."""
        if self.context.world_size > 1:
            path = path.parent / "r0"
        return str(path / "trainer")

    def state_dict(self) -> dict[str, Any]:
        return {"steps_done": self.steps_done}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps_done = state["steps_done"]

    async def close(self) -> None:
        try:
            if self.steps_done and self.context.run_dir is not None:
                # The final policy as a Hugging Face directory that from_pretrained loads.
                await self._call("export_hf", str(Path(self.context.run_dir) / "export" / self.context.node))
        finally:
            if self.child is not None:
                await asyncio.to_thread(self.child.close)
