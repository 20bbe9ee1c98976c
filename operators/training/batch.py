"""Packing trajectories into padded tensors, sharding over ranks and micro-batching.

`pack(trajectories) -> Batch`. A row is `prompt_ids + response_ids`, right-padded. Per-token
tensors are *target aligned*: they have `L - 1` columns and column j describes token
`input_ids[:, j + 1]`, the token the logits at position j predict. So
`token_logprobs(logits[:, :-1], input_ids[:, 1:])` lines up with every per-token field, and
prompt and padding columns carry `loss_mask == 0` (the trainer computes the logits of the
`loss_mask > 0` columns only: training/head.py).

Each trajectory's sampling spans become per-token `temperature`, `top_p` and `top_k` (None when
every token was sampled at temperature 1 from the full vocabulary): the trainer and the reference
compute logprobs under the distribution each token was drawn from (`sampling_inputs`; the critic's
value head reads no logits).

Rewards are placed on tokens (`rewards`, with `reward_mask` marking where a reward is defined):
a sequence reward on the last model token, a turn reward on the last token of its turn span, token
rewards on their tokens. Where a trajectory sets several granularities their rewards add up.

The loss normaliser is global (`Normaliser`, counted over the whole batch before it is split), so
a loss summed over micro-batches and ranks does not depend on how the batch was split.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import msgspec
import torch

from flowrl.data.trajectory import GREEDY_BASELINE, Trajectory
from flowrl_operators.training.prefix import Unit, units

# Fields of Batch shaped (B, L - 1); `input_ids`, `attention_mask`, `position_ids` are (B, L).
TOKEN_FIELDS = (
    "loss_mask",
    "behaviour_logprobs",
    "reference_logprobs",
    "proximal_logprobs",
    "rewards",
    "reward_mask",
    "values",
    "advantages",
    "returns",
    "versions",
    "temperature",
    "top_p",
    "top_k",
    "behaviour_weights",
    "top_ids",
    "top_logprobs",
)
SAMPLING_FIELDS = ("temperature", "top_p", "top_k")
ROW_FIELDS = ("group_index", "lengths", "baseline")  # shaped (B,)
# Trajectory metadata key of a greedy baseline sample (generate `greedy_baseline: true`).
# The value of a sampling field on a token outside every span: the model's own distribution.
SAMPLING_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1}


@dataclasses.dataclass
class Batch:
    input_ids: torch.Tensor  # (B, L) long
    attention_mask: torch.Tensor  # (B, L) long
    position_ids: torch.Tensor  # (B, L) long
    loss_mask: torch.Tensor  # (B, L-1) float: 1 on model-produced response tokens
    behaviour_logprobs: torch.Tensor  # (B, L-1) float: engine logprobs
    rewards: torch.Tensor  # (B, L-1) float
    reward_mask: torch.Tensor  # (B, L-1) float: 1 where a reward is defined
    versions: torch.Tensor  # (B, L-1) long: policy version of each response token
    group_index: torch.Tensor  # (B,) long: rows of one group share an index
    lengths: torch.Tensor  # (B,) long: prompt + response tokens
    reference_logprobs: torch.Tensor | None = None
    proximal_logprobs: torch.Tensor | None = None  # filled by Trainer.compute_logprobs
    values: torch.Tensor | None = None  # critic values, filled by Critic.compute_values
    advantages: torch.Tensor | None = None  # filled by advantages.compute_advantages
    returns: torch.Tensor | None = None
    # The distribution each token was sampled from (greedy tokens: temperature 1, no filter).
    temperature: torch.Tensor | None = None  # (B, L-1) float
    top_p: torch.Tensor | None = None  # (B, L-1) float
    top_k: torch.Tensor | None = None  # (B, L-1) long; <= 0: no limit
    # pi_proximal / pi_behaviour as the loss weights each token (decoupled PPO, tis, mis), no gradient;
    # set by `losses.set_behaviour_weights`. A token with weight 0 carries no loss.
    behaviour_weights: torch.Tensor | None = None
    # (B,) 1.0 on a group's greedy baseline row (generate `greedy_baseline: true`, for advantage
    # remax): its reward is the group's baseline and its loss mask is all zero.
    baseline: torch.Tensor | None = None
    # The behaviour policy's K most likely tokens at each token and their logprobs (generate
    # `sampling.top_logprobs`), (B, L-1, K) long / float; an entry not recorded has id 0 and logprob
    # -inf (no mass), so a token without any record has all -inf. None unless a trajectory has them.
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None
    # Per row, the trajectory's images (list[ImageRef]; vision-language policies: training/vl_inputs.py).
    images: list | None = None

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    def select(self, rows: Sequence[int]) -> Batch:
        """The given rows, trimmed to their longest sequence (less padding in each micro-batch)."""
        index = torch.as_tensor(list(rows), dtype=torch.long)
        width = int(self.lengths[index].max()) if len(index) else 1
        out = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is None:
                out[field.name] = None
            elif isinstance(value, list):  # images
                out[field.name] = [value[i] for i in index.tolist()]
            elif field.name in ROW_FIELDS:
                out[field.name] = value[index]
            elif field.name in TOKEN_FIELDS:
                out[field.name] = value[index, : max(width - 1, 0)]
            else:
                out[field.name] = value[index, :width]
        return Batch(**out)

    def sampling_inputs(self, rows: torch.Tensor, cols: torch.Tensor) -> dict[str, torch.Tensor]:
        """The sampling fields set, as `token_logprobs` keywords, at the target-aligned positions
        (rows, cols): the tokens whose logprobs are computed (training/head.py)."""
        return {name: getattr(self, name)[rows, cols] for name in SAMPLING_FIELDS if getattr(self, name) is not None}

    def to(self, device: torch.device | str) -> Batch:
        return Batch(
            **{
                f.name: (getattr(self, f.name) if not isinstance(getattr(self, f.name), torch.Tensor)
                         else getattr(self, f.name).to(device))
                for f in dataclasses.fields(self)
            }
        )


class Normaliser(msgspec.Struct, frozen=True):
    """Global counts the loss divides by: loss tokens and sequences with at least one; and the loss
    tokens that carry weight (behaviour weight > 0), which per-token metrics average over, and the
    sequences with at least one of those (a correction's `normalise: kept` divides by these two)."""

    tokens: float
    sequences: float
    weighted_tokens: float
    weighted_sequences: float = 0.0

    @staticmethod
    def of(batch: Batch) -> Normaliser:
        per_row = batch.loss_mask.sum(dim=1)
        weighted = weighted_mask(batch).sum(dim=1)
        return Normaliser(tokens=float(per_row.sum()), sequences=float((per_row > 0).sum()),
                          weighted_tokens=float(weighted.sum()), weighted_sequences=float((weighted > 0).sum()))

    def kept(self, sequences: bool = True) -> Normaliser:
        """The counts over the tokens that carry weight alone (and the sequences that keep one, unless
        `sequences` is false: then every sequence with a loss token still counts)."""
        kept_rows = self.weighted_sequences if sequences else self.sequences
        return Normaliser(tokens=self.weighted_tokens, sequences=kept_rows,
                          weighted_tokens=self.weighted_tokens, weighted_sequences=self.weighted_sequences)


def weighted_mask(batch: Batch) -> torch.Tensor:
    """1.0 on the tokens that carry loss: on the loss mask, with a behaviour weight > 0 if one is set
    (`mis` gives 0 to the tokens it masks)."""
    carried = batch.loss_mask > 0
    if batch.behaviour_weights is not None:
        carried = carried & (batch.behaviour_weights > 0)
    return carried.float()


def _sampling_columns(traj: Trajectory) -> dict[str, list[float]] | None:
    """Per response token temperature / top_p / top_k from the trajectory's spans; None if every
    token has the defaults. A greedy span (temperature 0) is temperature 1 without filters, the
    distribution whose logprob the engine reports for an argmax."""
    if not any(s.temperature > 0 and (s.temperature != 1 or s.top_p < 1 or s.top_k > 0) for s in traj.sampling):
        return None
    n = len(traj.response_ids)
    columns = {name: [value] * n for name, value in SAMPLING_DEFAULTS.items()}
    for span in traj.sampling:
        if span.temperature > 0:
            values = {"temperature": span.temperature, "top_p": span.top_p, "top_k": span.top_k}
        else:
            values = SAMPLING_DEFAULTS
        for name, value in values.items():
            columns[name][span.start : span.end] = [value] * (span.end - span.start)
    return columns


def credited_rewards(traj: Trajectory) -> tuple[list[float], list[float]]:
    """The credited rewards on the response tokens: the finest granularity the trajectory has.
    `reward` next to turn or token rewards is their total (set for metrics and filters, e.g. by the
    environment workflow), so crediting it as well would count the episode twice."""
    n = len(traj.response_ids)
    rewards, defined = [0.0] * n, [0.0] * n
    if traj.token_rewards is not None:
        return [float(r) for r in traj.token_rewards], [1.0] * n
    if traj.turn_rewards is not None:
        for turn, reward in zip(traj.turns, traj.turn_rewards, strict=True):
            rewards[turn.end - 1] += reward
            defined[turn.end - 1] = 1.0
    elif traj.reward is not None:
        model_tokens = [i for i, m in enumerate(traj.loss_mask) if m]
        last = model_tokens[-1] if model_tokens else n - 1
        rewards[last] = traj.reward
        defined[last] = 1.0
    return rewards, defined


def pack(trajectories: Sequence[Trajectory], require_reward: bool = True) -> Batch:
    """Pad trajectories into a Batch. Every trajectory needs at least one response token."""
    if not trajectories:
        raise ValueError("pack() needs at least one trajectory")
    groups, lengths = _checked_rows(trajectories, require_reward)
    width = max(lengths)
    fields = _padded_rows(trajectories, width)
    long = {"input_ids", "attention_mask", "position_ids", "versions", "top_k"}
    tensors = {name: torch.tensor(v, dtype=torch.long if name in long else torch.float32)
               for name, v in (fields | _sampling_fields(trajectories, width)).items() if v}
    input_ids, attention_mask = tensors.pop("input_ids"), tensors.pop("attention_mask")
    position_ids, versions = tensors.pop("position_ids"), tensors.pop("versions")
    reference, values = tensors.pop("reference_logprobs", None), tensors.pop("values", None)
    token = tensors  # loss_mask, behaviour_logprobs, rewards, reward_mask, and sampling fields if any
    baseline = [1.0 if t.metadata.get(GREEDY_BASELINE) else 0.0 for t in trajectories]
    return Batch(
        **_top_fields(trajectories, width),
        baseline=torch.tensor(baseline) if any(baseline) else None,
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        versions=versions,
        group_index=torch.tensor([groups[t.group_id] for t in trajectories]),
        lengths=torch.tensor(lengths),
        reference_logprobs=reference,
        values=values, images=_images(trajectories),
        **token,
    )


def _checked_rows(trajectories: Sequence[Trajectory], require_reward: bool) -> tuple[dict[str, int], list[int]]:
    """Each trajectory checked for training (pack's rules), and its group's index and its length."""
    groups: dict[str, int] = {}
    lengths = []
    for traj in trajectories:
        traj.validate()
        if not traj.response_ids or not traj.prompt_ids:
            raise ValueError(f"trajectory {traj.id}: needs a non-empty prompt and response to train on")
        if require_reward and traj.reward is None and traj.turn_rewards is None and traj.token_rewards is None:
            raise ValueError(f"trajectory {traj.id} has no reward: put a reward node before the trainer")
        groups.setdefault(traj.group_id, len(groups))
        lengths.append(len(traj.prompt_ids) + len(traj.response_ids))
    return groups, lengths


def _padded_rows(trajectories: Sequence[Trajectory], width: int) -> dict[str, list[list[float]]]:
    """pack's per-token fields as padded Python lists, `width` columns a row."""
    has_reference = all(t.reference_logprobs is not None for t in trajectories)
    has_values = all(t.values is not None for t in trajectories)
    # Rows are built as padded Python lists and converted once per field: a tensor per row and
    # field cost ~20 ms for a quickstart batch of 128 short rows, more than its optimizer step.
    fields: dict[str, list[list[float]]] = {name: [] for name in (
        "input_ids", "attention_mask", "position_ids", "loss_mask", "behaviour_logprobs", "rewards",
        "reward_mask", "versions", "reference_logprobs", "values")}
    for traj in trajectories:
        p, n = len(traj.prompt_ids), len(traj.response_ids)
        pad = width - p - n
        fields["input_ids"].append(traj.prompt_ids + traj.response_ids + [0] * pad)
        fields["attention_mask"].append([1] * (p + n) + [0] * pad)
        fields["position_ids"].append(list(range(p + n)) + [0] * pad)
        head = [0] * (p - 1)  # response values sit on the target-aligned columns p-1 .. p-2+n
        rewards, defined = credited_rewards(traj)
        loss_mask = [0] * n if traj.metadata.get(GREEDY_BASELINE) else list(traj.loss_mask)
        fields["loss_mask"].append(head + loss_mask + [0] * pad)
        fields["behaviour_logprobs"].append(head + list(traj.behaviour_logprobs) + [0] * pad)
        fields["rewards"].append(head + rewards + [0] * pad)
        fields["reward_mask"].append(head + defined + [0] * pad)
        fields["versions"].append(head + list(traj.versions) + [0] * pad)
        if has_reference:
            fields["reference_logprobs"].append(head + list(traj.reference_logprobs) + [0] * pad)
        if has_values:
            fields["values"].append(head + list(traj.values) + [0] * pad)
    return fields


def _top_fields(trajectories: Sequence[Trajectory], width: int) -> dict[str, torch.Tensor]:
    """`top_ids` / `top_logprobs` (B, width - 1, K) at the target-aligned response columns, K the
    longest record; {} when no trajectory has any."""
    if all(t.top_ids is None for t in trajectories):
        return {}
    k = max(len(ids) for t in trajectories if t.top_ids is not None for ids in t.top_ids)
    ids = torch.zeros(len(trajectories), max(width - 1, 0), k, dtype=torch.long)
    logprobs = torch.full(ids.shape, -math.inf)
    for row, traj in enumerate(trajectories):
        if traj.top_ids is None:
            continue
        p, n = len(traj.prompt_ids), len(traj.response_ids)
        ids[row, p - 1 : p - 1 + n] = torch.tensor([i + [0] * (k - len(i)) for i in traj.top_ids], dtype=torch.long)
        logprobs[row, p - 1 : p - 1 + n] = torch.tensor(
            [lp + [-math.inf] * (k - len(lp)) for lp in traj.top_logprobs], dtype=torch.float32)
    return {"top_ids": ids, "top_logprobs": logprobs}


def _images(trajectories: Sequence[Trajectory]) -> list | None:
    """Each row's images (vision-language policies), or None when no row has any."""
    return [list(t.images) for t in trajectories] if any(t.images for t in trajectories) else None


def _sampling_fields(trajectories: Sequence[Trajectory], width: int) -> dict[str, list[list[float]]]:
    """Padded rows of the sampling fields, or {} when every token has the defaults."""
    columns = [_sampling_columns(t) for t in trajectories]
    if all(c is None for c in columns):
        return {}
    fields: dict[str, list[list[float]]] = {name: [] for name in SAMPLING_FIELDS}
    for traj, column in zip(trajectories, columns, strict=True):
        p, n = len(traj.prompt_ids), len(traj.response_ids)
        for name in SAMPLING_FIELDS:
            default = SAMPLING_DEFAULTS[name]
            body = column[name] if column is not None else [default] * n
            fields[name].append([default] * (p - 1) + body + [default] * (width - p - n))
    return fields


def response_values(batch: Batch, field: str, trajectories: Sequence[Trajectory]) -> list[list[float]]:
    """Read a per-token field back as one list per trajectory (e.g. reference logprobs, values)."""
    tensor = getattr(batch, field)
    out = []
    for i, traj in enumerate(trajectories):
        p, n = len(traj.prompt_ids), len(traj.response_ids)
        out.append(tensor[i, p - 1 : p - 1 + n].tolist())
    return out


def shard(batch: Batch, rank: int, world_size: int, shared: bool = False) -> Batch:
    """This rank's rows, balanced by the tokens they cost (largest first onto the least loaded rank).

    A rank may receive no rows when the batch is smaller than the world: it then gets an empty
    Batch, and the trainer still joins the collectives with a zero-weight micro-batch.

    `shared` (the trainer's forward computes a group's shared prefix once, training/prefix.py): the
    rows of a group that share a prefix go to one rank, at the tokens they cost so, so that the
    prefix is computed once in all instead of once on every rank holding some of them. A group
    costing more than a rank's even share is spread instead, after the whole groups, each row onto
    the rank where it adds the least load: its branch where that rank holds the group's prefix
    already, the prefix too where not; so few large groups still keep the ranks balanced.
    """
    lengths = [int(n) for n in batch.lengths.tolist()]
    load = [0] * world_size
    owned: list[list[int]] = [[] for _ in range(world_size)]
    groups = units(batch, math.inf) if shared and world_size > 1 else [Unit(n, [r], n) for r, n in enumerate(lengths)]
    even = sum(unit.width for unit in groups) / world_size
    whole = [unit for unit in groups if len(unit.rows) == 1 or unit.width <= even]
    for unit in sorted(whole, key=lambda u: (-u.width, min(u.rows))):
        target = min(range(world_size), key=lambda k: (load[k], k))
        owned[target].extend(unit.rows)
        load[target] += unit.width
    for unit in sorted((u for u in groups if len(u.rows) > 1 and u.width > even), key=lambda u: (-u.width, min(u.rows))):
        _spread(unit, lengths, load, owned)
    return batch.select(sorted(owned[rank]))


def _spread(unit: Unit, lengths: list[int], load: list[int], owned: list[list[int]]) -> None:
    """A sharing group's rows, longest first, each onto the rank where it adds the least load: its
    branch on a rank that holds the group's prefix already, its whole length elsewhere."""
    holding: set[int] = set()
    for row in sorted(unit.rows, key=lambda r: (-lengths[r], r)):
        added = [lengths[row] - (unit.prefix if k in holding else 0) for k in range(len(load))]
        target = min(range(len(load)), key=lambda k: (load[k] + added[k], k))
        load[target] += added[target]
        owned[target].append(row)
        holding.add(target)


def micro_batch_rows(batch: Batch, token_budget: int, packed: bool = False, shared: bool = False) -> list[list[int]]:
    """The batch's rows in micro-batches of at most `token_budget` tokens each; a row longer than the
    budget runs alone. Each micro-batch lists its rows in ascending order.

    `packed` (the forward lays a micro-batch's sequences end to end, training/head.py): a micro-batch
    costs its tokens, so the rows are balanced by token count over as few micro-batches as fit the
    budget (longest first onto the least loaded), and a long-tailed batch does not leave one
    micro-batch full and the next nearly empty. Otherwise (padded rows): it costs rows x its longest
    row, so rows of similar length go together (longest first, filled up to the budget).

    `shared` (with `packed`: the forward computes a group's shared prefix once, training/prefix.py):
    a group's rows that share one go together, counted at the tokens they cost so.
    """
    lengths = [int(n) for n in batch.lengths.tolist()]
    if not lengths:
        return []
    if not packed:
        return _by_width(lengths, token_budget)
    items = _shared_items(batch, token_budget) if shared else [([row], n) for row, n in enumerate(lengths)]
    return _balanced(items, token_budget)


def _shared_items(batch: Batch, budget: int) -> list[tuple[list[int], int]]:
    """What a packed micro-batch is made of: a group whose rows share a prefix, at the tokens it
    computes with the prefix once (training/prefix.py), kept whole so that the sharing survives the
    split, unless it exceeds the budget; otherwise single rows at their length."""
    lengths = batch.lengths.tolist()
    items = []
    for unit in units(batch, math.inf):
        if len(unit.rows) > 1 and unit.width <= budget:
            items.append((sorted(unit.rows), unit.width))
        else:
            items.extend(([row], lengths[row]) for row in unit.rows)
    return items


def _balanced(items: list[tuple[list[int], int]], budget: int) -> list[list[int]]:
    """Items (rows, tokens), largest first onto the least loaded of `count` micro-batches, for the
    fewest `count` whose loads all fit (a micro-batch of one item may exceed the budget)."""
    order = sorted(items, key=lambda item: (-item[1], item[0][0]))
    for count in range(max(1, -(-sum(n for _, n in items) // budget)), len(items) + 1):
        loads, groups, sizes = [0] * count, [[] for _ in range(count)], [0] * count
        for rows, tokens in order:
            k = min(range(count), key=lambda j: (loads[j], j))
            loads[k] += tokens
            groups[k].extend(rows)
            sizes[k] += 1
        if all(load <= budget or size == 1 for load, size in zip(loads, sizes, strict=True)):
            break
    return sorted((sorted(g) for g in groups if g), key=lambda g: g[0])


def _by_width(lengths: list[int], budget: int) -> list[list[int]]:
    """Rows longest first, each micro-batch filled while rows x its widest row fits."""
    groups: list[list[int]] = []
    current: list[int] = []
    for row in sorted(range(len(lengths)), key=lambda r: (-lengths[r], r)):
        width = lengths[current[0]] if current else lengths[row]  # the first row is the widest
        if current and (len(current) + 1) * width > budget:
            groups.append(sorted(current))
            current = []
        current.append(row)
    if current:
        groups.append(sorted(current))
    return groups


def micro_batches(batch: Batch, token_budget: int, packed: bool = False, shared: bool = False) -> list[Batch]:
    return [batch.select(rows) for rows in micro_batch_rows(batch, token_budget, packed, shared)]
