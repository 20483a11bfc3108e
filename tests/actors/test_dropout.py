"""Dropout is off in the RL forwards by default (``<model>.disable_dropout``): at step 0 the
policy, the rollout policy and the reference are one model, so the actor's ratio is exactly 1
and its KL to the reference exactly 0.

The trainer's own plan runs step 0 on every model in one process (``tests/steps.py``, one gloo
rank): a fixed rollout of a GPT-2 whose config keeps GPT-2's dropout of 0.1 (resid, embd, attn),
fixed scores, GRPO's experience with the KL in the loss, and the step's update. Both cases run
the plan with the old log-probs' separate forward (``actor.old_logprobs``): with dropout off the
config's plan gives them from the update instead (``old_logprobs_from_update``), where the ratio
is 1 whatever the dropout, so that rewrite is left out. The old log-probs and the reference's
come from forwards in eval mode; the update's forward runs in train mode, where a dropout left
on samples another network: ``approx_kl``, ``clipfrac`` and ``kl_loss`` then move off 0, which
the second case shows (so the first can fail).
"""

from __future__ import annotations


import pytest
import torch

from tests.confs import load
from tests.conftest import fixed_rollout
from tests.dist_utils import run_distributed

pytestmark = [pytest.mark.dist, pytest.mark.slow]

# GPT-2's own dropout defaults (0.1 each) left as they are; ids inside the task's vocabulary.
GPT2 = ("{model_type: gpt2, n_embd: 64, n_layer: 2, n_head: 2, n_positions: 64, "
        "bos_token_id: 1, eos_token_id: 2}")
ARGV = [f"actor.config={GPT2}", "reward.path=null", "data.train_files=null",
        "cluster.num_devices=1", "cluster.group_size=1", "algorithm.adv_estimator=grpo",
        "rollout.n=2", "algorithm.kl_in_loss=true", "algorithm.kl_coef=0.1",
        "ppo.rollout_batch_size=4", "ppo.mini_batch_size=8", "ppo.ppo_epochs=1",
        "actor.micro_batch_size=4", "ref.micro_batch_size=4"]
# Scores that differ inside each group: every sample has a non-zero advantage.
SCORES = torch.tensor([1.0, 0.0, 0.2, 0.9, 0.5, 0.1, 0.0, 0.7])


def _step_zero(rank: int, world_size: int, disable: bool) -> dict[str, list[float]]:
    from rlhf_paro.ppo import algorithms, data
    from tests.steps import local_trainer, plan_without

    argv = [*ARGV, f"actor.disable_dropout={disable}", f"ref.disable_dropout={disable}"]
    cfg = load(argv)
    rollout = fixed_rollout(data.vocab_sizes(cfg)["actor"],
                            data.rollout_tokenizer(cfg).pad_token_id)
    plan = (plan_without(cfg, "old_logprobs_from_update")
            if algorithms.old_logprobs_from_update(cfg) else None)
    trainer = local_trainer(argv, rollout, SCORES, plan)
    assert trainer.plan.producer("old_logp").method == "old_logprobs"
    actor = trainer.models["actor"].workers[0]
    # The update's statistics per micro-batch, read before the step's report clears them.
    stats, report = [], actor.report
    actor.report = lambda: (stats.append(dict(actor._train_stats)), report())[1]
    row = trainer.run_step(0)
    return {**stats[0], "ppo/kl": [row["ppo/kl"]]}


@pytest.fixture(scope="module")
def stats() -> dict[bool, dict[str, list[float]]]:
    return {disable: run_distributed(_step_zero, 1, disable)[0] for disable in (True, False)}


def test_at_step_zero_the_ratio_is_exactly_one_and_the_kl_exactly_zero(stats):
    got = stats[True]
    # Two micro-batches of 4 rows, each one value per statistic.
    assert len(got["approx_kl"]) == 2
    for key in ("approx_kl", "actor/clipfrac", "actor/kl_loss", "ppo/kl"):
        assert got[key] == [0.0] * len(got[key]), key


def test_with_dropout_kept_the_training_forward_samples_another_policy(stats):
    got = stats[False]
    # The KL of the rollout is made in eval mode (dropout off either way): still 0 ...
    assert got["ppo/kl"] == [0.0]
    # ... the update's forward in train mode is not the policy that sampled.
    assert all(v > 0 for v in got["approx_kl"]) and all(v != 0 for v in got["actor/kl_loss"])
