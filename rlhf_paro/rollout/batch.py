"""What a rollout engine takes and gives: the prompts of a rank and the rollout made from them.

Layout (docs/design.md, "Batching"): ``(B, T)`` rows of a left-padded prompt followed by a
right-padded response of width ``R``; ``attention_mask`` marks the real tokens (contiguous in
every row) and the last ``R`` columns are the response. ``action_mask`` marks the policy's own
tokens there: the response through its first <eos>, or, in a multi-turn episode, each turn's
action, with holes where the environment's observations lie (attended, never trained:
docs/design.md, "Multi-turn episodes"). ``logprobs``, when the engine gives them, is the
log-prob it sampled each action token with (0 elsewhere), and ``scores`` an environment's score
of each episode. Plain dataclasses of CPU tensors: Ray pickles them to the other models of the
rank.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable, Sequence

import torch
from torch import Tensor


@dataclass(frozen=True)
class PromptBatch:
    """A rank's prompts, left-padded to one width."""

    input_ids: Tensor  # (B, P)
    attention_mask: Tensor  # (B, P) 1 on real tokens

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, rows: Tensor | slice) -> PromptBatch:
        return PromptBatch(self.input_ids[rows], self.attention_mask[rows])

    @classmethod
    def left_padded(cls, ids: Sequence[Sequence[int]], pad_token_id: int) -> PromptBatch:
        """Token ids of different lengths, left-padded to the longest."""
        width = max(len(row) for row in ids)
        input_ids = torch.full((len(ids), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(ids), width), dtype=torch.long)
        for i, row in enumerate(ids):
            if len(row):
                input_ids[i, width - len(row):] = torch.as_tensor(row, dtype=torch.long)
                mask[i, width - len(row):] = 1
        return cls(input_ids, mask)


@dataclass(frozen=True)
class RolloutBatch:
    """Rows of prompt + response (the module's layout)."""

    sequences: Tensor  # (B, T) int64: prompt then response tokens
    attention_mask: Tensor  # (B, T) int64 0/1: real tokens, contiguous in every row
    # (B, R) float 0/1: the policy's tokens of the response (actions), R <= T; 0 on padding and
    # on an episode's observations.
    action_mask: Tensor
    # (B, R) float32: the engine's log-prob of each action token under the distribution it
    # sampled from (softmax(logits / temperature), before top-k), 0 elsewhere; None: the engine
    # gives none (a greedy evaluation).
    logprobs: Tensor | None = None
    # (B,) float32: each episode's score from its environment (the sum of its step rewards);
    # None: no environment scored the rollout.
    scores: Tensor | None = None

    def __len__(self) -> int:
        return self.sequences.shape[0]

    @property
    def response_len(self) -> int:
        return self.action_mask.shape[1]

    @property
    def prompts(self) -> Tensor:
        """(B, T - R) the left-padded prompts."""
        return self.sequences[:, :self.sequences.shape[1] - self.response_len]

    @property
    def responses(self) -> Tensor:
        """(B, R) the right-padded responses."""
        return self.sequences[:, self.sequences.shape[1] - self.response_len:]

    def num_tokens(self) -> Tensor:
        """(B,) real tokens of each row, prompt and response."""
        return self.attention_mask.sum(-1)

    @property
    def response_attention(self) -> Tensor:
        """(B, R) 0/1 the real tokens of the responses: actions and observations."""
        return self.attention_mask[:, self.sequences.shape[1] - self.response_len:]

    def select(self, rows: Tensor | slice) -> RolloutBatch:
        """The sub-batch of ``rows`` (indices or a slice), same widths."""
        return self._map(lambda t: t[rows])

    def trimmed(self) -> RolloutBatch:
        """The same rows without the columns that are padding in every one: prompts as wide as
        the longest, responses as wide as the longest."""
        prompt_len = self.sequences.shape[1] - self.response_len
        prompt = int(self.attention_mask[:, :prompt_len].sum(-1).max())
        response = int(self.response_attention.sum(-1).max())
        keep = slice(prompt_len - prompt, prompt_len + response)
        return RolloutBatch(self.sequences[:, keep], self.attention_mask[:, keep],
                            self.action_mask[:, :response],
                            None if self.logprobs is None else self.logprobs[:, :response],
                            self.scores)

    def to(self, device: torch.device | str) -> RolloutBatch:
        return self._map(lambda t: t.to(device))

    def _map(self, fn: Callable[[Tensor], Tensor]) -> RolloutBatch:
        """``fn`` applied to every tensor (row-wise or whole: the widths stay aligned)."""
        return RolloutBatch(*(None if (t := getattr(self, f.name)) is None else fn(t)
                              for f in fields(self)))

    @classmethod
    def concat(cls, batches: Sequence[RolloutBatch], pad_token_id: int) -> RolloutBatch:
        """The rows of ``batches`` in order, in one layout: prompts left-padded to the widest
        prompt, responses right-padded to the longest response (``pad_token_id``, masked).
        ``logprobs`` and ``scores`` only if every batch has them (one engine made them all)."""
        prompt_len = max(b.sequences.shape[1] - b.response_len for b in batches)
        response_len = max(b.response_len for b in batches)
        with_logprobs = all(b.logprobs is not None for b in batches)
        with_scores = all(b.scores is not None for b in batches)
        parts = []
        for b in batches:
            left = prompt_len - (b.sequences.shape[1] - b.response_len)
            right = response_len - b.response_len
            parts.append(cls(
                torch.nn.functional.pad(b.sequences, (left, right), value=pad_token_id),
                torch.nn.functional.pad(b.attention_mask, (left, right)),
                torch.nn.functional.pad(b.action_mask, (0, right)),
                torch.nn.functional.pad(b.logprobs, (0, right)) if with_logprobs else None,
                b.scores if with_scores else None))
        return cls(*(None if getattr(parts[0], f.name) is None else
                     torch.cat([getattr(p, f.name) for p in parts]) for f in fields(cls)))


def response_mask(responses: Tensor, eos_token_id: int) -> Tensor:
    """(B, R) float 0/1: generated tokens up to and including the first <eos>."""
    is_eos = (responses == eos_token_id).long()
    after_eos = (is_eos.cumsum(-1) - is_eos) > 0
    return (~after_eos).float()


def join(prompts: PromptBatch, responses: Tensor, eos_token_id: int,
         logprobs: Tensor | None = None) -> RolloutBatch:
    """The rollout of left-padded ``prompts`` and their right-padded ``responses`` (B, R): each
    response's real tokens run through its first <eos>. ``logprobs`` (B, R): the engine's, of
    every response column; those past a response's end become 0."""
    action_mask = response_mask(responses, eos_token_id)
    return RolloutBatch(torch.cat([prompts.input_ids, responses], dim=1),
                        torch.cat([prompts.attention_mask.long(), action_mask.long()], dim=1),
                        action_mask,
                        None if logprobs is None else
                        logprobs.float().masked_fill(action_mask == 0, 0.0))
