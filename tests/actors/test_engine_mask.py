"""``rollout.mask`` in the actor's update, on the trainer's own plan in one process
(``tests/steps.py``, one gloo rank): one fixed GRPO rollout whose engine log-probs are the
policy's own plus 1e-3 noise, fixed scores, no reference (the policy loss is all the gradient
there is), one step. Each case runs in a process of its own built from the same seed.

- off: today's step.
- keep_all: a sequence band no sample leaves ([1e-6, 1e6]): the step of ``off`` to the bit (each
  kept token's term is multiplied by 1.0), with ``rollout/masked_fraction`` 0.
- some: a geometric band [0.9, 1.1] with samples 1 and 5 given engine log-probs 0.5 above the
  policy's on every token (a geometric mean of e^-0.5 = 0.61: below the band), and token TIS on
  top: 2 of 8 masked, from below, and the smallest log ratio -0.5.
- mask_all: a band [1.5, 2] no sample reaches: every sample masked and no gradient at all.

``off``, ``keep_all`` and ``some`` take the old log-probs from the update's own forwards
(``algorithms.old_logprobs_from_update``); ``mask_all`` from their separate forward, before the
update, the plan without that rewrite.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from tests.confs import INLINE, load
from tests.conftest import fixed_rollout
from tests.dist_utils import run_distributed

pytestmark = [pytest.mark.dist, pytest.mark.slow]

ARGV = [*INLINE, "cluster.num_devices=1", "cluster.group_size=1",
        "algorithm.adv_estimator=grpo", "rollout.n=2", "algorithm.kl_coef=0",
        "ppo.rollout_batch_size=4", "ppo.mini_batch_size=8", "ppo.ppo_epochs=1",
        "actor.micro_batch_size=4"]
# Scores that differ inside each group: every sample has a non-zero advantage.
SCORES = torch.tensor([1.0, 0.0, 0.2, 0.9, 0.5, 0.1, 0.0, 0.7])
OFF_BAND = [1, 5]  # the samples whose engine log-probs are pushed away in ``some``
CASES = {
    "off": [],
    "keep_all": ["rollout.mask=sequence", "rollout.mask_low=1e-6", "rollout.mask_high=1e6"],
    "some": ["rollout.mask=geometric", "rollout.mask_low=0.9", "rollout.mask_high=1.1",
             "rollout.tis_cap=2"],
    "mask_all": ["rollout.mask=geometric", "rollout.mask_low=1.5", "rollout.mask_high=2"],
}
MASK_KEYS = {"rollout/masked_fraction", "rollout/masked_fraction_high",
             "rollout/masked_fraction_low", "rollout/mask_log_ratio_mean",
             "rollout/mask_log_ratio_min", "rollout/mask_log_ratio_max"}


def _step(rank: int, world_size: int, case: str) -> dict:
    from rlhf_paro.actors.actor import logprobs
    from rlhf_paro.ppo import algorithms, data
    from tests.steps import local_trainer, plan_without

    argv = [*ARGV, *CASES[case]]
    cfg = load(argv)
    assert algorithms.old_logprobs_from_update(cfg)
    rollout = fixed_rollout(data.vocab_sizes(cfg)["actor"],
                            data.rollout_tokenizer(cfg).pad_token_id)
    separate = case == "mask_all"
    trainer = local_trainer(argv, rollout, SCORES,
                            plan_without(cfg, "old_logprobs_from_update") if separate else None)
    actor = trainer.models["actor"].workers[0]
    with torch.no_grad():
        own = logprobs(actor, rollout)
    engine = own + torch.randn(own.shape, generator=torch.Generator().manual_seed(1)) * 1e-3
    if case == "some":
        engine[OFF_BAND] += 0.5
    trainer.source.rollout = dataclasses.replace(rollout,
                                                 logprobs=engine * rollout.action_mask)
    row = trainer.run_step(0)
    return {"row": row, "params": {k: v.clone() for k, v in
                                   actor.engine.full_state_dict().items()}}


@pytest.fixture(scope="module")
def steps() -> dict[str, Any]:
    return {case: run_distributed(_step, 1, case)[0] for case in CASES}


def test_a_band_that_keeps_every_sample_is_the_step_without_a_mask_to_the_bit(steps):
    off, kept = steps["off"], steps["keep_all"]
    assert not MASK_KEYS & set(off["row"])  # off: no mask metrics
    assert kept["row"]["rollout/masked_fraction"] == 0.0
    for key in ("actor/loss", "actor/grad_norm"):
        assert kept["row"][key] == off["row"][key], key
    assert off["row"]["actor/grad_norm"] > 0
    for name, value in off["params"].items():
        assert torch.equal(kept["params"][name], value), name


def test_the_samples_outside_the_band_are_counted_and_change_the_step(steps):
    row = steps["some"]["row"]
    assert MASK_KEYS | {"rollout/tis_clipfrac"} <= set(row)
    assert row["rollout/masked_fraction"] == row["rollout/masked_fraction_low"] == 2 / 8
    assert row["rollout/masked_fraction_high"] == 0.0
    # The pushed samples' log geometric mean is -0.5 plus their noise's mean (1e-3 / sqrt(3)
    # at most a few times over); the others' is the noise alone.
    assert row["rollout/mask_log_ratio_min"] == pytest.approx(-0.5, abs=5e-3)
    assert abs(row["rollout/mask_log_ratio_max"]) < 5e-3
    assert row["actor/grad_norm"] != steps["off"]["row"]["actor/grad_norm"]


def test_a_band_that_keeps_no_sample_leaves_no_gradient(steps):
    row = steps["mask_all"]["row"]
    assert row["rollout/masked_fraction"] == row["rollout/masked_fraction_low"] == 1.0
    assert row["actor/loss"] == 0.0 and row["actor/grad_norm"] == 0.0
