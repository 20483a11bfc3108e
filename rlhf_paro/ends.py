"""How a run ends before its last step, in one line: the stop SIGTERM asks for (``StopFlag``),
what a failure during a step is in words (``what_stopped``), the skipped optimizer steps that
stop a run (``skip_stop``), and the ``RunError`` that carries the line and the resume value out
of ``PPOTrainer.fit``."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from rlhf_paro.actors import checkpoint
from rlhf_paro.actors.group import NoAnswerError, WorkerError
from rlhf_paro.config import Config
from rlhf_paro.envs import EnvError
from rlhf_paro.ppo.rewards import RewardFunctionError
from rlhf_paro.resume import CheckpointWriteError


class RunError(RuntimeError):
    """Why a run stopped before its last step, in one line; ``resume`` is the
    ``trainer.resume`` value that goes on from the newest checkpoint."""

    def __init__(self, message: str, resume: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.resume = resume
        self.exit_code = exit_code


@dataclasses.dataclass
class StopFlag:
    """Set when SIGTERM asks the run to stop, by a handler that only sets it (an exception
    raised into Ray's code at a random moment breaks it). The trainer reads it at safe points:
    between steps, and while the workers start."""

    requested: bool = False


def running(cfg: Config, err: WorkerError) -> str:
    """What a dead reward rank was running, when it runs no model: its process runs the user's
    functions in a step and little else, so one that calls ``os._exit`` or crashes the
    interpreter is named. A ``RewardFunctionError`` names them itself."""
    reward = cfg.model("reward")
    if not (err.died and err.role == "reward" and reward.function is not None):
        return ""
    if reward.score_function is None:
        return f" running reward function {reward.function}"
    return (f" running reward function {reward.function} or score function "
            f"{reward.score_function}")


def what_stopped(cfg: Config, err: BaseException, step: int) -> tuple[str, int]:
    """A failure during ``step`` (a dead or failing worker, a checkpoint that cannot be written,
    a worker that does not answer, Ctrl-C) in words, and the exit status it ends with."""
    if isinstance(err, WorkerError):
        # Their lines name the function or environment, the step (and the sample).
        if isinstance(err.cause, (RewardFunctionError, EnvError)):
            return str(err.cause), 1
        if err.node is not None:
            return f"{err.node} was lost at step {step}", 1
        return (f"{err.role} rank {err.rank} {'died' if err.died else 'raised'} at step "
                f"{step}{running(cfg, err)} ({err.reason})", 1)
    if isinstance(err, CheckpointWriteError):
        return str(err), 1
    if isinstance(err, NoAnswerError):
        return f"{err} at step {step}", 1
    return f"interrupted at step {step}", 130


def stopped(cfg: Config, resumed_from: Path | None, what: str, exit_code: int = 1) -> RunError:
    """``what`` went wrong: the ``RunError`` that also says where to resume from."""
    found = checkpoint.newest(cfg.trainer.output_dir)
    if found is not None:
        return RunError(f"{what}; newest checkpoint: {found}", "auto", exit_code)
    if resumed_from is not None:  # another run's checkpoint, nothing saved here yet
        return RunError(f"{what}; newest checkpoint: {resumed_from}", str(resumed_from),
                        exit_code)
    return RunError(f"{what}; no checkpoint yet (trainer.save_every="
                    f"{cfg.trainer.save_every})", "auto", exit_code)


def skip_stop(cfg: Config, skip_runs: dict[str, int], applied: dict[str, int],
              start_step: int, step: int) -> str | None:
    """Why the optimizer steps skipped so far stop the run after ``step``, in words (exit 1,
    as any failure); None when they do not. ``skip_runs``: each trained model's longest run of
    skipped steps in a row in the last step; ``applied``: the optimizer steps each applied in
    this run, which started at ``start_step``. A trained model stops it when it skipped more
    than ``trainer.max_skipped_steps`` in a row, or, once the run's last step is done, when it
    skipped every optimizer step it took in this run, however few: that run ended with exit 0
    and its usual lines, having trained nothing."""
    limit = cfg.trainer.max_skipped_steps
    for role, n in skip_runs.items():
        if n > limit:
            return (f"{role} skipped {n} optimizer step{'s' * (n > 1)} in a row (non-finite "
                    f"loss or gradient norm) at step {step}, more than "
                    f"trainer.max_skipped_steps={limit}")
    if step + 1 < cfg.trainer.steps:
        return None
    for role, n in skip_runs.items():
        if n and not applied.get(role):
            steps = f"step {step}" if step == start_step else f"steps {start_step}-{step}"
            return (f"{role} skipped every optimizer step of {steps} (non-finite loss or "
                    f"gradient norm), no more than trainer.max_skipped_steps={limit} in a "
                    "row: it trained nothing")
    return None
