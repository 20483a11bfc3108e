"""Checkpoints, resume and faults of the PPO loop, through the command line a user runs.

One module-scoped chain of short runs (each start of Ray and 16 workers costs most of a run's
time, so every test below reads the same runs):

    straight   4 steps from scratch, a checkpoint every 2 steps
    killed     resumed from straight's step_2 into its own directory, 6 steps; actor rank 1 is
               SIGKILLed during step 5
    finished   trainer.resume=auto in killed's directory: goes on from its step_4 to step 6, with
               actor rank 1's loss NaN at step 5 (one skipped optimizer step, within the limit)
    nan_stop   resumed from straight's step_2 on one device; critic rank 0's loss NaN at step 2,
               no skipped step allowed
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
from pathlib import Path

import pytest

from rlhf_paro.actors import checkpoint
from tests.conftest import Run, compared, demo_cache, error_line, train

pytestmark = [pytest.mark.ray, pytest.mark.slow]

# The default run's four models on two devices in two groups of one (16 workers take twice the
# start-up of 8, and a rank 1, I against G and N against G are all there with two).
PAIR = ["cluster.num_devices=2", "cluster.group_size=1"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Run]:
    root = tmp_path_factory.mktemp("trainer")
    cache = demo_cache()
    straight = train(root / "straight", *PAIR, "trainer.steps=4", "trainer.save_every=2",
                     cache=cache)
    assert straight.returncode == 0, straight.stderr
    step_2 = checkpoint.checkpoint_dir(straight.out, 2)
    killed = train(root / "killed", *PAIR, f"trainer.resume={step_2}", "trainer.steps=6",
                   "trainer.save_every=2", cache=cache, kill_after_step=4)
    finished = train(root / "killed", *PAIR, "trainer.steps=6", "trainer.save_every=2",
                     "trainer.keep_checkpoints=1", "trainer.max_skipped_steps=1",
                     cache=cache, nan_loss="actor:1:5")
    # Half the workers: a checkpoint of two ranks loads on one (RESUMABLE_SECTIONS, "cluster").
    nan_stop = train(root / "nan_stop", "cluster.num_devices=1", "cluster.group_size=1",
                     f"trainer.resume={step_2}", "trainer.steps=4", "trainer.save_every=1",
                     "trainer.max_skipped_steps=0", cache=cache, nan_loss="critic:0:2")
    return {"straight": straight, "killed": killed, "finished": finished, "nan_stop": nan_stop}


def test_resuming_gives_the_rows_of_the_straight_run(runs):
    # Same strategies, restored shards, Adam moments and random streams: the resumed run repeats
    # the straight run's arithmetic in the same order. 1e-6 relative is the fp32 bound every
    # strategy holds against the unsharded model (docs/design.md, "Exactness"), the bound a
    # resume under other strategies is held to below.
    straight, killed = runs["straight"].rows, runs["killed"].rows
    assert [r["step"] for r in straight] == [0, 1, 2, 3]
    for step in (2, 3):
        expected, got = compared(straight[step]), compared(killed[step - 2])
        assert set(got) == set(expected) and len(expected) > 7
        assert got == pytest.approx(expected, rel=1e-6, abs=0), step


def test_a_killed_worker_stops_the_run_at_once_in_one_line_and_leaves_no_process(runs):
    killed = runs["killed"]
    newest = checkpoint.checkpoint_dir(killed.out, 4)
    line = error_line(killed)
    assert killed.returncode == 1 and killed.exit_s < 30, (killed.exit_s, line)
    assert line.startswith("error: actor rank 1 died at step 5 (its process exited")
    assert f"; newest checkpoint: {newest}; resume with: python -m rlhf_paro.train " in line
    assert line.endswith(f"trainer.output_dir={killed.out} {' '.join(PAIR)} trainer.steps=6 "
                         "trainer.save_every=2 trainer.resume=auto")
    assert killed.left == [], killed.left
    assert [r["step"] for r in killed.rows] == [2, 3, 4]


def test_resume_auto_finishes_a_killed_run_replacing_the_rows_after_its_checkpoint(runs):
    finished = runs["finished"]
    assert finished.returncode == 0, finished.stderr
    assert f"resumed from {checkpoint.checkpoint_dir(finished.out, 4)}: step 4 of 6" \
        in finished.stdout
    # Row 4 of the killed run is replaced, not repeated; rows 2 and 3 are kept.
    assert [r["step"] for r in finished.rows] == [2, 3, 4, 5]
    assert finished.rows[:2] == runs["killed"].rows[:2]
    # One skipped optimizer step at step 5, within trainer.max_skipped_steps=1.
    assert [r["actor/skipped_steps"] for r in finished.rows] == [0, 0, 0, 1]
    assert math.isnan(finished.rows[3]["actor/loss"])
    assert all(r["critic/skipped_steps"] == 0 for r in finished.rows)
    # keep_checkpoints=1: only the newest, complete and intact; no scratch left behind.
    assert [p.name for p in (finished.out / "checkpoints").iterdir()] == ["step_6"]
    checkpoint.check(finished.out / "checkpoints" / "step_6")


def test_too_many_skipped_steps_stop_the_run_and_keep_the_last_checkpoint(runs):
    nan_stop = runs["nan_stop"]
    source = checkpoint.checkpoint_dir(runs["straight"].out, 2)
    line = error_line(nan_stop)
    assert nan_stop.returncode == 1
    assert line.startswith("error: critic skipped 1 optimizer step in a row (non-finite loss "
                           "or gradient norm) at step 2, more than trainer.max_skipped_steps=0; "
                           f"newest checkpoint: {source}; resume with: ")
    assert line.endswith(f"trainer.resume={source}")  # nothing saved here yet: go on from there
    assert [(r["step"], r["critic/skipped_steps"]) for r in nan_stop.rows] == [(2, 1)]
    assert not (nan_stop.out / "checkpoints").exists()  # step 3 would have come after the skip
    assert nan_stop.left == []


def test_a_resume_under_other_strategies_runs_on(runs, tmp_path):
    step_4 = checkpoint.checkpoint_dir(runs["straight"].out, 4)
    other = train(tmp_path / "other", *PAIR, f"trainer.resume={step_4}", "trainer.steps=6",
                  "actor.strategy=GGG", "critic.strategy=NNG", "ref.strategy=N",
                  "reward.strategy=G", cache=demo_cache())
    assert other.returncode == 0, other.stderr
    assert [r["step"] for r in other.rows] == [4, 5]
    for row in other.rows:
        assert all(math.isfinite(v) for v in compared(row).values()), row


# One device: the faults a scheduler or a stuck worker brings (what they check does not depend
# on the ranks; more of them only start more workers).
ONE = ["cluster.num_devices=1", "cluster.group_size=1", "trainer.keep_checkpoints=0"]
HUNG_S = 20  # trainer.step_timeout_s of the run whose actor is stopped
# A step of these runs takes about 0.1 s on a quiet machine, less on a fast one: a signal sent
# once a step is logged lands in a later step that the machine decides. Runs that are to be
# stopped are long enough to be running when it lands; the tests read which step it was from
# the run's line.
LONG_STEPS = 40
LONG = f"trainer.steps={LONG_STEPS}"


def _step_of(line: str, pattern: str) -> int:
    found = re.search(pattern, line)
    assert found, line
    return int(found[1])


@pytest.fixture(scope="module")
def faults(tmp_path_factory) -> dict[str, Run]:
    root = tmp_path_factory.mktemp("faults")
    cache, out = demo_cache(), root / "run"
    # SIGTERM once step 1 is logged: the step in progress (k) ends, then the preemption
    # checkpoint step_{k+1}, the run's only one (save_every=0).
    preempted = train(out, *ONE, LONG, "trainer.save_every=0", cache=cache,
                      kill_after_step=1, kill=signal.SIGTERM, kill_driver=True)
    # The line counts the steps done, as step_{k+1} does; k is the last row's step.
    k = _step_of(error_line(preempted), r"stopped by SIGTERM after (\d+) steps;") - 1
    # On from step_{k+1} to k+3, a checkpoint a step.
    resumed = train(out, *ONE, f"trainer.steps={k + 3}", "trainer.save_every=1", cache=cache)
    # step_{k+3}, the newest, damaged: auto goes on from step_{k+2}; the actor is stopped once
    # step k+3 is logged (no run logged it before).
    newest = checkpoint.checkpoint_dir(out, k + 3)
    damaged = sorted(p for p in (newest / "actor").rglob("*") if p.is_file())[0]
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF
    damaged.write_bytes(bytes(data))
    # The timeout bounds the workers' setup too: 15 s was too short for the setup of 8 workers
    # on a loaded 2-core machine; these 4 take about 7 s on a quiet one.
    hung = train(out, *ONE, LONG, f"trainer.step_timeout_s={HUNG_S}", cache=cache,
                 kill_after_step=k + 3, kill=signal.SIGSTOP, kill_role=("actor", 0))
    # SIGTERM while step_2 is being written: the save ends, and so does the run.
    in_save = train(root / "in_save", *ONE, "trainer.steps=4", "trainer.save_every=2",
                    cache=cache, kill_in_save=2, kill=signal.SIGTERM)
    return {"preempted": preempted, "stopped_at": k, "resumed": resumed, "hung": hung,
            "in_save": in_save, "damaged": newest, "damaged_file": damaged}


def test_sigterm_during_a_save_finishes_the_save_and_stops_in_one_line(faults):
    in_save = faults["in_save"]
    assert in_save.watched == ["signalled during the save"], "the save ended before the signal"
    step_2 = checkpoint.checkpoint_dir(in_save.out, 2)
    line = error_line(in_save)
    assert in_save.returncode == 143, in_save.stderr
    # The checkpoint the signal found half written is complete, intact, and the newest; no
    # second one for the preemption, no scratch left behind, no process of the run alive.
    assert line.startswith(f"error: stopped by SIGTERM after 2 steps; newest checkpoint: {step_2}"
                           "; resume with: python -m rlhf_paro.train "), line
    checkpoint.check(step_2)
    assert [p.name for p in (in_save.out / checkpoint.CHECKPOINTS).iterdir()] == ["step_2"]
    assert [r["step"] for r in in_save.rows] == [0, 1] and in_save.left == []


def test_sigterm_stops_after_the_step_with_a_checkpoint_that_resumes(faults):
    preempted, resumed, k = faults["preempted"], faults["resumed"], faults["stopped_at"]
    out = preempted.out
    line = error_line(preempted)
    assert preempted.returncode == 143, preempted.stderr
    # Sent once step 1 was logged: it landed in a later step, which ended first; the
    # checkpoint after it is the preemption's (save_every=0 saves nothing else).
    assert k >= 2 and [r["step"] for r in preempted.rows] == list(range(k + 1))
    after = checkpoint.checkpoint_dir(out, k + 1)
    # It said "after step {k}" beside step_{k+1}: one counted from 0, the other steps done.
    assert line.startswith(f"error: stopped by SIGTERM after {k + 1} steps; newest checkpoint: "
                           f"{after}; resume with: python -m rlhf_paro.train "), line
    assert line.endswith("trainer.resume=auto") and preempted.left == []
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {after}: step {k + 1} of {k + 3}" in resumed.stdout
    assert [r["step"] for r in resumed.rows] == list(range(k + 3))
    workers = json.loads((out / "workers.json").read_text())
    assert all(isinstance(pid, int) for pids in workers.values() for pid in pids), workers
    # Exports are for others to read, as checkpoints are (umask 022 here).
    umask = os.umask(0)
    os.umask(umask)
    for role in ("actor", "critic"):
        exported = out / "hf" / role
        assert exported.stat().st_mode & 0o777 == 0o777 & ~umask
        assert all(p.stat().st_mode & 0o777 == 0o666 & ~umask
                   for p in exported.rglob("*") if p.is_file())


def test_resume_auto_skips_a_damaged_newest_checkpoint_and_a_stopped_rank_is_named(faults):
    hung, newest, k = faults["hung"], faults["damaged"], faults["stopped_at"]
    name = faults["damaged_file"].relative_to(newest).as_posix()
    assert (f"skipped {newest}: it does not match its manifest ({name} has changed (SHA-256 "
            "differs))") in hung.stdout, hung.stdout
    kept = checkpoint.checkpoint_dir(hung.out, k + 2)
    assert f"resumed from {kept}: step {k + 2} of {LONG_STEPS}" in hung.stdout
    line = error_line(hung)
    assert hung.returncode == 1
    assert line.startswith("error: actor rank 0 did not answer in "), line
    # Stopped once step k+3 was logged: the step it did not answer in is a later one.
    stalled = _step_of(line, r"\(its process is stopped\) at step (\d+);")
    assert stalled > k + 3 and hung.rows[-1]["step"] == stalled - 1, line
    assert (f" within trainer.step_timeout_s={HUNG_S} (its process is stopped) at step "
            f"{stalled}; newest checkpoint: {kept}; resume with: ") in line, line
    assert hung.left == [], hung.left


@pytest.fixture(scope="module")
def outputs(faults, tmp_path_factory) -> dict[str, Run | Path]:
    """``in_save``'s run (steps 0 and 1, the checkpoint step_2), copied: resumed after its
    metrics.jsonl was deleted; and resumed from its step_2 into a directory where the
    checkpoints cannot be written (``checkpoints`` is a file there: no write permission stops
    root)."""
    root = tmp_path_factory.mktemp("outputs")
    first = root / "first"
    shutil.copytree(faults["in_save"].out, first)
    cache = demo_cache()
    (first / "metrics.jsonl").unlink()
    deleted = train(first, *ONE, "trainer.steps=3", cache=cache)
    blocked = root / "blocked"
    blocked.mkdir()
    (blocked / checkpoint.CHECKPOINTS).write_text("")
    unwritable = train(blocked, *ONE, f"trainer.resume={checkpoint.checkpoint_dir(first, 2)}",
                       "trainer.steps=4", "trainer.save_every=1", cache=cache)
    return {"first": first, "deleted": deleted, "unwritable": unwritable}


def test_resuming_after_metrics_jsonl_was_deleted_says_its_rows_are_gone(outputs):
    deleted = outputs["deleted"]
    assert deleted.returncode == 0, deleted.stderr
    assert (f"{deleted.out}/metrics.jsonl has no rows for steps 0-1 (deleted since they were "
            "logged): they are gone, and the run logs steps 2 on") in deleted.stdout
    assert [r["step"] for r in deleted.rows] == [2]


def test_a_checkpoint_that_cannot_be_written_is_one_line_and_its_steps_row_is_kept(outputs):
    unwritable = outputs["unwritable"]
    line = error_line(unwritable)
    assert unwritable.returncode == 1
    # Before: a 25-line PermissionError traceback, and no row for the step.
    target = checkpoint.checkpoint_dir(unwritable.out, 3)
    assert line.startswith(f"error: cannot write the checkpoint {target} (FileExistsError: "
                           f"[Errno 17] File exists: '{unwritable.out / checkpoint.CHECKPOINTS}'"
                           f"); newest checkpoint: "
                           f"{checkpoint.checkpoint_dir(outputs['first'], 2)}; resume with: "
                           ), line
    assert [r["step"] for r in unwritable.rows] == [2]
    assert unwritable.left == []
