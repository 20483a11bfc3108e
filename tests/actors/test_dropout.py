"""Dropout is off in the RL forwards by default (``<model>.disable_dropout``): at step 0 the
policy, the rollout policy and the reference are one model, so the actor's ratio is exactly 1
and its KL to the reference exactly 0.

The actor and reference workers themselves (``Worker.shard_model``, no Ray, one gloo rank) take
a fixed rollout of a GPT-2 whose config keeps GPT-2's dropout of 0.1 (resid, embd, attn), make
GRPO's experience with the KL in the loss, and run the step's update. The old log-probs and the
reference's come from forwards in eval mode; the update's forward runs in train mode, where a
dropout left on samples another network: ``approx_kl``, ``clipfrac`` and ``kl_loss`` then move
off 0, which the second case shows (so the first can fail).
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


def _step_zero(rank: int, world_size: int, disable: bool) -> dict[str, list[float]]:
    from rlhf_paro.actors.actor import ActorWorker
    from rlhf_paro.actors.ref import RefWorker
    from rlhf_paro.ppo import data

    cfg = load([*ARGV, f"actor.disable_dropout={disable}", f"ref.disable_dropout={disable}"])
    actor, ref = ActorWorker(cfg, "actor", rank, world_size), RefWorker(cfg, "ref", rank,
                                                                         world_size)
    for worker in (actor, ref):
        worker.shard_model()
    rollout = fixed_rollout(data.vocab_sizes(cfg)["actor"], actor.tokenizer.pad_token_id)
    actor.set_rollout(rollout)
    actor.old_logprobs()
    ref_logp = ref.logprobs(rollout)
    # Scores that differ inside each group: every sample has a non-zero advantage.
    score = torch.tensor([1.0, 0.0, 0.2, 0.9, 0.5, 0.1, 0.0, 0.7])
    _, sums = actor.make_experience(ref_logp, None, score, kl_coef=0.1)
    actor.train(step=0, kl_coef=0.1)
    return {**actor._train_stats, "ppo/kl": [sums["kl"]]}


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
