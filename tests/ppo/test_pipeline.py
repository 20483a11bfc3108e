"""The order of a step's stages (ppo/pipeline.py): which step's data each stage handles, and the
policy version every rollout is generated with, over a run of the trainer's own steps
(``PPOTrainer.step``, its plan built from the config) on models and a rollout source that
record what they are asked."""

from __future__ import annotations

from typing import Any

import pytest

from rlhf_paro.compose import load_config
from rlhf_paro.metrics import RankReport, Sums
from rlhf_paro.ppo import algorithms, pipeline
from rlhf_paro.ppo.pipeline import COLLECT, EXPERIENCE, LAUNCH, TRAIN
from rlhf_paro.sources import Launched, RolloutSource
from rlhf_paro.trainer import PPOTrainer, StepResult
from tests.confs import INLINE


class _Model:
    """A model's group of one rank that answers each call of the plan at once with the names
    of the values it gives."""

    num_ranks = 1

    def __init__(self, role: str) -> None:
        self.role = role
        self.issued: list[Any] = []

    def run(self, method: str, step: int, returns: tuple[str, ...] = (), *args: Any,
            **kwargs: Any) -> list[Any]:
        given = tuple(f"{self.role}.{name}@{step}" for name in returns)
        return [given if len(given) > 1 else (given[0] if given else None)]


class _Source(RolloutSource):
    """The trainer's rollout source (its launch, collect and checkpoint's restore), generating
    nothing: it records the policy's version each step's rollout is generated with, and
    whether the trainer drew prompts for it."""

    def __init__(self, cfg: Any, generators: _Model) -> None:
        super().__init__(cfg, generators, lambda **calls: calls, pad_token_id=0)
        self.versions: dict[int, int] = {}
        self.drawn: dict[int, bool] = {}

    def launch(self, step: int, prompts: Any, version: int) -> dict[str, Any]:
        assert step < self.cfg.trainer.steps, step  # nothing past the last step
        self.drawn[step] = prompts is not None
        return super().launch(step, prompts, version)

    def _launch(self, step: int, prompts: Any, rows: Any, version: int) -> Launched:
        assert step not in self.versions, step  # nothing launched twice
        self.versions[step] = version
        return Launched(step, version, rollouts=[f"rollout@{step}"], stats=[Sums()],
                        rows=[None])

    def _launch_gives(self, launched: Launched) -> dict[str, Any]:
        # As a source on the actor's ranks gives it, and as replicas deal it at once.
        return {**super()._launch_gives(launched),
                "rollout": launched.rollouts, "rows": launched.rows}

    def restore_versions(self, saved: dict[int, int]) -> None:
        """The rollouts a checkpoint saved, by step, with the version of each."""
        for step, version in saved.items():
            self.launched[step] = Launched.from_checkpoint(
                step, [f"rollout@{step}"], {"version": version, "stats": [Sums().to_dict()],
                                                "rows": None})
            self.versions[step] = version


class _Cluster:
    """The run's models and source as records; each call answers at once."""

    def __init__(self, cfg: Any) -> None:
        self.issued: list[Any] = []
        self.models = {role: _Model(role) for role in algorithms.roles(cfg)}
        self.source = _Source(cfg, self.models["actor"])

    def wait(self, **calls: list[Any]) -> dict[str, list[Any]]:
        return calls


class _Run:
    """A trainer of ``steps`` steps in the K-step-off order (K = ``max_staleness``) whose run
    starts at step ``start``, with the rollouts ``launched`` (step -> version) a checkpoint
    saved. ``calls``: the stage and step of every call the trainer issues, in order;
    ``staleness``: each step's, as the source gave it to the step's fold."""

    def __init__(self, tmp_path: Any, steps: int, max_staleness: int, start: int = 0,
                 launched: dict[int, int] | None = None) -> None:
        # Rollouts launched ahead run on devices of their own.
        cfg = load_config([*INLINE, f"trainer.output_dir={tmp_path}", "trainer.resume=none",
                           f"trainer.steps={steps}", f"rollout.max_staleness={max_staleness}",
                           f"rollout.num_devices={int(max_staleness > 0)}"])
        self.trainer = trainer = PPOTrainer(cfg, cluster=_Cluster(cfg))
        assert trainer.plan.max_staleness == max_staleness
        trainer.start_step = trainer.updates = start  # as a checkpoint of step ``start`` sets
        self.source: _Source = trainer.source
        self.source.restore_versions(launched or {})
        self.calls: list[tuple[str, int]] = []
        self.staleness: dict[int, int] = {}
        issue = trainer._issue

        def issued(call: Any, step: int) -> None:
            if not self.calls or self.calls[-1] != (call.stage, step):
                self.calls.append((call.stage, step))
            issue(call, step)

        trainer._issue = issued
        trainer.fold = self.fold

    def fold(self, step: int, staleness: int, **sums: Any) -> dict[str, StepResult]:
        self.staleness[step] = staleness
        reports = {role: [RankReport(0, {}, {}, {}, 0, applied=1)]
                   for role in algorithms.trained_roles(self.trainer.cfg)}
        return {"row": StepResult({}, 0.0, 1, reports)}

    def step(self, step: int) -> None:
        """The step as the loop that owns training runs it: the policy's version goes up."""
        self.trainer._trained(self.trainer.step(step))

    def steps(self) -> _Run:
        for step in range(self.trainer.start_step, self.trainer.cfg.trainer.steps):
            self.step(step)
        return self

    @property
    def launched(self) -> dict[int, int]:
        return self.source.versions


def _simulate(tmp_path: Any, max_staleness: int, steps: int) -> dict[int, int]:
    """The version each step's rollout was launched with, over a run from step 0."""
    return _Run(tmp_path, steps, max_staleness).steps().launched


@pytest.mark.parametrize("k", [1, 2, 3])
def test_the_rollout_of_step_t_comes_from_the_policy_after_update_t_minus_k(tmp_path, k):
    versions = _simulate(tmp_path, k, 10)
    assert versions == {t: max(0, t - k) for t in range(10)}
    # Staleness: the updates between it and the policy that trains it (version t at step t).
    assert max(pipeline.staleness(t, v) for t, v in versions.items()) == k


def test_the_synchronous_order_trains_on_the_current_policys_rollout(tmp_path):
    assert _simulate(tmp_path, 0, 6) == {t: t for t in range(6)}
    assert [s.name for s in pipeline.order(0)] == [LAUNCH, COLLECT, EXPERIENCE, TRAIN]
    assert not pipeline.overlaps(pipeline.order(0)) and pipeline.overlaps(pipeline.order(2))
    assert list(pipeline.prologue(0, 5)) == [] and list(pipeline.prologue(2, 5)) == [5, 6]


def test_a_step_is_the_longer_of_generation_and_training_when_they_overlap():
    # 1 s of sync, 3 s of generation, 2 s of training: one after another 6 s; overlapped 4 s,
    # and 1 + 5 = 6 s once training is the longer (5 s).
    assert pipeline.step_seconds(pipeline.order(0), 1.0, 3.0, 2.0) == 6.0
    assert pipeline.step_seconds(pipeline.order(1), 1.0, 3.0, 2.0) == 4.0
    assert pipeline.step_seconds(pipeline.order(1), 1.0, 3.0, 5.0) == 6.0
    with pytest.raises(ValueError, match="allowed: 0 or more"):
        pipeline.order(-1)


def test_a_step_runs_its_stages_in_order_with_the_prologue_on_its_first_step_only(tmp_path):
    run = _Run(tmp_path, steps=9, max_staleness=2, start=5)
    run.step(5)
    assert run.calls == [(LAUNCH, 5), (LAUNCH, 6), (COLLECT, 5), (LAUNCH, 7), (EXPERIENCE, 5),
                         (TRAIN, 5)]
    run.calls.clear()
    run.step(6)
    assert run.calls == [(COLLECT, 6), (LAUNCH, 8), (EXPERIENCE, 6), (TRAIN, 6)]
    # The last step launches nothing: step 9 is past the run.
    run.calls.clear()
    run.step(7)
    run.step(8)
    assert run.calls == [(COLLECT, 7), (EXPERIENCE, 7), (TRAIN, 7),
                         (COLLECT, 8), (EXPERIENCE, 8), (TRAIN, 8)]
    run = _Run(tmp_path, steps=8, max_staleness=0, start=3)
    run.step(3)
    assert run.calls == [(LAUNCH, 3), (COLLECT, 3), (EXPERIENCE, 3), (TRAIN, 3)]


@pytest.mark.parametrize("k", [0, 1, 2])
def test_a_resumed_run_collects_its_checkpoints_rollouts_and_goes_on_as_the_straight_run(
        tmp_path, k):
    # A checkpoint after 4 updates holds the rollouts of steps 4 .. 4 + K - 1, launched with the
    # policies after updates 4 - K .. 3 ([Note: rollouts launched ahead]).
    straight = _Run(tmp_path, 10, k).steps()
    saved = {t: v for t, v in straight.launched.items() if 4 <= t < 4 + k}
    resumed = _Run(tmp_path, 10, k, start=4, launched=saved).steps()
    assert resumed.launched == {t: v for t, v in straight.launched.items() if t >= 4}
    assert resumed.staleness == {t: s for t, s in straight.staleness.items() if t >= 4}
    assert straight.staleness == {t: min(t, k) for t in range(10)}
    # The checkpoint's rollouts take no prompts: the resumed run draws those the straight one
    # drew for the steps after them.
    assert resumed.source.drawn == {t: t >= 4 + k for t in range(4, 10)}
