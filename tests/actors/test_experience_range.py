"""Scores that float32 holds one by one but a step's arithmetic does not (no Ray, no model).

A reward of 3e38 passes the check where it is read (``usercode.finite32``); a group's sum of
four does not fit float32, so GRPO's mean, every advantage and every loss were non-finite, and
the run only ever said that the actor skipped its optimizer steps. ``check_experience`` stops
it at the step in one line naming the reward's source.
"""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from rlhf_paro.actors.actor import check_experience, reward_source
from rlhf_paro.ppo import core
from rlhf_paro.ppo.rewards import RewardFunctionError

GRPO = core.ExperienceSpec("grpo", "k1", True, 1.0, 1.0, False)
PPO = core.ExperienceSpec("gae", "k1", False, 1.0, 0.95, False)


def _experience(spec: core.ExperienceSpec, score: torch.Tensor) -> tuple:
    mask = torch.ones(len(score), 3)
    values = torch.zeros(len(score), 3) if spec is PPO else None
    groups = torch.arange(len(score)).div(4, rounding_mode="floor")
    exp = core.make_experience(spec, torch.zeros(len(score), 3), None, score, mask, groups,
                               values, 0.0)
    return exp, mask


@pytest.mark.parametrize("spec, score, what", [
    # A group's sum of four 3e38 is inf: GRPO's mean, then every advantage.
    (GRPO, [3e38] * 4, "advantages"),
    # GAE with zero values and gamma 1, no KL: advantages and returns are the score. 2e19 fits
    # float32, its square does not, and whitening and the critic's loss square them.
    (PPO, [2e19, 0.0, 0.0, 0.0], "advantages"),
])
def test_scores_float32_holds_that_overflow_the_step_are_refused_naming_source_and_step(
        spec, score, what):
    score = torch.tensor(score, dtype=torch.float32)
    assert torch.isfinite(score).all()  # each one passed the check where it was read
    exp, mask = _experience(spec, score)
    with pytest.raises(RewardFunctionError) as err:
        check_experience(exp, score, mask, "reward function f.py:score", step=7)
    assert str(err.value).startswith(f"reward function f.py:score at step 7: the scores "
                                     f"(largest |x| {float(score.abs().max()):.4g}) overflow "
                                     f"float32 in the step's {what}; allowed: ")


@pytest.mark.parametrize("spec", [GRPO, PPO])
def test_ordinary_and_large_but_safe_scores_pass(spec):
    # 1e15: squares of 1e30, four of them far inside float32's 3.4e38.
    for score in ([1.0, -2.0, 0.5, 3.0], [1e15, -1e15, 0.0, 1e15]):
        score = torch.tensor(score)
        exp, mask = _experience(spec, score)
        check_experience(exp, score, mask, "reward function f.py:score", step=0)


def test_padding_is_not_checked():
    # Positions outside the mask may hold anything the estimator left there.
    score = torch.tensor([1.0, 2.0, 3.0, 4.0])
    exp, mask = _experience(GRPO, score)
    exp.returns[:, 2] = float("inf")
    mask[:, 2] = 0
    check_experience(exp, score, mask, "reward function f.py:score", step=0)


def test_the_source_is_named_as_the_run_names_it():
    def cfg(**reward):
        base = {"function": None, "url": None, "env_score": False, "path": None}
        return OmegaConf.create({"reward": {**base, **reward}, "env": {"function": "e.py:Env"}})

    assert reward_source(cfg(function="f.py:score")) == "reward function f.py:score"
    assert reward_source(cfg(url="http://127.0.0.1:9/")) == "reward server http://127.0.0.1:9/"
    assert reward_source(cfg(env_score=True)) == "environment e.py:Env"
    assert reward_source(cfg(path="my/rm")) == "reward model my/rm"
