"""Each model's rank takes an equal share of its device, by the number of models the run has."""

import pytest

from rlhf_paro.actors.group import bundle_share
from rlhf_paro.ppo import algorithms
from tests.confs import INLINE, load


@pytest.mark.parametrize("argv, share", [
    ([], 1 / 4),  # PPO: actor, critic, reward, ref
    (["algorithm.adv_estimator=grpo", "rollout.n=2"], 1 / 3),  # no critic
    (["algorithm.adv_estimator=grpo", "rollout.n=2", "algorithm.kl_coef=0"], 1 / 2),  # no ref
])
def test_the_run_s_models_share_each_device_whole(argv, share):
    cfg = load([*INLINE, *argv])
    assert bundle_share(cfg) == pytest.approx(share)
    # Every bundle is used whole and never over-asked: Ray places all of the run's ranks on it.
    assert len(algorithms.roles(cfg)) * bundle_share(cfg) == pytest.approx(1.0)
