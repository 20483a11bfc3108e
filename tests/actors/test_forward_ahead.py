"""The update's first forward run ahead of the scores (``ActorWorker.forward_ahead``, which the
trainer calls while a reward that runs no model is waited for): the same step to the bit, one
training forward fewer in the update.

An actor and a reference worker (``Worker.shard_model``, no Ray, one gloo rank) take one fixed
GRPO rollout and run two steps on it, once as before (``make_experience``, then ``train``) and
once with ``forward_ahead`` first. Each way runs in a process of its own built from the same
seed. Two configurations: the old log-probs from the update (one pass over one mini-batch of two
micro-batches), and two epochs over mini-batches of two micro-batches each, with GPT-2's dropout
left on (so the forward run ahead draws its dropout masks at the same point of the random
stream as the update would have: right after the mini-batches' own draw).

The bound is exact equality: the two ways run the same float operations on the same inputs in
the same order, only the first forward at an earlier moment, so any difference is a bug (a
forward on other rows, with other weights, or a random draw moved).
"""

from __future__ import annotations

import pytest
import torch

from tests.confs import INLINE, load
from tests.conftest import fixed_rollout
from tests.dist_utils import run_distributed

pytestmark = [pytest.mark.dist, pytest.mark.slow]

COMMON = ["cluster.num_devices=1", "cluster.group_size=1", "algorithm.adv_estimator=grpo",
          "rollout.n=2", "algorithm.kl_in_loss=true", "algorithm.kl_coef=0.1",
          "ppo.rollout_batch_size=4", "ref.micro_batch_size=4"]
GPT2 = ("{model_type: gpt2, n_embd: 64, n_layer: 2, n_head: 2, n_positions: 64, "
        "bos_token_id: 1, eos_token_id: 2}")
CASES = {
    # One mini-batch of 8 rows in micro-batches of 4: the old log-probs come from the update.
    "old from the update": [*INLINE, *COMMON, "ppo.mini_batch_size=8", "ppo.ppo_epochs=1",
                            "actor.micro_batch_size=4"],
    # Two epochs of two mini-batches of 4 in micro-batches of 2, dropout on (0.1).
    "epochs, dropout": [f"actor.config={GPT2}", "reward.path=null", "data.train_files=null",
                        *COMMON, "ppo.mini_batch_size=4", "ppo.ppo_epochs=2",
                        "actor.micro_batch_size=2", "actor.disable_dropout=false",
                        "ref.disable_dropout=false"],
}


def _steps(rank: int, world_size: int, argv: list[str], ahead: bool) -> dict:
    from rlhf_paro.actors.actor import ActorWorker
    from rlhf_paro.actors.ref import RefWorker
    from rlhf_paro.ppo import algorithms, data

    cfg = load(argv)
    from_update = algorithms.old_logprobs_from_update(cfg)
    actor, ref = ActorWorker(cfg, "actor", rank, world_size), RefWorker(cfg, "ref", rank,
                                                                         world_size)
    for worker in (actor, ref):
        worker.shard_model()
    rollout = fixed_rollout(data.vocab_sizes(cfg)["actor"], actor.tokenizer.pad_token_id)
    score = torch.tensor([1.0, 0.0, 0.2, 0.9, 0.5, 0.1, 0.0, 0.7])
    ref_logp = ref.logprobs(rollout)
    forward, forwards = actor.forward, []

    def counted(*args, **kwargs):
        forwards.append(kwargs.get("train", False))
        return forward(*args, **kwargs)

    actor.forward = counted
    steps = []
    for step in range(2):
        actor.set_rollout(rollout)
        if not from_update:  # else the update's forwards give them, as in the trainer
            actor.old_logprobs()
        if ahead:
            actor.forward_ahead(ref_logp, None)
        ahead_forwards = len(forwards)
        actor.make_experience(ref_logp, None, score, kl_coef=0.1)
        steps.append({"returned": actor.train(step=step, kl_coef=0.1),
                      "stats": dict(actor._train_stats),
                      "update_forwards": sum(forwards[ahead_forwards:])})
        actor._train_stats.clear()
        forwards.clear()
    return {"steps": steps, "from_update": from_update,
            "params": {k: v.clone() for k, v in actor.engine.full_state_dict().items()}}


@pytest.fixture(scope="module", params=list(CASES))
def runs(request) -> dict[bool, dict]:
    return {ahead: run_distributed(_steps, 1, CASES[request.param], ahead)[0]
            for ahead in (False, True)}


def test_the_forward_run_ahead_gives_the_same_step_to_the_bit(runs):
    before, ahead = runs[False], runs[True]
    assert before["params"].keys() == ahead["params"].keys()
    for name, expected in before["params"].items():
        assert torch.equal(ahead["params"][name], expected), name
    for one, other in zip(before["steps"], ahead["steps"]):
        assert other["stats"]["grad_norm"][0] > 0  # the parameters moved
        assert other["stats"] == one["stats"]
        # The KL and the engine's distance, which the update returns when it gives the old
        # log-probs, come from the forward run ahead for its rows.
        assert other["returned"] == one["returned"]


def test_the_cases_cover_both_sources_of_the_old_log_probs(runs):
    assert runs[True]["from_update"] == (runs[True]["steps"][0]["returned"] != {})


def test_the_update_runs_one_training_forward_fewer(runs):
    for one, other in zip(runs[False]["steps"], runs[True]["steps"]):
        assert other["update_forwards"] == one["update_forwards"] - 1
