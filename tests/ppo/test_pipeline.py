"""The order of a step's stages (ppo/pipeline.py): which step's data each stage handles, and the
policy version every rollout is generated with, simulated over a run."""

from __future__ import annotations

import pytest

from rlhf_paro.ppo import pipeline
from rlhf_paro.ppo.pipeline import COLLECT, EXPERIENCE, LAUNCH, TRAIN


def _simulate(max_staleness: int, steps: int) -> dict[int, int]:
    """Run the order's table as the trainer does, counting updates: the version each step's
    rollout was launched with, checking every rollout is launched before it is collected and
    collected before it is trained on."""
    version, launched, collected = 0, {}, set()
    for step in range(steps):
        if step == 0:
            for ahead in pipeline.prologue(max_staleness, 0):
                launched[ahead] = version
        for stage in pipeline.order(max_staleness):
            target = step + stage.ahead
            if stage.name == LAUNCH and target < steps:
                launched.setdefault(target, version)
            elif stage.name == COLLECT:
                assert target in launched
                collected.add(target)
            elif stage.name == EXPERIENCE:
                assert target in collected
            elif stage.name == TRAIN:
                version += 1
    return launched


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
