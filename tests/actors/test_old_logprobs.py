"""The old log-probs from the update's own forwards (``algorithms.old_logprobs_from_update``):
the same step as with their separate forward, one forward fewer.

An actor and a reference worker (``Worker.shard_model``, no Ray, one gloo rank) take one fixed
GRPO rollout with the engine's log-probs (the trainer's plus noise, as a vLLM engine's differ),
make its experience with the KL in the loss and run the update, two steps, once the way the
trainer did before (``old_logprobs``, then ``make_experience`` and ``train``) and once without
the separate forward. Each way runs in a process of its own built from the same seed.

The bound: both are fp32 forwards of the same weights on the same rows; they may group the rows
into other micro-batches (the update draws its rows at random), so they agree to fp32 rounding,
and the update, which reads them only through the ratio exp(logp - old) = 1 + rounding, agrees
to 1e-6 relative, the bound every strategy holds against the unsharded model (docs/design.md,
"Exactness").
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.confs import INLINE, load
from tests.conftest import fixed_rollout
from tests.dist_utils import run_distributed

pytestmark = [pytest.mark.dist, pytest.mark.slow]

ARGV = [*INLINE, "cluster.num_devices=1", "cluster.group_size=1",
        "algorithm.adv_estimator=grpo", "rollout.n=2", "algorithm.kl_in_loss=true",
        "algorithm.kl_coef=0.1", "ppo.rollout_batch_size=4", "ppo.mini_batch_size=8",
        "ppo.ppo_epochs=1", "actor.micro_batch_size=4", "ref.micro_batch_size=4"]
BOUND = 1e-6


def _step(rank: int, world_size: int, separate: bool) -> dict:
    from rlhf_paro.actors.actor import ActorWorker, logprobs
    from rlhf_paro.actors.ref import RefWorker
    from rlhf_paro.ppo import algorithms, data

    cfg = load(ARGV)
    assert algorithms.old_logprobs_from_update(cfg)
    actor, ref = ActorWorker(cfg, "actor", rank, world_size), RefWorker(cfg, "ref", rank,
                                                                         world_size)
    for worker in (actor, ref):
        worker.shard_model()
    rollout = fixed_rollout(data.vocab_sizes(cfg)["actor"], actor.tokenizer.pad_token_id)
    # The engine's log-probs: the policy's own, 1e-3 off at random (the bound is the engine's).
    with torch.no_grad():
        own = logprobs(actor, rollout)
    noise = torch.randn(own.shape, generator=torch.Generator().manual_seed(1)) * 1e-3
    rollout = dataclasses.replace(rollout, logprobs=(own + noise) * rollout.action_mask)
    # Scores that differ inside each group: every sample has a non-zero advantage.
    score = torch.tensor([1.0, 0.0, 0.2, 0.9, 0.5, 0.1, 0.0, 0.7])
    ref_logp = ref.logprobs(rollout)
    steps = []
    # Two steps on the same rollout: at step 0 the policy is the reference (a KL of 0).
    for step in range(2):
        actor.set_rollout(rollout)
        diff = actor.old_logprobs() if separate else {}
        _, sums = actor.make_experience(ref_logp, None, score, kl_coef=0.1)
        returned = actor.train(step=step, kl_coef=0.1)
        stats = dict(actor._train_stats)
        steps.append({"diff": diff, "sums": sums, "returned": returned, "stats": stats,
                      "inference_s": actor.report().time_s.get("inference", 0.0)})
    return {"steps": steps,
            "params": {k: v.clone() for k, v in actor.engine.full_state_dict().items()}}


@pytest.fixture(scope="module")
def steps() -> dict[bool, dict]:
    return {separate: run_distributed(_step, 1, separate)[0] for separate in (True, False)}


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


def test_the_kl_and_the_engines_distance_come_back_from_the_update(steps):
    for step, (separate, fused) in enumerate(zip(steps[True]["steps"], steps[False]["steps"])):
        # The separate way gives them before the update, as the trainer logged them; this one
        # after it, from the forwards it ran before its optimizer step.
        assert separate["returned"] == {} and fused["sums"]["kl"] == 0.0
        assert fused["returned"]["kl"] == pytest.approx(separate["sums"]["kl"], rel=BOUND)
        assert set(fused["returned"]) == {"kl", *separate["diff"]}
        if step == 0:  # the engine's 1e-3 noise (at step 1 its log-probs are a step behind)
            assert 1e-4 < separate["diff"]["logprob_diff_max"] < 1e-2
        for key, value in separate["diff"].items():
            assert fused["returned"][key] == pytest.approx(value, rel=1e-4), (step, key)
        # The forward it saves: none in the inference phase.
        assert separate["inference_s"] > 0 and fused["inference_s"] == 0.0
    # After one update the policy has left the reference.
    assert steps[False]["steps"][1]["returned"]["kl"] > 0
