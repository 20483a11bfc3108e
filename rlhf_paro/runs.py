"""What a PPO run reads and writes besides its metrics: prompts, evaluation, Hugging Face exports,
its output directory.

``Prompts`` hands the trainer each step's prompts, sliced per rank: from ``data.train_files``
(``ppo/data.py``) or, without them, made by the task. ``evaluate`` runs greedy responses to
``data.val_files`` through the reward; ``export`` writes the actor (and at the end the critic) in
Hugging Face format under ``<output_dir>/hf/``. ``check_output_dir`` and ``locked`` keep a run
from starting where it cannot write, or where another run writes; ``check_definition`` keeps
``trainer.resume=auto`` from going on with another run than the one asked for
(docs/design.md, "A run's definition").
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch
import yaml

from rlhf_paro.actors import checkpoint
from rlhf_paro.config import ROLES, Config, ConfigError, NothingToRun
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
             source: Any) -> dict[str, float]:
    """Greedy responses to every validation prompt, scored: ``eval/reward_mean`` and
    ``eval/score_mean``. The validation set goes in rollout-batch pieces, all ranks busy; the
    run's rollout ``source`` generates them (``sources.py``; holding the newest weights)."""
    reward = models["reward"]
    reward_runs_model = prompts.cfg.reward.runs_model
    total = {"count": 0.0, "reward": 0.0, "task_score": 0.0}
    batch = prompts.cfg.ppo.rollout_batch_size
    num_ranks = prompts.cfg.cluster.num_devices
    shards = source.num_shards
    every = math.lcm(num_ranks, shards)
    for start in range(0, len(prompts.val), batch):
        index = list(range(start, min(len(prompts.val), start + batch)))
        while len(index) % every:  # every rank needs rows: repeat the last prompt
            index.append(index[-1])
        per_slice, rows = prompts.split(prompts.val.rows(index), shards=shards)
        rollouts, _ = source.generate(per_slice, rows, step, greedy=True)
        if shards != num_ranks:  # the generators' slices cut again into the reward's ranks
            whole = RolloutBatch.concat(wait(**{source.role: rollouts})[source.role],
                                        prompts.tokenizer.pad_token_id)
            order = list(torch.arange(len(whole)).chunk(num_ranks))
            rollouts = [whole.select(i) for i in order]
            rows = deal_rows(rows, order)
        # The scores and their sums; a report a reward without a model gives with them stays
        # out of the step's.
        gives = ("scores", "reward_sums") + (() if reward_runs_model else ("reward_report",))
        extra = {"sent": {"rollout": rollouts, "rows": rows}} if rows is not None else {
            "sent": {"rollout": rollouts}, "common": {"rows": None}}
        refs = reward.run("score", step, gives, **extra)
        scored = [wait(reward=[r[i] for r in refs])["reward"] for i in range(len(gives))]
        total["count"] += sum(len(s) for s in scored[0])
        total["reward"] += float(sum(s.sum() for s in scored[0]))
        total["task_score"] += sum(s.total["task_score"] for s in scored[1])
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
# In the output directory: what defines the run there (``definition``), written when it starts,
# and the steps it finished, written when it ends.
DEFINITION_FILE = "definition.yaml"
FINISHED_FILE = "finished.json"


# What a run writes first into its output directory (``locked``, then the metrics logger): a
# directory that holds one of them is a run's, which a run may go on in or replace.
RUN_MARKS = (LOCK_FILE, DEFINITION_FILE, "run.json", "metrics.jsonl",
             checkpoint.CHECKPOINTS)


def check_output_dir(output_dir: str) -> None:
    """Raise ``ConfigError`` (``trainer.output_dir``, one line) unless a run can make and write
    ``output_dir``: not a file, not under one, within a directory this user can write, and new,
    empty or a run's own (``RUN_MARKS``): a run replaces the files at its paths (``run.json``,
    ``hf/actor/``, ``checkpoints/step_<k>/``...), so a directory of the user's own files is
    refused rather than written into. Nothing is created."""
    path = Path(output_dir).absolute()
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


def check_unlocked(output_dir: str) -> None:
    """``locked``'s refusal, before anything slow: a ``ConfigError`` when a run holds
    ``output_dir``'s lock now. Takes nothing: ``locked`` still takes the lock when the run
    starts, and refuses a run that came in between."""
    path = Path(output_dir) / LOCK_FILE
    if not path.is_file():
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        _take_lock(fd, output_dir)
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _take_lock(fd: int, output_dir: str) -> None:
    """flock ``fd`` (the output directory's ``LOCK_FILE``) or raise the ``ConfigError`` naming
    the process that holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        raise ConfigError("trainer.output_dir", f"{output_dir} is in use by the run of process "
                                                f"{holder} (it holds {LOCK_FILE} there); "
                                                "allowed: another trainer.output_dir, or the "
                                                "same once that run ends") from None


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
        _take_lock(fd, output_dir)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        os.close(fd)  # releases the lock


# --- a run's definition -------------------------------------------------------------------------

# The keys a run may change and stay the same run, resumed: how long it runs and what it logs,
# saves, evaluates or exports meanwhile, its timeouts, and where and in what layout it computes
# (a checkpoint loads under other strategies, devices and groups; micro-batching, offload and
# the engine's memory settings change the speed, not the algorithm).
RESUMABLE_SECTIONS = ("logger", "ray", "cluster", "comm")
RESUMABLE_KEYS = frozenset(
    [f"trainer.{key}" for key in ("steps", "resume", "output_dir", "save_every",
                                  "keep_checkpoints", "max_skipped_steps", "export_every",
                                  "eval_every", "step_timeout_s", "save_on_preempt")]
    + [f"{role}.{key}" for role in ROLES
       for key in ("strategy", "offload", "micro_batch_size", "max_micro_batch_size",
                   "gradient_checkpointing", "packing", "max_tokens_per_micro_batch",
                   "timeout_s", "token_env")]
    + [f"rollout.{key}" for key in ("micro_batch_size", "gpu_memory_utilization",
                                    "max_num_seqs", "tensor_parallel_size", "enforce_eager",
                                    "enable_prefix_caching")]
    + ["env.timeout_s", "env.num_workers", "task.cache_dir"])


def resumable(key: str) -> bool:
    """Whether a run may change the dotted ``key`` of its config and go on (``RESUMABLE_*``)."""
    return key.partition(".")[0] in RESUMABLE_SECTIONS or key in RESUMABLE_KEYS


def _leaves(data: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every leaf of nested mappings; an empty mapping is a leaf."""
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping) and value:
            yield from _leaves(value, dotted)
        else:
            yield dotted, value


def definition(cfg: Config) -> dict[str, Any]:
    """What defines the run of ``cfg`` (the config as composed, ``compose.load_config``): every
    leaf of the config but the ``resumable`` ones, as plain data (lists, not tuples), by dotted
    key. Two runs of one definition are the same run, however long each is asked to go on."""
    plain = json.loads(json.dumps(cfg.to_dict()))
    return {key: value for key, value in sorted(_leaves(plain)) if not resumable(key)}


_ABSENT = "(not set)"


def definition_diff(recorded: Mapping[str, Any], current: Mapping[str, Any]
                    ) -> dict[str, tuple[Any, Any]]:
    """key -> (recorded value, current value) of every key the two definitions do not share
    with one value, in key order; a key one of them lacks has ``_ABSENT`` there."""
    keys = sorted(set(recorded) | set(current))
    return {key: (recorded.get(key, _ABSENT), current.get(key, _ABSENT)) for key in keys
            if key not in recorded or key not in current or recorded[key] != current[key]}


def _short(value: Any, width: int = 40) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= width else "..." + text[-(width - 3):]  # a path's end tells


def _fresh_dir(output_dir: str) -> str:
    """``output_dir`` with the first free ``_<k>`` suffix: a directory no run has used."""
    k = 2
    while Path(f"{output_dir.rstrip('/')}_{k}").exists():
        k += 1
    return f"{output_dir.rstrip('/')}_{k}"


def check_definition(cfg: Config) -> None:
    """Before anything slow, with ``trainer.resume=auto`` in a directory whose run recorded its
    definition (``record_definition``): a ``ConfigError`` naming the keys that differ when
    ``cfg`` (as composed) defines another run, and ``NothingToRun`` when it defines the same
    run, which has finished as many steps as ``cfg`` asks for. Another ``resume`` replaces the
    directory's run (``none``) or starts from a checkpoint the user named: nothing to check."""
    output_dir = cfg.trainer.output_dir
    path = Path(output_dir) / DEFINITION_FILE
    if cfg.trainer.resume != "auto" or not path.is_file():
        return
    fresh = f"allowed: a fresh trainer.output_dir={_fresh_dir(output_dir)}, or trainer.resume=none"
    try:
        recorded = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise ConfigError("trainer.output_dir", f"{path} cannot be read ({type(err).__name__}), "
                                                f"so which run {output_dir} holds is unknown; "
                                                f"{fresh} to start over there") from None
    differ = definition_diff(recorded if isinstance(recorded, dict) else {}, definition(cfg))
    if differ:
        keys = list(differ)
        shown = "; ".join(f"{key}: {_short(differ[key][0])} there, {_short(differ[key][1])} now"
                          for key in keys[:3])
        more = f"; and {', '.join(keys[3:])}" if keys[3:] else ""
        raise ConfigError("trainer.output_dir", f"{output_dir} holds another run ({shown}{more}),"
                                                " which trainer.resume=auto would go on with; "
                                                f"{fresh} to replace it")
    done = finished_steps(output_dir)
    if done is not None and cfg.trainer.steps <= done:
        newest = checkpoint.complete(output_dir)
        since = newest[-1][0] if newest else 0
        more = (f"goes on from its step_{since} checkpoint" if since else
                "starts again at step 0 (it kept no checkpoint)")
        raise NothingToRun(f"{output_dir}: finished, {done} of {done} steps ({output_dir}/"
                           f"dashboard.png); trainer.steps above {done} {more}, "
                           "trainer.resume=none starts over")


def record_definition(cfg: Config) -> None:
    """Write ``cfg``'s definition (``cfg`` as composed) into its output directory as its run
    starts, and drop the mark of a finished run there: the run now goes on or starts over."""
    output_dir = Path(cfg.trainer.output_dir)
    (output_dir / FINISHED_FILE).unlink(missing_ok=True)
    text = yaml.safe_dump(definition(cfg), sort_keys=False, default_flow_style=None,
                          width=float("inf"))
    (output_dir / DEFINITION_FILE).write_text(
        "# What defines the run in this directory; trainer.resume=auto goes on only with a run\n"
        "# of the same (the keys a run may change on resume are left out).\n" + text)


def mark_finished(output_dir: str, steps: int) -> None:
    """Record that the run in ``output_dir`` finished ``steps`` steps (``finished_steps``)."""
    (Path(output_dir) / FINISHED_FILE).write_text(json.dumps({"steps": steps}) + "\n")


def finished_steps(output_dir: str) -> int | None:
    """The steps the run in ``output_dir`` finished (``mark_finished``); None when it has not."""
    try:
        return int(json.loads((Path(output_dir) / FINISHED_FILE).read_text())["steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_inputs(cfg: Config) -> dict[str, int]:
    """Every user file a run reads, read once before anything runs: the tokenizers, the prompt
    files, the reward function. Returns the vocabulary each model must hold."""
    from rlhf_paro import usercode

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
    # A reward function's import is held to the bound the workers' start is held to.
    limit = usercode.Limit(cfg.trainer.step_timeout_s, "trainer.step_timeout_s")
    for key in ("function", "score_function"):
        spec = getattr(cfg.reward, key)
        if spec is not None:
            usercode.load_function(spec, f"reward.{key}", limit)
    if cfg.trainer.eval_every and cfg.data.val_files is None:
        raise ConfigError("trainer.eval_every", "evaluates on data.val_files, which is not set")
    return vocab_sizes
