"""What each algorithm asks of a run (ppo/algorithms.py), read from the config as a user writes
it: the loss aggregation and the KL estimator a null key leaves to the algorithm."""

from __future__ import annotations

import pytest

from rlhf_paro.compose import load_config
from rlhf_paro.ppo import algorithms


@pytest.mark.parametrize("argv, expected", [
    (["algorithm.adv_estimator=grpo"], "token_mean"),
    # Dr. GRPO's own: token sums over the response budget, a mean over sequences.
    (["algorithm.adv_estimator=dr_grpo"], "seq_mean_token_sum"),
    (["algorithm.adv_estimator=dr_grpo", "algorithm.loss_agg_mode=token_mean"], "token_mean"),
])
def test_a_null_loss_aggregation_is_the_algorithms_and_a_set_one_wins(argv, expected):
    assert algorithms.loss_agg_mode(load_config(argv)) == expected


@pytest.mark.parametrize("argv, expected", [
    (["algorithm.kl_in_loss=false"], "k1"),  # the penalty in the reward
    (["algorithm.kl_in_loss=true"], "k3"),  # the loss term: unbiased, never negative
    (["algorithm.kl_in_loss=true", "algorithm.kl_estimator=k2"], "k2"),
])
def test_a_null_kl_estimator_follows_where_the_kl_goes(argv, expected):
    cfg = load_config([*argv, "algorithm.adaptive_kl=false"])
    assert algorithms.kl_estimator(cfg) == expected


def test_each_algorithm_asks_for_what_its_estimator_reads():
    # Only gae trains a critic; the group estimators need rollout.n >= 2 (their baseline is the
    # other samples of the prompt); only dr_grpo divides token sums by the response budget.
    specs = algorithms.ALGORITHMS
    assert {name for name, spec in specs.items() if spec.critic} == {"gae"}
    assert {name for name, spec in specs.items() if spec.group_baseline} == \
        {"grpo", "dr_grpo", "rloo"}
    assert {name for name, spec in specs.items() if spec.token_sum_norm} == {"dr_grpo"}
    # A registered estimator without a spec of its own runs as a default Algorithm: no critic,
    # no group baseline, token means.
    default = algorithms.Algorithm("other")
    assert (default.critic, default.group_baseline, default.loss_agg_mode,
            default.token_sum_norm) == (False, False, "token_mean", False)


# The demo's PPO (conf=ppo_tiny's defaults: a KL penalty in the reward, a critic) and GRPO.
GRPO = ["algorithm.adv_estimator=grpo", "algorithm.kl_in_loss=true", "rollout.n=4",
        "ppo.rollout_batch_size=16", "ppo.mini_batch_size=64", "ppo.ppo_epochs=1"]


@pytest.mark.parametrize("argv, expected", [
    (GRPO, True),
    ([*GRPO, "algorithm.kl_coef=0"], True),  # no reference at all
    ([*GRPO, "ppo.ppo_epochs=2"], False),  # the second pass anchors to the first's policy
    ([*GRPO, "ppo.mini_batch_size=32"], False),  # an optimizer step between mini-batches
    ([*GRPO, "algorithm.kl_in_loss=false"], False),  # the reward's KL penalty reads them first
    ([*GRPO, "algorithm.kl_in_loss=false", "algorithm.kl_coef=0"], True),
    ([*GRPO, "actor.disable_dropout=false"], False),  # the update's forward is another network
    ([*GRPO, "actor.lora.enabled=true", "actor.lora.dropout=0.1"], False),
    ([*GRPO, "actor.lora.enabled=true"], True),  # LoRA without dropout
])
def test_the_update_gives_the_old_log_probs_only_where_nothing_comes_between(argv, expected):
    assert algorithms.old_logprobs_from_update(load_config(argv)) is expected
