"""The multi-turn demo through the command line a user runs (``conf=grpo_agent_tiny``, small):
its episodes' ``env/*`` metrics, and a resume that repeats the straight run's steps.

    straight   4 steps on one rank, a checkpoint every 2 steps, greedy games every 2
    resumed    trainer.resume=<straight's step_2> in a directory of its own: steps 2 and 3 again
"""

from __future__ import annotations

import pytest

from rlhf_paro.actors import checkpoint
from rlhf_paro.metrics import required_keys
from tests.conftest import Run, compared, demo_cache, train

pytestmark = [pytest.mark.ray, pytest.mark.slow]

# A small grpo_agent_tiny: 4 games x 4 episodes a step, one rank (a rank's games do not depend on
# the others'), one optimizer step a step.
SMALL = ["conf=grpo_agent_tiny", "cluster.num_devices=1", "cluster.group_size=1",
         "task.model.hidden_size=32", "task.model.intermediate_size=64", "task.sft_steps=20",
         "task.train_prompts=64", "task.val_prompts=8", "ppo.rollout_batch_size=4",
         "rollout.n=4", "ppo.mini_batch_size=16", "actor.micro_batch_size=4",
         "ref.micro_batch_size=8", "trainer.eval_every=2", "trainer.save_every=2"]
ROLES = ("actor", "reward", "ref")
MAX_TURNS = 5  # the conf's env.max_turns


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Run]:
    root = tmp_path_factory.mktemp("agent")
    cache = demo_cache()
    straight = train(root / "straight", *SMALL, "trainer.steps=4", cache=cache)
    assert straight.returncode == 0, straight.stderr
    resumed = train(root / "resumed", *SMALL, "trainer.steps=4",
                    f"trainer.resume={checkpoint.checkpoint_dir(root / 'straight', 2)}",
                    cache=cache)
    return {"straight": straight, "resumed": resumed}


def _env(row: dict) -> dict:
    """A row's env/* metrics but the environment's times (step_time_s, step_latency_p*_s)."""
    return {k: v for k, v in row.items() if k.startswith("env/") and not k.endswith("_s")}


def test_every_step_plays_whole_games_and_logs_them(runs):
    rows = runs["straight"].rows
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for row in rows:
        missing = set(required_keys(ROLES, task_score=False)) - set(row)  # no score function
        assert not missing, sorted(missing)
        turns = row["env/turns_mean"]
        assert 1 <= turns <= MAX_TURNS
        # Every turn but an episode's last is answered with one word (higher or lower), and an
        # action is a symbol and <eos>, or less (a turn that starts with <eos> forfeits).
        assert row["env/observation_tokens"] == pytest.approx(turns - 1) and turns > 1
        assert turns <= row["env/action_tokens"] <= 2 * turns
        assert row["ppo/response_length"] == pytest.approx(row["env/action_tokens"])
        assert 0 <= row["env/truncated_fraction"] == row["env/truncated_fraction_max_turns"] <= 1
        assert row["env/truncated_fraction_max_total_tokens"] == 0  # 16 of 64 tokens at most
        assert row["env/tool_calls"] == row["env/tool_errors"] == 0
        # The games' steps were timed (a step of this game takes microseconds), and all of them
        # ran within the step's generation: the mean step's seconds times the steps (one per
        # turn, none cut by tokens above) within timing_s/generate.
        steps = 16 * turns
        assert 0 < row["env/step_time_s"] * steps <= row["timing_s/generate"]
        # Where the rollout's time went: within the generation, in order.
        assert 0 <= row["rollout/engine_idle_fraction"] <= 1
        assert 0 < row["rollout/first_sample_s"] <= row["rollout/last_sample_s"] \
            <= row["timing_s/generate"]
        assert 0 < row["env/step_latency_p50_s"] <= row["env/step_latency_p90_s"] \
            <= row["env/step_latency_p99_s"] < row["timing_s/generate"]
        # The reward is the game's score: a win is 1, anything else 0, over 4 x 4 episodes a
        # step (no score function: no task score apart from it).
        assert "ppo/task_score" not in row
        assert (16 * row["ppo/reward_mean"]) == pytest.approx(round(16 * row["ppo/reward_mean"]))
        # A truncated episode is a lost one.
        assert row["ppo/reward_mean"] <= 1 - row["env/truncated_fraction"]
    # Greedy games on the validation rows after steps 1 and 3.
    evals = [r["eval/score_mean"] for r in rows if "eval/score_mean" in r]
    assert len(evals) == 2 and all(0 <= e <= 1 for e in evals)


def test_a_resumed_agent_run_repeats_the_straight_runs_steps(runs):
    # Restored shards, Adam moments and random streams, and the same games from the same rows:
    # the same arithmetic in the same order, held to the fp32 bound of tests/test_trainer.py
    # (1e-6 relative); the episodes' counts are equal outright.
    straight, resumed = runs["straight"], runs["resumed"]
    assert resumed.returncode == 0, resumed.stderr
    assert [r["step"] for r in resumed.rows] == [2, 3]
    for got in resumed.rows:
        expected = straight.rows[got["step"]]
        assert set(compared(got)) == set(compared(expected)) and "ppo/kl" in compared(got)
        assert compared(got) == pytest.approx(compared(expected), rel=1e-6, abs=0), got["step"]
        assert _env(got) == _env(expected) and _env(got), got["step"]
