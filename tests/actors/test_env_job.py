"""Multi-turn episodes through the command line (docs/design.md, "Multi-turn episodes").

    one turn     an environment that ends after its first step, rewarding the action with the
                 reward function's score, gives the single-turn run with that function, row for
                 row, on hf and on vllm: the multi-turn path adds nothing to a one-turn episode
    timeout      an environment whose step outlasts env.timeout_s at step 2 stops the run in one
                 line naming it, the step and the sample, its step_2 checkpoint intact
    sys.exit     an environment that calls sys.exit() in a step at step 2 does the same (it read
                 as the actor rank's death)
"""

from __future__ import annotations

import pytest

from rlhf_paro.actors import checkpoint
from rlhf_paro.rollout import vllm as vllm_engine
from tests.conftest import compared, demo_cache, error_line, train

pytestmark = [pytest.mark.ray, pytest.mark.slow]

# The demo's GRPO on one rank (what a rank sees of an episode does not depend on the others'),
# 4 prompts x 4 samples a step; hidden 64 (heads of 32, which vLLM's CPU attention needs); prompts
# of at most 8 tokens, so an episode has room in the demo model's 64 positions.
SMALL = ["conf=grpo_tiny", "cluster.num_devices=1", "cluster.group_size=1",
         "task.model.hidden_size=64", "task.model.intermediate_size=128",
         "ppo.rollout_batch_size=4", "ppo.mini_batch_size=16", "actor.micro_batch_size=4",
         "ref.micro_batch_size=8", "trainer.eval_every=0", "data.max_prompt_length=8"]
ONE_STEP = '''
import sys
import time

from rlhf_paro.ppo.task import counting_score


class OneStep:
    """Scores the action with the counting score and ends the episode."""

    def __init__(self, prompt, **columns):
        self.prompt, self.columns = prompt, {k: [v] for k, v in columns.items()}

    def reset(self):
        return None

    def step(self, action):
        return None, counting_score([self.prompt], [action], **self.columns)[0], True


class Stuck(OneStep):
    """Takes a minute over the steps of one prompt's samples."""

    def reset(self, seed):
        self.seed = seed

    def step(self, action):
        if self.columns["stall"][0]:
            time.sleep(60)
        return super().step(action)


class Exits(Stuck):
    """Calls sys.exit() in the steps of one prompt's samples."""

    def step(self, action):
        if self.columns["stall"][0]:
            sys.exit(3)
        return OneStep.step(self, action)
'''


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("env")
    (root / "envs.py").write_text(ONE_STEP)
    return root


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_a_one_turn_episode_repeats_the_single_turn_run_row_for_row(root, engine):
    if engine == "vllm" and not vllm_engine.installed():
        pytest.skip('needs the vllm extra: pip install -e ".[vllm]"')
    # One thread in every phase of every run: the replica's run has two devices, so by default
    # each phase gets half the cores the single run's gets, and torch's CPU reductions split
    # their sums by thread (a sum over more than 32768 values is cut into a part per thread), so
    # the same operations round differently (4 threads against 2 on this model: ppo/kl 7e-7
    # apart at step 1); at equal threads, equal bits. The replica's run shuffles its mini-batches
    # as the colocated one does only because building the colocated vLLM engine leaves the
    # actor's random stream alone (ActorWorker.shard_model): it once reseeded it, 1.6e-6 apart.
    cache, args = demo_cache(), [*SMALL, f"rollout.engine={engine}", "trainer.steps=2",
                                 "cluster.cpu_threads=1"]
    env = [f"env.function={root}/envs.py:OneStep", "env.reward=env"]
    single = train(root / f"single-{engine}", *args, cache=cache)
    runs = {"colocated": train(root / f"episodes-{engine}", *args, *env, cache=cache)}
    if engine == "vllm":
        # Streamed (each episode its own loop) on a replica of its own: every rollout source
        # gives the same rows.
        runs["replica"] = train(root / f"replica-{engine}", *args, *env,
                                "rollout.num_devices=1", cache=cache)
    assert single.returncode == 0, single.stderr
    for name, episodes in runs.items():
        assert episodes.returncode == 0, episodes.stderr
        for step in range(2):
            expected, got = compared(single.rows[step]), compared(episodes.rows[step])
            assert set(got) == set(expected) and "ppo/reward_mean" in got
            # The same tokens sampled by the same random streams, the same scores: the same fp32
            # arithmetic in the same order (tests/test_trainer.py's bound, 1e-6 relative).
            assert got == pytest.approx(expected, rel=1e-6, abs=0), (name, step)
            row = episodes.rows[step]
            assert row["env/turns_mean"] == 1.0 and row["env/observation_tokens"] == 0.0
            assert row["env/action_tokens"] == row["ppo/response_length"]


@pytest.mark.parametrize("name, says", [
    ("Stuck", "Stuck.step took longer than env.timeout_s=2 at step 2, sample {k} (turn 0)"),
    ("Exits", "Exits.step raised at step 2, sample {k} (turn 0) (SystemExit: 3)"),
])
def test_an_environment_past_its_timeout_or_exiting_stops_the_run_in_one_line(root, name, says):
    # Rows of the demo's prompts carry no "stall" column: the environment stalls through a
    # column made by a prompt file of its own.
    import json

    prompts = root / "stall.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": "a b c", "num_symbols": 16,
                                           "response_len": 8, "stall": i == 9}) + "\n"
                               for i in range(16)))
    run = train(root / name, *SMALL, "trainer.steps=4", "trainer.save_every=2",
                f"data.train_files={prompts}", "data.shuffle=false",
                f"env.function={root}/envs.py:{name}", "env.reward=env", "env.timeout_s=2",
                cache=demo_cache())
    line = error_line(run)
    assert run.returncode == 1, run.stderr
    # Step 2 takes rows 8 to 11, each 4 times (rollout.n): row 9's samples are 4 to 7, which
    # stall or exit at once in their threads; the line names the one whose failure came first.
    newest = checkpoint.checkpoint_dir(run.out, 2)
    assert any(line.startswith(f"error: {says.format(k=k)}; newest checkpoint: {newest}")
               for k in range(4, 8)), line
    assert checkpoint.newest(run.out) == newest
    checkpoint.check(newest)  # complete: every file its manifest lists, of its size
    assert [r["step"] for r in run.rows] == [0, 1]
    assert run.left == [], run.left
