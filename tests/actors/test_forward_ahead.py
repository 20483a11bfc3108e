"""The update's first forward run ahead of the scores (the plan's ``forward_ahead`` rewrite:
``actor.forward_ahead`` issued while a reward that runs no model is waited for): the same step
to the bit, one training forward fewer in the update.

The trainer's own plan runs on every model in one process (``tests/steps.py``, one gloo rank):
one fixed GRPO rollout, fixed scores (a reward function's: no model), two steps. Once with the
config's plan and once with the same plan built without ``forward_ahead``. Each way runs in a
process of its own built from the same seed. Two configurations: the old log-probs from the
update (one pass over one mini-batch of two micro-batches), and two epochs over mini-batches of
two micro-batches each, with GPT-2's dropout left on (so the forward run ahead draws its dropout
masks at the same point of the random stream as the update would have: right after the
mini-batches' own draw).

The bound is exact equality: the two ways run the same float operations on the same inputs in
the same order, only the first forward at an earlier moment, so any difference is a bug (a
forward on other rows, with other weights, or a random draw moved).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rlhf_paro.ppo.demo import SCORE_FUNCTION
from tests.confs import INLINE, load
from tests.conftest import fixed_rollout
from tests.dist_utils import run_distributed

pytestmark = [pytest.mark.dist, pytest.mark.slow]

COMMON = ["cluster.num_devices=1", "cluster.group_size=1", "algorithm.adv_estimator=grpo",
          "rollout.n=2", "algorithm.kl_in_loss=true", "algorithm.kl_coef=0.1",
          "ppo.rollout_batch_size=4", "ref.micro_batch_size=4",
          # A reward without a model: the plan runs the forward ahead while it scores.
          f"reward.function={SCORE_FUNCTION}"]
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
# Scores that differ inside each group: every sample has a non-zero advantage.
SCORES = torch.tensor([1.0, 0.0, 0.2, 0.9, 0.5, 0.1, 0.0, 0.7])


def _steps(rank: int, world_size: int, argv: list[str], ahead: bool) -> dict:
    from rlhf_paro.ppo import data
    from tests.steps import local_trainer, plan_without

    cfg = load(argv)
    rollout = fixed_rollout(data.vocab_sizes(cfg)["actor"],
                            data.rollout_tokenizer(cfg).pad_token_id)
    # The engine's log-probs, any fixed numbers: they give the engine's distance, which the
    # update measures from its forwards when it gives the old log-probs.
    engine = -torch.rand(rollout.action_mask.shape, generator=torch.Generator().manual_seed(1))
    rollout = dataclasses.replace(rollout, logprobs=engine * rollout.action_mask)
    trainer = local_trainer(argv, rollout, SCORES,
                            None if ahead else plan_without(cfg, "forward_ahead"))
    actor = trainer.models["actor"].workers[0]
    # Each forward's mode (train or not), the training forwards of each update, what each
    # update gives, and its statistics per micro-batch (read before the report clears them).
    forwards, update_forwards, updates, stats = [], [], [], []
    forward, train, report = actor.forward, actor.train, actor.report

    def counted(*args, **kwargs):
        forwards.append(kwargs.get("train", False))
        return forward(*args, **kwargs)

    def update(*args, **kwargs):
        before = len(forwards)
        given = train(*args, **kwargs)
        update_forwards.append(sum(forwards[before:]))
        updates.append({name: dataclasses.asdict(value) for name, value in given.items()})
        return given

    actor.forward, actor.train = counted, update
    actor.report = lambda: (stats.append(dict(actor._train_stats)), report())[1]
    rows = [trainer.run_step(step) for step in range(2)]
    steps = [{"row": row, "stats": stat, "update": given, "update_forwards": count}
             for row, stat, given, count in zip(rows, stats, updates, update_forwards)]
    return {"steps": steps, "rewrites": trainer.plan.rewrites,
            "params": {k: v.clone() for k, v in actor.engine.full_state_dict().items()}}


@pytest.fixture(scope="module", params=list(CASES))
def runs(request) -> dict[bool, dict]:
    return {ahead: run_distributed(_steps, 1, CASES[request.param], ahead)[0]
            for ahead in (False, True)}


def _returned(row: dict) -> dict:
    """What the update gives the row when it gives the old log-probs: the KL and the engine's
    distance."""
    return {k: v for k, v in row.items()
            if k == "ppo/kl" or k.startswith("rollout/logprob_diff_")}


def test_the_forward_run_ahead_gives_the_same_step_to_the_bit(runs):
    before, ahead = runs[False], runs[True]
    assert "forward_ahead" in ahead["rewrites"] and "forward_ahead" not in before["rewrites"]
    assert before["params"].keys() == ahead["params"].keys()
    for name, expected in before["params"].items():
        assert torch.equal(ahead["params"][name], expected), name
    for one, other in zip(before["steps"], ahead["steps"]):
        assert other["stats"]["grad_norm"][0] > 0  # the parameters moved
        assert other["stats"] == one["stats"]
        # The KL and the engine's distance, which the update gives when it gives the old
        # log-probs, come from the forward run ahead for its rows.
        assert other["update"] == one["update"]
        assert len(_returned(other["row"])) == 3
        assert _returned(other["row"]) == _returned(one["row"])


def test_the_cases_cover_both_sources_of_the_old_log_probs(runs):
    from_update = "old_logprobs_from_update" in runs[True]["rewrites"]
    assert from_update == ("kl" in runs[True]["steps"][0]["update"]["update_sums"]["total"])


def test_the_update_runs_one_training_forward_fewer(runs):
    for one, other in zip(runs[False]["steps"], runs[True]["steps"]):
        assert other["update_forwards"] == one["update_forwards"] - 1
