"""GRPO through the command line a user runs: three models (no critic anywhere), several samples
per prompt, a kill and resume that continue exactly, and the reward from a server.

    straight   conf=grpo_tiny, 4 steps from scratch, a checkpoint every 2 steps
    killed     40 steps in its own directory, every checkpoint kept; the actor is SIGKILLed once
               step 1 is logged (its step_2 checkpoint is written before the row)
    resumed    trainer.resume=<killed's step_2> in killed's directory: goes on to step 4, whatever
               the kill left after step_2 (a 4-step run killed after step 2 could finish before
               the kill landed: steps take a fraction of a second)
    served     2 steps with reward.url: the reference server on loopback runs the conf's
               reward function, with a bearer token
"""

from __future__ import annotations

import json
import os
import re
import select
import subprocess
import sys

import pytest

from rlhf_paro.actors import checkpoint
from rlhf_paro.metrics import required_keys
from tests.confs import load
from tests.conftest import Run, compared, demo_cache, error_line, marked, train

pytestmark = [pytest.mark.ray, pytest.mark.slow]

# A small grpo_tiny: 4 prompts x 4 samples a step, one rank (what these runs check does not
# depend on the ranks: a resume of several ranks is tests/test_trainer.py's, GRPO's groups over
# ranks tests/actors/test_action_mask.py's), one optimizer step a step.
SMALL = ["conf=grpo_tiny", "cluster.num_devices=1", "cluster.group_size=1",
         "task.model.hidden_size=32", "task.model.intermediate_size=64", "task.sft_steps=10",
         "task.train_prompts=64", "task.val_prompts=8", "ppo.rollout_batch_size=4",
         "ppo.mini_batch_size=16", "actor.micro_batch_size=4", "ref.micro_batch_size=8",
         "trainer.eval_every=0", "trainer.save_every=2"]
ROLES = ("actor", "reward", "ref")
TOKEN_ENV = "RLHF_PARO_TEST_REWARD_TOKEN"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Run]:
    root = tmp_path_factory.mktemp("grpo")
    cache = demo_cache()
    straight = train(root / "straight", *SMALL, "trainer.steps=4", cache=cache,
                     watch=_critic_processes)
    assert straight.returncode == 0, straight.stderr
    # Steps take a fraction of a second: 40 of them keep the run going until the kill lands.
    killed = train(root / "killed", *SMALL, "trainer.steps=40", "trainer.keep_checkpoints=0",
                   cache=cache, kill_after_step=1, kill_role=("actor", 0))
    resumed = train(root / "killed", *SMALL, "trainer.steps=4",
                    f"trainer.resume={checkpoint.checkpoint_dir(root / 'killed', 2)}",
                    cache=cache)
    # The conf's reward function (the demo's score), served over HTTP on loopback.
    spec = load([*SMALL, f"task.cache_dir={cache}"]).reward.function
    os.environ[TOKEN_ENV] = "grpo-test-token"  # the run's processes (its private Ray) inherit it
    with subprocess.Popen([sys.executable, "-m", "rlhf_paro.reward_server", spec, "--port", "0",
                           "--token-env", TOKEN_ENV], stdout=subprocess.PIPE, text=True) as proc:
        try:
            ready, _, _ = select.select([proc.stdout], [], [], 60)
            url = re.search(r" at (http://127\.0\.0\.1:\d+/score),",
                            proc.stdout.readline() if ready else "")
            assert url, proc.poll()
            served = train(root / "served", *SMALL, "trainer.steps=2", f"reward.url={url[1]}",
                           f"reward.token_env={TOKEN_ENV}", cache=cache,
                           private=True)  # its reward workers read the token where they run
        finally:
            proc.kill()
            os.environ.pop(TOKEN_ENV)
    return {"straight": straight, "killed": killed, "resumed": resumed, "served": served}


def _critic_processes(mark: str) -> list[str]:
    """Processes of the run whose command line names a critic worker (Ray titles each worker
    process after its actor class)."""
    return [cmd for cmd in marked(mark) if "Critic" in cmd]


def test_three_models_run_and_no_critic_worker_ever_exists(runs):
    straight = runs["straight"]
    assert set(json.loads((straight.out / "workers.json").read_text())) == set(ROLES)
    assert straight.watched == [], straight.watched  # sampled while the run went on
    for row in straight.rows:
        assert not any(k.startswith("critic/") for k in row)
        # The demo's prompt files and reward function, no score function: no task score.
        missing = set(required_keys(ROLES, task_score=False)) - set(row)
        assert not missing and "ppo/task_score" not in row, sorted(missing)
    # 4 prompts x rollout.n = 4 samples each step.
    assert all(r["ppo/reward_mean"] >= 0 for r in straight.rows)
    run = json.loads((straight.out / "run.json").read_text())
    assert set(run["strategies"]) == set(ROLES) and run["algorithm"] == "grpo"
    # No critic in the checkpoint, and none exported.
    step_4 = checkpoint.checkpoint_dir(straight.out, 4)
    assert sorted(p.name for p in step_4.iterdir() if p.is_dir()) == ["actor", "ref", "workers"]
    assert not (straight.out / "hf" / "critic").exists()
    assert (straight.out / "hf" / "actor" / "config.json").is_file()


def test_the_update_gives_the_old_log_probs_and_the_kl_to_the_reference(runs):
    # One pass over one mini-batch with the KL in the loss (algorithms.old_logprobs_from_update):
    # no forward of the old log-probs of their own, a ratio of exactly 1 in the update.
    rows = runs["straight"].rows
    assert all(r["actor/time_s/inference"] == 0.0 for r in rows)
    assert all(r["actor/approx_kl"] == 0.0 and r["actor/clipfrac"] == 0.0 for r in rows)
    # The KL to the reference, from the update's forwards: within fp32 rounding of 0 while the
    # policy is the reference's copy (step 0), then the updates' (a trainer that dropped the
    # update's figure would log 0 at every step).
    assert abs(rows[0]["ppo/kl"]) < 1e-6 < min(r["ppo/kl"] for r in rows[1:])


def test_a_killed_grpo_run_resumes_exactly(runs):
    straight, killed, resumed = runs["straight"], runs["killed"], runs["resumed"]
    assert killed.returncode == 1 and killed.left == []
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {checkpoint.checkpoint_dir(resumed.out, 2)}: step 2 of 4" \
        in resumed.stdout
    assert [r["step"] for r in resumed.rows] == [0, 1, 2, 3]
    # The same arithmetic in the same order as the straight run: the fp32 bound of
    # tests/test_trainer.py (1e-6 relative).
    for step in range(4):
        expected, got = compared(straight.rows[step]), compared(resumed.rows[step])
        assert set(got) == set(expected) and "ppo/kl" in got
        assert got == pytest.approx(expected, rel=1e-6, abs=0), step


def test_a_reward_server_gives_the_run_of_the_same_function_in_process(runs):
    straight, served = runs["straight"], runs["served"]
    assert served.returncode == 0, served.stderr
    assert [r["step"] for r in served.rows] == [0, 1]
    # Same seed, same scores: the same arithmetic as the in-process function's run.
    for step in range(2):
        expected, got = compared(straight.rows[step]), compared(served.rows[step])
        assert got == pytest.approx(expected, rel=1e-6, abs=0), step


def test_a_reward_function_that_kills_its_worker_is_named_with_the_step(tmp_path_factory):
    # Before, the line said "reward rank 0 died" and named no function. A function that raises
    # SystemExit or KeyboardInterrupt raises a RewardFunctionError instead (tests/ppo/
    # test_rewards.py), which reaches the user as any other function error does
    # (tests/actors/test_own_models.py): only a death needs a run of its own.
    root = tmp_path_factory.mktemp("leaving")
    fns = root / "leaving.py"
    fns.write_text("import os\n\n\ndef score(prompts, responses, **columns):\n    os._exit(3)\n")
    spec = f"{fns}:score"
    run = train(root / "run", *SMALL, "trainer.steps=1",
                f"reward.function={spec}", cache=demo_cache())
    assert run.returncode == 1 and run.left == []
    assert error_line(run).startswith(
        f"error: reward rank 0 died at step 0 running reward function {spec} (its process "
        "exited: killed, out of memory or crashed); no checkpoint yet")
