"""The synthetic task of the default run: its tokenizer, prompts, score and preference pairs.

Counting task: the alphabet is ``num_symbols`` symbols in a cycle (a, b, ..., p, a, ...). A prompt
is ``<bos>`` followed by a run of consecutive symbols (``<bos> f g h``); the response should go on
counting (``i j k l ...``). The ground-truth score is the fraction of the ``response_len`` response
slots whose token is the successor of the token before it (the first slot follows the prompt's
last symbol), so it lies in [0, 1], stopping early or any wrong symbol costs, and one mistake does
not ruin the rest. A random policy scores about 1/num_symbols; counting perfectly scores 1.
Each step depends only on the previous token, which is why tiny models learn it in a few dozen PPO
steps, while the prompt still decides what the right answer is.

The default run's assets made from the task (SFT'd actor, reward model, prompt files) are in
``ppo/demo.py``.
"""

from __future__ import annotations

import string
from dataclasses import dataclass

import torch

from rlhf_paro.config import Config
from rlhf_paro.rollout.batch import response_mask


class SymbolTokenizer:
    """Three special tokens then one token per symbol; text is symbols separated by spaces."""

    pad_token = "<pad>"
    bos_token = "<bos>"
    eos_token = "<eos>"
    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2
    num_special = 3

    def __init__(self, num_symbols: int) -> None:
        letters = string.ascii_lowercase + string.ascii_uppercase
        self.symbols = [letters[k] if k < len(letters) else f"s{k}" for k in range(num_symbols)]
        self.vocab = [self.pad_token, self.bos_token, self.eos_token, *self.symbols]
        self._ids = {token: index for index, token in enumerate(self.vocab)}

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> list[int]:
        try:
            return [self._ids[token] for token in text.split()]
        except KeyError as err:
            raise ValueError(f"token {err.args[0]!r} is not in the vocabulary") from None

    def decode(self, ids: list[int] | torch.Tensor) -> str:
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else ids
        return " ".join(self.vocab[i] for i in ids if i != self.pad_token_id)


@dataclass(frozen=True)
class CountingTask:
    num_symbols: int = 16
    prompt_len: int = 4  # <bos> included
    response_len: int = 8

    @property
    def tokenizer(self) -> SymbolTokenizer:
        return SymbolTokenizer(self.num_symbols)

    def _successor(self, tokens: torch.Tensor) -> torch.Tensor:
        """Id of the next symbol in the cycle (meaningless for special tokens; mask those)."""
        offset = SymbolTokenizer.num_special
        return (tokens - offset + 1) % self.num_symbols + offset

    def sample_prompts(self, num: int, generator: torch.Generator) -> torch.Tensor:
        """(num, prompt_len) ids: <bos> then a run of consecutive symbols from a random start."""
        start = torch.randint(0, self.num_symbols, (num, 1), generator=generator)
        run = (start + torch.arange(self.prompt_len - 1)) % self.num_symbols
        bos = torch.full((num, 1), SymbolTokenizer.bos_token_id)
        return torch.cat([bos, run + SymbolTokenizer.num_special], dim=1)

    def score(self, prompts: torch.Tensor, responses: torch.Tensor,
              mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B,) ground truth in [0, 1]: correct successors / response_len.

        prompts (B, P); responses (B, R) with R <= response_len, right padded; mask (B, R) marks
        generated tokens (default: through the first <eos>).
        """
        if mask is None:
            mask = response_mask(responses, SymbolTokenizer.eos_token_id)
        tokens = torch.cat([prompts[:, -1:], responses], dim=1)
        prev, cur = tokens[:, :-1], tokens[:, 1:]
        is_symbol = prev >= SymbolTokenizer.num_special
        correct = is_symbol & (cur == self._successor(prev)) & mask.bool()
        return correct.sum(-1).float() / self.response_len

    def sample_responses(self, prompts: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """(B, response_len) responses of mixed quality for preference data.

        Each response draws a skill p ~ U(0, 1); each token is the right successor with
        probability p, otherwise a random symbol, and with probability 0.05 the response ends
        (<eos>, then padding). This covers everything from a random policy to a perfect one.
        """
        num = prompts.shape[0]
        skill = torch.rand(num, 1, generator=generator)
        right = torch.rand(num, self.response_len, generator=generator) < skill
        noise = torch.randint(0, self.num_symbols, (num, self.response_len), generator=generator)
        stop = torch.rand(num, self.response_len, generator=generator) < 0.05
        out = torch.empty(num, self.response_len, dtype=torch.long)
        prev = prompts[:, -1]
        for t in range(self.response_len):
            token = torch.where(right[:, t], self._successor(prev),
                                noise[:, t] + SymbolTokenizer.num_special)
            out[:, t] = prev = torch.where(stop[:, t], SymbolTokenizer.eos_token_id, token)
        ended = response_mask(out, SymbolTokenizer.eos_token_id) == 0
        return out.masked_fill(ended, SymbolTokenizer.pad_token_id)

    def preference_pairs(self, num: int, seed: int) -> PreferencePairs:
        """``num`` pairs (prompt, chosen, rejected) with chosen scoring strictly higher."""
        generator = torch.Generator().manual_seed(seed)
        kept: list[tuple[torch.Tensor, ...]] = []
        count = 0
        while count < num:
            prompts = self.sample_prompts(num, generator)
            a = self.sample_responses(prompts, generator)
            b = self.sample_responses(prompts, generator)
            score_a, score_b = self.score(prompts, a), self.score(prompts, b)
            differ = score_a != score_b
            a_wins = (score_a > score_b)[:, None]
            chosen = torch.where(a_wins, a, b)[differ]
            rejected = torch.where(a_wins, b, a)[differ]
            kept.append((prompts[differ], chosen, rejected))
            count += int(differ.sum())
        prompts, chosen, rejected = (torch.cat(parts)[:num] for parts in zip(*kept))
        return PreferencePairs(prompts, chosen, rejected)


@dataclass
class PreferencePairs:
    prompts: torch.Tensor  # (B, P)
    chosen: torch.Tensor  # (B, R) right padded
    rejected: torch.Tensor  # (B, R) right padded


def counting_score(prompts: list[str], responses: list[str], num_symbols: list[int],
                   response_len: list[int], **_: list) -> list[float]:
    """``CountingTask.score`` on text, as a reward function (``reward.score_function``): the
    demo's prompt files carry ``num_symbols`` and ``response_len`` as columns. A response is
    decoded without special tokens, so it ends where the model's <eos> was."""
    out = []
    for prompt, response, n, length in zip(prompts, responses, num_symbols, response_len):
        symbols = SymbolTokenizer(n).symbols
        index = {s: k for k, s in enumerate(symbols)}
        words = prompt.split()[-1:] + response.split()
        correct = sum(1 for prev, cur in zip(words, words[1:])
                      if prev in index and cur == symbols[(index[prev] + 1) % n])
        out.append(correct / length)
    return out


def task_from_config(cfg: Config) -> CountingTask:
    return CountingTask(cfg.task.num_symbols, cfg.task.prompt_len, cfg.ppo.max_new_tokens)
