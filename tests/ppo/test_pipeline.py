"""The order of a step's stages (ppo/pipeline.py): which step's data each stage handles, and the
policy version every rollout is generated with, over a run of the trainer's step loop
(``pipeline.run_step``) with its stages recorded."""

from __future__ import annotations

import pytest

from rlhf_paro.ppo import pipeline
from rlhf_paro.ppo.pipeline import COLLECT, EXPERIENCE, LAUNCH, TRAIN


class _Run:
    """The trainer's stages as records, run by ``pipeline.run_step`` as the trainer runs them:
    a launch takes the policy's version (``PPOTrainer._launch``: nothing past the last step,
    nothing launched twice), a training step raises it, and each stage checks the data it
    handles is there: launched before collected, collected before trained on."""

    def __init__(self, steps: int, start: int = 0, launched: dict[int, int] | None = None):
        self.steps, self.version = steps, start
        self.launched = dict(launched or {})  # step -> the version that generates its rollout
        self.collected: set[int] = set()
        self.calls: list[tuple[str, int]] = []
        self.staleness: dict[int, int] = {}
        self.stages = {LAUNCH: self.launch, COLLECT: self.collect, EXPERIENCE: self.experience,
                       TRAIN: self.train}

    def launch(self, step: int) -> None:
        self.calls.append((LAUNCH, step))
        if step < self.steps and step not in self.launched:
            self.launched[step] = self.version

    def collect(self, step: int) -> None:
        self.calls.append((COLLECT, step))
        assert step in self.launched and step not in self.collected, step
        self.collected.add(step)

    def experience(self, step: int) -> None:
        self.calls.append((EXPERIENCE, step))
        assert step in self.collected, step
        self.staleness[step] = pipeline.staleness(self.version, self.launched[step])

    def train(self, step: int) -> None:
        self.calls.append((TRAIN, step))
        self.version += 1

    def steps_from(self, start: int, max_staleness: int) -> "_Run":
        for step in range(start, self.steps):
            pipeline.run_step(step, start, max_staleness, self.stages)
        return self


def _simulate(max_staleness: int, steps: int) -> dict[int, int]:
    """The version each step's rollout was launched with, over a run from step 0."""
    return _Run(steps).steps_from(0, max_staleness).launched


@pytest.mark.parametrize("k", [1, 2, 3])
def test_the_rollout_of_step_t_comes_from_the_policy_after_update_t_minus_k(k):
    versions = _simulate(k, 10)
    assert versions == {t: max(0, t - k) for t in range(10)}
    # Staleness: the updates between it and the policy that trains it (version t at step t).
    assert max(pipeline.staleness(t, v) for t, v in versions.items()) == k


def test_the_synchronous_order_trains_on_the_current_policys_rollout():
    assert _simulate(0, 6) == {t: t for t in range(6)}
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


def test_a_step_runs_its_stages_in_order_with_the_prologue_on_its_first_step_only():
    run = _Run(steps=8)
    pipeline.run_step(5, 5, 2, run.stages)
    assert run.calls == [(LAUNCH, 5), (LAUNCH, 6), (COLLECT, 5), (LAUNCH, 7), (EXPERIENCE, 5),
                         (TRAIN, 5)]
    run.calls.clear()
    pipeline.run_step(6, 5, 2, run.stages)
    assert run.calls == [(COLLECT, 6), (LAUNCH, 8), (EXPERIENCE, 6), (TRAIN, 6)]
    run.calls.clear()
    pipeline.run_step(3, 3, 0, run.stages)
    assert run.calls == [(LAUNCH, 3), (COLLECT, 3), (EXPERIENCE, 3), (TRAIN, 3)]


@pytest.mark.parametrize("k", [0, 1, 2])
def test_a_resumed_run_collects_its_checkpoints_rollouts_and_goes_on_as_the_straight_run(k):
    # A checkpoint after 4 updates holds the rollouts of steps 4 .. 4 + K - 1, launched with the
    # policies after updates 4 - K .. 3 ([Note: rollouts launched ahead]).
    straight = _Run(10).steps_from(0, k)
    saved = {t: v for t, v in straight.launched.items() if 4 <= t < 4 + k}
    resumed = _Run(10, start=4, launched=saved).steps_from(4, k)
    assert resumed.launched == {t: v for t, v in straight.launched.items() if t >= 4}
    assert resumed.staleness == {t: s for t, s in straight.staleness.items() if t >= 4}
    assert straight.staleness == {t: min(t, k) for t in range(10)}
