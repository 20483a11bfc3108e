"""The keys of asynchronous rollouts (docs/design.md, "Asynchronous rollouts"): bad values are
one line naming the key and what is allowed, before anything starts."""

from __future__ import annotations

import pytest

from rlhf_paro import train
from tests.confs import INLINE


@pytest.fixture
def jobs(monkeypatch, tmp_path):
    ran = []
    monkeypatch.setattr(train, "run", lambda cfg, argv: ran.append(cfg))
    monkeypatch.chdir(tmp_path)
    return ran


@pytest.mark.parametrize("bad, key, says", [
    (["rollout.max_staleness=1"], "rollout.max_staleness",
     "needs devices of its own for the rollout"),
    (["rollout.num_devices=-1"], "rollout.num_devices", "must be >= 0, got -1"),
    (["rollout.num_devices=1", "rollout.max_staleness=-2"], "rollout.max_staleness",
     "must be >= 0, got -2"),
    (["rollout.num_devices=3"], "rollout.num_devices",
     "3 replicas do not share ppo.rollout_batch_size=64 prompts evenly"),
    (["rollout.num_devices=1", "rollout.tensor_parallel_size=2"],
     "rollout.tensor_parallel_size", "2 does not divide rollout.num_devices=1"),
])
def test_bad_asynchronous_rollout_keys_are_one_line(jobs, capsys, tmp_path, bad, key, says):
    with pytest.raises(SystemExit) as info:
        train.main([f"trainer.output_dir={tmp_path / 'out'}", *INLINE, *bad])
    stderr = capsys.readouterr().err
    assert info.value.code == 2 and stderr.count("\n") == 1, stderr
    assert stderr.startswith(f"error: {key}: ") and says in stderr, stderr
    assert jobs == [] and not (tmp_path / "out").exists()


def test_good_keys_reach_the_run(jobs, capsys):
    train.main([*INLINE, "rollout.num_devices=2", "rollout.max_staleness=1"])
    assert capsys.readouterr().err == ""
    assert (jobs[0].rollout.num_devices, jobs[0].rollout.max_staleness) == (2, 1)
