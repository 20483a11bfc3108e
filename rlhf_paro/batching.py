"""The rollout's layout, and the packed layout every model's forward runs on.

Rollout layout (``rollout.RolloutBatch``): ``(B, T)`` rows of a left-padded prompt followed by a
right-padded response of width ``R``; ``attention_mask`` marks the real tokens, and the last ``R``
columns are the response (``action_mask``). Every consumer reads per-token results in this
layout.

Packed layout: the real tokens of the rows, whole sequences placed one after another into
``K`` rows of width ``W`` (the longest sequence, by default) by first-fit decreasing, with
position ids restarting at 0 for each sequence and no attention mask; the tail of a row that
no sequence fills is a dummy sequence whose results are never read. Hugging Face models that
build their masks with ``masking_utils.create_causal_mask`` read a restart of the position ids as
the start of a new sequence and attend only inside it (block-diagonal causal, for sdpa, eager
and flash attention alike) when the attention mask is None and there is no key/value cache. So
a model computes on ``K * W``, about ``attention_mask.sum()`` positions, instead of ``B * T``,
with the same result per sequence up to the rounding of differently shaped products. Rows of
width ``W`` rather than one row of every token keep attention's cost at ``K * W^2``: a dense
block mask over one row of ``L`` tokens costs ``L^2``, several times the padded batch's on a
CPU (docs/design.md, "Batching").

Real tokens are numbered in row-major order of the padded layout (``mask.nonzero()``); each has
its place in the padded layout (``rows``, ``cols``) and its slot in the packed rows
(``slots``, flat over ``K * W``), so unpacking is one index.

Also here, as pure functions: a trained model's micro-batches (by sequences or by a token
budget, with the fillers that keep the ranks' counts equal), and the assignment of a step's
sequence groups to ranks and mini-batches by real tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

# Model types whose Hugging Face implementation reads packed position ids as separate sequences
# (tests/test_batching.py checks each against its padded forward on a random tiny model).
PACKED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text",
                      "phi3", "olmo2", "smollm3")


@dataclass(frozen=True)
class Packed:
    """A micro-batch in the packed layout, with what it takes to put results back."""

    input_ids: Tensor  # (K, W) whole sequences one after another, 0 in the unused tails
    position_ids: Tensor  # (K, W) 0, 1, ... within each sequence (and each tail)
    rows: Tensor  # (L,) each real token's row in the padded layout, row-major order
    cols: Tensor  # (L,) its column there
    slots: Tensor  # (L,) its place in the packed rows, flat over K * W
    shape: tuple[int, int]  # (B, T) of the padded layout


def first_fit_decreasing(lengths: list[int], width: int) -> list[list[int]]:
    """Rows of at most ``width`` tokens holding every sequence whole: longest first, each into
    the first row with room (deterministic: ties keep the sequences' order)."""
    bins: list[list[int]] = []
    room: list[int] = []
    for seq in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        k = next((k for k, free in enumerate(room) if free >= lengths[seq]), len(bins))
        if k == len(bins):
            bins.append([])
            room.append(width)
        bins[k].append(seq)
        room[k] -= lengths[seq]
    return bins


def pack(input_ids: Tensor, attention_mask: Tensor, width: int | None = None) -> Packed:
    """``(B, T)`` padded rows -> their real tokens in rows of ``width`` (default: the longest
    sequence's length)."""
    mask = attention_mask.bool()
    rows, cols = mask.nonzero(as_tuple=True)
    positions = (attention_mask.long().cumsum(-1) - 1)[rows, cols]
    lengths = mask.sum(-1).tolist()
    width = width or max(lengths)
    bins = first_fit_decreasing(lengths, width)
    start = [0] * len(lengths)  # flat slot of each sequence's first token
    # Every slot's position: the tails count from 0 here, the real tokens are set below.
    flat_positions = torch.zeros(len(bins) * width, dtype=torch.long, device=mask.device)
    for k, seqs in enumerate(bins):
        used = k * width
        for seq in seqs:
            start[seq], used = used, used + lengths[seq]
        flat_positions[used:(k + 1) * width] = torch.arange((k + 1) * width - used,
                                                            device=mask.device)
    slots = torch.tensor(start, dtype=torch.long, device=mask.device)[rows] + positions
    flat_ids = input_ids.new_zeros(len(bins) * width)
    flat_ids[slots] = input_ids[rows, cols]
    flat_positions[slots] = positions
    return Packed(flat_ids.view(len(bins), width), flat_positions.view(len(bins), width), rows,
                  cols, slots, tuple(attention_mask.shape))


def unpack(values: Tensor, packed: Packed) -> Tensor:
    """``(K, W)`` per-position results -> ``(B, T)`` in the padded layout, 0 at padding."""
    out = values.new_zeros(packed.shape)
    out[packed.rows, packed.cols] = values.reshape(-1)[packed.slots]
    return out


def response_predictors(packed: Packed, response_len: int) -> tuple[Tensor, Tensor, Tensor]:
    """Where the next-token predictions of the response tokens are: ``(index, row, col)`` with
    ``index`` the number of the real token whose logits predict the next one (number
    ``index + 1``; ``slots`` gives either's packed place), and (row, col) the predicted
    token's place in the ``(B, response_len)`` response layout. Only real tokens followed by a
    real token of their own row, inside the response window, are listed; the others are padding
    in the response layout."""
    width = packed.shape[1]
    first = width - response_len - 1  # the column that predicts the first response token
    rows, cols = packed.rows, packed.cols
    # Real tokens of a row are contiguous, so the next real token is this row's next column
    # exactly when it is in the same row.
    same_row = torch.zeros_like(rows, dtype=torch.bool)
    same_row[:-1] = rows[1:] == rows[:-1]
    keep = same_row & (cols >= first) & (cols < width - 1)
    index = keep.nonzero(as_tuple=True)[0]
    return index, rows[index], cols[index] - first


def last_tokens(packed: Packed) -> Tensor:
    """``(B,)`` the number of each row's last real token; every row has one (a prompt is never
    empty)."""
    return torch.bincount(packed.rows, minlength=packed.shape[0]).cumsum(0) - 1


# -- micro-batches by tokens -----------------------------------------------------------------------
# [Note: micro-batches by tokens]
# A trained model's mini-batch on a rank is split into micro-batches of up to
# ``<model>.max_tokens_per_micro_batch`` real tokens (``split_by_tokens``). Ranks then hold
# different numbers of micro-batches, but the engine's collectives run per micro-batch and its loss
# scale 1/grad_accum_steps and boundary (in the last backward) need the count in advance: the worker
# agrees on the largest count over the model's ranks, sets it on the engine (``set_micro_batches``),
# and a rank with fewer runs filler micro-batches (``fill_to``): the forward and backward of the
# mini-batch's shortest sequence with its loss times 0, which joins every collective and adds
# nothing to the gradient. The divisor of each micro-batch's loss is the global count / (ranks x
# agreed count), so the engine's mean over ranks and micro-batches stays the aggregate over the
# global mini-batch (docs/design.md, "Batching").


@dataclass(frozen=True)
class MicroBatch:
    """Rows of a rank's rollout that one forward and backward run on."""

    rows: Tensor  # (b,) indices into the rollout
    weight: float  # 1.0; 0.0 for a filler that only joins the collectives


def split_by_tokens(rows: Tensor, num_tokens: Tensor, max_tokens: int) -> list[Tensor]:
    """``rows`` in their order, cut into consecutive micro-batches of at most ``max_tokens``
    real tokens each (``num_tokens[r]``: row r's count, its attention mask's sum). Raises
    ``ValueError`` naming the longest sequence when one row alone exceeds the budget."""
    lengths = num_tokens[rows].tolist()
    longest = max(lengths, default=0)
    if longest > max_tokens:
        raise ValueError(f"max_tokens_per_micro_batch={max_tokens} is smaller than the longest "
                         f"sequence of the mini-batch, {longest} tokens; allowed: at least "
                         f"{longest}")
    cuts, used = [0], 0
    for i, n in enumerate(lengths):
        if used + n > max_tokens:
            cuts.append(i)
            used = 0
        used += n
    cuts.append(len(lengths))
    return [rows[a:b] for a, b in zip(cuts, cuts[1:]) if b > a]


def split_by_rows(rows: Tensor, size: int) -> list[Tensor]:
    """``rows`` in their order, cut into micro-batches of ``size`` rows (the last may be short)."""
    return [rows[i:i + size] for i in range(0, len(rows), size)]


def micro_divisor(global_count: float, num_ranks: int, num_micro: int) -> float:
    """What a micro-batch's loss sum is divided by so that the engine's mean over ranks and its
    1/``num_micro`` scale give the aggregate over the global mini-batch (``global_count``: its
    ``core.agg_count`` over all ranks; ``num_micro``: the count agreed over ranks)."""
    return global_count / (num_ranks * num_micro)


def fill_to(micros: list[Tensor], count: int, num_tokens: Tensor) -> list[MicroBatch]:
    """``micros`` as weighted micro-batches, followed by fillers up to ``count`` (the largest
    count over ranks): each filler is the shortest row of ``micros`` with weight 0."""
    if len(micros) > count:
        raise ValueError(f"{len(micros)} micro-batches exceed the agreed count {count}")
    rows = torch.cat(micros)
    shortest = rows[num_tokens[rows].argmin()].reshape(1)
    return ([MicroBatch(m, 1.0) for m in micros]
            + [MicroBatch(shortest, 0.0)] * (count - len(micros)))


# -- balanced ranks ------------------------------------------------------------------------------
# [Note: balanced ranks]
# The rank with the most real tokens sets the pace of every collective, so a step's sequences are
# better dealt to ranks by their real tokens than in rollout order. The unit is a group of
# ``rollout.n`` samples of one prompt (a group baseline needs its samples on one rank); each part
# gets as many groups (so every rank trains on as many sequences), and the assignment is a pure
# function of the lengths (ties go to the lower index), so the assignment is deterministic. The
# driver computes it once per step from every rank's rollout (``rank_order``), deals the rows, and
# each trained model then takes its mini-batches as consecutive slices of its rows, in a shuffled
# order (``TrainedWorker._mini_batches``).


def balanced_parts(weights: Tensor, num_parts: int) -> list[Tensor]:
    """Indices of ``weights`` in ``num_parts`` parts of equal size with sums as even as the
    sorted greedy gets them: heaviest first, each to the lightest part that still has room
    (ties: the lower part). Each part's indices ascending."""
    num = len(weights)
    if num_parts < 1 or num % num_parts:
        raise ValueError(f"{num} items do not split into {num_parts} parts of equal size")
    size = num // num_parts
    # Stable sort: equal weights keep their index order, so the result is deterministic.
    order = sorted(range(num), key=lambda i: -float(weights[i]))
    sums, parts = [0.0] * num_parts, [[] for _ in range(num_parts)]
    for i in order:
        part = min((p for p in range(num_parts) if len(parts[p]) < size), key=lambda p: sums[p])
        parts[part].append(i)
        sums[part] += float(weights[i])
    return [torch.tensor(sorted(p), dtype=torch.long) for p in parts]


def balance_groups(num_tokens: Tensor, group_size: int, num_ranks: int, num_minis: int
                   ) -> list[list[Tensor]]:
    """Rows of a step's rollout (``num_tokens[r]``: row r's real tokens; rows ``g * group_size``
    to ``(g + 1) * group_size - 1`` one group) dealt to ``num_ranks`` ranks and, on each, to
    ``num_minis`` mini-batches, by real tokens (``balanced_parts``, groups kept whole): the rows
    of rank r's mini-batch m are ``result[r][m]``."""
    if len(num_tokens) % group_size:
        raise ValueError(f"{len(num_tokens)} rows are not whole groups of {group_size}")
    per_group = num_tokens.reshape(-1, group_size).sum(-1)
    rows = torch.arange(len(num_tokens)).reshape(-1, group_size)
    out = []
    for groups in balanced_parts(per_group, num_ranks):
        minis = balanced_parts(per_group[groups], num_minis)
        out.append([rows[groups[m]].flatten() for m in minis])
    return out


def rank_order(num_tokens: Tensor, group_size: int, num_ranks: int, mini_size: int
               ) -> list[Tensor]:
    """The rows of a step's rollout (every rank's rows in rank order; ``num_tokens[r]``: row r's
    real tokens) that each rank trains on, in order: its ``balance_groups`` mini-batches of
    ``mini_size`` rows one after another. When a rank's groups do not split evenly into its
    mini-batches (a group larger than a mini-batch), only the ranks are balanced, and consecutive
    slices of a rank's rows are its mini-batches."""
    num_minis = len(num_tokens) // (num_ranks * mini_size)
    if num_minis < 1 or (len(num_tokens) // group_size // num_ranks) % num_minis:
        num_minis = 1
    return [torch.cat(minis) for minis in balance_groups(num_tokens, group_size, num_ranks,
                                                         num_minis)]
