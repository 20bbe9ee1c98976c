"""RL losses: a registry of policy losses chosen in YAML, plus the critic's clipped value loss.

`LossConfig` uses the key names of the train node's schema (flowrl_operators.config.LossConfig)
and adds a few of its own (`norm_length`, `correction.floor`); `loss_config(value)` accepts a
kind name or a mapping:

    loss: {kind: ppo_clip, clip_low: 0.2, clip_high: 0.28, dual_clip: 3.0, decoupled: true,
           aggregation: seq_mean_token_mean, correction: {kind: tis, level: token, threshold: 2.0},
           kl: {coef: 0.001, estimator: k3, apply_as: loss}, entropy_coef: 0.0}

Per token, with A the advantage, old the logprob the ratio is taken against, m the loss mask:

    ppo_clip  r = exp(logp - old); l = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))
              dual clip (c > 1): l = min(l, -A c) where A < 0
    gspo      r_i = exp(mean_t m (logp - old)) per sequence, used per token as
              exp(sg(log r_i) + logp - sg(logp)); then clipped like ppo_clip (GSPO's clip ranges
              are about 3e-4 / 4e-4)
    sft       l = -logp (supervised; advantages unused)

Behaviour policy. By default old = the engine's behaviour logprobs: the clipped ratio is PPO's
importance correction for whatever policy produced each token (a stale version behind an async
edge, several versions under partial rollout, the engine's numerics). With `decoupled: true`
(decoupled PPO, AReaL) or a `correction`, old = the proximal logprobs the trainer recomputes
before the update (`Trainer.compute_logprobs`), and the per-token loss is multiplied by the
behaviour weight w = exp(prox - behav) per token, or exp(sum_t m (prox - behav)) per sequence
(`correction.level: sequence`), without gradient:
    decoupled, no correction   w   (unbounded: refused unless `allow_unbounded_weight: true`)
    correction.kind tis        min(w, threshold)                    (truncated importance sampling)
    correction.kind mis        w if floor <= w <= threshold else 0  (masked importance sampling)
`set_behaviour_weights(batch, config)` stores w on the batch once the proximal logprobs are known.

Aggregation (N = loss tokens of the global batch, S = its sequences with a loss token):
    token_mean            sum_{i,t} m l / N
    seq_mean_token_mean   sum_i (sum_t m l / n_i) / S
    seq_mean_token_sum    sum_i (sum_t m l) / (S * norm_length)   (Dr.GRPO; norm_length 1 if unset)

KL to the reference, d = logp - ref: k1 = d, k2 = d^2 / 2, k3 = exp(-d) - 1 + d. `apply_as: loss`
adds coef * aggregate(k) to the loss; `apply_as: reward` subtracts coef * k (of the behaviour
logprobs) from the token rewards before the advantages (`apply_kl_penalty`; only the token-return
estimators reinforce_pp and gae see it, see `check_compatible`). Entropy bonus:
loss -= entropy_coef * aggregate(H).

A loss function built by `policy_loss(config)` or `value_loss(config)` is called once per
micro-batch as `fn(output, batch, normaliser) -> (loss, metrics)`; the loss and every metric are
already divided by the global normaliser, so sums over micro-batches and ranks give the batch value
(a metric named `*_max` is a maximum instead: the trainer takes the largest).

Per-token metrics (`clip_fraction`, `entropy`, `behaviour_weight`, the mismatch metrics) average
over the tokens that carry loss: on the loss mask with a behaviour weight > 0 (`mis` gives 0 to
the tokens it masks; `masked_by_correction` is their share of the loss-mask tokens). The
train/inference mismatch, with d = logp - behaviour per token (policy logprobs under each token's
sampling distribution; meaningful on a step's first pass, before the update, where the Learner
reads it):
    mismatch_logprob_mean   mean |d|
    mismatch_logprob_max    max |d|
    mismatch_out_of_clip    share of tokens with exp(d) outside [1 - clip_low, 1 + clip_high]
On-policy data with the engine's numerics gives ~1e-6, 1e-6 and 0; data from older versions adds
its staleness.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import msgspec
import torch

from flowrl_operators.config import UNBOUNDED_WEIGHT, unbounded_weight
from flowrl_operators.training.advantages import AdvantageConfig
from flowrl_operators.training.batch import Batch, Normaliser, weighted_mask

Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]


class Correction(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    kind: Literal["tis", "mis"] = "tis"
    level: Literal["token", "sequence"] = "token"
    threshold: float = 2.0
    floor: float = 0.0  # mis only: weights below it are masked too

    def __post_init__(self) -> None:
        if self.threshold <= 0 or self.floor < 0 or self.floor >= self.threshold:
            raise ValueError("correction needs 0 <= floor < threshold")


class KLConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    coef: float = 0.0
    estimator: Literal["k1", "k2", "k3"] = "k3"
    apply_as: Literal["loss", "reward"] = "loss"


class LossConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    kind: str = "ppo_clip"
    clip_low: float = 0.2
    clip_high: float = 0.2  # > clip_low is DAPO's clip-higher (0.28)
    dual_clip: float | None = None
    decoupled: bool = False
    correction: Correction | None = None
    allow_unbounded_weight: bool = False  # decoupled without a correction: accept w unbounded
    aggregation: Aggregation = "token_mean"
    norm_length: float | None = None
    kl: KLConfig = msgspec.field(default_factory=KLConfig)
    entropy_coef: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in LOSSES:
            raise ValueError(f"unknown loss {self.kind!r}; choose one of {sorted(LOSSES)}")
        if self.clip_low < 0 or self.clip_high < 0 or self.clip_low >= 1:
            raise ValueError("loss clip_low must lie in [0, 1) and clip_high be >= 0")
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ValueError("loss dual_clip must be > 1 (e.g. 3.0), or left out")
        if self.norm_length is not None and self.norm_length <= 0:
            raise ValueError("loss norm_length must be > 0")
        if unbounded_weight(self):
            raise ValueError(UNBOUNDED_WEIGHT)


def loss_config(value: str | dict | msgspec.Struct) -> LossConfig:
    """A LossConfig from YAML (a kind name or a mapping) or from the node schema's LossConfig."""
    if isinstance(value, LossConfig):
        return value
    if isinstance(value, msgspec.Struct):
        value = msgspec.to_builtins(value)
    return msgspec.convert({"kind": value} if isinstance(value, str) else value, LossConfig)


def needs_proximal(config: LossConfig) -> bool:
    """Whether the trainer must recompute proximal logprobs (`Trainer.compute_logprobs`) first."""
    # Supervised targets have no behaviour policy: decoupled / correction keys set for the RL phase
    # of a pipeline must not weight an `sft` loss (exp(proximal - 0) would sharpen it).
    return config.kind != "sft" and (config.decoupled or config.correction is not None)


def needs_reference(config: LossConfig) -> bool:
    """Whether the loss needs reference logprobs (a reference node before the trainer)."""
    return config.kl.coef > 0


def check_compatible(loss: LossConfig, advantage: AdvantageConfig) -> None:
    """Reject a KL reward penalty that the chosen estimator would silently ignore."""
    if loss.kl.apply_as == "reward" and loss.kl.coef > 0 and advantage.estimator in ("grpo", "dr_grpo", "rloo"):
        raise ValueError(
            f"kl apply_as 'reward' has no effect with advantage {advantage.estimator!r} (it normalises "
            "the defined rewards only); use kl apply_as 'loss', or advantage reinforce_pp or gae"
        )


# Policy loss registry: fn(logprobs, old, advantages, mask, config) -> (per-token loss, clipped).
PolicyLoss = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, LossConfig], tuple[torch.Tensor, torch.Tensor]
]
LOSSES: dict[str, PolicyLoss] = {}


def register(name: str) -> Callable[[PolicyLoss], PolicyLoss]:
    def wrap(fn: PolicyLoss) -> PolicyLoss:
        LOSSES[name] = fn
        return fn

    return wrap


def _clipped_objective(
    ratio: torch.Tensor, advantages: torch.Tensor, config: LossConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - config.clip_low, 1 + config.clip_high)
    loss = torch.maximum(unclipped, clipped)
    was_clipped = clipped > unclipped
    if config.dual_clip is not None:
        lower_bound = -advantages * config.dual_clip
        dual = (advantages < 0) & (loss > lower_bound)
        loss = torch.where(dual, lower_bound, loss)
        was_clipped = was_clipped | dual
    return loss, was_clipped.float()


@register("ppo_clip")
def ppo_clip(logprobs, old, advantages, mask, config):
    return _clipped_objective(torch.exp(logprobs - old), advantages, config)


@register("sft")
def sft(logprobs, old, advantages, mask, config):
    return -logprobs, torch.zeros_like(logprobs)


@register("gspo")
def gspo(logprobs, old, advantages, mask, config):
    lengths = mask.sum(dim=1, keepdim=True).clamp(min=1)
    log_seq_ratio = ((logprobs - old) * mask).sum(dim=1, keepdim=True) / lengths
    # Value of the sequence ratio on every token, gradient of each token's own logprob.
    log_ratio = log_seq_ratio.detach() + logprobs - logprobs.detach()
    return _clipped_objective(torch.exp(log_ratio), advantages, config)


def aggregate(
    per_token: torch.Tensor, mask: torch.Tensor, normaliser: Normaliser, aggregation: Aggregation, norm_length=None
) -> torch.Tensor:
    # where(), not a product: a nan/inf on a padding or prompt column must not reach the loss.
    masked = torch.where(mask > 0, per_token, 0.0) * mask
    if aggregation == "token_mean":
        return masked.sum() / max(normaliser.tokens, 1.0)
    sums = masked.sum(dim=1)
    if aggregation == "seq_mean_token_mean":
        return (sums / mask.sum(dim=1).clamp(min=1)).sum() / max(normaliser.sequences, 1.0)
    return sums.sum() / (max(normaliser.sequences, 1.0) * (norm_length or 1.0))


def kl_estimate(logprobs: torch.Tensor, reference: torch.Tensor, estimator: str) -> torch.Tensor:
    d = logprobs - reference
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    return torch.exp(-d) - 1 + d


def behaviour_weight(
    proximal: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor, correction: Correction | None
) -> torch.Tensor:
    """prox / behav per token or sequence, truncated (tis) or masked (mis), without gradient."""
    log_w = (proximal - behaviour).detach() * mask
    if correction is not None and correction.level == "sequence":
        log_w = log_w.sum(dim=1, keepdim=True).expand_as(mask)
    w = torch.exp(log_w)
    if correction is None:
        return w
    if correction.kind == "tis":
        return w.clamp(max=correction.threshold)
    return torch.where((w >= correction.floor) & (w <= correction.threshold), w, 0.0)


def apply_kl_penalty(batch: Batch, config: LossConfig) -> Batch:
    """`kl.apply_as: reward`: rewards -= coef * k(behaviour, reference) on model tokens (in place)."""
    if config.kl.apply_as != "reward" or config.kl.coef == 0:
        return batch
    if batch.reference_logprobs is None:
        raise ValueError("kl in reward needs reference logprobs: add a reference node before the trainer")
    kl = kl_estimate(batch.behaviour_logprobs, batch.reference_logprobs, config.kl.estimator)
    batch.rewards = batch.rewards - config.kl.coef * kl * batch.loss_mask
    return batch


LossFn = Callable[[dict[str, torch.Tensor], Batch, Normaliser], tuple[torch.Tensor, dict[str, float]]]


def set_behaviour_weights(batch: Batch, config: LossConfig) -> Batch:
    """Store the loss's behaviour weight w per token (`behaviour_weight`) on the batch, when the
    loss uses one; call it once the proximal logprobs are set, before `Trainer.forward_backward`."""
    if needs_proximal(config):
        if batch.proximal_logprobs is None:
            raise ValueError(f"loss {config.kind!r} needs proximal logprobs: call Trainer.compute_logprobs")
        batch.behaviour_weights = behaviour_weight(
            batch.proximal_logprobs, batch.behaviour_logprobs, batch.loss_mask, config.correction)
    return batch


def token_metrics(
    output: dict[str, torch.Tensor], batch: Batch, normaliser: Normaliser, clipped: torch.Tensor, config: LossConfig
) -> dict[str, float]:
    """Per-token metrics over the tokens that carry loss, including the train/inference mismatch
    (see the module docs)."""
    carried = weighted_mask(batch) > 0

    def mean(x: torch.Tensor) -> float:
        return (torch.where(carried, x.detach().float(), 0.0).sum() / max(normaliser.weighted_tokens, 1.0)).item()

    metrics = {"clip_fraction": mean(clipped), "entropy": mean(output["entropy"])}
    if config.kind != "sft":  # supervised targets have no behaviour policy
        d = output["logprobs"].detach() - batch.behaviour_logprobs
        ratio = torch.exp(d)
        metrics["mismatch_logprob_mean"] = mean(d.abs())
        metrics["mismatch_logprob_max"] = float(torch.where(carried, d.abs(), 0.0).max()) if d.numel() else 0.0
        metrics["mismatch_out_of_clip"] = mean((ratio < 1 - config.clip_low) | (ratio > 1 + config.clip_high))
    if batch.behaviour_weights is not None:
        metrics["behaviour_weight"] = mean(batch.behaviour_weights)
        dropped = (batch.loss_mask > 0) & ~carried
        metrics["masked_by_correction"] = (dropped.sum() / max(normaliser.tokens, 1.0)).item()
    return metrics


def policy_loss(config: LossConfig) -> LossFn:
    """The per-micro-batch loss. `output` holds `logprobs` and `entropy`, both (B, T)."""
    loss_per_token = LOSSES[config.kind]

    def fn(output: dict[str, torch.Tensor], batch: Batch, normaliser: Normaliser):
        logprobs, mask = output["logprobs"], batch.loss_mask
        if batch.advantages is None and config.kind != "sft":
            raise ValueError("the batch has no advantages: call compute_advantages first")
        old, weight = batch.behaviour_logprobs, None
        if needs_proximal(config):
            if batch.proximal_logprobs is None or batch.behaviour_weights is None:
                raise ValueError(f"loss {config.kind!r} needs proximal logprobs and behaviour weights: call "
                                 "Trainer.compute_logprobs, then set_behaviour_weights")
            old, weight = batch.proximal_logprobs, batch.behaviour_weights
        per_token, clipped = loss_per_token(logprobs, old, batch.advantages, mask, config)
        if weight is not None:
            per_token = per_token * weight

        def agg(x):
            return aggregate(x, mask, normaliser, config.aggregation, config.norm_length)

        loss = agg(per_token)
        metrics = {"policy_loss": loss.item()} | token_metrics(output, batch, normaliser, clipped, config)
        if config.kl.apply_as == "loss" and config.kl.coef > 0:
            if batch.reference_logprobs is None:
                raise ValueError("kl in loss needs reference logprobs: add a reference node before the trainer")
            kl = agg(kl_estimate(logprobs, batch.reference_logprobs, config.kl.estimator))
            loss = loss + config.kl.coef * kl
            metrics["kl"] = kl.item()
        if config.entropy_coef:
            loss = loss - config.entropy_coef * agg(output["entropy"])
        metrics["loss"] = loss.item()
        return loss, metrics

    return fn


class ValueLossConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    value_clip: float | None = 0.2  # clip range around the values the data was scored with
    aggregation: Aggregation = "token_mean"


def value_loss(config: ValueLossConfig) -> LossFn:
    """Clipped value loss: l = 0.5 max((v - R)^2, (v_old + clip(v - v_old, -c, c) - R)^2).

    `output["values"]` are the critic's new values; `batch.values` the values the advantages were
    computed with and `batch.returns` the targets R.
    """

    def fn(output: dict[str, torch.Tensor], batch: Batch, normaliser: Normaliser):
        if batch.returns is None or batch.values is None:
            raise ValueError("value loss needs batch.values and batch.returns (compute_advantages with gae)")
        v, old, target = output["values"], batch.values, batch.returns
        loss_t = (v - target) ** 2
        if config.value_clip is not None:
            clipped_v = old + (v - old).clamp(-config.value_clip, config.value_clip)
            loss_t = torch.maximum(loss_t, (clipped_v - target) ** 2)
        loss = 0.5 * aggregate(loss_t, batch.loss_mask, normaliser, config.aggregation)
        return loss, {"value_loss": loss.item()}

    return fn
