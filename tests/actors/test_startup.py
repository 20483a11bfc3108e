"""A run's start on its own machine (``actors/group.py``, ``preloaded_workers``): its workers fork
from the zygote that has imported what they import, instead of each importing torch and
transformers for seconds, and train the same rows as workers Ray starts itself; each phase of
the start that goes on says so in one line (``phase``).

Two in-process runs of PPO's four models on one device, 2 steps: with the preload, and with
Ray's own worker start-up.
"""

from __future__ import annotations

import contextlib

import psutil
import pytest
import ray

from rlhf_paro import cluster, trainer
from rlhf_paro.actors import group
from rlhf_paro.metrics import read_jsonl
from tests.confs import INLINE, load
from tests.conftest import compared

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ARGV = [*INLINE, "cluster.num_devices=1", "cluster.group_size=1", "ppo.rollout_batch_size=4",
        "ppo.mini_batch_size=4", "actor.micro_batch_size=2", "critic.micro_batch_size=2",
        "reward.micro_batch_size=4", "ref.micro_batch_size=4", "ppo.ppo_epochs=1",
        "task.train_prompts=16", "task.val_prompts=4", "trainer.steps=2",
        "trainer.save_every=0", "trainer.export_every=0", "logger.wandb.mode=disabled",
        "logger.progress=false"]


def _run(out):
    """The run's rows, and each worker's parent process's command line."""
    cfg = load([*ARGV, f"trainer.output_dir={out}"])
    try:
        run = trainer.PPOTrainer(cfg)  # starts a private Ray
        try:
            parents = {role: [" ".join(psutil.Process(pid).parent().cmdline()) for pid in pids]
                       for role, pids in run.pids.items()}
            run.fit()
        finally:
            run.shutdown()
    finally:
        ray.shutdown()
    return read_jsonl(str(out / "metrics.jsonl")), parents


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("startup")
    out = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(group, "preloaded_workers", contextlib.nullcontext)
        out["ray's own"] = _run(root / "own")
    capture = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(group, "NOTE_S", 0.0)  # every phase says so, however quick
        # The start's lines come from where the workers are started (cluster.py).
        patch.setattr(cluster, "print", lambda *a, **k: capture.append(" ".join(map(str, a))),
                      raising=False)
        out["preloaded"] = _run(root / "preloaded")
    out["lines"] = capture
    return out


def test_a_private_rays_workers_fork_from_the_zygote_and_train_the_same_rows(runs):
    rows, parents = runs["preloaded"]
    assert set(parents) == {"actor", "critic", "reward", "ref"}
    for role, commands in parents.items():
        assert all("rlhf_paro.actors.zygote" in command for command in commands), (role, commands)
    own_rows, own_parents = runs["ray's own"]
    assert not any("zygote" in command for commands in own_parents.values()
                   for command in commands), own_parents
    assert len(rows) == 2
    assert [compared(row) for row in rows] == [compared(row) for row in own_rows]


def test_each_phase_of_the_start_says_so_in_one_line(runs):
    said = [line for line in runs["lines"] if not line.startswith("waiting for")]
    assert said == ["starting Ray on this machine",
                    "starting 4 worker processes (actor, critic, reward, ref)",
                    "building the models on 1 device (process groups, weights, engines)"], said
