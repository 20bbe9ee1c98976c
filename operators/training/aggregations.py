"""Loss aggregations (registry `flowrl.aggregations`): per-token values l (B, T) and the loss mask m
to one number, over the *global* batch: N = loss tokens of the whole batch, S = its sequences with
a loss token, n_i = loss tokens of row i (`Normaliser`), so sums over micro-batches and ranks give
the batch's value. The names are verl's `loss_agg_mode`s with underscores.
"""

from __future__ import annotations

from typing import Annotated

import torch
from msgspec import Meta

from flowrl_operators.config import AggregationConfig
from flowrl_operators.training.batch import Normaliser
from flowrl_operators.training.registry import Algorithm


def masked(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # where(), not a product: a nan/inf on a padding or prompt column must not reach the loss.
    return torch.where(mask > 0, per_token, 0.0) * mask


class TokenMean(AggregationConfig):
    """sum_{i,t} m l / N (verl token-mean; AReaL's default)."""


class TokenSum(AggregationConfig):
    """sum_{i,t} m l, no normalisation (the loss grows with the batch's tokens)."""


class SeqMeanTokenMean(AggregationConfig):
    """sum_i (sum_t m l / n_i) / S (verl seq-mean-token-mean)."""


class SeqMeanTokenSum(AggregationConfig):
    """sum_i (sum_t m l) / S (verl seq-mean-token-sum)."""


class SeqMeanTokenSumNorm(AggregationConfig, kw_only=True):
    """sum_{i,t} m l / (S norm_length): each sequence's token sum over a constant length instead of
    its own (Dr.GRPO, arXiv 2503.20783; verl seq-mean-token-sum-norm with loss_scale_factor =
    norm_length, which divides the sequences' mean token sum by it)."""

    norm_length: Annotated[float, Meta(gt=0)]  # the constant, e.g. the generation budget in tokens


def token_mean(per_token, mask, normaliser: Normaliser, config) -> torch.Tensor:
    return masked(per_token, mask).sum() / max(normaliser.tokens, 1.0)


def token_sum(per_token, mask, normaliser: Normaliser, config) -> torch.Tensor:
    return masked(per_token, mask).sum()


def seq_mean_token_mean(per_token, mask, normaliser: Normaliser, config) -> torch.Tensor:
    sums = masked(per_token, mask).sum(dim=1)
    return (sums / mask.sum(dim=1).clamp(min=1)).sum() / max(normaliser.sequences, 1.0)


def seq_mean_token_sum(per_token, mask, normaliser: Normaliser, config) -> torch.Tensor:
    return masked(per_token, mask).sum() / max(normaliser.sequences, 1.0)


def seq_mean_token_sum_norm(per_token, mask, normaliser: Normaliser, config: SeqMeanTokenSumNorm) -> torch.Tensor:
    return masked(per_token, mask).sum() / max(normaliser.sequences, 1.0) / config.norm_length


TOKEN_MEAN = Algorithm("token_mean", TokenMean, token_mean)
TOKEN_SUM = Algorithm("token_sum", TokenSum, token_sum)
SEQ_MEAN_TOKEN_MEAN = Algorithm("seq_mean_token_mean", SeqMeanTokenMean, seq_mean_token_mean)
SEQ_MEAN_TOKEN_SUM = Algorithm("seq_mean_token_sum", SeqMeanTokenSum, seq_mean_token_sum)
SEQ_MEAN_TOKEN_SUM_NORM = Algorithm("seq_mean_token_sum_norm", SeqMeanTokenSumNorm, seq_mean_token_sum_norm)
