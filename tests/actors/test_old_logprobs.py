"""The old log-probs from the update's own forwards (``algorithms.old_logprobs_from_update``):
the same step as with their separate forward, one forward fewer.

The trainer's own plan runs on every model in one process (``tests/steps.py``, one gloo rank):
one fixed GRPO rollout with the engine's log-probs (the trainer's plus noise, as a vLLM
engine's differ), fixed scores, the KL in the loss, two steps. Once with the config's plan,
where the update gives the old log-probs, and once with the same plan built without that
rewrite (``old_logprobs_from_update``), where ``actor.old_logprobs`` runs before the update as
it did before. Each way runs in a process of its own built from the same seed.

The bound: both are fp32 forwards of the same weights on the same rows; they may group the rows
into other micro-batches (the update draws its rows at random), so they agree to fp32 rounding,
and the update, which reads them only through the ratio exp(logp - old) = 1 + rounding, agrees
to 1e-6 relative, the bound every strategy holds against the unsharded model (docs/design.md,
"Exactness").
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from rlhf_paro.metrics import Sums
from tests.confs import INLINE, load
from tests.conftest import fixed_rollout
from tests.dist_utils import run_distributed

pytestmark = [pytest.mark.dist, pytest.mark.slow]

ARGV = [*INLINE, "cluster.num_devices=1", "cluster.group_size=1",
        "algorithm.adv_estimator=grpo", "rollout.n=2", "algorithm.kl_in_loss=true",
        "algorithm.kl_coef=0.1", "ppo.rollout_batch_size=4", "ppo.mini_batch_size=8",
        "ppo.ppo_epochs=1", "actor.micro_batch_size=4", "ref.micro_batch_size=4"]
BOUND = 1e-6
# Scores that differ inside each group: every sample has a non-zero advantage.
SCORES = torch.tensor([1.0, 0.0, 0.2, 0.9, 0.5, 0.1, 0.0, 0.7])


def _record(worker: Any, method: str, into: list) -> None:
    """``worker.method`` as it was, each call's dict of named values appended to ``into``."""
    original = getattr(worker, method)

    def recorded(*args: Any, **kwargs: Any) -> Any:
        given = original(*args, **kwargs)
        into.append(given)
        return given

    setattr(worker, method, recorded)


def _steps(rank: int, world_size: int, separate: bool) -> dict:
    from rlhf_paro.actors.actor import logprobs
    from rlhf_paro.ppo import algorithms, data
    from tests.steps import local_trainer, plan_without

    cfg = load(ARGV)
    assert algorithms.old_logprobs_from_update(cfg)
    rollout = fixed_rollout(data.vocab_sizes(cfg)["actor"],
                            data.rollout_tokenizer(cfg).pad_token_id)
    trainer = local_trainer(ARGV, rollout, SCORES,
                            plan_without(cfg, "old_logprobs_from_update") if separate else None)
    actor = trainer.models["actor"].workers[0]
    # The engine's log-probs: the policy's own, 1e-3 off at random (the bound is the engine's).
    # The policy is the trainer's actor, so the source's rollout is set once it is built.
    with torch.no_grad():
        own = logprobs(actor, rollout)
    noise = torch.randn(own.shape, generator=torch.Generator().manual_seed(1)) * 1e-3
    trainer.source.rollout = dataclasses.replace(rollout,
                                                 logprobs=(own + noise) * rollout.action_mask)
    # What the update and the experience give, and the update's statistics per micro-batch,
    # read before the step's report clears them.
    updates, experiences, stats = [], [], []
    _record(actor, "train", updates)
    _record(actor, "make_experience", experiences)
    report = actor.report
    actor.report = lambda: (stats.append(dict(actor._train_stats)), report())[1]
    # Two steps on the same rollout: at step 0 the policy is the reference (a KL of 0).
    rows = [trainer.run_step(step) for step in range(2)]
    steps = [{"row": row, "stats": stat, "exp_kl": exp["exp_sums"].total["kl"],
              "update": {name: dataclasses.asdict(value) for name, value in update.items()}}
             for row, stat, exp, update in zip(rows, stats, experiences, updates)]
    return {"steps": steps, "mismatch_from": str(trainer.plan.producer("mismatch")),
            "params": {k: v.clone() for k, v in actor.engine.full_state_dict().items()}}


@pytest.fixture(scope="module")
def steps() -> dict[bool, dict]:
    return {separate: run_distributed(_steps, 1, separate)[0] for separate in (True, False)}


def test_the_update_without_the_separate_forward_is_the_same_step(steps):
    separate, fused = steps[True], steps[False]
    assert separate["params"].keys() == fused["params"].keys()
    for name, expected in separate["params"].items():
        torch.testing.assert_close(fused["params"][name], expected, rtol=BOUND, atol=0,
                                   msg=name)
    for step, (one, other) in enumerate(zip(separate["steps"], fused["steps"])):
        # The parameters moved: steps that changed nothing would also agree.
        assert other["stats"]["grad_norm"][0] > 0
        for key in ("loss", "grad_norm", "actor/kl_loss"):
            assert other["stats"][key] == pytest.approx(one["stats"][key], rel=BOUND), (step, key)
        # The ratio is 1 exactly, as in exact arithmetic: nothing clipped, no KL to the old
        # policy.
        assert other["stats"]["actor/clipfrac"] == [0.0, 0.0]
        assert other["stats"]["approx_kl"] == [0.0, 0.0]


DIFF = {"rollout/logprob_diff_max", "rollout/logprob_diff_mean"}


def test_the_kl_and_the_engines_distance_come_back_from_the_update(steps):
    assert steps[True]["mismatch_from"].startswith("actor.old_logprobs(")
    assert steps[False]["mismatch_from"].startswith("actor.train(")
    for step, (separate, fused) in enumerate(zip(steps[True]["steps"], steps[False]["steps"])):
        # The separate way gives them before the update, in its experience; this one after it,
        # from the forwards it ran before its optimizer step.
        assert separate["update"] == {"update_sums": dataclasses.asdict(Sums())}
        assert fused["exp_kl"] == 0.0
        assert set(fused["update"]) == {"update_sums", "mismatch"}
        assert fused["update"]["update_sums"]["total"]["kl"] == pytest.approx(
            separate["exp_kl"], rel=BOUND)
        assert fused["row"]["ppo/kl"] == pytest.approx(separate["row"]["ppo/kl"], rel=BOUND)
        assert DIFF <= set(separate["row"]) and DIFF <= set(fused["row"])
        if step == 0:  # the engine's 1e-3 noise (at step 1 its log-probs are a step behind)
            assert 1e-4 < separate["row"]["rollout/logprob_diff_max"] < 1e-2
        for key in DIFF:
            assert fused["row"][key] == pytest.approx(separate["row"][key], rel=1e-4), (step, key)
        # The forward it saves: none in the inference phase.
        assert separate["row"]["actor/time_s/inference"] > 0
        assert fused["row"]["actor/time_s/inference"] == 0.0
    # After one update the policy has left the reference.
    assert steps[False]["steps"][1]["row"]["ppo/kl"] > 0
