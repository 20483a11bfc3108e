"""The rollout's layout, and the packed layout every model's forward runs on.

Rollout layout (``ppo/task.join``): ``(B, T)`` rows of a left-padded prompt followed by a
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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

# Model types whose Hugging Face implementation reads packed position ids as separate sequences
# (tests/test_batching.py checks each against its padded forward on a random tiny model).
PACKED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3",
                      "olmo2", "smollm3")


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
    tail_positions = torch.zeros(len(bins) * width, dtype=torch.long)
    for k, seqs in enumerate(bins):
        used = k * width
        for seq in seqs:
            start[seq], used = used, used + lengths[seq]
        tail_positions[used:(k + 1) * width] = torch.arange((k + 1) * width - used)
    slots = torch.tensor(start, dtype=torch.long)[rows] + positions
    flat_ids = input_ids.new_zeros(len(bins) * width)
    flat_ids[slots] = input_ids[rows, cols]
    flat_positions = tail_positions
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
