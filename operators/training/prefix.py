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

Groups often open with the same tokens too (a system prompt, a few-shot preamble): units whose
prefixes start alike for at least `MIN_SYSTEM` tokens form a *tree*, that common start once, then
each unit's rest of its prefix and its branches,

    [ common start | unit a's prefix rest | a's branches | unit b's prefix rest | b's branches | ... ]

where a token sees the common start, and within its own unit what it sees in a unit alone. (Rows
of different groups that share only such a start, a group of one row each, share it too.)

Units and trees are laid into packed rows as `pack_rows` lays sequences. Their widths are bounded
by the same cost model (`row_cost`: linear layers plus attention computed densely under the mask):
a branch joins a unit of its group while that costs less than opening another unit with its own
copy of the prefix, and a unit joins a tree while one row holding both costs less than two. The
micro-batch split and the ranks' shards (training/batch.py) keep a group's units together; trees
form within each micro-batch. The mask is explicit (4-D), so this needs an attention
implementation that takes one (sdpa, eager); flash attention and the vision-language families keep
`pack_rows`.
"""

from __future__ import annotations

import dataclasses
import math

import torch

# Attention implementations that take an explicit 4-D mask (bool for sdpa, additive for eager).
MASKED_ATTENTION = frozenset({"sdpa", "eager"})
# Units of different groups share their common start (a system prompt) when it is this long at least.
MIN_SYSTEM = 16


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
class Tree:
    """Units (of different groups) that open with the same tokens, a system prompt: that common
    start (`system` tokens) computed once, then each unit's rest (its prefix after the start, then
    its branches). A tree of one unit has no common start (`system` 0)."""

    system: int
    units: list[Unit]
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


def trees(mb, found: list[Unit], attention_width: float) -> list[Tree]:
    """`found` units grouped into trees (module docs), largest first: in the order of their prefixes'
    tokens, each unit joins the tree before it while their common start is at least `MIN_SYSTEM`
    tokens and one row holding both costs less than two."""

    def start(unit: Unit) -> list[tuple[int, int]]:  # one row's prefix, not the whole batch again
        row = unit.rows[0]
        return list(zip(mb.input_ids[row, : unit.prefix].tolist(), mb.position_ids[row, : unit.prefix].tolist(),
                        strict=True))

    out: list[Tree] = []
    first: list[tuple[int, int]] = []
    for unit, tokens in sorted(((u, start(u)) for u in found), key=lambda pair: pair[1]):
        tree = out[-1] if out else None
        if tree is not None:
            common = min(tree.system, _common_prefix([first, tokens]))
            width = common + sum(u.width - common for u in tree.units) + unit.width - common
            if common >= MIN_SYSTEM and row_cost(width, attention_width) <= \
                    row_cost(tree.width, attention_width) + row_cost(unit.width, attention_width):
                tree.system, tree.width = common, width
                tree.units.append(unit)
                continue
        out.append(Tree(unit.prefix, [unit], unit.width))
        first = tokens
    for tree in out:
        tree.system = tree.system if len(tree.units) > 1 else 0
    return sorted(out, key=lambda t: (-t.width, min(t.units[0].rows)))


def shared_rows(mb, groups: list[Tree], lay_out, attention_mask_dtype: torch.dtype | None = None) -> SharedRows:
    """Micro-batch `mb`'s `trees` (or units, each a tree of its own) packed into rows by
    `lay_out(widths) -> (loads, where)` (the same row choice as `pack_rows`).
    `attention_mask_dtype` None gives a bool mask (sdpa), a float dtype an additive one (eager)."""
    groups = [g if isinstance(g, Tree) else Tree(0, [g], g.width) for g in groups]
    loads, where = lay_out([t.width for t in groups])
    count, width, device = len(loads), max(loads), mb.input_ids.device
    size, lengths = mb.input_ids.shape, mb.lengths.tolist()
    # Per row: its packed row and tree; per token: its packed column, its part of the tree (0: the
    # common start, u: unit u) and its branch there (0: the unit's prefix).
    row_of, tree_of = [0] * size[0], [0] * size[0]
    cols, parts, branches = ([[0] * size[1] for _ in lengths] for _ in range(3))
    for k, (tree, (row, offset)) in enumerate(zip(groups, where, strict=True)):
        at = offset + tree.system
        for u, unit in enumerate(tree.units, start=1):
            rest = range(at, at + unit.prefix - tree.system)  # the unit's prefix after the common start
            at = rest.stop
            for b, member in enumerate(unit.rows, start=1):
                n = lengths[member] - unit.prefix
                row_of[member], tree_of[member] = row, k
                cols[member][: lengths[member]] = [*range(offset, offset + tree.system), *rest, *range(at, at + n)]
                parts[member][tree.system : lengths[member]] = [u] * (lengths[member] - tree.system)
                branches[member][unit.prefix : lengths[member]] = [b] * n
                at += n
    place_row = torch.tensor(row_of)[:, None].expand(size)
    place_col, part_of, branch_of = torch.tensor(cols), torch.tensor(parts), torch.tensor(branches)
    # Every token of every row in one copy (a prefix token written once per row, the same value).
    src = (torch.arange(size[1])[None, :] < mb.lengths[:, None].cpu()).nonzero(as_tuple=True)
    dst = (place_row[src], place_col[src])
    input_ids = torch.zeros(count, width, dtype=torch.long)
    position_ids = (torch.arange(width)[None, :] - torch.tensor(loads)[:, None]).clamp(min=0)
    tree_id = (-1 - torch.arange(count))[:, None].repeat(1, width)  # a row's unused tail: its own tree
    part, branch = torch.zeros(count, width, dtype=torch.long), torch.zeros(count, width, dtype=torch.long)
    input_ids[dst] = mb.input_ids.cpu()[src]
    position_ids[dst] = mb.position_ids.cpu()[src]
    tree_id[dst] = torch.tensor(tree_of)[src[0]]
    part[dst], branch[dst] = part_of[src], branch_of[src]
    mask = _mask(tree_id, part, branch)
    if attention_mask_dtype is not None:
        mask = torch.zeros(mask.shape, dtype=attention_mask_dtype).masked_fill(
            ~mask, torch.finfo(attention_mask_dtype).min)
    return SharedRows(input_ids.to(device), position_ids.to(device), mask.to(device), place_row.contiguous().to(device),
                      place_col.to(device), computed=sum(t.width for t in groups))


def _mask(tree_id: torch.Tensor, part: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
    """(P, 1, W, W) bool: query i attends key j when j <= i in the same tree, and j is in the
    common start (part 0), or in i's unit and there in the unit's prefix (branch 0) or i's branch."""
    width = tree_id.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    same_tree = tree_id[:, :, None] == tree_id[:, None, :]
    same_branch = (branch[:, None, :] == 0) | (branch[:, :, None] == branch[:, None, :])
    visible = (part[:, None, :] == 0) | ((part[:, :, None] == part[:, None, :]) & same_branch)
    return (causal & same_tree & visible)[:, None]


def saving(mb, attention_width: float = math.inf) -> float:
    """The fraction of the rows' tokens sharing leaves uncomputed (0 when no group shares a prefix)."""
    total = int(mb.lengths.sum())
    return 1 - sum(t.width for t in trees(mb, units(mb, attention_width), attention_width)) / max(total, 1)
