"""The rollout's layout, and the packed layout every model's forward runs on.

Rollout layout (``ppo/task.join``): ``(B, T)`` rows of a left-padded prompt followed by a
right-padded response of width ``R``; ``attention_mask`` marks the real tokens, and the last ``R``
columns are the response (``action_mask``). Every consumer reads per-token results in this
layout.

Packed layout: the real tokens of all rows, row after row, as one row ``(1, L)`` with position
ids restarting at 0 for each row, and no attention mask. Hugging Face models that build their
masks with ``masking_utils.create_causal_mask`` read a restart of the position ids as the start of
a new sequence and attend only inside it (block-diagonal causal, for sdpa, eager and flash
attention alike) when the attention mask is None and there is no key/value cache. So a model
computes on ``L = attention_mask.sum()`` tokens instead of ``B * T``, with the same result per
sequence up to the rounding of differently shaped products (docs/design.md, "Batching").

Packing is boolean indexing with the attention mask: ``mask.nonzero()`` walks the real tokens
in row-major order, which is the packed order, so unpacking is the same index put back.
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

    input_ids: Tensor  # (1, L) the real tokens of every row, row after row
    position_ids: Tensor  # (1, L) 0, 1, ... within each row
    rows: Tensor  # (L,) the row of each packed token in the padded layout
    cols: Tensor  # (L,) its column there
    shape: tuple[int, int]  # (B, T) of the padded layout


def pack(input_ids: Tensor, attention_mask: Tensor) -> Packed:
    """``(B, T)`` padded rows -> one packed row of their real tokens."""
    rows, cols = attention_mask.bool().nonzero(as_tuple=True)
    positions = attention_mask.long().cumsum(-1) - 1
    return Packed(input_ids[rows, cols].unsqueeze(0), positions[rows, cols].unsqueeze(0),
                  rows, cols, tuple(attention_mask.shape))


def unpack(values: Tensor, packed: Packed) -> Tensor:
    """``(L,)`` per-token results -> ``(B, T)`` in the padded layout, 0 where there is padding."""
    out = values.new_zeros(packed.shape)
    out[packed.rows, packed.cols] = values
    return out


def response_predictors(packed: Packed, response_len: int) -> tuple[Tensor, Tensor, Tensor]:
    """Where the next-token predictions of the response tokens are: ``(index, row, col)`` with
    ``index`` the packed position whose logits predict the token after it, and (row, col) that
    token's place in the ``(B, response_len)`` response layout. Only real tokens followed by a
    real token of their own row, inside the response window, are listed; the others are padding
    in the response layout."""
    width = packed.shape[1]
    first = width - response_len - 1  # the column that predicts the first response token
    rows, cols = packed.rows, packed.cols
    # Real tokens of a row are contiguous, so the next packed token is this row's next column
    # exactly when it is in the same row.
    same_row = torch.zeros_like(rows, dtype=torch.bool)
    same_row[:-1] = rows[1:] == rows[:-1]
    keep = same_row & (cols >= first) & (cols < width - 1)
    index = keep.nonzero(as_tuple=True)[0]
    return index, rows[index], cols[index] - first


def last_tokens(packed: Packed) -> Tensor:
    """``(B,)`` packed position of each row's last real token; every row has one (a prompt is
    never empty)."""
    return torch.bincount(packed.rows, minlength=packed.shape[0]).cumsum(0) - 1
