"""The generate node: runs a workflow per sample on an inference engine."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, ClassVar

import msgspec

from flowrl.blame import UserCodeFailed, describe
from flowrl.data.trajectory import Group, SamplingSpan, Trajectory
from flowrl.operator import (
    PROMPTS,
    TRAJECTORIES,
    WEIGHTS,
    ConfigError,
    CostShape,
    DataFacts,
    GraphFacts,
    Knobs,
    Operator,
    OperatorContext,
    Resources,
)
from flowrl_operators.config import EngineConfig, GenerateConfig
from flowrl_operators.inference import SamplingParams
from flowrl_operators.timing import engine_handoff, engine_pass
from flowrl_operators.waits import Episodes

KEPT_ERRORS = 8  # episode errors buffered between two errors() calls; the rest are counted only


class TooManyEpisodeErrors(UserCodeFailed):
    """More episodes failed than the node's `max_episode_errors` allows."""


class Generate(Operator):
    """Runs a workflow per sample on an inference engine; emits trajectory groups."""

    kind = "generate"
    Config = GenerateConfig

    @classmethod
    def knobs(cls, config: GenerateConfig) -> Knobs:
        provides = {"baseline"} if config.greedy_baseline else set()
        if config.sampling.top_logprobs > 0:  # the trajectories carry top_ids / top_logprobs
            provides.add("top_logprobs")
        return Knobs(concurrency=config.max_concurrency, partial_rollout=config.partial_rollout,
                     provides=frozenset(provides))

    @classmethod
    def cost_shape(cls, config: GenerateConfig) -> CostShape:
        """Slots: the engine's max_batch (an SGLang server's own limit is not known here: the
        embedded engine's default stands in for it); threads: the embedded engine's torch threads
        where it decodes on the CPU (on a GPU, or a server's, they are not what its speed is bound by)."""
        engine = config.engine if isinstance(config.engine, EngineConfig) else EngineConfig(kind=config.engine)
        return CostShape(concurrency=config.max_concurrency, partial_rollout=config.partial_rollout,
                         group_size=config.group_size, slots=engine.max_batch,
                         threads=engine.threads if engine.kind == "embedded" and engine.device != "cuda" else None)

    pass_timer = classmethod(engine_pass)  # plan's thread gain: a forward pass
    handoff = classmethod(engine_handoff)  # plan's lock handoff: two engines side by side

    @classmethod
    def check_graph(cls, config: GenerateConfig, facts: GraphFacts) -> list[tuple[tuple[str, ...], str]]:
        limit = config.engine.max_context if isinstance(config.engine, EngineConfig) else None
        if limit is not None and config.sampling.max_new_tokens >= limit:
            return [(("engine", "max_context"), f"max_context {limit} leaves no room for a prompt next to "
                     f"sampling.max_new_tokens {config.sampling.max_new_tokens}; raise max_context or lower "
                     "max_new_tokens")]
        return []

    @classmethod
    def check_data(cls, config: GenerateConfig, facts: DataFacts) -> list[tuple[tuple[str, ...], str]]:
        """`data.eval` as this node builds it, and a source of images against the model."""
        from flowrl_operators.evaluate import eval_problems
        from flowrl_operators.models import image_model_problems

        data, out = facts.data, []
        if facts.source is not None and getattr(facts.source, "images", None) and facts.model:
            out += image_model_problems(data["source"], facts.model)
        if isinstance(data.get("eval"), dict) and (facts.source is not None or data["eval"].get("source")):
            out += eval_problems(data, facts.seed, facts.model, facts.source)
        if isinstance(data.get("eval"), dict):
            out += cls._eval_budget_problems(config, data["eval"].get("max_new_tokens"))
        return out

    @staticmethod
    def _eval_budget_problems(config: GenerateConfig, budget: int | None) -> list[tuple[tuple[str, ...], str]]:
        """data.eval.max_new_tokens within the engine's max_context, as sampling.max_new_tokens is."""
        limit = config.engine.max_context if isinstance(config.engine, EngineConfig) else None
        if budget is None or limit is None or budget < limit:
            return []
        return [(("data", "eval", "max_new_tokens"), f"data.eval.max_new_tokens {budget} leaves no room for a "
                 f"prompt within the engine's max_context {limit}; lower it or raise engine.max_context")]

    inputs: ClassVar = {"prompts": PROMPTS, "weights": WEIGHTS}
    outputs: ClassVar = {"trajectories": TRAJECTORIES}
    resources = Resources(cpus=0.5)

    config: GenerateConfig

    def __init__(self, config: GenerateConfig, context: OperatorContext) -> None:
        super().__init__(config, context)
        # Made by setup(); close() may follow a setup that failed half-way.
        self.engine: Any = None
        self.services: dict[str, Any] = {}
        self.paused = False
        self.last_eval: dict[str, Any] | None = None
        self.last_sync: dict[str, float] = {}
        self.counts = {"episodes": 0, "episode_errors": 0, "rejected_samples": 0, "trajectories": 0,
                       "model_tokens": 0, "turns": 0, "weight_updates": 0, "episode_timeouts": 0}
        self.last_error: str | None = None
        self.isolated: list[str] = []  # errors() since its last call, at most KEPT_ERRORS
        self.evaluator: Any = None
        self.sandbox: Any = None  # tools.sandbox's service, when the node has one
        self.episodes = Episodes(config.slow_episode_s)  # in flight, with what each awaits

    async def setup(self) -> None:
        from flowrl_operators.models import load_tokenizer
        from flowrl_operators.tokenizer import import_transformers
        from flowrl_operators.workflows import load_workflow

        import_transformers()
        model = self.context.model.get("path")
        if not model:
            raise ValueError("the generate node needs the pipeline's model.path (a checkpoint or builtin:<name>)")
        self._check_max_context(model)
        # In a thread, so that the other stages set up meanwhile (the runtime starts them together).
        self.engine = await asyncio.to_thread(self._make_engine, model)
        engine = self.config.engine
        if isinstance(engine, EngineConfig) and engine.url is not None and engine.load_on_attach:
            from flowrl_operators.models import resolve_model

            await self.engine.load(resolve_model(model), version=0)
        self.tokenizer = load_tokenizer(model)
        self.workflow = load_workflow(self.config.workflow, self.config.workflow_args)
        s = self.config.sampling
        self.sampling = SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                       max_new_tokens=s.max_new_tokens, stop_token_ids=list(s.stop_token_ids),
                                       top_logprobs=s.top_logprobs)
        if self.config.tools.sandbox is not None:
            from flowrl_operators.tools import SandboxService

            self.sandbox = SandboxService(self.config.tools.sandbox)
            try:
                self.services["sandbox"] = await self.sandbox.astart()  # a SandboxClient for workflows
            except RuntimeError as exc:  # e.g. isolation: bwrap where bubblewrap does not work
                raise ConfigError(self.context.node, ("tools", "sandbox", "isolation"), str(exc)) from None
        if getattr(self.workflow, "needs_proxy", False) or self.config.serve_openai:
            from flowrl_operators.workflows.proxy import Proxy

            proxy = Proxy(self.engine, self.tokenizer, self.sampling, host=self.config.proxy_host,
                          allow_remote=self.config.proxy_allow_remote,
                          tools={k: v for k, v in self.services.items() if k != "proxy"})
            url = await proxy.start()
            self.services["proxy"] = proxy
            if self.context.run_dir is not None:
                folder = Path(self.context.run_dir) / "endpoints"
                folder.mkdir(parents=True, exist_ok=True)
                names = [f"{self.context.node}-r{self.context.rank}.url"]
                if self.context.rank == 0:
                    names.append(f"{self.context.node}.url")  # what a judge's `node:` reads
                for name in names:
                    scratch = folder / f".{name}.tmp"
                    scratch.write_text(url + "/v1")
                    scratch.replace(folder / name)  # readers never see half a file
        # Periodic greedy evaluation (data.eval), on replica 0 only.
        if self.context.data.get("eval") and self.context.rank == 0:
            from flowrl_operators.evaluate import Evaluator

            self.evaluator = Evaluator(self.context.data, self.context.seed, self.context.run_dir, self.tokenizer,
                                       final=self.context.steps if self.context.data["eval"].get("final", True) else None)
            await self.evaluate(self.engine.version)

    def _check_max_context(self, model: str) -> None:
        """engine.max_context within the model's max_position_embeddings, before any weight loads."""
        engine = self.config.engine
        if not isinstance(engine, EngineConfig) or engine.max_context is None:
            return
        from flowrl_operators.engine.embedded.engine import check_max_context
        from flowrl_operators.models import load_config

        try:
            check_max_context(engine.max_context, load_config(model))
        except ValueError as e:
            raise ConfigError(self.context.node, ("engine", "max_context"), str(e)) from None

    def _make_engine(self, model: str) -> Any:
        """The embedded engine in this process, or the SGLang adapter (servers at `engine.url`, or
        launched by it): both implement InferenceEngine, so workflows see no difference."""
        from flowrl_operators.engine.factory import make_engine

        return make_engine(self.config.engine, model, dtype=self.context.model.get("dtype", "float32"),
                           seed=self.context.seed)

    # --- the generate kind's contract (flowrl/operator.py) -----------------------------------------

    async def generate(self, sample: dict[str, Any], *, step: int, sample_id: str,
                       greedy: bool = False, max_new_tokens: int | None = None) -> Group | None:
        """`group_size` episodes of `sample` (one greedy episode if `greedy`, for evaluation), and with
        `greedy_baseline` one more, greedy, marked in its metadata (`flowrl.data.trajectory.GREEDY_BASELINE`).
        `max_new_tokens` (greedy only: `data.eval.max_new_tokens`) replaces the sampling budget."""
        greedy_sampling = msgspec.structs.replace(self.sampling, temperature=0.0)
        # Evaluation trains on nothing: no top logprobs to record.
        sampling = msgspec.structs.replace(greedy_sampling, top_logprobs=0) if greedy else self.sampling
        if greedy and max_new_tokens is not None:
            sampling = msgspec.structs.replace(sampling, max_new_tokens=max_new_tokens)
        episodes = [sampling] * (1 if greedy else self.config.group_size)
        baseline = not greedy and self.config.greedy_baseline
        if baseline:  # ReMax: the last episode is the greedy baseline of the group
            episodes.append(greedy_sampling)
        prompt_cache: dict[int, tuple[dict, list[int]]] = {}  # one tokenisation of the sample's prompt for the group
        results = await asyncio.gather(*(self._episode(sample, step, sample_id, i, s, prompt_cache)
                                         for i, s in enumerate(episodes)))
        if baseline:
            from flowrl.data.trajectory import GREEDY_BASELINE

            for t in results[-1]:
                t.metadata[GREEDY_BASELINE] = True
        trajectories = [t for episode in results for t in episode]
        if not trajectories:
            self.counts["rejected_samples"] += 1
            return None
        self.counts["trajectories"] += len(trajectories)
        return Group(id=sample_id, step=step, trajectories=trajectories)

    async def _episode(self, sample: dict[str, Any], step: int, sample_id: str, episode: int,
                       sampling: SamplingParams, prompt_cache: dict) -> list[Trajectory]:
        from flowrl_operators.workflows.base import WorkflowContext

        wait = self.episodes.begin(sample_id, episode)
        ctx = WorkflowContext(engine=self.engine, tokenizer=self.tokenizer, sampling=sampling,
                              sample_id=sample_id, episode=episode, step=step, seed=self.context.seed,
                              args=dict(self.config.workflow_args), services=self.services, prompt_cache=prompt_cache,
                              wait=wait)
        self.counts["episodes"] += 1
        try:
            out = await _within(self.workflow(ctx, sample), self.config.episode_timeout_s)
            trajectories = self._trajectories(out, sample_id, episode)
            for j, t in enumerate(trajectories):
                self._stamp(t, sample, step, sample_id, episode, j if len(trajectories) > 1 else None, sampling)
        except Exception as exc:  # an environment, agent or engine failure costs this episode only
            self.counts["episode_errors"] += 1
            if isinstance(exc, asyncio.TimeoutError):
                self.counts["episode_timeouts"] += 1
                exc = TimeoutError(f"episode {episode} of {sample_id} ran past episode_timeout_s "
                                   f"{self.config.episode_timeout_s}")
            self.last_error = f"sample {sample_id}, episode {episode}: {describe(exc)}"
            self._isolate(self.last_error)
            if self.counts["episode_errors"] >= self.config.max_episode_errors:
                raise TooManyEpisodeErrors(
                    f"{self.counts['episode_errors']} episodes failed (max_episode_errors "
                    f"{self.config.max_episode_errors}); the last one, {self.last_error}"
                ) from None
            return []
        finally:
            self.episodes.end(wait)
        return trajectories

    def _trajectories(self, out: Any, sample_id: str, episode: int) -> list[Trajectory]:
        """What a workflow returned, as a list of trajectories: a Trajectory, a list or tuple of
        them, or None (no trajectory: said in errors(), so that a run that trains nothing says why)."""
        if out is None:
            self._isolate(f"sample {sample_id}, episode {episode}: workflow {self.config.workflow!r} returned None "
                          "(no trajectory)")
            return []
        if isinstance(out, Trajectory):
            return [out]
        if not isinstance(out, list | tuple):
            raise TypeError(f"workflow {self.config.workflow!r} returned {type(out).__name__} {out!r:.60}; expected "
                            "a Trajectory, a list of them, or None")
        return list(out)

    def _isolate(self, text: str) -> None:
        if len(self.isolated) < KEPT_ERRORS:
            self.isolated.append(text)

    def errors(self) -> list[str]:
        out, self.isolated = self.isolated, []
        return out

    def _stamp(self, t: Trajectory, sample: dict[str, Any], step: int, sample_id: str, episode: int,
               part: int | None, sampling: SamplingParams) -> None:
        if not isinstance(t, Trajectory):
            raise TypeError(f"workflow {self.config.workflow!r} returned {type(t).__name__}; expected Trajectory")
        if not t.sampling and any(t.loss_mask):
            # A workflow that built its trajectory by hand recorded no sampling: the episode's own.
            t.sampling = [SamplingSpan(0, len(t.response_ids), sampling.temperature, sampling.top_p, sampling.top_k)]
        t.id = f"{sample_id}/{episode}" + ("" if part is None else f".{part}")
        t.group_id, t.sample_id, t.step = sample_id, sample_id, step
        t.metadata.setdefault("sample", sample)
        t.metadata.setdefault("text", self.tokenizer.decode(t.response_ids, skip_special_tokens=True))
        t.metadata["episode"] = episode
        t.validate()
        self.counts["model_tokens"] += sum(t.loss_mask)
        self.counts["turns"] += len(t.turns)
        # The agent proxy's prefix checks and tool calls (workflows/proxy.py): per trajectory, and per
        # episode where `part` is its first trajectory.
        for key in ("drift_tokens",) + (("chain_breaks", "tool_calls", "tool_s") if part in (None, 0) else ()):
            if isinstance(t.metadata.get(key), int | float):
                self.counts[key] = self.counts.get(key, 0) + t.metadata[key]

    async def update_weights(self, weights: Any, version: int) -> None:
        """Apply a weights record from a sync node (flowrl_operators.transport), or plain buckets
        (a list of [(name, tensor), ...]) handed over in-process."""
        self.counts["weight_updates"] += 1
        if isinstance(weights, list | tuple):
            await self.engine.update_weights(weights, version)
        else:
            from flowrl_operators.transport import apply

            synced = await apply(self.engine, weights, version, replica=self.context.rank)
            self.last_sync = synced.as_dict()
        await self.evaluate(version)

    async def pause(self) -> None:
        self.paused = True
        await self.engine.pause(self.config.pause_mode)

    async def resume(self) -> None:
        self.paused = False
        await self.engine.resume()
        await self.evaluate(self.engine.version)

    async def evaluate(self, version: int) -> dict[str, float] | None:
        """Greedy evaluation on held-out samples when `version` is due (see flowrl_operators.evaluate);
        a paused engine (partial rollout) evaluates at resume."""
        if self.evaluator is None or self.paused or not self.evaluator.due(version):
            return None
        self.last_eval = await self.evaluator.run(self, version)
        return self.last_eval

    def metrics(self) -> dict[str, float]:
        """Cumulative counters since setup (episodes, episode_errors, rejected_samples, ...), the
        episodes slow now (`slow_episode_s`), and the embedded engine's step counters (`engine/`:
        its steps, those that prefilled, the requests admitted, their seconds; an SGLang engine
        reports none)."""
        evaluation = {"eval/reward": self.last_eval["eval_reward"]} if self.last_eval else {}
        slow = {"generate/slow_episodes": float(len(self.episodes.slow()))}
        counts = {f"generate/{k}": float(v) for k, v in self.counts.items()}
        return counts | slow | self.last_sync | evaluation | self._engine_steps()

    def _engine_steps(self) -> dict[str, float]:
        from flowrl_operators.engine.embedded.engine import EmbeddedEngine

        if not isinstance(self.engine, EmbeddedEngine):
            return {}
        return {f"engine/{k}": float(v) for k, v in self.engine.step_stats.as_dict().items()}

    def waits(self) -> list[dict[str, Any]]:
        """The episodes awaiting one thing for `slow_episode_s` or longer now, longest first
        (flowrl_operators.waits.Episodes.slow)."""
        return self.episodes.slow()

    async def close(self) -> None:
        proxy = self.services.get("proxy")
        if proxy is not None:
            await proxy.close()
        if self.sandbox is not None:
            await self.sandbox.astop()
        if self.engine is not None:
            await self.engine.close()


async def _within(coro: Any, seconds: float) -> Any:
    """`coro`'s result, or asyncio.TimeoutError after `seconds`. Python 3.11's asyncio.timeout runs it
    in this task (wait_for made a task per episode: 128 a quickstart step)."""
    if hasattr(asyncio, "timeout"):
        async with asyncio.timeout(seconds):
            return await coro
    return await asyncio.wait_for(coro, seconds)
