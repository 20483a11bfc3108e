"""The RL loop, driven from one process; the run's models run as Ray actor groups.

The models are those the algorithm needs (``ppo/algorithms.py``, ``roles``): PPO's four (actor,
critic, reward, ref), three for a critic-free estimator such as GRPO, two when no KL reads a
reference. One step (every remote call goes to all N ranks of a model at once, each with its
own slice):

    prompts x rollout.n --slice--> actor.generate          (P gathered once: phase "generate")
    rollouts --driver--> dealt to ranks by real tokens     (ppo.balance_batch; actor.old_logprobs)
    rollout[r] -> actor.old_logprobs | ref.logprobs | critic.values | reward.score  (concurrent)
    actor.make_experience: token rewards, the algorithm's advantages (core.make_experience)
    actor.train | critic.train: PPO epochs, mini-batches of s micro-batches    (concurrent)
        (one pass over one mini-batch, no KL in the reward, no dropout: the update's forwards
        give the old log-probs, and actor.old_logprobs is skipped; algorithms.py)
    KL controller update; per-model reports -> one metrics row

A rank's rollout goes from its actor straight to the ref, critic and reward ranks on the same
device, or, with ``ppo.balance_batch``, through the driver, which deals the step's sequences so
that every rank holds as many real tokens ([Note: balanced ranks] in ``batching.py``); beyond the
rollouts (token ids and masks) the driver sees object references and a few sums.

Every ``trainer.save_every`` steps the run is checkpointed (``actors/checkpoint.py``), and a run
starts from the checkpoint ``trainer.resume`` names. Whatever stops a run (a worker that dies,
raises or does not answer within ``trainer.step_timeout_s``, Ctrl-C, SIGTERM, too many skipped
optimizer steps, a last step after which a model has skipped every one of this run's) comes out
of ``fit`` as one ``RunError`` that names the model, the rank, the step and the checkpoint to
resume from.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import shutil
import time
from pathlib import Path
from typing import Any, Iterator

import ray
from omegaconf import OmegaConf

from rlhf_paro import runs, sources
from rlhf_paro.actors import checkpoint
from rlhf_paro.actors.actor import ActorWorker
from rlhf_paro.actors.critic import CriticWorker
from rlhf_paro.actors.group import (
    Call, ModelGroup, NoAnswerError, RayOutput, StopRequested, WorkerError, get, init_ray,
    missing_devices, phase, place,
)
from rlhf_paro.actors.ref import RefWorker
from rlhf_paro.actors.reward import RewardWorker
from rlhf_paro.config import RAY_ADDRESS_ALLOWED, Config, ConfigError
from rlhf_paro.envs import EnvError
from rlhf_paro.metrics import (
    TASK_SCORE_KEY, MetricsLogger, has_task_score, logprob_diff, missing_steps, model_metrics,
    padding_fraction,
)
from rlhf_paro.ppo import algorithms, core, pipeline
from rlhf_paro.ppo.data import rollout_tokenizer
from rlhf_paro.ppo.rewards import RewardFunctionError
from rlhf_paro.ppo.task import task_from_config
from rlhf_paro.rollout import RolloutBatch
from rlhf_paro.sources import Launched

WORKERS = {"actor": ActorWorker, "critic": CriticWorker, "reward": RewardWorker,
           "ref": RefWorker}


def _running(cfg: Config, err: WorkerError) -> str:
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


@dataclasses.dataclass
class _StepContext:
    """What one step's stages hand one another."""

    step: int
    start: float
    times: dict[str, float] = dataclasses.field(default_factory=dict)  # seconds per stage
    launched: Launched | None = None
    gen: dict[str, float] = dataclasses.field(default_factory=dict)
    exp: dict[str, float] = dataclasses.field(default_factory=dict)
    mismatch: dict[str, float] = dataclasses.field(default_factory=dict)
    targets: list[Any] = dataclasses.field(default_factory=list)
    reward_reports: list[Any] | None = None  # a modelless reward's, taken as it scored
    kl_coef: float = 0.0
    staleness: int = 0


class RunError(RuntimeError):
    """Why a run stopped before its last step, in one line; ``resume`` is the
    ``trainer.resume`` value that goes on from the newest checkpoint."""

    def __init__(self, message: str, resume: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.resume = resume
        self.exit_code = exit_code


class CheckpointWriteError(RuntimeError):
    """The checkpoint of a step could not be written (a full or read-only disk, a path taken by
    a file); ``str()`` is one line naming the checkpoint and the operating system's reason."""


@dataclasses.dataclass
class StopFlag:
    """Set when SIGTERM asks the run to stop, by a handler that only sets it (an exception
    raised into Ray's code at a random moment breaks it). The trainer reads it at safe points:
    between steps, and while the workers start."""

    requested: bool = False


class PPOTrainer:
    """Places the run's models on the devices and runs RL steps; ``cfg`` is resolved
    (``rlhf_paro.resolve``, which the entry point runs once); ``stop`` stops it early
    (``StopFlag``)."""

    def __init__(self, cfg: Config, stop: StopFlag | None = None,
                 output: RayOutput | None = None) -> None:
        self.stop = stop or StopFlag()
        self._in_steps = False  # fit's steps are running: a stop waits for the step's end
        cluster = cfg.cluster
        num_devices, use_gpu = cluster.num_devices, cluster.device == "cuda"
        # The training devices, then the rollout's own (rollout.num_devices).
        replicas = cfg.rollout.num_devices
        # Each phase of the start that takes more than a few seconds says so in one line.
        say = output.say if output is not None else lambda line: print(line, flush=True)
        try:
            # Joining a cluster takes a second; a wait for its devices says so itself (place).
            with contextlib.nullcontext() if cfg.ray.address else \
                    phase("starting Ray on this machine", say):
                init_ray(cfg.ray.address, cfg.ray.num_cpus, num_devices + replicas, output)
        except ConnectionError as err:
            refused = "authentication" in str(err)  # a cluster that answers: the address is good
            raise ConfigError("ray.address", str(err) if refused else
                              f"{err}; {RAY_ADDRESS_ALLOWED}") from None
        problem = missing_devices(num_devices, cluster.group_size, use_gpu, replicas)
        if problem:
            key = "rollout.num_devices" if cfg.rollout.num_devices else "cluster.num_devices"
            raise ConfigError(key, problem)
        self.cfg = cfg
        wait = dict(use_gpu=use_gpu, timeout_s=cfg.ray.placement_timeout_s,
                    stop=lambda: self.stop.requested, say=say)
        self.placement = place(num_devices, cluster.group_size, **wait)
        # Each replica a device of its own, on any node.
        try:
            replica_placement = place(replicas, 1, **wait) if replicas else None
        except BaseException:
            self.placement.remove()
            raise
        # Every model's calls since the last step's were done, in the order issued: what a
        # worker that does not answer is traced back to (actors/group.py, get).
        self.issued: list[Call] = []
        self.pids: dict[str, list[int]] = {}  # each model's process id per rank
        self.models = {role: ModelGroup(WORKERS[role], role, cfg, self.placement, use_gpu,
                                        self.issued)
                       for role in algorithms.roles(cfg)}
        self.pad_token_id = rollout_tokenizer(cfg).pad_token_id  # of the rollouts it deals
        # Where each step's rollout comes from: the actor's ranks, or replicas on devices of
        # their own (rollout.num_devices), each alone on its own.
        self.source = sources.make(cfg, self.models["actor"], self.wait, self.pad_token_id,
                                   replica_placement, self.issued, use_gpu)
        groups = self.groups()
        processes = sum(group.num_ranks for group in groups.values())
        with phase(f"starting {processes} worker processes ({', '.join(groups)})", say):
            self.wait(**{role: group.call("node") for role, group in groups.items()})
        # The models join their process groups and build their engines at once.
        with phase(f"building the models on {num_devices} device{'s' * (num_devices > 1)} "
                   "(process groups, weights, engines)", say):
            self.pids = self.wait(**{role: group.rendezvous()
                                     for role, group in self.models.items()})
        with phase(f"starting the rollout's {replicas} replica{'s' * (replicas > 1)}", say) \
                if replicas else contextlib.nullcontext():
            self.pids.update(self.source.start())
        self.issued.clear()
        # A step's stages by name (ppo/pipeline.py runs them in order), the rollouts launched
        # ahead.
        self.stages = {pipeline.LAUNCH: self._launch, pipeline.COLLECT: self._collect,
                       pipeline.EXPERIENCE: self._experience, pipeline.TRAIN: self._train}
        self._launched: dict[int, Launched] = {}
        self.updates = 0  # the policy's version: its updates so far
        # From data.train_files, or made by the task.
        self.prompts = runs.Prompts(cfg, task_from_config(cfg))
        # The update's forwards give the old log-probs: their own forward is skipped.
        self.old_from_update = algorithms.old_logprobs_from_update(cfg)
        # Rows carry ppo/task_score only where a score of its own exists, not the reward again.
        self.task_scored = has_task_score(cfg.to_dict())
        alg = cfg.algorithm
        self.kl_ctl = core.kl_controller(alg.kl_coef, alg.adaptive_kl, alg.kl_target,
                                         alg.kl_horizon)
        # Longest run of optimizer steps skipped in a row that each trained model saw in the
        # last step.
        self.skip_runs: dict[str, int] = {}
        # Optimizer steps each trained model applied, not skipped, in this run's steps.
        self.applied: dict[str, int] = {}
        self.start_step = 0  # steps done before this run: a resumed checkpoint's
        self.wandb_id: str | None = None  # the wandb run this run logs to, kept in checkpoints
        self.resumed_from = self._resume()  # the checkpoint this run started from, if any
        self.updates = self.start_step

    def wait(self, **calls: list[ray.ObjectRef]) -> dict[str, list[Any]]:
        """The results of each model's calls (``model=refs``); a worker that dies or raises
        is a ``WorkerError`` at once, one that does not answer within
        ``trainer.step_timeout_s`` a ``NoAnswerError`` (``actors/group.py``, ``get``). A stop
        asked for before the steps is a ``StopRequested`` at once; during them it waits for the
        step's end."""
        placements = {**dict.fromkeys(self.models, self.placement), **self.source.placements()}
        return get(calls, {role: group.workers for role, group in self.groups().items()},
                   self.cfg.trainer.step_timeout_s, self.issued, self.pids,
                   None if self._in_steps else (lambda: self.stop.requested), placements)

    def fit(self) -> str:
        """Run the steps from ``start_step`` to ``trainer.steps``, logging each and saving
        checkpoints; returns the dashboard's path. Raises ``RunError`` when the run stops early.
        """
        cfg = self.cfg
        trainer = cfg.trainer
        wandb_cfg = cfg.logger.wandb
        logger = MetricsLogger(trainer.output_dir, trainer.steps, run_info(cfg),
                               wandb_mode=wandb_cfg.mode, show_progress=cfg.logger.progress,
                               wandb_init={"project": wandb_cfg.project, "name": wandb_cfg.name,
                                           "entity": wandb_cfg.entity, "tags": wandb_cfg.tags},
                               start_step=self.start_step, wandb_id=self.wandb_id)
        self.wandb_id = logger.wandb_id
        # Which process is which worker, for ps, a debugger, or a test that kills one.
        with open(Path(trainer.output_dir) / "workers.json", "w") as f:
            json.dump(self.pids, f)
        if self.stop.requested:  # during the start, after its last wait
            logger.close()
            raise StopRequested
        self._in_steps = True
        try:
            for step in range(self.start_step, trainer.steps):
                with self._stops_at(step):
                    row = self.step(step)
                    done = step + 1
                    skip_stop = self._skip_stop(step)
                    if trainer.eval_every and (done % trainer.eval_every == 0
                                               or done == trainer.steps):
                        self.source.sync(self.updates)
                        row.update(runs.evaluate(self.models, self.prompts, done, self.wait,
                                                 self.source))
                    if trainer.export_every and done % trainer.export_every == 0:
                        runs.export(self.models, trainer.output_dir, self.wait, done)
                    # A run that stops here keeps its last checkpoint from before the skips.
                    try:
                        if not skip_stop and trainer.save_every and \
                                done % trainer.save_every == 0:
                            row.update(self.save(done))
                    finally:  # the step's row, even when its checkpoint cannot be written
                        logger.log(step, row)
                if skip_stop:
                    raise self._stopped(skip_stop)
                if self.stop.requested:
                    raise self._preempted(step)
            with self._stops_at(trainer.steps):
                runs.export(self.models, trainer.output_dir, self.wait)
        finally:
            self._in_steps = False
            logger.close()
        # Imported here: matplotlib is a second or two of the start that only the end needs.
        from rlhf_paro import report

        return report.draw(trainer.output_dir)

    def _skip_stop(self, step: int) -> str | None:
        """Why the optimizer steps skipped so far stop the run after ``step``, in words (exit 1,
        as any failure); None when they do not. A trained model stops it when it skipped more
        than ``trainer.max_skipped_steps`` in a row, or, once the run's last step is done, when
        it skipped every optimizer step it took in this run, however few: that run ended with
        exit 0 and its usual lines, having trained nothing."""
        limit = self.cfg.trainer.max_skipped_steps
        for role, n in self.skip_runs.items():
            if n > limit:
                return (f"{role} skipped {n} optimizer step{'s' * (n > 1)} in a row (non-finite "
                        f"loss or gradient norm) at step {step}, more than "
                        f"trainer.max_skipped_steps={limit}")
        if step + 1 < self.cfg.trainer.steps:
            return None
        for role, n in self.skip_runs.items():
            if n and not self.applied.get(role):
                steps = (f"step {step}" if step == self.start_step else
                         f"steps {self.start_step}-{step}")
                return (f"{role} skipped every optimizer step of {steps} (non-finite loss or "
                        f"gradient norm), no more than trainer.max_skipped_steps={limit} in a "
                        "row: it trained nothing")
        return None

    def _preempted(self, step: int) -> RunError:
        """The stop SIGTERM asked for, after ``step``: its state saved first with
        ``trainer.save_on_preempt`` (unless ``save_every`` just did)."""
        done = step + 1
        output_dir = self.cfg.trainer.output_dir
        if self.cfg.trainer.save_on_preempt and checkpoint.newest(output_dir) != \
                checkpoint.checkpoint_dir(output_dir, done):
            with self._stops_at(step):
                self.save(done)
        # Counted as the checkpoint's name counts them (``step_<done>``): the steps done, not
        # the last one's index (rows and "at step" say that).
        return self._stopped(f"stopped by SIGTERM after {done} step{'s' * (done != 1)}",
                             exit_code=143)

    @contextlib.contextmanager
    def _stops_at(self, step: int) -> Iterator[None]:
        """A dead or failing worker, or Ctrl-C, during ``step`` as a ``RunError``."""
        try:
            yield
        except WorkerError as err:
            # Their lines name the function or environment, the step (and the sample).
            if isinstance(err.cause, (RewardFunctionError, EnvError)):
                raise self._stopped(str(err.cause)) from None
            if err.node is not None:
                raise self._stopped(f"{err.node} was lost at step {step}") from None
            raise self._stopped(f"{err.role} rank {err.rank} {'died' if err.died else 'raised'}"
                                f" at step {step}{_running(self.cfg, err)} ({err.reason})"
                                ) from None
        except CheckpointWriteError as err:
            raise self._stopped(str(err)) from None
        except NoAnswerError as err:
            raise self._stopped(f"{err} at step {step}") from None
        except KeyboardInterrupt:
            raise self._stopped(f"interrupted at step {step}", exit_code=130) from None

    def _stopped(self, what: str, exit_code: int = 1) -> RunError:
        """``what`` went wrong: the ``RunError`` that also says where to resume from."""
        found = checkpoint.newest(self.cfg.trainer.output_dir)
        if found is not None:
            return RunError(f"{what}; newest checkpoint: {found}", "auto", exit_code)
        if self.resumed_from is not None:  # another run's checkpoint, nothing saved here yet
            return RunError(f"{what}; newest checkpoint: {self.resumed_from}",
                            str(self.resumed_from), exit_code)
        return RunError(f"{what}; no checkpoint yet (trainer.save_every="
                        f"{self.cfg.trainer.save_every})", "auto", exit_code)

    # -- checkpoints ---------------------------------------------------------------------------
    def save(self, step: int) -> dict[str, float]:
        """Checkpoint the state after ``step`` steps (actors/checkpoint.py, [Note: a checkpoint
        is complete or absent]); returns its time and size for the metrics row."""
        start = time.perf_counter()
        output_dir = self.cfg.trainer.output_dir
        target = checkpoint.checkpoint_dir(output_dir, step)
        scratch = None
        try:
            scratch = checkpoint.scratch(output_dir, step)
            self.wait(**{role: group.call("save_checkpoint", directory=str(scratch))
                         for role, group in self.models.items()})
            sources.save_launched(self.source, self._launched, scratch)
            checkpoint.write_json(scratch / checkpoint.TRAINER_FILE, {
                "step": step, "kl_coef": self.kl_ctl.value, "wandb_id": self.wandb_id,
                "prompts": self.prompts.state(),
                "rng": checkpoint.rng_state()})
            (scratch / checkpoint.CONFIG_FILE).write_text(OmegaConf.to_yaml(self.cfg.to_dict()))
            digests = self._digests(scratch, checkpoint.files(scratch))
            checkpoint.publish(scratch, target, step, digests)
            checkpoint.prune(output_dir, self.cfg.trainer.keep_checkpoints)
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

    def _digests(self, directory: Path, names: list[str]) -> dict[str, tuple[int, str]]:
        """(bytes, SHA-256) of each file, shared among all workers (each flushes its share)."""
        num_ranks, num_models = self.cfg.cluster.num_devices, len(self.models)
        shares = [names[k::num_models * num_ranks] for k in range(num_models * num_ranks)]
        results = self.wait(**{
            role: group.call("digest", [[str(directory / n) for n in share]
                                        for share in shares[m * num_ranks:(m + 1) * num_ranks]])
            for m, (role, group) in enumerate(self.models.items())})
        found = [d for role in self.models for per_rank in results[role] for d in per_rank]
        ordered = [n for m in range(num_models) for share in
                   shares[m * num_ranks:(m + 1) * num_ranks] for n in share]
        return dict(zip(ordered, found))

    def _resume(self) -> Path | None:
        """Load the checkpoint ``trainer.resume`` names (none: a fresh start); returns it.

        Checkpoints of this output directory after the starting step belong to the run this
        one replaces, as its metrics rows do: they go, so that ``auto`` never returns to them.
        """
        trainer = self.cfg.trainer
        if trainer.resume == "none":
            source = None
        elif trainer.resume == "auto":
            source = self._newest_intact()
        else:
            source = Path(trainer.resume)
            self._verify(source)
        if source is not None:
            self._load(source)
        for stale in checkpoint.discard_after(trainer.output_dir, self.start_step):
            print(f"removed {stale}: it is of the run that this one replaces", flush=True)
        if source is not None:
            print(f"resumed from {source}: step {self.start_step} of {trainer.steps}",
                  flush=True)
            self._say_lost_rows(source)
        return source

    def _say_lost_rows(self, source: Path) -> None:
        """One line when this output directory's own checkpoint goes on where metrics.jsonl
        lacks rows before it (deleted or cut by hand): the new rows cannot bring them back."""
        output_dir = Path(self.cfg.trainer.output_dir)
        if output_dir.resolve() not in source.resolve().parents:  # another run's rows
            return
        path = output_dir / "metrics.jsonl"
        missing = missing_steps(str(path), self.start_step)
        if missing:
            first, last = missing[0], missing[-1]
            which = f"step {first}" if first == last else (
                f"steps {first}-{last}" if len(missing) == last - first + 1 else
                f"{len(missing)} of steps 0-{self.start_step - 1}")
            print(f"{path} has no rows for {which} (deleted since they were logged): they are "
                  f"gone, and the run logs steps {self.start_step} on", flush=True)

    def _newest_intact(self) -> Path | None:
        """The newest checkpoint of the output directory whose files match its manifest (None:
        there is none); each newer one is skipped saying why in one line (and then removed with
        the steps after the one resumed from). When every one is damaged, the newest's
        ``DamagedCheckpoint`` is raised: a fresh start would replace the run."""
        refused = None
        for _, directory in reversed(checkpoint.complete(self.cfg.trainer.output_dir)):
            try:
                self._verify(directory)
                return directory
            except checkpoint.DamagedCheckpoint as err:
                refused = refused or err
                print(f"skipped {directory}: it does not match its manifest ({err.problem})",
                      flush=True)
        if refused is not None:
            raise refused
        return None

    def _verify(self, directory: Path) -> None:
        """Every file held to the manifest, sizes then hashes (the workers share the hashing);
        raises ``checkpoint.DamagedCheckpoint`` (a ``ConfigError``, one line)."""
        listed = checkpoint.check(directory)
        checkpoint.refuse_changed(directory, listed, self._digests(directory, sorted(listed)))

    def _load(self, directory: Path) -> None:
        """Every worker and the driver load ``directory``, verified first (``_verify``): a
        damaged checkpoint is refused whole."""
        try:
            self.wait(**{role: group.call("load_checkpoint", directory=str(directory))
                         for role, group in self.models.items()})
        except WorkerError as err:
            if isinstance(err.cause, ValueError):  # the engine refuses what it cannot load
                reason = str(err.cause).strip().splitlines()[0]
                raise ConfigError("trainer.resume", f"{err.role} cannot load {directory}: "
                                                    f"{reason}") from None
            raise
        state = json.loads((directory / checkpoint.TRAINER_FILE).read_text())
        self.start_step = state["step"]
        for step, (batches, meta) in checkpoint.read_rollouts(directory, RolloutBatch).items():
            self._launched[step] = Launched.from_checkpoint(step, batches, meta)
        self.kl_ctl.value = state["kl_coef"]
        self.prompts.load_state(state["prompts"])
        checkpoint.set_rng_state(state["rng"])
        # Our own checkpoint goes on with its wandb run; another run's starts a new one.
        output_dir = Path(self.cfg.trainer.output_dir).resolve()
        if output_dir in directory.resolve().parents:
            self.wandb_id = state["wandb_id"]

    # -- one step: the stages of ppo/pipeline.py, in the order of the run --------------------
    def step(self, step: int) -> dict[str, float]:
        """Step ``step``: its metrics row. The stages run in ``pipeline.order`` (synchronous, or
        K steps off with ``rollout.max_staleness``), each on the data of the step it names."""
        start = time.perf_counter()
        # The last step's calls are all done, but for rollouts launched ahead.
        self.issued[:] = [c for launched in self._launched.values() for c in launched.calls]
        now = _StepContext(step=step, start=start)
        pipeline.run_step(step, self.start_step, self.cfg.rollout.max_staleness, self.stages, now)
        return self._row(now)

    def _launch(self, step: int, now: _StepContext) -> None:
        """Start step ``step``'s rollout (``pipeline.LAUNCH``): its prompts drawn, in the actor's
        ranks, or, with replicas of their own, the actor's weights sent to them first (when they
        changed) and the rollout dealt to the training ranks by a task of its own as soon as it
        is generated; a reward that reads nothing trained starts scoring it then."""
        if step >= self.cfg.trainer.steps or step in self._launched:
            return
        began = time.perf_counter()
        cfg = self.cfg
        issued_before = len(self.issued)
        # Sliced here, before anything is sent: each generator receives only its own prompts
        # (an environment's episodes are built from the prompts' rows, their columns).
        prompts, rows = self.prompts.next(cfg.ppo.rollout_batch_size, cfg.rollout.n,
                                          self.source.num_shards)
        launched = self.source.launch(step, prompts, rows, self.updates)
        if self.source.scores_ahead:
            launched.scores = self._score(launched.rollouts, launched.rows, step)
        launched.calls = self.issued[issued_before:]
        self._launched[step] = launched
        now.times["launch"] = now.times.get("launch", 0.0) + time.perf_counter() - began

    def _score(self, rollouts: list[Any], rows: list[Any] | None, step: int
               ) -> tuple[list[ray.ObjectRef], list[ray.ObjectRef], list[ray.ObjectRef] | None]:
        """The reward's scores of a rollout and their sums (``RewardWorker.score``), refs per
        rank, and, for a reward that runs no model, its reports.

        A reward without a model does nothing but score, so its report comes with the scoring:
        a ``report`` call at the step's end would queue on the worker behind the score of the
        rollout launched ahead, and the step would wait for that rollout's generation and
        scoring (a slow reward's whole wait) before it could end."""
        reward = self.models["reward"]
        extra = () if rows is None else (rows,)
        if self.cfg.reward.runs_model:
            scores, sums = zip(*reward.call("score", rollouts, *extra, step=step, with_sums=True,
                                            num_returns=2))
            return list(scores), list(sums), None
        scores, sums, reports = zip(*reward.call("score", rollouts, *extra, step=step,
                                                 with_report=True, num_returns=3))
        return list(scores), list(sums), list(reports)

    def _collect(self, step: int, now: _StepContext) -> None:
        """Wait for step ``step``'s rollout (``pipeline.COLLECT``), dealt to the training ranks
        by the source; the wait is the trainer's idle time when the rollout runs ahead."""
        began = time.perf_counter()
        launched = self._launched.pop(step)
        now.gen = _sum(self.source.collect(launched))
        now.launched = launched
        now.times["wait_rollout"] = time.perf_counter() - began

    def _experience(self, step: int, now: _StepContext) -> None:
        """Old log-probs, reference log-probs, values and scores of the collected rollout, then
        the actor's experience (``pipeline.EXPERIENCE``)."""
        began = time.perf_counter()
        actor = self.models["actor"]
        critic, ref = self.models.get("critic"), self.models.get("ref")
        absent = [None] * self.cfg.cluster.num_devices
        launched = now.launched
        rollouts, rows = launched.rollouts, launched.rows
        # Each rank takes its dealt rows; else the one it generated, which it kept.
        given = (rollouts,) if launched.dealt else ()
        if self.old_from_update:
            old = actor.call("set_rollout", *given) if given else []
        else:
            old = actor.call("old_logprobs", *given)
        ref_logp = ref.call("logprobs", rollouts) if ref else absent
        values = critic.call("values", rollouts) if critic else absent
        scores, sums, now.reward_reports = launched.scores or self._score(rollouts, rows, step)
        # The update's first forward needs no score: it runs while a reward that computes
        # nothing here (a function, a server: wall time) is waited for, once the reference's
        # and critic's forwards are done. A reward model computes on these devices itself.
        ahead = ([] if self.cfg.reward.runs_model else
                 actor.call("forward_ahead", ref_logp, values))
        kl_coef = self.kl_ctl.value
        targets, exp_stats = zip(*actor.call("make_experience", ref_logp, values, scores,
                                             kl_coef=kl_coef, step=step, num_returns=2))
        if ahead:
            self.wait(actor=ahead)
        now.exp = _sum(self.wait(actor=list(exp_stats))["actor"])
        now.gen.update(_sum(self.wait(reward=sums)["reward"]))
        now.mismatch = logprob_diff(self.wait(actor=old)["actor"]) if old else {}
        now.targets, now.kl_coef = list(targets), kl_coef
        now.staleness = pipeline.staleness(self.updates, launched.version)
        now.times["make_experience"] = time.perf_counter() - began

    def _train(self, step: int, now: _StepContext) -> None:
        """The update of the actor and the critic (``pipeline.TRAIN``): the policy's version
        goes up by one."""
        began = time.perf_counter()
        training = {"actor": self.models["actor"].call("train", step=step, kl_coef=now.kl_coef)}
        if "critic" in self.models:
            training["critic"] = self.models["critic"].call("train", now.targets, step=step)
        done = self.wait(**training)
        if self.old_from_update:  # the KL and the engine's distance, from the update's forwards
            now.exp["kl"] = sum(r["kl"] for r in done["actor"])
            now.mismatch = logprob_diff([{k: v for k, v in r.items() if k != "kl"}
                                         for r in done["actor"]])
        self.updates += 1
        now.times["train"] = time.perf_counter() - began

    def _row(self, now: _StepContext) -> dict[str, float]:
        """The step's metrics row, from its context and every model's report."""
        taken = {} if now.reward_reports is None else {"reward": now.reward_reports}
        reports = self.wait(**{role: taken.get(role) or group.call("report")
                               for role, group in self.models.items()})
        row: dict[str, float] = {}
        for role, per_rank in reports.items():
            row.update(model_metrics(role, per_rank))
        self.skip_runs = {role: max(r.skip_run for r in reports[role])
                          for role in algorithms.trained_roles(self.cfg)}
        for role in self.skip_runs:  # every rank of a model skips a step alike
            self.applied[role] = self.applied.get(role, 0) + max(r.applied for r in reports[role])
        done = time.perf_counter()
        gen, exp, times = now.gen, now.exp, now.times
        if "ref" in self.models:
            kl = exp["kl"] / exp["count"]  # per sequence, summed over its tokens
            self.kl_ctl.update(kl, int(exp["count"]))
            row.update({"ppo/kl": kl, "ppo/kl_coef": now.kl_coef})
        if self.task_scored:
            row[TASK_SCORE_KEY] = gen["task_score"] / gen["count"]
        row.update(reward_extras(gen))
        row.update(env_metrics(gen))
        row.update(now.mismatch)
        row.update(self.source.metrics(gen, done - now.start))
        generated = times.get("launch", 0.0) + times["wait_rollout"]
        row.update({
            "ppo/reward_mean": exp["reward"] / exp["count"],
            "ppo/advantage_mean": exp["advantage"] / exp["tokens"],
            "ppo/return_mean": exp["return"] / exp["tokens"],
            "ppo/response_length": gen["response_length"] / gen["count"],
            # Updates between the policy that generated the rollout and the one it trains.
            "rollout/staleness_mean": float(now.staleness),
            "rollout/staleness_max": float(now.staleness),
            "timing_s/generate": generated,
            "timing_s/wait_rollout": times["wait_rollout"],
            "timing_s/make_experience": times["make_experience"],
            "timing_s/train": times["train"],
            "timing_s/step": done - now.start,
            "perf/samples_per_s": gen["count"] / (done - now.start),
            # The rollout's real tokens (prompts and responses, all ranks) over the step.
            "perf/tokens_per_s": gen["real_tokens"] / (done - now.start),
            "perf/padding_fraction": padding_fraction(reports),
        })
        return row

    def groups(self) -> dict[str, ModelGroup]:
        """Every group of workers: the models', and the rollout source's own."""
        return {**self.models, **self.source.groups()}

    def shutdown(self) -> None:
        """Kill every worker (even one blocked in a collective) and free their devices."""
        for group in self.models.values():
            group.shutdown()
        self.placement.remove()
        self.source.shutdown()


def run_info(cfg: Config) -> dict[str, Any]:
    """What the dashboard's title and the wandb run's config say about the run."""
    return {
        "name": cfg.logger.wandb.name or cfg.trainer.output_dir.rstrip("/").split("/")[-1],
        "num_devices": cfg.cluster.num_devices,
        "group_size": cfg.cluster.group_size,
        "comm": cfg.comm.algorithm,
        "algorithm": cfg.algorithm.adv_estimator,
        "strategies": {role: cfg.model(role).strategy for role in algorithms.roles(cfg)},
        "config": cfg.to_dict(),
    }


def _sum(dicts: list[dict[str, Any]]) -> dict[str, Any]:
    """Key by key over ranks: sums, where a key some ranks lack (a reward extra) counts 0
    there; a ``<key>:min`` or ``<key>:max`` the least or the most of the ranks that have it; a
    list (a value per call, ``step_latencies_s``) all ranks' values in one."""
    keys = dict.fromkeys(k for d in dicts for k in d)
    out: dict[str, Any] = {}
    for key in keys:
        values = [d[key] for d in dicts if key in d]
        if isinstance(values[0], list):
            out[key] = [v for value in values for v in value]
        elif key.endswith((":min", ":max")):
            out[key] = (min if key.endswith(":min") else max)(values)
        else:
            out[key] = sum(values)
    return out


def env_metrics(sums: dict[str, float]) -> dict[str, float]:
    """``env/*`` of a step's episodes from the actor ranks' ``env_*`` sums (``episodes.run``):
    per episode its turns, observation and action tokens, observations dropped for the budget,
    tool calls and tool errors; the fraction of episodes cut short by ``env.max_turns`` or
    ``env.max_total_tokens`` (each, and both as ``env/truncated_fraction``); the mean seconds of
    one environment step. None without an environment."""
    episodes = sums.get("env_episodes")
    if not episodes:
        return {}
    turns, tokens = sums["env_truncated_max_turns"], sums["env_truncated_max_total_tokens"]
    return {
        "env/turns_mean": sums["env_turns"] / episodes,
        "env/truncated_fraction": (turns + tokens) / episodes,
        "env/truncated_fraction_max_turns": turns / episodes,
        "env/truncated_fraction_max_total_tokens": tokens / episodes,
        "env/step_time_s": sums["env_step_time_s"] / max(sums["env_steps"], 1.0),
        "env/observation_tokens": sums["env_observation_tokens"] / episodes,
        # (absent from the sums of a rollout launched ahead by an older version, then resumed)
        "env/dropped_observations": sums.get("env_dropped_observations", 0.0) / episodes,
        "env/action_tokens": sums["env_action_tokens"] / episodes,
        "env/tool_calls": sums["env_tool_calls"] / episodes,
        "env/tool_errors": sums["env_tool_errors"] / episodes,
        **rollout_timing(sums),
    }


def rollout_timing(sums: dict[str, Any]) -> dict[str, float]:
    """How an episodes' rollout spent its time (``episodes.run``'s sums): the share of it the
    engine had nothing to decode (``rollout/engine_idle_fraction``, over the ranks' seconds),
    the seconds to the first and the last episode's end, and percentiles of one environment
    step's seconds (nearest rank). Empty for the sums of a rollout launched ahead by an older
    version, then resumed."""
    if "env_rollout_s" not in sums:
        return {}
    latencies = sorted(sums["env_step_latencies_s"])
    out = {"rollout/engine_idle_fraction": sums["env_engine_idle_s"] / sums["env_rollout_s"],
           "rollout/first_sample_s": sums["env_first_sample_s:min"],
           "rollout/last_sample_s": sums["env_last_sample_s:max"]}
    if latencies:
        for q in (50, 90, 99):
            out[f"env/step_latency_p{q}_s"] = latencies[max(math.ceil(q / 100 * len(latencies)),
                                                            1) - 1]
    return out


def reward_extras(sums: dict[str, float]) -> dict[str, float]:
    """``reward/<name>``: the mean of a reward function's extra ``name`` over the samples that
    have it, from the reward workers' ``reward/<name>`` sums and ``reward/<name>:count``."""
    return {key: total / sums[f"{key}:count"] for key, total in sums.items()
            if key.startswith("reward/") and ":" not in key and sums.get(f"{key}:count")}
