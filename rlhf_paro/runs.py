"""What a PPO run reads and writes besides its metrics: prompts, evaluation, Hugging Face exports,
its output directory.

``Prompts`` hands the trainer each step's prompts, sliced per rank: from ``data.train_files``
(``ppo/data.py``) or, without them, made by the task. ``evaluate`` runs greedy responses to
``data.val_files`` through the reward; ``export`` writes the actor (and at the end the critic) in
Hugging Face format under ``<output_dir>/hf/``. ``check_output_dir`` and ``locked`` keep a run
from starting where it cannot write, or where another run writes.
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import os
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from rlhf_paro.actors import checkpoint
from rlhf_paro.config import Config, ConfigError
from rlhf_paro.ppo import data
from rlhf_paro.rollout import PromptBatch, RolloutBatch

# The trainer's wait: each model's refs in, their results out, a failed worker raised at once.
Wait = Callable[..., dict[str, list[Any]]]


class Prompts:
    """Each step's prompts as per-rank slices; ``rows`` are what the reward workers need."""

    def __init__(self, cfg: Config, task: Any) -> None:
        self.cfg = cfg
        self.task = task
        self.files = cfg.data.train_files is not None
        self.rng = torch.Generator().manual_seed(cfg.trainer.seed)
        self.tokenizer = data.actor_tokenizer(cfg) if self.files else None
        self.stream = None
        self.val = None
        if self.files:
            context = shortest_context(cfg, data.vocab_sizes(cfg))
            self.stream = data.PromptStream(data.load_prompts(cfg, self.tokenizer,
                                                              context=context),
                                            cfg.trainer.seed, cfg.data.shuffle)
            if cfg.data.val_files is not None:
                self.val = data.load_prompts(cfg, self.tokenizer, split="val", context=context)

    def state(self) -> dict[str, Any]:
        """Where the prompts stand, for a run checkpoint: the task's generator, or the epoch
        and how much of it is used."""
        if not self.files:
            return {"rng": checkpoint.generator_state(self.rng)}
        return {"epoch": self.stream.epoch, "left": self.stream.left}

    def load_state(self, state: dict[str, Any]) -> None:
        """Go on from ``state()``: the next prompts are those the saved run would have taken."""
        if not self.files:
            checkpoint.set_generator_state(self.rng, state["rng"])
        else:
            self.stream.seek(state["epoch"], state["left"])

    def next(self, num: int, n: int = 1, shards: int | None = None
             ) -> tuple[list[PromptBatch], list[Any] | None]:
        """(per-slice prompts, per-slice rows or None) for ``num`` prompts, each ``n`` times in a
        row (``rollout.n``: its group of samples), in ``shards`` slices (default: one per
        rank; a rollout replica's, with replicas of their own). A prompt's copies go to one
        slice, so a group baseline needs no exchange between ranks; each slice gets
        ``num / shards`` whole groups."""
        num_ranks = shards or self.cfg.cluster.num_devices
        if not self.files:
            prompts = self.task.sample_prompts(num, self.rng).repeat_interleave(n, dim=0)
            return [PromptBatch(p, torch.ones_like(p)) for p in prompts.chunk(num_ranks)], None
        return self.split(self.stream.next(num), n, shards)

    def split(self, prompts: data.PromptSet, n: int = 1, shards: int | None = None
              ) -> tuple[list[PromptBatch], list[Any]]:
        """Cut the batch in contiguous slices (default: one per rank), each prompt ``n`` times in
        a row, each slice left-padded to its own longest prompt: no rank generates or computes on
        columns that only another rank's prompts need."""
        num_ranks = shards or self.cfg.cluster.num_devices
        size = -(-len(prompts) // num_ranks)
        batches, rows = [], []
        for r in range(num_ranks):
            index = [i for i in range(r * size, min(len(prompts), (r + 1) * size))
                     for _ in range(n)]
            part = prompts.rows(index)
            ids, mask = data.left_pad(part.ids, self.tokenizer.pad_token_id)
            batches.append(PromptBatch(ids, mask))
            rows.append({"texts": part.texts, "columns": part.columns})
        return batches, rows


def shortest_context(cfg: Config, vocab_sizes: dict[str, int]) -> tuple[int, str] | None:
    """(tokens, what) of the shortest context of the run's models and its rollout engine
    (``resolve.context_limits``), which no prompt may fill; None without one."""
    from rlhf_paro.resolve import context_limits

    limits = context_limits(cfg, vocab_sizes)
    return limits[0] if limits else None


def deal_rows(rows: list[dict[str, Any]], order: list[torch.Tensor]) -> list[dict[str, Any]]:
    """The prompts' rows (``Prompts.split``'s, one dict per rank) dealt as the rollout's rows are:
    rank r gets the rows ``order[r]`` of all ranks' rows in rank order."""
    texts = [text for part in rows for text in part["texts"]]
    columns = {name: [value for part in rows for value in part["columns"][name]]
               for name in rows[0]["columns"]}
    return [{"texts": [texts[i] for i in index.tolist()],
             "columns": {name: [values[i] for i in index.tolist()]
                         for name, values in columns.items()}}
            for index in order]


def evaluate(models: dict[str, Any], prompts: Prompts, step: int, wait: Wait,
             replicas: Any = None) -> dict[str, float]:
    """Greedy responses to every validation prompt, scored: ``eval/reward_mean`` and
    ``eval/score_mean``. The validation set goes in rollout-batch pieces, all ranks busy; the
    rollout ``replicas`` generate when they are the run's (their weights sent already)."""
    reward = models["reward"]
    generator = replicas or models["actor"]
    total = {"count": 0.0, "reward": 0.0, "task_score": 0.0}
    batch = prompts.cfg.ppo.rollout_batch_size
    num_ranks = prompts.cfg.cluster.num_devices
    shards = generator.num_ranks
    every = math.lcm(num_ranks, shards)
    for start in range(0, len(prompts.val), batch):
        index = list(range(start, min(len(prompts.val), start + batch)))
        while len(index) % every:  # every rank needs rows: repeat the last prompt
            index.append(index[-1])
        per_slice, rows = prompts.split(prompts.val.rows(index), shards=shards)
        episode_rows = (rows,) if prompts.cfg.env.enabled else ()
        rollouts, _ = zip(*generator.call("generate", per_slice, *episode_rows, num_returns=2,
                                          greedy=True, step=step))
        rollouts = list(rollouts)
        if shards != num_ranks:  # the replicas' slices cut again into the reward's ranks
            whole = RolloutBatch.concat(wait(rollout=rollouts)["rollout"],
                                        prompts.tokenizer.pad_token_id)
            order = list(torch.arange(len(whole)).chunk(num_ranks))
            rollouts = [whole.select(i) for i in order]
            rows = deal_rows(rows, order)
        scores = wait(reward=reward.call("score", rollouts, rows, step=step))["reward"]
        sums = wait(reward=reward.call("score_sums"))["reward"]
        total["count"] += sum(len(s) for s in scores)
        total["reward"] += float(sum(s.sum() for s in scores))
        total["task_score"] += sum(s["task_score"] for s in sums)
    return {"eval/reward_mean": total["reward"] / total["count"],
            "eval/score_mean": total["task_score"] / total["count"]}


def export(models: dict[str, Any], output_dir: str, wait: Wait, step: int | None = None
           ) -> Path:
    """The actor (and, at the end, the critic of a run that has one) in Hugging Face format:
    ``hf/actor`` and ``hf/critic``, or ``hf/step_<k>/actor`` during the run."""
    root = Path(output_dir) / "hf" / (f"step_{step}" if step is not None else "")
    roles = ("actor",) if step is not None else tuple(r for r in ("actor", "critic")
                                                      if r in models)
    wait(**{role: models[role].call("export", directory=str(root / role)) for role in roles})
    return root


# In the output directory: held locked by the run that uses it, and holding that run's pid.
LOCK_FILE = "run.lock"


# What a run writes first into its output directory (``locked``, then the metrics logger): a
# directory that holds one of them is a run's, which a run may go on in or replace.
RUN_MARKS = (LOCK_FILE, "run.json", "metrics.jsonl", checkpoint.CHECKPOINTS)


def check_output_dir(output_dir: str) -> None:
    """Raise ``ConfigError`` (``trainer.output_dir``, one line) unless a run can make and write
    ``output_dir``: not a file, not under one, within a directory this user can write, and new,
    empty or a run's own (``RUN_MARKS``): a run replaces the files at its paths (``run.json``,
    ``hf/actor/``, ``checkpoints/step_<k>/``...), so a directory of the user's own files is
    refused rather than written into. Nothing is created."""
    path = Path(output_dir).expanduser().absolute()
    found = next(p for p in [path, *path.parents] if p.exists())
    if not found.is_dir():
        where = "is" if found == path else f"is under {found}, which is"
        raise ConfigError("trainer.output_dir", f"{output_dir} {where} a file, not a directory; "
                                                "allowed: a directory, or a path to make one at")
    if not os.access(found, os.W_OK | os.X_OK):
        raise ConfigError("trainer.output_dir", f"{found} is not writable by this user; allowed: "
                                                "a directory you can write, or a path under one")
    if found == path:
        names = sorted(os.listdir(path))
        if names and not any(name in names for name in RUN_MARKS):
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            raise ConfigError("trainer.output_dir", f"{output_dir} holds files no run wrote "
                                                    f"({shown}), which a run would write among "
                                                    "or over; allowed: a new or empty "
                                                    "directory, or one a run wrote (with "
                                                    "run.json or metrics.jsonl)")


@contextlib.contextmanager
def locked(output_dir: str) -> Iterator[None]:
    """Hold ``output_dir``'s lock (making the directory) while the run uses it; its
    ``LOCK_FILE`` holds this process's id. A second run on the same directory gets a
    ``ConfigError`` naming the holder's pid and touches nothing: two runs there would resume
    from and prune each other's checkpoints and interleave their metrics. The lock is the
    kernel's (flock): a holder that is killed releases it."""
    path = Path(output_dir)
    path.mkdir(parents=True, exist_ok=True)
    fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            raise ConfigError("trainer.output_dir", f"{output_dir} is in use by the run of "
                                                    f"process {holder} (it holds {LOCK_FILE} "
                                                    "there); allowed: another trainer.output_dir"
                                                    ", or the same once that run ends") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        os.close(fd)  # releases the lock


def check_inputs(cfg: Config) -> dict[str, int]:
    """Every user file a run reads, read once before anything runs: the tokenizers, the prompt
    files, the reward function. Returns the vocabulary each model must hold."""
    from rlhf_paro.ppo import rewards

    vocab_sizes = data.vocab_sizes(cfg)
    if cfg.data.train_files is not None:
        if data.tokenizer_dir(cfg) is None:
            raise ConfigError("data.train_files", "prompt files are read with the actor's "
                                                  "tokenizer, and an inline actor has none; "
                                                  "allowed: with actor.path or actor.tokenizer")
        tokenizer = data.actor_tokenizer(cfg)
        context = shortest_context(cfg, vocab_sizes)
        data.load_prompts(cfg, tokenizer, context=context)
        if cfg.data.val_files is not None:
            data.load_prompts(cfg, tokenizer, split="val", context=context)
    elif cfg.reward.url is not None:
        raise ConfigError("reward.url", "a reward server reads the prompts' text; allowed: with "
                                        "data.train_files")
    elif cfg.reward.function is not None or cfg.reward.score_function is not None:
        raise ConfigError("reward.function", "a reward function reads the prompts' text; "
                                             "allowed: with data.train_files")
    for key in ("function", "score_function"):
        spec = getattr(cfg.reward, key)
        if spec is not None:
            rewards.load_function(spec, f"reward.{key}")
    if cfg.trainer.eval_every and cfg.data.val_files is None:
        raise ConfigError("trainer.eval_every", "evaluates on data.val_files, which is not set")
    return vocab_sizes
