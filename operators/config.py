"""Config schemas of the built-in node kinds: the YAML keys users write under a node.

Kept free of torch imports so that `flowrl validate` and `flowrl operators` start fast.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

import msgspec
from msgspec import Meta

from flowrl.spec.refs import check_with, model_folder
from flowrl_operators import checks

PositiveInt = Annotated[int, Meta(ge=1)]
Probability = Annotated[float, Meta(ge=0.0, le=1.0)]
ModelPath = Annotated[str, check_with(model_folder)]  # a model folder or builtin:<name>, checked by validate


Beta = Annotated[float, Meta(ge=0.0, lt=1.0)]


class Strict(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class SamplingConfig(Strict):
    temperature: Annotated[float, Meta(ge=0.0)] = 1.0  # 0 = greedy
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    top_k: int = -1  # -1 = no limit
    max_new_tokens: PositiveInt = 64
    stop_token_ids: list[Annotated[int, Meta(ge=0)]] = []  # token ids (the vocabulary's bound is checked by the engine)
    # K > 0: record the behaviour policy's K most likely tokens and their logprobs at every generated
    # token (softmax(logits / temperature), before top_k / top_p), for a top-K divergence loss
    # (dppo_tv_topk, dppo_kl_topk). Both engines honour it (SGLang: top_logprobs_num).
    top_logprobs: Annotated[int, Meta(ge=0)] = 0


class EngineConfig(Strict):
    kind: Literal["embedded", "sglang"] = "embedded"
    url: str | None = None  # attach to running servers (comma-separated) instead of launching
    engines: PositiveInt = 1
    device: Literal["auto", "cpu", "cuda"] = "auto"
    threads: PositiveInt = 1  # torch threads per engine process
    max_batch: PositiveInt = 32  # slots of the KV cache: requests decoded together
    # embedded: the most tokens (prompt + output) one request may hold; default the model's
    # max_position_embeddings, which it may not exceed. The KV cache is sized by the requests
    # admitted, not by this limit; a longer prompt is refused, output stops here ("length").
    max_context: Annotated[int, Meta(ge=2)] | None = None
    server_args: dict[str, Any] = {}  # forwarded to sglang.launch_server
    # How the SGLang adapter delivers weights to its servers: tensor (HTTP; CUDA IPC on real SGLang,
    # colocated only), distributed (the adapter broadcasts: NCCL on GPU, gloo on CPU), disk
    # (a checkpoint folder); auto = tensor for flowrl's server, distributed for SGLang.
    weight_sync: Literal["auto", "tensor", "distributed", "disk"] = "auto"
    launch_timeout_s: Annotated[float, Meta(gt=0)] = 900.0  # engine: sglang, until /health answers
    # With `url`: load the pipeline's model.path into the attached servers at start (as weight
    # version 0, by update_weights_from_disk), so they serve exactly the policy the trainer starts
    # from, e.g. a later phase's. The servers must be able to read that folder (same machine or a
    # shared filesystem); false serves whatever the servers were started with until the first sync.
    load_on_attach: bool = True

    def __post_init__(self) -> None:
        if self.max_context is not None and self.kind != "embedded":
            raise ValueError("max_context sizes the embedded engine; an SGLang server takes its own "
                             "(server_args: {context_length: N})")


class SandboxConfig(Strict):
    """The code-execution tool service (flowrl_operators.tools): each call a fresh Python process."""

    workers: Annotated[int, Meta(ge=1, le=256)] = 4  # calls running at once; the rest wait in its queue
    cpu_s: PositiveInt = 2  # CPU seconds a call may use (RLIMIT_CPU)
    memory_mb: Annotated[int, Meta(ge=64)] = 256  # address space a call may map (RLIMIT_AS)
    wall_s: Annotated[float, Meta(gt=0)] = 5.0  # wall-clock seconds, start included; a call may ask for less
    output_bytes: Annotated[int, Meta(ge=64)] = 8192  # kept of stdout and of stderr each; more stops the call
    processes: PositiveInt = 16  # processes and threads a call may have at once (RLIMIT_NPROC)
    # bwrap: bubblewrap namespaces around the rlimits (start fails if bwrap does not work here);
    # rlimits: the rlimits alone; auto: bwrap where a probe at start shows it works.
    isolation: Literal["auto", "bwrap", "rlimits"] = "auto"


class ToolsConfig(Strict):
    sandbox: SandboxConfig | None = None  # started with the node, reached as ctx.services["sandbox"]


class GenerateConfig(Strict):
    engine: Literal["embedded", "sglang"] | EngineConfig = "embedded"
    group_size: PositiveInt = 1  # trajectories per sample
    # Also one greedy (temperature 0) episode per sample, marked as its group's baseline: it carries
    # no loss, and advantage remax subtracts its reward (ReMax). Other estimators refuse it.
    greedy_baseline: bool = False
    sampling: SamplingConfig = msgspec.field(default_factory=SamplingConfig)
    workflow: Annotated[str, check_with(checks.workflow)] = "single_turn"  # a workflow name or module:attr
    workflow_args: dict[str, Any] = {}
    # Continue in-flight generations under new weights instead of waiting for them.
    partial_rollout: bool = False
    # How the engine pauses for a weight update: retract (re-prefill under the new weights),
    # in_place (keep the KV cache computed by the old weights), abort (resubmit prompt + output).
    pause_mode: Literal["retract", "in_place", "abort"] = "retract"
    max_concurrency: PositiveInt = 64  # episodes in flight
    # An episode that raises (environment, agent, engine rejection) is dropped and counted; the run
    # fails once this many episodes have failed in total.
    max_episode_errors: PositiveInt = 100
    # An episode still running after this long (a hung environment, agent or engine) is cancelled
    # and counted as an episode error (generate/episode_timeouts). The default is far above a normal
    # episode (minutes even for long reasoning on a busy engine) and still ends a hang within the
    # hour; null (explicit only) waits forever.
    episode_timeout_s: Annotated[float, Meta(gt=0)] | None = 1800.0
    # An episode awaiting one thing (the engine, an environment call, an agent) this long is reported
    # as slow: in the live view, in waits.jsonl, and as generate/slow_episodes (0: never). A minute
    # is past any single engine turn or tool call of a healthy run, and still 30x before the timeout.
    slow_episode_s: Annotated[float, Meta(ge=0)] = 60.0
    # Where agent workflows' OpenAI proxy listens: a loopback address, unless proxy_allow_remote
    # (the proxy has no authentication; allow it only on a trusted network).
    proxy_host: Annotated[str, check_with(checks.proxy_host)] = "127.0.0.1"
    proxy_allow_remote: bool = False  # let proxy_host be a non-loopback address (no authentication!)
    # Serve the engine at an OpenAI-compatible endpoint (e.g. for a judge node with `node:`), written
    # to <run_dir>/endpoints/<node>.url. Agent workflows always start it.
    serve_openai: bool = False
    # Tool services the node starts and stops with itself (workflows reach them in ctx.services).
    tools: ToolsConfig = msgspec.field(default_factory=ToolsConfig)


class RewardConfig(Strict):
    fn: Annotated[str, check_with(checks.reward_fn)]  # module:attr, or builtin:<task> for a built-in task's reward
    timeout_s: Annotated[float, Meta(gt=0)] = 30.0
    on_error: Literal["zero", "drop", "fail"] = "zero"  # what a raising or hanging reward does
    max_errors: PositiveInt = 100  # the run fails after this many errors in total
    batched: bool = False  # fn takes the whole list of trajectories
    concurrency: PositiveInt = 16
    # random: the control arm, trained on rewards drawn from the run's own scores, independent of the
    # answer (flowrl_operators/reward_control.py); the true score is kept and reported beside it.
    control: Literal["random"] | None = None


class GACConfig(Strict):
    # At most max_cos x |g_t| of a step's gradient may lie along the previous step's gradient; the
    # rest of that component is projected out (0: all of the aligned component).
    max_cos: Annotated[float, Meta(ge=-1.0, lt=1.0)] = 0.0


class OptimConfig(Strict):
    lr: Annotated[float, Meta(gt=0)] = 1.0e-5
    betas: tuple[Beta, Beta] = (0.9, 0.999)  # AdamW's decay rates, each in [0, 1)
    weight_decay: Annotated[float, Meta(ge=0)] = 0.0
    warmup_steps: Annotated[int, Meta(ge=0)] = 0
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    # The horizon of a linear / cosine schedule in train steps (one per policy version); None: the
    # run's (phase's) `steps`. The decay spans total_steps x epochs optimizer steps, warm-up included.
    total_steps: PositiveInt | None = None
    grad_clip: Annotated[float, Meta(gt=0)] | None = 1.0
    # Gradient alignment control (GAC, arXiv 2603.01501; flowrl_operators/training/alignment.py):
    # cap each step's gradient component along the previous step's gradient. null: off.
    gac: GACConfig | None = None

    def __post_init__(self) -> None:
        if self.total_steps is not None and self.schedule == "constant":
            raise ValueError("total_steps: total_steps is the horizon of a linear or cosine schedule, and schedule "
                             "is constant: set schedule: linear or cosine, or remove total_steps")


# The concepts of a training objective. Each is a registry (flowrl_operators.training.registry) whose
# entries (built-in or a plugin's) subclass the concept's config class below with their own keys;
# YAML names an entry and writes its keys alongside: `loss: {kind: cispo, clip_high: 4.0}`.
# `flowrl algorithms` lists every entry with its keys.


class EntropyControl(Strict):
    """The entropy bonus's coefficient follows the policy's entropy instead of staying fixed: on each
    micro-batch, with H its mean entropy over the loss tokens (no gradient), the coefficient is
    entropy_coef + (max_coef - entropy_coef) * clamp((target - H) / target, 0, 1). A policy at or above
    the target keeps the fixed bonus; one that collapses gets up to max_coef, before its distributions
    saturate (where an entropy gradient vanishes). A proportional form of the adaptive entropy control
    of Skywork-OR1 (arXiv 2505.22312), which steps the coefficient towards a target entropy; this one
    keeps no state, so a resumed or replayed run computes the same coefficients."""

    target: Annotated[float, Meta(gt=0)]  # nats per token
    max_coef: Annotated[float, Meta(ge=0)]


class KLCov(Strict, tag="kl", tag_field="kind"):
    """KL-Cov (arXiv 2505.22617): on the `fraction` of a micro-batch's loss tokens with the largest
    covariance (logp - mean logp)(A - mean A) (no gradient), the loss adds coef * |logp - old|. Those
    tokens, confident and rewarded, are the ones whose update collapses entropy; the penalty holds
    them near the policy that sampled them while the rest learn (the paper: fraction 0.002 at
    batches of millions of tokens, coef 1; on top of this loss's clip here, not instead of it)."""

    fraction: Annotated[float, Meta(gt=0, le=1)]
    coef: Annotated[float, Meta(gt=0)] = 1.0


class ClipCov(Strict, tag="clip", tag_field="kind"):
    """Clip-Cov (arXiv 2505.22617): of a micro-batch's loss tokens whose covariance lies in (low,
    high), a random `fraction` of all loss tokens (at least one) gets no gradient this step (the
    paper: fraction 2e-4, bounds 1 and 5)."""

    fraction: Annotated[float, Meta(gt=0, le=1)]
    low: float = 1.0
    high: float = 5.0

    def __post_init__(self) -> None:
        if self.high <= self.low:
            raise ValueError(f"high ({self.high}) must be above low ({self.low})")


class LossConfig(Strict):
    """A policy loss (`kind`), and how its per-token values become the step's loss."""

    kind: str = "ppo_clip"  # a registered loss (flowrl.losses)
    # Decoupled PPO: clip against the proximal policy (recomputed by the trainer) and weight by
    # pi_proximal / pi_behaviour with the engine's logprobs. Without a correction that weight is
    # unbounded, which is refused unless allow_unbounded_weight is true.
    decoupled: bool = False
    # A registered correction (flowrl.corrections), {kind: NAME, ...its keys}: weights and masks
    # from pi_proximal / pi_behaviour.
    correction: dict[str, Any] | None = None
    allow_unbounded_weight: bool = False
    # A registered aggregation (flowrl.aggregations): NAME or {kind: NAME, ...its keys}.
    aggregation: str | dict[str, Any] = "token_mean"
    # KL to the reference: {coef, apply_as, estimator: NAME (flowrl.kl), ...the estimator's keys}.
    kl: dict[str, Any] = {}
    entropy_coef: float = 0.0  # loss -= entropy_coef * aggregate(entropy)
    # Adaptive entropy control: the bonus's coefficient rises with how far entropy fell below a target.
    entropy_control: EntropyControl | None = None
    # Unlikelihood on negative-advantage tokens: loss += coef * |A| * -log(1 - p(token)). Its gradient
    # on the token's logit is coef * |A| * p, largest where the policy is sure: it keeps a wrong token
    # from becoming certain, where -A log p's gradient, |A| (1 - p), vanishes. Only for token-level
    # credit (a token with A < 0 is wrong): under sequence rewards it would push down a wrong answer's
    # right tokens as hard. 0: off.
    unlikelihood: Annotated[float, Meta(ge=0)] = 0.0
    # Covariance control of entropy collapse: {kind: kl, fraction, coef} or {kind: clip, fraction, low, high}.
    cov: KLCov | ClipCov | None = None

    # A supervised loss (sft) reads no advantages and applies no behaviour weight.
    supervised: ClassVar[bool] = False
    # Whether the loss reads the behaviour logprobs (`old`) itself: one that does not (plain REINFORCE)
    # trains stale tokens as on-policy unless a correction weights them; validate refuses it behind an
    # async edge or partial rollout (flowrl_operators/semantics.py). A plugin loss says so the same way.
    reads_behaviour: ClassVar[bool] = True
    # The proximal pass (a correction's weights and rejection) is redone before every epoch, not once a
    # step: a loss whose own weight is 1 relies on it (reinforce_bypass).
    proximal_each_epoch: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if unbounded_weight(self):
            raise ValueError(UNBOUNDED_WEIGHT)
        if self.supervised and (self.unlikelihood or self.cov is not None):
            raise ValueError("unlikelihood and cov act on advantages, which a supervised loss has none of: remove them")
        if self.entropy_control is not None and self.entropy_control.max_coef < self.entropy_coef:
            raise ValueError(f"entropy_control.max_coef ({self.entropy_control.max_coef}) is below entropy_coef "
                             f"({self.entropy_coef}): the bonus would shrink as entropy collapses")


UNBOUNDED_WEIGHT = (
    "decoupled: true without a correction weights every token by pi_proximal / pi_behaviour, which is "
    "unbounded on stale or mismatched tokens; add correction: {kind: tis} (truncated) or {kind: mis} "
    "(masked), or set allow_unbounded_weight: true to accept it")


def unbounded_weight(loss: LossConfig) -> bool:
    """Whether a loss weights tokens without bound and does not say that it allows it."""
    return not loss.supervised and loss.decoupled and loss.correction is None and not loss.allow_unbounded_weight


class AdvantageConfig(Strict):
    """An advantage estimator (`estimator`)."""

    estimator: str = "grpo"  # a registered estimator (flowrl.advantages)


class KLConfig(Strict):
    """The KL term to the reference policy and its estimator of KL per token."""

    coef: Annotated[float, Meta(ge=0)] = 0.0
    estimator: str = "k3"  # a registered KL estimator (flowrl.kl)
    apply_as: Literal["loss", "reward"] = "loss"


class CorrectionConfig(Strict):
    """Train/inference mismatch correction: a weight (and mask) per token from pi_proximal / pi_behaviour."""

    kind: str = "tis"  # a registered correction (flowrl.corrections)


class AggregationConfig(Strict):
    """How per-token losses become one number (over the global batch)."""

    kind: str = "token_mean"  # a registered aggregation (flowrl.aggregations)


class LoraSpec(Strict):
    """Low-rank adapters (peft) on the policy's linear layers; only they train, the base is frozen."""

    r: PositiveInt = 8  # the adapters' rank
    alpha: Annotated[float, Meta(gt=0)] = 16.0  # the update is scaled by alpha / r
    dropout: Probability = 0.0  # on the adapters' input; > 0 makes the trainer's logprobs noisy
    # Module names (their last part, as peft matches them) that get adapters.
    target_modules: Annotated[list[str], Meta(min_length=1)] = msgspec.field(default_factory=lambda: [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    # What each version sends to the engines: the adapter tensors (the embedded engine applies them
    # next to its base weights), or the merged weights of the adapted modules (any engine, SGLang too).
    sync: Literal["adapter", "merged"] = "adapter"


class OwnProcess(Strict):
    threads: PositiveInt = 1  # torch threads of the trainer's process


class TrainConfig(Strict):
    # The training engine (training/engine.py): fsdp2, or one a plugin registers (flowrl.training_engines).
    engine: str = "fsdp2"
    # A registered advantage estimator: NAME or {estimator: NAME, ...its keys} (`flowrl algorithms`).
    advantage: str | dict[str, Any] = {}
    # A registered loss: NAME or {kind: NAME, ...its keys and LossConfig's} (`flowrl algorithms`).
    loss: str | dict[str, Any] = {}
    optim: OptimConfig = msgspec.field(default_factory=OptimConfig)
    micro_batch_tokens: PositiveInt = 8192
    epochs: PositiveInt = 1  # passes over each batch (PPO epochs)
    max_nonfinite_steps: PositiveInt = 3  # consecutive NaN/Inf steps before the run stops
    # Also export every N steps to export/<node>-step-<version>; 0: only at the end, to export/<node>.
    export_every: Annotated[int, Meta(ge=0)] = 0
    # Every N steps, one forward pass without gradients after the update measures the KL between
    # the policy before and after it (metric `policy_kl`, flowrl/health.py); 0: never.
    policy_kl_every: Annotated[int, Meta(ge=0)] = 10
    # The trainer in a child process of its own, e.g. {threads: 1}: under the in-process executor
    # training then overlaps generation without sharing the GIL (flowrl_operators.training.process).
    own_process: OwnProcess | None = None
    # Recompute each decoder layer's activations in the backward pass instead of keeping them:
    # less memory for activations, about one more forward pass of time; the same gradients.
    gradient_checkpointing: bool = False
    # Parameters that do not train: shell-style patterns (fnmatch) over the model's parameter names,
    # e.g. ["model.embed_tokens.*", "model.layers.[0-9].*"]. Frozen parameters get no gradient and
    # no optimizer state, and are not sent to the engines again (they keep the model's values).
    freeze: list[str] = []
    lora: LoraSpec | None = None  # train low-rank adapters instead of the whole model (needs peft)


class ReferenceConfig(Strict):
    # The training engine (training/engine.py): fsdp2, or one a plugin registers (flowrl.training_engines).
    engine: str = "fsdp2"
    model: ModelPath | None = None  # defaults to the pipeline's model
    micro_batch_tokens: PositiveInt = 8192


class CriticConfig(Strict):
    # The training engine (training/engine.py): fsdp2, or one a plugin registers (flowrl.training_engines).
    engine: str = "fsdp2"
    model: ModelPath | None = None  # defaults to the pipeline's model with a value head
    optim: OptimConfig = msgspec.field(default_factory=OptimConfig)
    value_clip: Annotated[float, Meta(gt=0)] = 0.2
    micro_batch_tokens: PositiveInt = 8192
    # The returns the value model learns: GAE with the train node's gamma and lam (interpolate them,
    # e.g. `lam: ${nodes.learner.advantage.lam}`).
    gamma: Probability = 1.0
    lam: Probability = 1.0


class SyncConfig(Strict):
    # auto: in-process when the pipeline runs in one process, the Ray object store under Ray;
    # inprocess, object_store, broadcast, or a transport a plugin registers (flowrl.transports).
    transport: str = "auto"
    # Under Ray with the object store, a train stage's version goes on in the buckets it was put in
    # (the trainer's, 64 MB): nothing is re-bucketed or put again, so bucket_mb does not apply there.
    bucket_mb: Annotated[float, Meta(gt=0)] = 64.0
    # inprocess: copy the tensors at send time instead of handing over references (needed when the
    # trainer may step again before the engines applied the version, e.g. behind async edges).
    snapshot: bool = False
    # broadcast: the engines that join the group (ranks 1..receivers; rank 0 sends), where the
    # sender hosts its TCP store (port 0 = any free port), gloo on CPU / NCCL on GPU, and whether
    # each bucket travels tensor by tensor (no packing copy; measured faster on CPU) or packed
    # into one flat buffer (fewer collectives).
    receivers: PositiveInt = 1
    address: str = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, le=65535)] = 0
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    layout: Literal["per_tensor", "flat"] = "per_tensor"
    timeout_s: Annotated[float, Meta(gt=0)] = 600.0
