"""The task's reward model: trained once on the task's preference pairs, then cached.

The reward section's model, trained with the Bradley-Terry loss on preference pairs of the counting
task (``ppo/task.py``) labelled by the ground-truth score. It is made on first use and cached on
disk under a key of everything that determines it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from rlhf_paro.config import Config, ConfigError, ModelConfig
from rlhf_paro.models import build_value_model, count_parameters, save_value_model
from rlhf_paro.ppo.task import PreferencePairs, join, task_from_config

# Bumped when the task, the pairs or the training recipe change, so stale caches are not reused.
_RECIPE_VERSION = 1


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
    if cfg.reward.path is not None or cfg.reward.function is not None:
        return cfg.reward
    trained = train_reward_model(cfg)
    return dataclasses.replace(cfg.reward, path=str(trained.path), config=None)
