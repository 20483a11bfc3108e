"""Rollout replicas on devices of their own through the command line (docs/design.md,
"Asynchronous rollouts").

    colocated   conf=grpo_tiny (and the default PPO) on one device, the engine in the actor
    replica     the same with rollout.num_devices=1 rollout.max_staleness=0: the same rows
    off         max_staleness=1, 4 steps, a checkpoint every 2, the actor exported every step:
                staleness 0 then 1
    resumed     off's step_2 checkpoint resumed in a directory of its own: off's steps 2 and 3
    again       off's first two steps once more, from scratch: the same rows
    killed      a replica killed during a step: one line naming it
"""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf

from rlhf_paro.actors import checkpoint
from rlhf_paro.rollout import RolloutBatch
from tests.conftest import compared, demo_cache, error_line, train

pytestmark = [pytest.mark.ray, pytest.mark.slow]

# The demo's GRPO on one training device: 4 prompts x 4 samples a step.
GRPO = ["conf=grpo_tiny", "cluster.num_devices=1", "cluster.group_size=1",
        "ppo.rollout_batch_size=4", "ppo.mini_batch_size=16", "actor.micro_batch_size=8",
        "ref.micro_batch_size=8", "trainer.eval_every=0"]
REPLICA = ["rollout.num_devices=1"]


def _same(expected: list[dict], got: list[dict], steps: range) -> None:
    # The same tokens from the same per-step random streams, the same arithmetic in the same
    # order: tests/test_trainer.py's fp32 bound, 1e-6 relative.
    for step in steps:
        want, have = compared(expected[step]), compared(got[step])
        assert set(have) == set(want) and "ppo/reward_mean" in have
        assert have == pytest.approx(want, rel=1e-6, abs=0), step


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("async")


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_a_replica_of_its_own_repeats_the_colocated_run(root, algorithm):
    args = GRPO if algorithm == "grpo" else [
        "cluster.num_devices=1", "cluster.group_size=1", "ppo.rollout_batch_size=8",
        "ppo.mini_batch_size=8", "trainer.eval_every=0"]
    # One thread in every phase of both runs: the replica's run has two devices, so by default
    # each phase of it gets half the cores the colocated run's gets, and torch's CPU reductions
    # split their sums by thread, which rounds the same operations differently
    # (tests/actors/test_env_job.py measures it).
    args = [*args, "cluster.cpu_threads=1"]
    cache = demo_cache()
    colocated = train(root / f"{algorithm}-colocated", *args, "trainer.steps=2", cache=cache)
    replica = train(root / f"{algorithm}-replica", *args, *REPLICA, "trainer.steps=2",
                    cache=cache)
    assert colocated.returncode == 0, colocated.stderr
    assert replica.returncode == 0, replica.stderr
    _same(colocated.rows, replica.rows, range(2))
    for row in replica.rows:
        assert row["rollout/staleness_max"] == 0.0
        # The actor sent its weights to the replica: what it gathered, then the weights once.
        assert row["actor/comm/transfer/intra_bytes"] == row["rollout/sync/received_bytes"] > 0
    workers = json.loads((replica.out / "workers.json").read_text())
    assert len(workers["rollout"]) == 1


@pytest.fixture(scope="module")
def off(root):
    cache = demo_cache()
    args = [*GRPO, *REPLICA, "rollout.max_staleness=1", "trainer.save_every=2"]
    straight = train(root / "off", *args, "trainer.steps=4", "trainer.export_every=1",
                     cache=cache)
    resumed = train(root / "resumed", *args, "trainer.steps=4",
                    f"trainer.resume={checkpoint.checkpoint_dir(root / 'off', 2)}", cache=cache)
    again = train(root / "again", *args, "trainer.steps=2", cache=cache)
    return straight, resumed, again


def test_one_step_off_is_exact_and_reproducible(off):
    straight, _, again = off
    assert straight.returncode == 0, straight.stderr
    assert again.returncode == 0, again.stderr
    # Step 0's rollout is the initial policy's (launched before step 0); every later one is
    # exactly one update old.
    assert [r["rollout/staleness_max"] for r in straight.rows] == [0.0, 1.0, 1.0, 1.0]
    _same(straight.rows, again.rows, range(2))


def _logprob_gap(rollout: RolloutBatch, model_dir, temperature: float) -> float:
    """The largest |difference| over the actions between a rollout's log-probs (its engine's)
    and those of the model in ``model_dir`` (one plain forward of each row's real tokens)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gap = 0.0
    for row in range(len(rollout)):
        ids = rollout.sequences[row][rollout.attention_mask[row].bool()]
        n = int(rollout.response_attention[row].sum())  # the response's real tokens, last
        with torch.no_grad():
            logits = model(ids[None]).logits[0, -n - 1:-1].float()
        logp = torch.log_softmax(logits / temperature, -1).gather(-1, ids[-n:, None])[:, 0]
        actions = rollout.action_mask[row][:n].bool()
        gap = max(gap, float((logp - rollout.logprobs[row][:n])[actions].abs().max()))
    return gap


def test_the_replica_generates_with_the_policy_one_update_old(off):
    # The checkpoint of step 2 holds step 2's rollout, which the replica generated during step 1
    # with the weights it had received: those of the policy after one update (exported at step
    # 1), not its first ones nor the newer policy's. Their log-probs against the engine's, both
    # fp32: a few ulps apart, as tests/actors/test_ppo_job.py's 1e-4 bound for the hf engine.
    straight = off[0]
    step_2 = checkpoint.checkpoint_dir(straight.out, 2)
    [rollout], meta = checkpoint.read_rollouts(step_2, RolloutBatch)[2]
    assert meta["version"] == 1
    temperature = OmegaConf.load(step_2 / checkpoint.CONFIG_FILE).ppo.temperature
    hf = straight.out / "hf"
    assert _logprob_gap(rollout, hf / "step_1" / "actor", temperature) <= 1e-4
    # One update moves these log-probs far past that bound: a replica still at its first
    # weights, or at the newer policy's, fails the check above.
    assert _logprob_gap(rollout, hf / "step_2" / "actor", temperature) > 1e-2


def test_a_resumed_run_repeats_the_straight_run_with_the_rollout_launched_ahead(off):
    straight, resumed, _ = off
    assert resumed.returncode == 0, resumed.stderr
    step_2 = checkpoint.checkpoint_dir(straight.out, 2)
    # The checkpoint holds step 2's rollout, launched during step 1 with the policy after one
    # update, which the resumed run collects instead of generating it again.
    assert (step_2 / checkpoint.ROLLOUTS_DIR / "step_2" / "rank_0.safetensors").is_file()
    assert [r["step"] for r in resumed.rows] == [2, 3]
    _same({2: straight.rows[2], 3: straight.rows[3]},
          {2: resumed.rows[0], 3: resumed.rows[1]}, range(2, 4))


def test_a_dead_replica_is_one_line_naming_it(root):
    # Steps of this run take about 0.1 s on a quiet machine: with few of them left after step 1,
    # the run could end before the kill lands (its last rollouts generated already), exit 0 and
    # print no line. 40 steps cost nothing more: the run stops at the kill.
    run = train(root / "killed", *GRPO, *REPLICA, "rollout.max_staleness=1", "trainer.steps=40",
                cache=demo_cache(), kill_role=("rollout", 0), kill_after_step=1)
    line = error_line(run)
    assert run.returncode == 1 and run.left == [], (run.stderr, run.left)
    assert line.startswith("error: rollout rank 0 died at step "), line


def test_more_rollout_devices_than_the_cluster_has_is_one_line(root):
    # A private Ray of 2 CPU slots (ray.num_cpus): the shared one has room for the run.
    run = train(root / "crowded", *GRPO, "rollout.num_devices=4", "ray.num_cpus=2",
                "trainer.steps=1", cache=demo_cache(), private=True)
    line = error_line(run)
    assert run.returncode == 2, run.stderr
    assert line.startswith("error: rollout.num_devices: needs 5 CPUs: 1 in groups of 1"), line
