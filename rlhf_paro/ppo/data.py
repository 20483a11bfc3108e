"""The synthetic task of the default run, its tokenizer, prompts and reward model.

Counting task: the alphabet is ``num_symbols`` symbols in a cycle (a, b, ..., p, a, ...). A prompt
is ``<bos>`` followed by a run of consecutive symbols (``<bos> f g h``); the response should go on
counting (``i j k l ...``). The ground-truth score is the fraction of the ``response_len`` response
slots whose token is the successor of the token before it (the first slot follows the prompt's
last symbol), so it lies in [0, 1], stopping early or any wrong symbol costs, and one mistake does
not ruin the rest. A random policy scores about 1/num_symbols; counting perfectly scores 1.
Each step depends only on the previous token, which is why tiny models learn it in a few dozen PPO
steps, while the prompt still decides what the right answer is.

The reward model is the reward section's model trained with the Bradley-Terry loss on preference
pairs labelled by the ground-truth score. It is made on first use and cached on disk under a key
of everything that determines it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import string
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from rlhf_paro.config import Config, ConfigError, ModelConfig

# Bumped when the task, the pairs or the training recipe change, so stale caches are not reused.
_RECIPE_VERSION = 1


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
        generated tokens (default: ``response_mask(responses)``).
        """
        if mask is None:
            mask = response_mask(responses)
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
        ended = response_mask(out) == 0
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


def response_mask(responses: torch.Tensor,
                  eos_token_id: int = SymbolTokenizer.eos_token_id) -> torch.Tensor:
    """(B, R) float 0/1: generated tokens up to and including the first <eos>."""
    is_eos = (responses == eos_token_id).long()
    after_eos = (is_eos.cumsum(-1) - is_eos) > 0
    return (~after_eos).float()


def join(prompts: torch.Tensor, responses: torch.Tensor,
         mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt + response as model input: (input_ids, attention_mask), both (B, P + R)."""
    if mask is None:
        mask = response_mask(responses)
    input_ids = torch.cat([prompts, responses], dim=1)
    attention_mask = torch.cat([torch.ones_like(prompts), mask.long()], dim=1)
    return input_ids, attention_mask


def task_from_config(cfg: Config) -> CountingTask:
    return CountingTask(cfg.task.num_symbols, cfg.task.prompt_len, cfg.ppo.max_new_tokens)


# --- reward model ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class TrainedRewardModel:
    path: Path  # a directory loadable with ``reward.path``
    accuracy: float  # on held-out pairs
    cached: bool  # True when it was loaded from the cache rather than trained now


def cache_root(cfg: Config) -> Path:
    return Path(cfg.task.cache_dir or Path.home() / ".cache" / "rlhf_paro").expanduser()


def reward_cache_key(cfg: Config) -> str:
    """Hash of everything that determines the trained reward model."""
    task = dataclasses.asdict(cfg.task)
    task.pop("cache_dir")
    spec = {"version": _RECIPE_VERSION, "task": task, "response_len": cfg.ppo.max_new_tokens,
            "model": cfg.reward.config, "seed": 0}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def _score_pairs(model: torch.nn.Module, pairs: PreferencePairs) -> tuple[torch.Tensor, ...]:
    """(chosen scores, rejected scores), both sides in one forward."""
    prompts = torch.cat([pairs.prompts, pairs.prompts])
    scores = model(*join(prompts, torch.cat([pairs.chosen, pairs.rejected])))
    return scores.chunk(2)


def pairwise_accuracy(model: torch.nn.Module, pairs: PreferencePairs, batch: int = 256) -> float:
    """Fraction of pairs in which the model scores the chosen response above the rejected one."""
    wins = 0
    with torch.no_grad():
        for start in range(0, pairs.prompts.shape[0], batch):
            part = PreferencePairs(*(x[start:start + batch] for x in dataclasses.astuple(pairs)))
            chosen, rejected = _score_pairs(model, part)
            wins += int((chosen > rejected).sum())
    return wins / pairs.prompts.shape[0]


# Training the task's reward model in-process is meant for small models; a big one needs a
# trained reward model given as reward.path.
MAX_TRAINED_REWARD_PARAMS = 50_000_000


def train_reward_model(cfg: Config) -> TrainedRewardModel:
    """The task's reward model: trained once (Bradley-Terry on ground-truth pairs), then cached.

    Single process on CPU. Trains into a temporary directory next to the cache entry and renames
    it into place, so a crash or a concurrent run never leaves a half-written model behind.
    """
    from rlhf_paro.models import build_value_model, count_parameters, save_value_model

    target = cache_root(cfg) / f"reward-{reward_cache_key(cfg)}"
    meta_file = target / "meta.json"
    if meta_file.is_file():
        return TrainedRewardModel(target, json.loads(meta_file.read_text())["accuracy"], True)

    task = task_from_config(cfg)
    vocab_size = task.tokenizer.vocab_size
    model_cfg = dataclasses.replace(cfg.reward, path=None)
    num_params, _ = count_parameters("reward", model_cfg, vocab_size)
    if num_params > MAX_TRAINED_REWARD_PARAMS:
        raise ConfigError("reward.path", f"the task's reward model is trained in-process only up "
                          f"to {MAX_TRAINED_REWARD_PARAMS:,} parameters (this one has "
                          f"{num_params:,}); allowed: a trained reward model directory")
    knobs = cfg.task
    train = task.preference_pairs(knobs.reward_pairs, seed=1)
    held_out = task.preference_pairs(knobs.reward_eval_pairs, seed=2)
    model = build_value_model(model_cfg, vocab_size, role="reward", per_token=False, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=knobs.reward_lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(3)
    threads = torch.get_num_threads()
    # One thread: on a small shared CPU, threads fighting over cores make tiny matmuls 10x slower.
    torch.set_num_threads(1)
    try:
        model.train()
        for _ in range(knobs.reward_steps):
            index = torch.randint(0, knobs.reward_pairs, (knobs.reward_batch_size,),
                                  generator=generator)
            chosen, rejected = _score_pairs(model, PreferencePairs(
                train.prompts[index], train.chosen[index], train.rejected[index]))
            loss = -F.logsigmoid(chosen - rejected).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        model.eval()
        accuracy = pairwise_accuracy(model, held_out)
    finally:
        torch.set_num_threads(threads)

    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        save_value_model(model, scratch)
        (scratch / "meta.json").write_text(json.dumps(
            {"accuracy": accuracy, "steps": knobs.reward_steps, "key": target.name}))
        os.replace(scratch, target)
    except OSError:
        # Another process put the same model in place first; theirs is as good as ours.
        shutil.rmtree(scratch, ignore_errors=True)
        if not meta_file.is_file():
            raise
    return TrainedRewardModel(target, accuracy, False)


def reward_model_config(cfg: Config) -> ModelConfig:
    """The reward section to build the reward model from: the user's ``reward.path`` as is, or
    the cached model trained on this task (trained now if missing)."""
    if cfg.reward.path is not None:
        return cfg.reward
    trained = train_reward_model(cfg)
    return dataclasses.replace(cfg.reward, path=str(trained.path), config=None)
