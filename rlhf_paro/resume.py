"""A run's state in checkpoints: written after a step (``save``), verified and loaded when a
run starts (``resume``). ``run`` is the ``PPOTrainer``: its workers write and load their own
shards, the driver its own state (the step, the KL coefficient, the prompts' order, the random
streams, the wandb run) and the rollouts launched ahead ([Note: rollouts launched ahead])."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from rlhf_paro.actors import checkpoint
from rlhf_paro.actors.group import WorkerError
from rlhf_paro.config import ConfigError
from rlhf_paro.metrics import missing_steps


class CheckpointWriteError(RuntimeError):
    """The checkpoint of a step could not be written (a full or read-only disk, a path taken by
    a file); ``str()`` is one line naming the checkpoint and the operating system's reason."""


def save(run: Any, step: int) -> dict[str, float]:
    """Checkpoint the state after ``step`` steps (actors/checkpoint.py, [Note: a checkpoint
    is complete or absent]); returns its time and size for the metrics row."""
    start = time.perf_counter()
    output_dir = run.cfg.trainer.output_dir
    target = checkpoint.checkpoint_dir(output_dir, step)
    scratch = None
    try:
        scratch = checkpoint.scratch(output_dir, step)
        run.wait(**{role: group.call("save_checkpoint", directory=str(scratch))
                     for role, group in run.models.items()})
        run.source.save(scratch)
        checkpoint.write_json(scratch / checkpoint.TRAINER_FILE, {
            "step": step, "kl_coef": run.kl_ctl.value, "wandb_id": run.wandb_id,
            "prompts": run.prompts.state(),
            "rng": checkpoint.rng_state()})
        (scratch / checkpoint.CONFIG_FILE).write_text(OmegaConf.to_yaml(run.cfg.to_dict()))
        digests = _digests(run, scratch, checkpoint.files(scratch))
        checkpoint.publish(scratch, target, step, digests)
        checkpoint.prune(output_dir, run.cfg.trainer.keep_checkpoints)
    except (OSError, WorkerError) as err:
        cause = err.cause if isinstance(err, WorkerError) else err
        if not isinstance(cause, OSError):
            raise
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
        raise CheckpointWriteError(f"cannot write the checkpoint {target} "
                                   f"({type(cause).__name__}: {cause})") from None
    return {"timing_s/checkpoint": time.perf_counter() - start,
            "checkpoint/bytes": float(sum(size for size, _ in digests.values()))}


def _digests(run: Any, directory: Path, names: list[str]) -> dict[str, tuple[int, str]]:
    """(bytes, SHA-256) of each file, shared among all workers (each flushes its share)."""
    num_ranks, num_models = run.cfg.cluster.num_devices, len(run.models)
    shares = [names[k::num_models * num_ranks] for k in range(num_models * num_ranks)]
    results = run.wait(**{
        role: group.call("digest", [[str(directory / n) for n in share]
                                    for share in shares[m * num_ranks:(m + 1) * num_ranks]])
        for m, (role, group) in enumerate(run.models.items())})
    found = [d for role in run.models for per_rank in results[role] for d in per_rank]
    ordered = [n for m in range(num_models) for share in
               shares[m * num_ranks:(m + 1) * num_ranks] for n in share]
    return dict(zip(ordered, found))


def resume(run: Any) -> Path | None:
    """Load the checkpoint ``trainer.resume`` names (none: a fresh start); returns it.

    Checkpoints of this output directory after the starting step belong to the run this
    one replaces, as its metrics rows do: they go, so that ``auto`` never returns to them.
    """
    trainer = run.cfg.trainer
    if trainer.resume == "none":
        source = None
    elif trainer.resume == "auto":
        source = _newest_intact(run)
    else:
        source = Path(trainer.resume)
        _verify(run, source)
    if source is not None:
        _load(run, source)
    for stale in checkpoint.discard_after(trainer.output_dir, run.start_step):
        print(f"removed {stale}: it is of the run that this one replaces", flush=True)
    if source is not None:
        print(f"resumed from {source}: step {run.start_step} of {trainer.steps}",
              flush=True)
        _say_lost_rows(run, source)
    return source


def _say_lost_rows(run: Any, source: Path) -> None:
    """One line when this output directory's own checkpoint goes on where metrics.jsonl
    lacks rows before it (deleted or cut by hand): the new rows cannot bring them back."""
    output_dir = Path(run.cfg.trainer.output_dir)
    if output_dir.resolve() not in source.resolve().parents:  # another run's rows
        return
    path = output_dir / "metrics.jsonl"
    missing = missing_steps(str(path), run.start_step)
    if missing:
        first, last = missing[0], missing[-1]
        which = f"step {first}" if first == last else (
            f"steps {first}-{last}" if len(missing) == last - first + 1 else
            f"{len(missing)} of steps 0-{run.start_step - 1}")
        print(f"{path} has no rows for {which} (deleted since they were logged): they are "
              f"gone, and the run logs steps {run.start_step} on", flush=True)


def _newest_intact(run: Any) -> Path | None:
    """The newest checkpoint of the output directory whose files match its manifest (None:
    there is none); each newer one is skipped saying why in one line (and then removed with
    the steps after the one resumed from). When every one is damaged, the newest's
    ``DamagedCheckpoint`` is raised: a fresh start would replace the run."""
    refused = None
    for _, directory in reversed(checkpoint.complete(run.cfg.trainer.output_dir)):
        try:
            _verify(run, directory)
            return directory
        except checkpoint.DamagedCheckpoint as err:
            refused = refused or err
            print(f"skipped {directory}: it does not match its manifest ({err.problem})",
                  flush=True)
    if refused is not None:
        raise refused
    return None


def _verify(run: Any, directory: Path) -> None:
    """Every file held to the manifest, sizes then hashes (the workers share the hashing);
    raises ``checkpoint.DamagedCheckpoint`` (a ``ConfigError``, one line)."""
    listed = checkpoint.check(directory)
    checkpoint.refuse_changed(directory, listed, _digests(run, directory, sorted(listed)))


def _load(run: Any, directory: Path) -> None:
    """Every worker and the driver load ``directory``, verified first (``_verify``): a
    damaged checkpoint is refused whole."""
    try:
        run.wait(**{role: group.call("load_checkpoint", directory=str(directory))
                     for role, group in run.models.items()})
    except WorkerError as err:
        if isinstance(err.cause, ValueError):  # the engine refuses what it cannot load
            reason = str(err.cause).strip().splitlines()[0]
            raise ConfigError("trainer.resume", f"{err.role} cannot load {directory}: "
                                                f"{reason}") from None
        raise
    state = json.loads((directory / checkpoint.TRAINER_FILE).read_text())
    run.start_step = state["step"]
    run.source.restore(directory)
    run.kl_ctl.value = state["kl_coef"]
    run.prompts.load_state(state["prompts"])
    checkpoint.set_rng_state(state["rng"])
    # Our own checkpoint goes on with its wandb run; another run's starts a new one.
    output_dir = Path(run.cfg.trainer.output_dir).resolve()
    if output_dir in directory.resolve().parents:
        run.wandb_id = state["wandb_id"]
