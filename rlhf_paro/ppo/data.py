"""Prompts from files: the actor's tokenizer, the prompt dataset, its seeded epochs, left padding.

``data.train_files`` are local .json, .jsonl or .parquet files read with the ``datasets`` library
(nothing is downloaded). Each row's ``data.prompt_key`` column holds a string, or a list of chat
messages ``[{"role": ..., "content": ...}]`` rendered with the tokenizer's chat template
(``data.apply_chat_template=true``; a string is then one user message). The row's other columns
travel with the prompt to a reward function (``ppo/rewards.py``).

Policy for long prompts: a prompt of more than ``data.max_prompt_length`` tokens is skipped and
the number skipped is printed once when the file is read; a file with no prompt left is an error.

Prompts of different lengths are left-padded for generation: the response then starts at the
same column in every row, and the models' position ids count valid tokens only
(``models._position_ids``), so a padded row computes what it computes alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlhf_paro.config import ROLES, Config, ConfigError, data_files


def tokenizer_dir(cfg: Config) -> str | None:
    """The actor's tokenizer directory: ``actor.tokenizer``, else ``actor.path`` (None: an inline
    actor, which speaks the task's tokenizer)."""
    return cfg.actor.tokenizer or cfg.actor.path


def load_tokenizer(directory: str, trust_remote_code: bool = False, key: str = "actor.tokenizer"
                   ) -> Any:
    """``AutoTokenizer`` from a local directory, with a pad token (the eos token when it has
    none) and left padding for generation."""
    import transformers

    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(
            str(Path(directory).expanduser()), local_files_only=True,
            trust_remote_code=trust_remote_code)
    except Exception as err:  # transformers raises many kinds for a directory without one
        detail = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ConfigError(key, f"no tokenizer loads from {directory!r} ({detail}); allowed: a "
                               "local directory saved by save_pretrained") from None
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise ConfigError(key, f"the tokenizer of {directory!r} has neither a pad nor an eos "
                                   "token; allowed: a tokenizer with an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def actor_tokenizer(cfg: Config) -> Any:
    key = "actor.tokenizer" if cfg.actor.tokenizer else "actor.path"
    return load_tokenizer(tokenizer_dir(cfg), cfg.actor.trust_remote_code, key)


# Files by which a model directory carries its own tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def reward_tokenizer(cfg: Config, actor: Any = None) -> Any | None:
    """The reward model's own tokenizer when it differs from the actor's (rollouts are then
    decoded and encoded again), else None: the reward reads the actor's token ids. ``actor``:
    the actor's tokenizer where the caller has it loaded already."""
    reward = cfg.reward
    if reward.path is None or not reward.runs_model or tokenizer_dir(cfg) is None:
        return None
    if not any((Path(reward.path).expanduser() / f).is_file() for f in TOKENIZER_FILES):
        return None  # a directory without a tokenizer is read with the actor's
    own = load_tokenizer(reward.path, reward.trust_remote_code, "reward.path")
    actor = actor if actor is not None else actor_tokenizer(cfg)
    return None if own.get_vocab() == actor.get_vocab() else own


def vocab_sizes(cfg: Config) -> dict[str, int]:
    """Token ids each model's embedding must hold: the actor tokenizer's (or the task's), except
    for a reward model that reads its own tokenizer's."""
    if tokenizer_dir(cfg) is None:
        from rlhf_paro.ppo.task import task_from_config

        actor, size = None, task_from_config(cfg).tokenizer.vocab_size
    else:
        actor = actor_tokenizer(cfg)
        size = len(actor)
    sizes = dict.fromkeys(ROLES, size)
    own = reward_tokenizer(cfg, actor)
    if own is not None:
        sizes["reward"] = len(own)
    return sizes


@dataclass
class PromptSet:
    """Tokenized prompts and the columns that travel with them."""

    ids: list[list[int]]  # token ids of each prompt, unpadded
    texts: list[str]  # each prompt as the model sees it (chat template applied)
    columns: dict[str, list[Any]] = field(default_factory=dict)  # the rows' other columns
    num_skipped: int = 0  # prompts longer than data.max_prompt_length

    def __len__(self) -> int:
        return len(self.ids)

    def rows(self, index: list[int]) -> PromptSet:
        return PromptSet([self.ids[i] for i in index], [self.texts[i] for i in index],
                         {k: [v[i] for i in index] for k, v in self.columns.items()})


def _read(files: list[str], key: str) -> Any:
    import datasets

    datasets.disable_progress_bars()
    parts = []
    for file in files:
        if Path(file).expanduser().stat().st_size == 0:
            raise ConfigError(key, f"{file!r} is empty; allowed: a file with at least one prompt")
        kind = "parquet" if file.endswith(".parquet") else "json"
        try:
            part = datasets.load_dataset(kind, data_files=str(Path(file).expanduser()),
                                         split="train")
        except Exception as err:  # the datasets library's parse errors come in many types
            cause = err.__cause__ or err
            detail = str(cause).splitlines()[0] if str(cause) else type(cause).__name__
            raise ConfigError(key, f"cannot read {file!r}: {detail}") from None
        if len(part) == 0:
            raise ConfigError(key, f"{file!r} holds no rows; allowed: at least one prompt")
        parts.append(part)
    return datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]


def load_prompts(cfg: Config, tokenizer: Any, split: str = "train") -> PromptSet:
    """The prompts of ``data.train_files`` (or ``val_files``), tokenized; ``ConfigError`` for a
    missing column, messages without a chat template, an empty file or nothing short enough."""
    data = cfg.data
    key = f"data.{split}_files"
    files = data_files(data.train_files if split == "train" else data.val_files)
    table = _read(files, key)
    if data.prompt_key not in table.column_names:
        raise ConfigError("data.prompt_key", f"no column {data.prompt_key!r} in {', '.join(files)}"
                                             f"; allowed: {', '.join(table.column_names)}")
    if data.apply_chat_template and not getattr(tokenizer, "chat_template", None):
        raise ConfigError("data.apply_chat_template", "the actor's tokenizer has no chat "
                                                      "template; allowed: false")
    others = [c for c in table.column_names if c != data.prompt_key]
    out = PromptSet([], [], {c: [] for c in others})
    for row in table:
        prompt = row[data.prompt_key]
        if data.apply_chat_template:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=False)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        elif isinstance(prompt, str):
            text = prompt
            ids = tokenizer(text)["input_ids"]
        else:
            raise ConfigError("data.prompt_key", f"{data.prompt_key!r} holds chat messages; "
                                                 "allowed: data.apply_chat_template=true")
        if len(ids) > data.max_prompt_length:
            out.num_skipped += 1
            continue
        if not ids:
            raise ConfigError(key, f"an empty prompt in {', '.join(files)}")
        out.ids.append(ids)
        out.texts.append(text)
        for c in others:
            out.columns[c].append(row[c])
    if out.num_skipped:
        print(f"[data] {key}: skipped {out.num_skipped} of {len(table)} prompts longer than "
              f"data.max_prompt_length={data.max_prompt_length} tokens", flush=True)
    if not out.ids:
        raise ConfigError("data.max_prompt_length", f"every prompt of {', '.join(files)} is "
                          f"longer than {data.max_prompt_length} tokens")
    return out


class PromptStream:
    """Batches of prompts in seeded epochs: epoch e is a permutation drawn from seed + e
    (``data.shuffle``) or the file order; a batch may run over into the next epoch."""

    def __init__(self, prompts: PromptSet, seed: int, shuffle: bool) -> None:
        self.prompts = prompts
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self._order: list[int] = []

    @property
    def left(self) -> int:
        """Prompts of the current epoch not yet taken."""
        return len(self._order)

    def seek(self, epoch: int, left: int) -> None:
        """Stand where a stream stood with ``epoch`` epochs begun and ``left`` prompts of the
        last one untaken (a resumed run's prompts go on where the saved run's stopped)."""
        self.epoch = max(epoch - 1, 0)
        self._order = []
        if epoch:
            self._draw()
            self._order = self._order[len(self._order) - left:] if left else []

    def _draw(self) -> None:
        n = len(self.prompts)
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        self._order = (torch.randperm(n, generator=generator).tolist() if self.shuffle
                       else list(range(n)))
        self.epoch += 1

    def next(self, num: int) -> PromptSet:
        index: list[int] = []
        while len(index) < num:
            if not self._order:
                self._draw()
            take = num - len(index)
            index += self._order[:take]
            self._order = self._order[take:]
        return self.prompts.rows(index)


def left_pad(ids: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), both (B, longest), padding on the left."""
    width = max(len(row) for row in ids)
    input_ids = torch.full((len(ids), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for i, row in enumerate(ids):
        if row:
            input_ids[i, width - len(row):] = torch.tensor(row)
            mask[i, width - len(row):] = 1
    return input_ids, mask
