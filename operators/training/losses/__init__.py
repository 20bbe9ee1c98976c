"""RL losses: the train node's policy loss, built from the registries, plus the critic's value loss.

`policy_loss(config)` combines the selected entries of four registries
(flowrl_operators.training.registry): the loss's per-token values (`kind`, losses/ppo.py,
losses/reinforce.py or a plugin's), the correction's behaviour weights (`correction`,
corrections.py), the aggregation (`aggregation`, aggregations.py) and the KL estimator (`kl`, kl.py):

    loss: {kind: ppo_clip, clip_low: 0.2, clip_high: 0.28, dual_clip: 3.0, decoupled: true,
           aggregation: seq_mean_token_mean, correction: {kind: tis, level: token, threshold: 2.0},
           kl: {coef: 0.001, estimator: k3, apply_as: loss}, entropy_coef: 0.0}

Behaviour policy. By default old = the engine's behaviour logprobs: the clipped ratio is PPO's
importance correction for whatever policy produced each token (a stale version behind an async
edge, several versions under partial rollout, the engine's numerics). With `decoupled: true`
(decoupled PPO, AReaL) or a `correction`, old = the proximal logprobs the trainer recomputes
before the update (`Trainer.compute_logprobs`), and the per-token loss is multiplied by the
behaviour weight w = exp(prox - behav) per token, or exp(sum_t m (prox - behav)) per sequence
(`correction.level: sequence`), without gradient:
    decoupled, no correction   w   (unbounded: refused unless `allow_unbounded_weight: true`)
    correction: {kind: tis}     min(w, threshold)                    (truncated importance sampling)
    correction: {kind: mis}     w if floor <= w <= threshold else 0  (masked importance sampling)
    any other registered correction (geometric, reject, ...; see corrections.py)
`set_behaviour_weights(batch, config)` stores w on the batch once the proximal logprobs are known.
A loss whose config says `weighting = "geometric"` (geo_mean) gets one weight per sequence instead,
the geometric mean of its tokens' weights. A correction with `normalise: kept` hands the loss and
its aggregation the kept tokens (w > 0) as the mask, with the counts N and S over them (verl's
rejection); by default masked tokens still count (AReaL's).

KL to the reference: `apply_as: loss` adds coef * aggregate(k) to the loss; `apply_as: reward`
subtracts coef * k (of the behaviour logprobs) from the token rewards before the advantages
(`apply_kl_penalty`; only estimators that read every token's reward see it, see
`objective.check_compatible`). Entropy bonus: loss -= entropy_coef * aggregate(H); under
`entropy_control: {target, max_coef}` the coefficient rises towards max_coef as the micro-batch's
mean entropy falls below the target (`entropy_coefficient`; metric `entropy_coef`).

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
                            (losses with a clip range)
On-policy data with the engine's numerics gives ~1e-6, 1e-6 and 0; data from older versions adds
its staleness.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

import msgspec
import torch
from msgspec import Meta

from flowrl_operators.config import ClipCov, KLConfig, KLCov, LossConfig
from flowrl_operators.training.batch import Batch, Normaliser, weighted_mask
from flowrl_operators.training.losses.dppo import TopLogprobs
from flowrl_operators.training.losses.ppo import ClipConfig
from flowrl_operators.training.objective import (
    aggregation_config,
    check_compatible,
    correction_config,
    kl_config,
    loss_config,
    needs_proximal,
    needs_reference,
)
from flowrl_operators.training.registry import AGGREGATIONS, CORRECTIONS, KL, LOSSES

__all__ = ["LossConfig", "ValueLossConfig", "apply_kl_penalty", "check_compatible", "loss_config",
           "needs_proximal", "needs_reference", "policy_loss", "set_behaviour_weights", "value_loss"]


def kl_estimate(logprobs: torch.Tensor, reference: torch.Tensor, kl: KLConfig) -> torch.Tensor:
    """The selected KL estimator per token (kl.py)."""
    return KL.of(kl).fn(logprobs, reference, kl)


def apply_kl_penalty(batch: Batch, config: LossConfig) -> Batch:
    """`kl.apply_as: reward`: rewards -= coef * k(behaviour, reference) on model tokens (in place)."""
    kl = kl_config(config)
    if kl.apply_as != "reward" or kl.coef == 0:
        return batch
    if batch.reference_logprobs is None:
        raise ValueError("kl in reward needs reference logprobs: add a reference node before the trainer")
    estimate = kl_estimate(batch.behaviour_logprobs, batch.reference_logprobs, kl)
    batch.rewards = batch.rewards - kl.coef * estimate * batch.loss_mask
    return batch


LossFn = Callable[[dict[str, torch.Tensor], Batch, Normaliser], tuple[torch.Tensor, dict[str, float]]]


def _local(values: list[float]) -> list[float]:
    return values


def set_behaviour_weights(batch: Batch, config: LossConfig, reduce: Callable = _local) -> Batch:
    """Store the loss's behaviour weight w per token on the batch, when the loss uses one; call it
    once the proximal logprobs are set, before `Trainer.forward_backward`. `reduce` sums a list of
    floats over the ranks (`Trainer.all_reduce`), for corrections with batch statistics."""
    if needs_proximal(config):
        if batch.proximal_logprobs is None:
            raise ValueError(f"loss {config.kind!r} needs proximal logprobs: call Trainer.compute_logprobs")
        proximal, behaviour, mask = batch.proximal_logprobs, batch.behaviour_logprobs, batch.loss_mask
        correction = correction_config(config)
        if correction is None:  # decoupled PPO: the plain ratio, unbounded
            batch.behaviour_weights = torch.exp(torch.where(mask > 0, proximal - behaviour, 0.0)) * mask
        else:
            batch.behaviour_weights = CORRECTIONS.of(correction).fn(proximal, behaviour, mask, correction, reduce)
    return batch


def geometric_mean(weight: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each sequence's geometric mean of its tokens' weights, on each of its tokens (verl geo_mean's
    sequence IS weight, with its eps: exp(sum_t m log(w + 1e-10) / (n_i + 1e-8)))."""
    log_w = torch.where(mask > 0, torch.log(weight + 1e-10), 0.0)
    mean = log_w.sum(dim=1, keepdim=True) / (mask.sum(dim=1, keepdim=True) + 1e-8)
    return torch.exp(mean).expand_as(weight) * mask


def token_metrics(
    output: dict[str, torch.Tensor], batch: Batch, normaliser: Normaliser, clipped: torch.Tensor, config: LossConfig
) -> dict[str, float]:
    """Per-token metrics over the tokens that carry loss, including the train/inference mismatch
    (see the module docs)."""
    carried = weighted_mask(batch) > 0

    def mean(x: torch.Tensor) -> float:
        return (torch.where(carried, x.detach().float(), 0.0).sum() / max(normaliser.weighted_tokens, 1.0)).item()

    metrics = {"clip_fraction": mean(clipped), "entropy": mean(output["entropy"])}
    if not config.supervised:  # supervised targets have no behaviour policy
        d = output["logprobs"].detach() - batch.behaviour_logprobs
        ratio = torch.exp(d)
        metrics["mismatch_logprob_mean"] = mean(d.abs())
        metrics["mismatch_logprob_max"] = float(torch.where(carried, d.abs(), 0.0).max()) if d.numel() else 0.0
        if isinstance(config, ClipConfig):  # losses with a clip range
            metrics["mismatch_out_of_clip"] = mean((ratio < 1 - config.clip_low) | (ratio > 1 + config.clip_high))
    if batch.behaviour_weights is not None:
        metrics["behaviour_weight"] = mean(batch.behaviour_weights)
        dropped = (batch.loss_mask > 0) & ~carried
        metrics["masked_by_correction"] = (dropped.sum() / max(normaliser.tokens, 1.0)).item()
    return metrics


def top_logprobs(output: dict[str, torch.Tensor], batch: Batch) -> TopLogprobs | None:
    """The current and the behaviour policy's logprobs of the behaviour policy's top-K tokens, or
    None when the batch has none (the loss says what to set)."""
    if batch.top_logprobs is None or "top_logprobs" not in output:
        return None
    return TopLogprobs(current=output["top_logprobs"], behaviour=batch.top_logprobs)


def entropy_coefficient(entropy: torch.Tensor, mask: torch.Tensor, config: LossConfig) -> float:
    """The entropy bonus's coefficient on a micro-batch: fixed, or under `entropy_control` raised as
    the mean entropy of its loss tokens falls below the target (EntropyControl)."""
    control = config.entropy_control
    if control is None:
        return config.entropy_coef
    tokens = float(mask.sum())
    h = float((entropy.detach() * mask).sum()) / tokens if tokens else control.target
    shortfall = min(max((control.target - h) / control.target, 0.0), 1.0)
    return config.entropy_coef + (control.max_coef - config.entropy_coef) * shortfall


def unlikelihood(logprobs: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """|A| * -log(1 - p) on tokens with A < 0, 0 elsewhere (Welleck et al. 2019, arXiv 1908.04319):
    its gradient on the token's logit is |A| p, largest where the policy is surest. p is clamped at
    1 - 1e-6 (-log(1 - p) is infinite at 1), where the gradient stops: the term keeps a wrong token from
    becoming certain; it does not free one that already is (docs/benchmarks.md measured both)."""
    p = logprobs.exp().clamp(max=1 - 1e-6)
    return torch.where(advantages < 0, -advantages * -torch.log1p(-p), 0.0)


def covariance_control(per_token: torch.Tensor, logprobs: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor,
                       mask: torch.Tensor, cov: KLCov | ClipCov) -> torch.Tensor:
    """KL-Cov or Clip-Cov (operators/config.py) on a micro-batch's per-token loss: the tokens chosen
    by the covariance of their (detached) logprob and advantage get |logp - old| added, or no gradient."""
    kept = mask > 0
    n = int(kept.sum())
    if n == 0:
        return per_token
    logp, adv = logprobs.detach()[kept], advantages[kept]
    covariance = (logp - logp.mean()) * (adv - adv.mean())
    count = max(1, int(n * cov.fraction))
    if isinstance(cov, KLCov):
        chosen = torch.topk(covariance, min(count, n)).indices
    else:  # a random draw among the tokens in the band (seeded by the trainer's torch generator)
        band = torch.nonzero((covariance > cov.low) & (covariance < cov.high)).squeeze(-1)
        chosen = band[torch.randperm(len(band))[:count]]
    selected = torch.zeros(n, dtype=torch.bool, device=per_token.device)
    selected[chosen] = True
    where = torch.zeros_like(kept)
    where[kept] = selected
    if isinstance(cov, KLCov):
        return per_token + torch.where(where, cov.coef * (logprobs - old).abs(), 0.0)
    return per_token.masked_fill(where, 0.0)


def policy_loss(config: LossConfig) -> LossFn:
    """The per-micro-batch loss. `output` holds `logprobs` and `entropy`, both (B, T)."""
    config = loss_config(config)
    loss_per_token = LOSSES.of(config).fn
    reads_top = "top_logprobs" in LOSSES.of(config).needs
    aggregation, kl = aggregation_config(config), kl_config(config)
    aggregate = AGGREGATIONS.of(aggregation).fn

    correction = correction_config(config) if needs_proximal(config) else None
    kept_only = getattr(correction, "normalise", "all") == "kept"
    geometric = getattr(config, "weighting", "token") == "geometric"
    count_rejected = getattr(config, "counts_rejected_sequences", False)

    def fn(output: dict[str, torch.Tensor], batch: Batch, normaliser: Normaliser):
        logprobs, mask = output["logprobs"], batch.loss_mask
        if batch.advantages is None and not config.supervised:
            raise ValueError("the batch has no advantages: call compute_advantages first")
        old, weight, counts = batch.behaviour_logprobs, None, normaliser  # counts: every loss token
        if needs_proximal(config):
            if batch.proximal_logprobs is None or batch.behaviour_weights is None:
                raise ValueError(f"loss {config.kind!r} needs proximal logprobs and behaviour weights: call "
                                 "Trainer.compute_logprobs, then set_behaviour_weights")
            old, weight = batch.proximal_logprobs, batch.behaviour_weights
            if kept_only:  # verl: the rejection-modified mask is the loss mask from here on
                mask, normaliser = weighted_mask(batch), normaliser.kept(sequences=not count_rejected)
        extra = {"top": top_logprobs(output, batch)} if reads_top else {}
        per_token, clipped = loss_per_token(logprobs, old, batch.advantages, mask, config, **extra)
        if config.unlikelihood:
            per_token = per_token + config.unlikelihood * unlikelihood(logprobs, batch.advantages)
        if config.cov is not None:
            per_token = covariance_control(per_token, logprobs, old, batch.advantages, mask, config.cov)
        if weight is not None:
            per_token = per_token * (geometric_mean(weight, mask) if geometric else weight)

        def agg(x):
            return aggregate(x, mask, normaliser, aggregation)

        loss = agg(per_token)
        metrics = {"policy_loss": loss.item()} | token_metrics(output, batch, counts, clipped, config)
        if kl.apply_as == "loss" and kl.coef > 0:
            if batch.reference_logprobs is None:
                raise ValueError("kl in loss needs reference logprobs: add a reference node before the trainer")
            kl_term = agg(kl_estimate(logprobs, batch.reference_logprobs, kl))
            loss = loss + kl.coef * kl_term
            metrics["kl"] = kl_term.item()
        coef = entropy_coefficient(output["entropy"], mask, config)
        if coef:
            loss = loss - coef * agg(output["entropy"])
        if config.entropy_control is not None:  # token-weighted, so micro-batches sum to the batch's mean
            metrics["entropy_coef"] = coef * float(batch.loss_mask.sum()) / max(counts.tokens, 1.0)
        metrics["loss"] = loss.item()
        return loss, metrics

    return fn


class ValueLossConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    value_clip: Annotated[float, Meta(gt=0)] | None = 0.2  # clip range around the values the data was scored with
    aggregation: str | dict = "token_mean"  # a registered aggregation


def value_loss(config: ValueLossConfig) -> LossFn:
    """Clipped value loss: l = 0.5 max((v - R)^2, (v_old + clip(v - v_old, -c, c) - R)^2).

    `output["values"]` are the critic's new values; `batch.values` the values the advantages were
    computed with and `batch.returns` the targets R.
    """

    aggregation = AGGREGATIONS.config(config.aggregation)
    aggregate = AGGREGATIONS.of(aggregation).fn

    def fn(output: dict[str, torch.Tensor], batch: Batch, normaliser: Normaliser):
        if batch.returns is None or batch.values is None:
            raise ValueError("value loss needs batch.values and batch.returns (compute_advantages with gae)")
        v, old, target = output["values"], batch.values, batch.returns
        loss_t = (v - target) ** 2
        if config.value_clip is not None:
            clipped_v = old + (v - old).clamp(-config.value_clip, config.value_clip)
            loss_t = torch.maximum(loss_t, (clipped_v - target) ** 2)
        loss = 0.5 * aggregate(loss_t, batch.loss_mask, normaliser, aggregation)
        return loss, {"value_loss": loss.item()}

    return fn
