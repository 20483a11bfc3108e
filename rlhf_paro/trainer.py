"""The RL loop, driven from one process: it runs each step's plan (``ppo/step.py``) on the run's
models, Ray actor groups on the devices or, for a test, all in this process (``cluster.py``).

``_stage`` is the one loop: it issues each call of a stage with the values it reads (references
handed on as they are) and waits only where the driver reads a value; the stages run in the
pipeline's order (synchronous, or K steps off). The loop that owns training (``fit``) raises
the policy's version, updates the KL controller and counts skipped optimizer steps from each
step's result; the row is a fold of the step's sums and reports (``metrics.py``), nothing else.
``python -m rlhf_paro.train --cfg step ...`` prints a run's plan.

Every ``trainer.save_every`` steps the run is checkpointed (``resume.py``). Whatever stops a run
before its last step comes out of ``fit`` as one ``RunError`` naming the model, the rank, the
step and the checkpoint to resume from (``ends.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import time
from pathlib import Path
from typing import Any, Iterator

from rlhf_paro import ends, metrics, resume, runs
from rlhf_paro.actors import checkpoint
from rlhf_paro.actors.group import NoAnswerError, RayOutput, StopRequested, WorkerError
from rlhf_paro.cluster import LocalCluster, RayCluster
from rlhf_paro.config import Config
from rlhf_paro.ends import RunError, StopFlag
from rlhf_paro.metrics import MetricsLogger, Sums
from rlhf_paro.ppo import algorithms, core, pipeline
from rlhf_paro.ppo import step as plans
from rlhf_paro.ppo.task import task_from_config
from rlhf_paro.resume import CheckpointWriteError


@dataclasses.dataclass
class StepResult:
    """What a step's fold gives the loop that owns training: the row, the KL summed over the
    step's samples and their count, and each trained model's reports."""

    row: dict[str, float]
    kl: float
    count: int
    reports: dict[str, list[metrics.RankReport]]


class PPOTrainer:
    """Runs RL steps on the run's models: Ray's (``RayCluster``, started here) or a
    ``LocalCluster`` given as ``cluster``; ``cfg`` is resolved (``rlhf_paro.resolve``, which
    the entry point runs once); ``stop`` stops it early (``StopFlag``)."""

    def __init__(self, cfg: Config, stop: StopFlag | None = None,
                 output: RayOutput | None = None,
                 cluster: RayCluster | LocalCluster | None = None) -> None:
        self.stop = stop or StopFlag()
        self.cfg = cfg
        self.cluster = cluster or RayCluster(cfg, lambda: self.stop.requested, output)
        self.models, self.source = self.cluster.models, self.cluster.source
        self.plan = plans.build(cfg)
        # Each step's values by (step, name): references the calls hand on, or, once waited
        # for, what the driver reads.
        self.values: dict[tuple[int, str], Any] = {}
        self.ready: set[tuple[int, str]] = set()  # the values waited for, not references
        self.times: dict[str, float] = {}  # seconds of each stage in the running step
        self.prompts = runs.Prompts(cfg, task_from_config(cfg))  # files' or the task's
        alg = cfg.algorithm
        self.kl_ctl = core.kl_controller(alg.kl_coef, alg.adaptive_kl, alg.kl_target,
                                         alg.kl_horizon)
        # Longest run of optimizer steps skipped in a row that each trained model saw in the
        # last step, and the optimizer steps each applied in this run's steps.
        self.skip_runs: dict[str, int] = {}
        self.applied: dict[str, int] = {}
        self.start_step = 0  # steps done before this run: a resumed checkpoint's
        self.wandb_id: str | None = None  # the wandb run this run logs to, kept in checkpoints
        self.resumed_from = resume.resume(self)  # the checkpoint this run started from, if any
        self.updates = self.start_step  # the policy's version: its updates so far

    @property
    def pids(self) -> dict[str, list[int]]:
        return self.cluster.pids

    def wait(self, **calls: list[Any]) -> dict[str, list[Any]]:
        """The results of each model's calls (``model=refs``): ``RayCluster.wait``."""
        return self.cluster.wait(**calls)

    def fit(self) -> str:
        """Run the steps from ``start_step`` to ``trainer.steps``, logging each and saving
        checkpoints; returns the dashboard's path. Raises ``RunError`` when the run stops early.
        """
        cfg = self.cfg
        trainer, wandb_cfg = cfg.trainer, cfg.logger.wandb
        info = metrics.run_info(cfg, tuple(self.models))
        logger = MetricsLogger(trainer.output_dir, trainer.steps, info,
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
        self.cluster.stoppable = False  # a stop during the steps waits for the step's end
        try:
            for step in range(self.start_step, trainer.steps):
                with self._stops_at(step):
                    result = self.step(step)
                    row, done = result.row, step + 1
                    self._trained(result)
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
            self.cluster.stoppable = True
            logger.close()
        # Imported here: matplotlib is a second or two of the start that only the end needs.
        from rlhf_paro import report

        return report.draw(trainer.output_dir)

    def _trained(self, result: StepResult) -> None:
        """What training reads of a step: the policy's version up by one, the KL controller's
        update from the step's KL, and each trained model's skipped optimizer steps (every rank
        of a model skips alike)."""
        self.updates += 1
        if "ref" in self.models:
            self.kl_ctl.update(result.kl / result.count, result.count)
        for role in algorithms.trained_roles(self.cfg):
            reports = result.reports[role]
            self.skip_runs[role] = max(r.skip_run for r in reports)
            self.applied[role] = self.applied.get(role, 0) + max(r.applied for r in reports)

    def _skip_stop(self, step: int) -> str | None:
        """Why the skipped optimizer steps stop the run after ``step`` (``ends.skip_stop``)."""
        return ends.skip_stop(self.cfg, self.skip_runs, self.applied, self.start_step, step)

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
        """A dead or failing worker, a checkpoint not written, a worker that does not answer,
        or Ctrl-C, during ``step`` as a ``RunError`` (``ends.what_stopped``)."""
        try:
            yield
        except (WorkerError, CheckpointWriteError, NoAnswerError, KeyboardInterrupt) as err:
            raise self._stopped(*ends.what_stopped(self.cfg, err, step)) from None

    def _stopped(self, what: str, exit_code: int = 1) -> RunError:
        return ends.stopped(self.cfg, self.resumed_from, what, exit_code)

    def save(self, step: int) -> dict[str, float]:
        """Checkpoint the state after ``step`` steps (``resume.save``); its time and size."""
        return resume.save(self, step)

    # -- one step: its plan's calls, stage by stage ----------------------------------------------
    def step(self, step: int) -> StepResult:
        """Step ``step``: the stages of ``pipeline.order`` (synchronous, or K steps off with
        ``rollout.max_staleness``), each on the values of the step it names."""
        self.times = dict.fromkeys(pipeline.STAGES, 0.0)
        self.times["start"] = time.perf_counter()
        # The last step's calls are all done, but for rollouts launched ahead.
        self.cluster.issued[:] = self.source.in_flight()
        stages = {name: functools.partial(self._stage, name) for name in pipeline.STAGES}
        pipeline.run_step(step, self.start_step, self.plan.max_staleness, stages)
        result = self.values.pop((step, "row"))
        for key in [k for k in self.values if k[0] == step]:  # read by models only
            del self.values[key]
        self.ready = {k for k in self.ready if k[0] > step}
        return result

    def _stage(self, name: str, step: int) -> None:
        """Stage ``name`` of the plan on step ``step``'s values: each call issued in order, the
        values a driver call reads waited for first; a stage that waits (``step.WAITS``) ends
        when what the driver reads of it is there. A launch past the last step does nothing."""
        if name == pipeline.LAUNCH and step >= self.cfg.trainer.steps:
            return
        began, timed = time.perf_counter(), False
        calls = self.plan.stage(name)
        for call in calls:
            if call.role == plans.DRIVER and call.reads:
                self._resolve(step, call.reads)
                if not timed:  # the stage's own time ends where the driver reads it
                    self.times[name] += time.perf_counter() - began
                    timed = True
            self._issue(call, step)
        if not timed:
            if plans.WAITS[name]:
                read = {v for c in self.plan.calls if c.role == plans.DRIVER for v in c.reads}
                self._resolve(step, [v for c in calls for v in c.gives if v in read] +
                              [f"{c.role}.{c.method}" for c in calls if not c.gives])
            self.times[name] += time.perf_counter() - began

    def _issue(self, call: plans.Call, step: int) -> None:
        """One call on step ``step``'s values; what it gives is stored by name."""
        plan = self.plan
        if call.role in (plans.DRIVER, plans.SOURCE):
            reads = {v: self.values[(step, v)] for v in call.reads}
            target = self if call.role == plans.DRIVER else self.source
            extra = {} if call.role == plans.DRIVER else {"version": self.updates}
            given = getattr(target, call.method)(step, **reads, **extra)
            for name in call.gives:
                self.values[(step, name)] = given[name]
                self.ready.add((step, name))
            return
        # A driver's value goes to every rank alike, as does None (no rows without files).
        driver = [v for v in plan.sent(call) if plan.producer(v).role == plans.DRIVER
                  or self.values[(step, v)] is None]
        sent = {v: self.values[(step, v)] for v in plan.sent(call) if v not in driver}
        returned = plan.returned(call)
        refs = self.models[call.role].run(
            call.method, step, returned, plan.keeps(call), plan.kept(call),
            *(self.values[(step, v)] for v in call.after), sent=sent,
            common={v: self.values[(step, v)] for v in driver})
        if len(returned) == 1:
            self.values[(step, returned[0])] = refs
        for i, name in enumerate(returned if len(returned) > 1 else ()):
            self.values[(step, name)] = [r[i] for r in refs]
        if not returned:  # nothing reads it, but it ends: waited for with its stage
            self.values[(step, f"{call.role}.{call.method}")] = refs

    def _resolve(self, step: int, names: list[str]) -> None:
        """Wait for step ``step``'s values ``names`` that are references still; they become
        the values (a failure names its model and rank: ``RayCluster.wait``)."""
        for name in names:
            key = (step, name)
            if key in self.ready or key not in self.values:
                continue
            role = name.split(".")[0] if "." in name else self.plan.producer(name).role
            self.values[key] = self.wait(**{role: self.values[key]})[role]
            self.ready.add(key)

    # -- the driver's calls ------------------------------------------------------------------
    def draw(self, step: int) -> dict[str, Any]:
        """``prompts``: the step's prompt slices and rows, sliced before anything is sent (each
        generator receives its own; an environment's episodes are built from the rows); None
        for a rollout the source holds already (restored from a checkpoint)."""
        if self.source.holds(step):
            return {"prompts": None}
        return {"prompts": self.prompts.next(self.cfg.ppo.rollout_batch_size, self.cfg.rollout.n,
                                             self.source.num_shards)}

    def kl_coef(self, step: int) -> dict[str, float]:
        """``kl_coef``: the KL controller's coefficient as the step starts its experience."""
        return {"kl_coef": self.kl_ctl.value}

    def fold(self, step: int, **sums: Any) -> dict[str, StepResult]:
        """``row``: the step's metrics row (``metrics.step_row``) from its sums and every
        model's report, with what training reads of it (``StepResult``)."""
        taken = {"reward": sums.pop("reward_report")} if "reward_report" in sums else {}
        reports = {**self.wait(**{role: group.call("report") for role, group
                                  in self.models.items() if role not in taken}), **taken}
        folded = {name: Sums.fold([s for s in value if s is not None])
                  for name, value in sums.items() if isinstance(value, list) and name != "trained"}
        exp = Sums.fold([folded["exp_sums"], folded["update_sums"]])
        row = metrics.step_row(self.cfg, folded["gen_sums"], exp, folded["reward_sums"],
                               folded.get("mismatch"), reports, sums["staleness"],
                               self.values[(step, "kl_coef")], self.times,
                               time.perf_counter())
        row.update(self.source.metrics(folded["gen_sums"], row["timing_s/step"]))
        return {"row": StepResult(row, exp.total["kl"], int(exp.total["count"]),
                                  {r: reports[r] for r in algorithms.trained_roles(self.cfg)})}

    def shutdown(self) -> None:
        """Kill every worker (even one blocked in a collective) and free their devices."""
        self.cluster.shutdown()
