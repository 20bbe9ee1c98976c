"""A group's shared prefix computed once in the trainer's forward: the prompt of a GRPO group runs
through the decoder once, and each sample's own tokens attend to it.

A GRPO group's samples share their prompt, often most of each row (a system prompt and a question
of ~60 tokens against responses of ~20). Packed as separate sequences (training/head.py
`pack_rows`) the prompt is computed once per sample. Here the rows of a group that start with the
same tokens become one *unit*: the common prefix, then each row's remaining tokens (its *branch*),
end to end:

    [ prefix (P) | branch of row a | branch of row b | ... ]

with an attention mask under which a prefix token attends causally within the prefix and a branch
token to the whole prefix and causally within its own branch, and each token keeps its row's
position id. Every token therefore sees exactly the context it has in its own row: its hidden
state, its logits and their gradient are those of the row's own forward (the prefix's gradient is
the sum over the rows that read it, as it is when each row computes it). A loss position inside
the prefix (the last prompt token, predicting each sample's first token; a first response token
several samples share) is read once per row from the same hidden state.

Units are laid into packed rows as `pack_rows` lays sequences. A unit's width is bounded by the
same cost model (`row_cost`: linear layers plus attention computed densely under the mask): a
branch joins a unit of its group while that costs less than opening another unit with its own
copy of the prefix. The mask is explicit (4-D), so this needs an attention implementation that
takes one (sdpa, eager); flash attention and the vision-language families keep `pack_rows`.
"""

from __future__ import annotations

import dataclasses
import math

import torch

# Attention implementations that take an explicit 4-D mask (bool for sdpa, additive for eager).
MASKED_ATTENTION = frozenset({"sdpa", "eager"})


def row_cost(width: int, attention_width: float) -> float:
    """The work of a packed row of `width` tokens: linear layers, plus attention growing with the
    width and costing as much as the linear layers at `attention_width`."""
    return width * (1 + width / attention_width)


@dataclasses.dataclass
class Unit:
    """A shared prefix and the rows that branch from it (a single row: the prefix is the row)."""

    prefix: int
    rows: list[int]
    width: int


@dataclasses.dataclass
class SharedRows:
    """The packed inputs and where each original token's hidden state is."""

    input_ids: torch.Tensor  # (P, W)
    position_ids: torch.Tensor  # (P, W)
    attention_mask: torch.Tensor  # (P, 1, W, W): bool (sdpa) or additive (eager)
    place_row: torch.Tensor  # (B, L): the packed row of (row, position)
    place_col: torch.Tensor  # (B, L): its column there
    computed: int  # tokens run through the decoder (the rows hold int(lengths.sum()))


def _common_prefix(rows: list[list[tuple[int, int]]]) -> int:
    """Length of the longest prefix of (token, position) pairs all rows share."""
    shortest = min(len(r) for r in rows)
    for j in range(shortest):
        first = rows[0][j]
        if any(r[j] != first for r in rows[1:]):
            return j
    return shortest


def units(mb, attention_width: float) -> list[Unit]:
    """The micro-batch's rows grouped into units (module docs), largest first."""
    lengths = mb.lengths.tolist()
    ids, pos = mb.input_ids.tolist(), mb.position_ids.tolist()
    groups: dict[int, list[int]] = {}
    for row, group in enumerate(mb.group_index.tolist()):
        groups.setdefault(group, []).append(row)
    out: list[Unit] = []
    for rows in groups.values():
        seqs = [list(zip(ids[r][: lengths[r]], pos[r][: lengths[r]], strict=True)) for r in rows]
        prefix = _common_prefix(seqs) if len(rows) > 1 else lengths[rows[0]]
        if prefix == 0:
            out.extend(Unit(lengths[r], [r], lengths[r]) for r in rows)
            continue
        out.extend(_branch(rows, lengths, prefix, attention_width))
    return sorted(out, key=lambda u: (-u.width, u.rows[0]))


def _branch(rows: list[int], lengths: list[int], prefix: int, attention_width: float) -> list[Unit]:
    """A group's rows, longest first, each into the unit where its branch adds the least work, or
    into a unit of its own (another copy of the prefix) when that costs less."""
    mine: list[Unit] = []
    for row in sorted(rows, key=lambda r: (-lengths[r], r)):
        branch = lengths[row] - prefix

        def added(unit: Unit, branch: int = branch) -> float:
            return row_cost(unit.width + branch, attention_width) - row_cost(unit.width, attention_width)

        best = min(mine, key=added, default=None)
        if best is not None and added(best) <= row_cost(prefix + branch, attention_width):
            best.rows.append(row)
            best.width += branch
        else:
            mine.append(Unit(prefix, [row], prefix + branch))
    return mine


def shared_rows(mb, groups: list[Unit], lay_out, attention_mask_dtype: torch.dtype | None = None) -> SharedRows:
    """Micro-batch `mb`'s `units` packed into rows by `lay_out(widths) -> (loads, where)` (the same
    row choice as `pack_rows`). `attention_mask_dtype` None gives a bool mask (sdpa), a float dtype
    an additive one (eager)."""
    loads, where = lay_out([u.width for u in groups])
    count, width, device = len(loads), max(loads), mb.input_ids.device
    size, lengths = mb.input_ids.shape, mb.lengths.tolist()
    # Per row: its packed row and unit; per token: its packed column and branch (0: the prefix).
    row_of, unit_of = [0] * size[0], [0] * size[0]
    cols, branches = [[0] * size[1] for _ in lengths], [[0] * size[1] for _ in lengths]
    for k, (unit, (row, offset)) in enumerate(zip(groups, where, strict=True)):
        at = offset + unit.prefix
        for b, member in enumerate(unit.rows, start=1):
            n = lengths[member] - unit.prefix
            row_of[member], unit_of[member] = row, k
            cols[member][: lengths[member]] = [*range(offset, offset + unit.prefix), *range(at, at + n)]
            branches[member][unit.prefix : lengths[member]] = [b] * n
            at += n
    place_row = torch.tensor(row_of)[:, None].expand(size)
    place_col, branch_of = torch.tensor(cols), torch.tensor(branches)
    # Every token of every row in one copy (a prefix token written once per row, the same value).
    src = (torch.arange(size[1])[None, :] < mb.lengths[:, None].cpu()).nonzero(as_tuple=True)
    dst = (place_row[src], place_col[src])
    input_ids = torch.zeros(count, width, dtype=torch.long)
    position_ids = (torch.arange(width)[None, :] - torch.tensor(loads)[:, None]).clamp(min=0)
    unit_id = (-1 - torch.arange(count))[:, None].repeat(1, width)  # a row's unused tail: its own unit
    branch = torch.zeros(count, width, dtype=torch.long)
    input_ids[dst] = mb.input_ids.cpu()[src]
    position_ids[dst] = mb.position_ids.cpu()[src]
    unit_id[dst] = torch.tensor(unit_of)[src[0]]
    branch[dst] = branch_of[src]
    mask = _mask(unit_id, branch)
    if attention_mask_dtype is not None:
        mask = torch.zeros(mask.shape, dtype=attention_mask_dtype).masked_fill(
            ~mask, torch.finfo(attention_mask_dtype).min)
    return SharedRows(input_ids.to(device), position_ids.to(device), mask.to(device), place_row.contiguous().to(device),
                      place_col.to(device), computed=sum(u.width for u in groups))


def _mask(unit_id: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
    """(P, 1, W, W) bool: query i attends key j when j <= i in the same unit, and j is in the prefix
    (branch 0) or in i's own branch."""
    width = unit_id.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    same_unit = unit_id[:, :, None] == unit_id[:, None, :]
    visible = (branch[:, None, :] == 0) | (branch[:, :, None] == branch[:, None, :])
    return (causal & same_unit & visible)[:, None]


def saving(mb, attention_width: float = math.inf) -> float:
    """The fraction of the rows' tokens sharing leaves uncomputed (0 when no group shares a prefix)."""
    total = int(mb.lengths.sum())
    return 1 - sum(u.width for u in units(mb, attention_width)) / max(total, 1)
