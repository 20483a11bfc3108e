"""Checkpoint directories without Ray: a checkpoint is complete or absent, a damaged one is
refused in one line, pruning keeps the newest, RNG states survive JSON."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from rlhf_paro.actors import checkpoint
from rlhf_paro.config import MANIFEST, ConfigError


def _save(out, step: int, payload: bytes = b"weights", publish: bool = True):
    """A checkpoint of ``step`` with two files, as the trainer writes one."""
    scratch = checkpoint.scratch(out, step)
    (scratch / "actor").mkdir()
    (scratch / "actor" / "rank_00000.bin").write_bytes(payload)
    checkpoint.write_json(scratch / checkpoint.TRAINER_FILE, {"step": step})
    if publish:
        digests = {n: checkpoint.file_digest(scratch / n) for n in checkpoint.files(scratch)}
        checkpoint.publish(scratch, checkpoint.checkpoint_dir(out, step), step, digests)
    return scratch


def test_a_save_killed_before_its_rename_leaves_the_previous_checkpoint_newest(tmp_path):
    _save(tmp_path, 2)
    _save(tmp_path, 4, publish=False)  # killed while writing: only its scratch exists
    assert checkpoint.newest(tmp_path) == checkpoint.checkpoint_dir(tmp_path, 2)
    listed = checkpoint.check(checkpoint.newest(tmp_path))
    assert set(listed) == {"actor/rank_00000.bin", checkpoint.TRAINER_FILE}
    assert listed["actor/rank_00000.bin"]["bytes"] == len(b"weights")
    checkpoint.prune(tmp_path, keep=2)  # the next save clears the scratch away
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_2"]


def test_saving_a_step_again_replaces_it(tmp_path):
    _save(tmp_path, 2, b"old")
    _save(tmp_path, 2, b"new")
    path = checkpoint.newest(tmp_path)
    assert (path / "actor" / "rank_00000.bin").read_bytes() == b"new"
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_2"]


@pytest.mark.parametrize("damage, problem", [
    (lambda p: (p / "actor" / "rank_00000.bin").unlink(), "rank_00000.bin is missing"),
    (lambda p: (p / "actor" / "rank_00000.bin").write_bytes(b"cut"), "has 3 bytes"),
    (lambda p: (p / MANIFEST).write_text("{"), "unreadable manifest.json"),
    # JSON of another shape: an AttributeError traceback on .items() before it was refused.
    (lambda p: (p / MANIFEST).write_text('{"step": 2, "files": ["a"]}'),
     "malformed manifest.json"),
    (lambda p: (p / MANIFEST).write_text('{"step": 2, "files": {"a": {"bytes": "3"}}}'),
     "malformed manifest.json"),
    (lambda p: (p / MANIFEST).write_text('{"step": 2, "files": {"a": 3}}'),
     "malformed manifest.json"),
])
def test_a_checkpoint_that_does_not_match_its_manifest_is_refused_in_one_line(
        tmp_path, damage, problem):
    _save(tmp_path, 2)
    path = checkpoint.newest(tmp_path)
    damage(path)
    with pytest.raises(checkpoint.DamagedCheckpoint, match=problem) as info:  # resume skips it
        checkpoint.check(path)
    assert str(info.value).startswith("trainer.resume: checkpoint ") and "\n" not in str(info.value)


def test_same_size_other_bytes_fail_the_hash(tmp_path):
    _save(tmp_path, 2, b"weights")
    path = checkpoint.newest(tmp_path)
    (path / "actor" / "rank_00000.bin").write_bytes(b"weightz")
    listed = checkpoint.check(path)  # sizes still match
    digests = {n: checkpoint.file_digest(path / n) for n in listed}
    with pytest.raises(ConfigError, match="rank_00000.bin has changed"):
        checkpoint.refuse_changed(path, listed, digests)


def test_prune_keeps_the_newest_and_discard_removes_a_replaced_run(tmp_path):
    for step in (2, 4, 6, 10):
        _save(tmp_path, step)
    removed = checkpoint.prune(tmp_path, keep=3)
    assert [p.name for p in removed] == ["step_2"]
    assert checkpoint.prune(tmp_path, keep=0) == []  # 0 keeps all
    removed = checkpoint.discard_after(tmp_path, 4)
    assert [p.name for p in removed] == ["step_6", "step_10"]
    assert [k for k, _ in checkpoint.complete(tmp_path)] == [4]


def test_rng_states_come_back_through_json():
    generator = torch.Generator().manual_seed(5)
    state = json.loads(json.dumps(checkpoint.rng_state()))
    saved_generator = checkpoint.generator_state(generator)

    def draw():
        return (torch.rand(3).tolist(), random.random(), np.random.rand(),
                torch.rand(2, generator=generator).tolist())

    expected = draw()
    checkpoint.set_rng_state(state)
    checkpoint.set_generator_state(generator, saved_generator)
    assert draw() == expected
