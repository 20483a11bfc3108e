"""Checkpoints, resume and faults of the PPO loop, through the command line a user runs.

One module-scoped chain of short runs (each start of Ray and 16 workers costs most of a run's
time, so every test below reads the same runs):

    straight   4 steps from scratch, a checkpoint every 2 steps
    killed     resumed from straight's step_2 into its own directory, 6 steps; actor rank 1 is
               SIGKILLed during step 5
    finished   trainer.resume=auto in killed's directory: goes on from its step_4 to step 6, with
               actor rank 1's loss NaN at step 5 (one skipped optimizer step, within the limit)
    nan_stop   resumed from straight's step_2; critic rank 0's loss NaN at step 2, no skipped step
               allowed
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Callable, NamedTuple

import pytest

from rlhf_paro.actors import checkpoint
from rlhf_paro.actors.worker import NAN_LOSS_ENV
from rlhf_paro.metrics import read_jsonl

pytestmark = [pytest.mark.ray, pytest.mark.slow]

# The tiny job of tests/actors/test_ppo_job.py: one optimizer step per model per PPO step.
SMALL = ["task.model.hidden_size=32", "task.model.intermediate_size=64", "task.sft_steps=10",
         "task.train_prompts=64", "task.val_prompts=8",
         "actor.micro_batch_size=1", "critic.micro_batch_size=1", "reward.micro_batch_size=2",
         "ref.micro_batch_size=1", "ppo.rollout_batch_size=8", "ppo.mini_batch_size=8",
         "ppo.ppo_epochs=1", "task.reward_pairs=256", "task.reward_eval_pairs=64",
         "task.reward_steps=20", "logger.wandb.mode=disabled", "logger.progress=false"]
# Every process a run starts (Ray's included) inherits the environment: a mark in it finds them.
MARK = "RLHF_PARO_TEST_RUN"


class Run(NamedTuple):
    out: Path
    returncode: int
    stdout: str
    stderr: str
    rows: list[dict]
    exit_s: float  # seconds from the kill (or from the start) to the driver's exit
    left: list[str]  # processes of the run still alive after it exited
    watched: list[str] = []  # what ``watch`` found while the run went on


def _train(out: Path, *args: str, cache: Path, nan_loss: str | None = None,
           kill_after_step: int | None = None, kill: signal.Signals = signal.SIGKILL,
           kill_driver: bool = False, kill_in_save: int | None = None,
           watch: Callable[[str], list[str]] | None = None,
           kill_role: tuple[str, int] = ("actor", 1)) -> Run:
    """``python -m rlhf_paro.train`` on the tiny job; with ``kill_after_step``, SIGKILL actor
    rank 1 (``kill``: another signal; ``kill_role``: another (role, rank); ``kill_driver``: the
    driver instead) once that step's row
    is logged (its pid from the run's workers.json); with ``kill_in_save``, send ``kill`` to
    the driver while the checkpoint of that step is being written (its scratch directory
    exists; the run's ``watched`` says whether it still did once the signal was sent);
    ``watch(mark)`` is called every half second while the run goes on, and what it returns is
    collected."""
    mark = uuid.uuid4().hex
    env = {**os.environ, MARK: mark}
    env.pop(NAN_LOSS_ENV, None)
    if nan_loss:
        env[NAN_LOSS_ENV] = nan_loss
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlhf_paro.train", *SMALL, f"task.cache_dir={cache}",
         f"trainer.output_dir={out}", *args], env=env, cwd=out.parent,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watched: list[str] = []
    if watch is not None:
        def sample() -> None:
            while proc.poll() is None:
                watched.extend(watch(mark))
                time.sleep(0.5)

        threading.Thread(target=sample, daemon=True).start()
    start = time.monotonic()
    if kill_after_step is not None:
        while proc.poll() is None and kill_after_step not in _steps(out):
            time.sleep(0.1)
        if proc.poll() is not None:  # ended before that step: its own error says why
            stdout, stderr = proc.communicate()
            raise AssertionError(f"the run ended (exit {proc.returncode}) before step "
                                 f"{kill_after_step} was logged:\n{stdout[-2000:]}\n"
                                 f"{stderr[-3000:]}")
        role, rank = kill_role
        target = proc.pid if kill_driver else json.loads(
            (out / "workers.json").read_text())[role][rank]
        os.kill(target, kill)
        start = time.monotonic()
    if kill_in_save is not None:
        pattern = f"{checkpoint.CHECKPOINTS}/.step_{kill_in_save}-*"
        while proc.poll() is None and not list(out.glob(pattern)):
            time.sleep(0.002)
        assert proc.poll() is None, f"the run ended before its save of step {kill_in_save}"
        os.kill(proc.pid, kill)
        start = time.monotonic()
        if list(out.glob(pattern)):  # published with a rename: still there, still saving
            watched.append("signalled during the save")
    stdout, stderr = proc.communicate(timeout=900)
    exit_s = time.monotonic() - start
    return Run(out, proc.returncode, stdout, stderr, _rows(out), exit_s, _left(mark),
               sorted(set(watched)))


def _left(mark: str, grace_s: float = 2.0) -> list[str]:
    """The run's processes still alive ``grace_s`` after its driver exited (what a shutdown
    stops has that long to go); sooner when none is left."""
    deadline = time.monotonic() + grace_s
    while (found := _marked(mark)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


def _rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return read_jsonl(str(path)) if path.is_file() else []


def _steps(out: Path) -> list[int]:
    try:
        return [row["step"] for row in _rows(out)]
    except ValueError:  # a line being written
        return []


def _marked(mark: str) -> list[str]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if f"{MARK}={mark}".encode() in Path(f"/proc/{pid}/environ").read_bytes():
                found.append(Path(f"/proc/{pid}/cmdline").read_bytes()[:80].decode(errors="replace"))
        except OSError:  # gone meanwhile, or not ours to read
            pass
    return found


def _error_line(run: Run) -> str:
    """The one line a run that stopped printed; nothing else of ours, no traceback."""
    ours = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert len(ours) == 1 and run.stderr.strip().splitlines()[-1] == ours[0], run.stderr
    assert "Traceback" not in run.stderr
    return ours[0]


# The default run's four models on two devices in two groups of one (16 workers take twice the
# start-up of 8, and a rank 1, I against G and N against G are all there with two).
PAIR = ["cluster.num_devices=2", "cluster.group_size=1"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Run]:
    root = tmp_path_factory.mktemp("trainer")
    cache = root / "cache"
    straight = _train(root / "straight", *PAIR, "trainer.steps=4", "trainer.save_every=2",
                      cache=cache)
    assert straight.returncode == 0, straight.stderr
    step_2 = checkpoint.checkpoint_dir(straight.out, 2)
    killed = _train(root / "killed", *PAIR, f"trainer.resume={step_2}", "trainer.steps=6",
                    "trainer.save_every=2", cache=cache, kill_after_step=4)
    finished = _train(root / "killed", *PAIR, "trainer.steps=6", "trainer.save_every=2",
                      "trainer.keep_checkpoints=1", "trainer.max_skipped_steps=1",
                      cache=cache, nan_loss="actor:1:5")
    nan_stop = _train(root / "nan_stop", *PAIR, f"trainer.resume={step_2}", "trainer.steps=4",
                      "trainer.save_every=1", "trainer.max_skipped_steps=0", cache=cache,
                      nan_loss="critic:0:2")
    return {"straight": straight, "killed": killed, "finished": finished, "nan_stop": nan_stop}


def _compared(row: dict) -> dict:
    return {k: v for k, v in row.items()
            if k.startswith("ppo/") or k.endswith(("/loss", "/grad_norm"))}


def test_resuming_gives_the_rows_of_the_straight_run(runs):
    # Same strategies, restored shards, Adam moments and random streams: the resumed run repeats
    # the straight run's arithmetic in the same order. 1e-6 relative is the fp32 bound every
    # strategy holds against the unsharded model (docs/design.md, "Exactness"), the bound a
    # resume under other strategies is held to below.
    straight, killed = runs["straight"].rows, runs["killed"].rows
    assert [r["step"] for r in straight] == [0, 1, 2, 3]
    for step in (2, 3):
        expected, got = _compared(straight[step]), _compared(killed[step - 2])
        assert set(got) == set(expected) and len(expected) > 7
        assert got == pytest.approx(expected, rel=1e-6, abs=0), step


def test_a_killed_worker_stops_the_run_at_once_in_one_line_and_leaves_no_process(runs):
    killed = runs["killed"]
    newest = checkpoint.checkpoint_dir(killed.out, 4)
    line = _error_line(killed)
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
    line = _error_line(nan_stop)
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
    other = _train(tmp_path / "other", *PAIR, f"trainer.resume={step_4}", "trainer.steps=6",
                   "actor.strategy=GGG", "critic.strategy=NNG", "ref.strategy=N",
                   "reward.strategy=G", cache=runs["straight"].out.parent / "cache")
    assert other.returncode == 0, other.stderr
    assert [r["step"] for r in other.rows] == [4, 5]
    for row in other.rows:
        assert all(math.isfinite(v) for v in _compared(row).values()), row


# Two devices, 2 to 4 steps: the faults a scheduler or a stuck worker brings.
TWO = ["cluster.num_devices=2", "cluster.group_size=2", "trainer.keep_checkpoints=0"]


@pytest.fixture(scope="module")
def faults(tmp_path_factory) -> dict[str, Run]:
    root = tmp_path_factory.mktemp("faults")
    cache, out = root / "cache", root / "run"
    # SIGTERM during step 2: the step ends, then the preemption checkpoint step_3 (step_2 is
    # save_every's).
    preempted = _train(out, *TWO, "trainer.steps=4", "trainer.save_every=2", cache=cache,
                       kill_after_step=1, kill=signal.SIGTERM, kill_driver=True)
    resumed = _train(out, *TWO, "trainer.steps=4", "trainer.save_every=2", cache=cache)
    # step_4, the newest, damaged: auto goes on from step_3; actor rank 1 stopped in step 5.
    newest = checkpoint.checkpoint_dir(out, 4)
    damaged = sorted(p for p in (newest / "actor").rglob("*") if p.is_file())[0]
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF
    damaged.write_bytes(bytes(data))
    # The timeout bounds the workers' setup too: 15 s was too short for it on a loaded 2-core
    # machine.
    hung = _train(out, *TWO, "trainer.steps=6", "trainer.step_timeout_s=30", cache=cache,
                  kill_after_step=4, kill=signal.SIGSTOP)
    # SIGTERM while step_2 is being written: the save ends, and so does the run.
    in_save = _train(root / "in_save", *TWO, "trainer.steps=4", "trainer.save_every=2",
                     cache=cache, kill_in_save=2, kill=signal.SIGTERM)
    return {"preempted": preempted, "resumed": resumed, "hung": hung, "in_save": in_save,
            "damaged": newest, "damaged_file": damaged}


def test_sigterm_during_a_save_finishes_the_save_and_stops_in_one_line(faults):
    in_save = faults["in_save"]
    assert in_save.watched == ["signalled during the save"], "the save ended before the signal"
    step_2 = checkpoint.checkpoint_dir(in_save.out, 2)
    line = _error_line(in_save)
    assert in_save.returncode == 143, in_save.stderr
    # The checkpoint the signal found half written is complete, intact, and the newest; no
    # second one for the preemption, no scratch left behind, no process of the run alive.
    assert line.startswith(f"error: stopped by SIGTERM after step 1; newest checkpoint: {step_2}"
                           "; resume with: python -m rlhf_paro.train "), line
    checkpoint.check(step_2)
    assert [p.name for p in (in_save.out / checkpoint.CHECKPOINTS).iterdir()] == ["step_2"]
    assert [r["step"] for r in in_save.rows] == [0, 1] and in_save.left == []


def test_sigterm_stops_after_the_step_with_a_checkpoint_that_resumes(faults):
    preempted, resumed = faults["preempted"], faults["resumed"]
    out = preempted.out
    line = _error_line(preempted)
    assert preempted.returncode == 143, preempted.stderr
    step_3 = checkpoint.checkpoint_dir(out, 3)
    assert line.startswith(f"error: stopped by SIGTERM after step 2; newest checkpoint: {step_3}"
                           "; resume with: python -m rlhf_paro.train "), line
    assert line.endswith("trainer.resume=auto") and preempted.left == []
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {step_3}: step 3 of 4" in resumed.stdout
    assert [r["step"] for r in resumed.rows] == [0, 1, 2, 3]
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
    hung, newest = faults["hung"], faults["damaged"]
    name = faults["damaged_file"].relative_to(newest).as_posix()
    assert (f"skipped {newest}: it does not match its manifest ({name} has changed (SHA-256 "
            "differs))") in hung.stdout, hung.stdout
    assert f"resumed from {checkpoint.checkpoint_dir(hung.out, 3)}: step 3 of 6" in hung.stdout
    line = _error_line(hung)
    assert hung.returncode == 1
    assert line.startswith("error: actor rank 1 did not answer in "), line
    assert " within trainer.step_timeout_s=30 (its process is stopped) at step 5; newest " \
           f"checkpoint: {checkpoint.checkpoint_dir(hung.out, 3)}; resume with: " in line, line
    assert hung.left == [], hung.left


ONE = ["cluster.num_devices=1", "cluster.group_size=1", "trainer.keep_checkpoints=0"]


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict[str, Run]:
    """A run of 2 steps with a checkpoint each; the same directory resumed after its
    metrics.jsonl was deleted; and a run resumed from its step_2 into a directory where the
    checkpoints cannot be written (``checkpoints`` is a file there: no write permission stops
    root)."""
    root = tmp_path_factory.mktemp("outputs")
    cache = root / "cache"
    first = _train(root / "first", *ONE, "trainer.steps=2", "trainer.save_every=1", cache=cache)
    assert first.returncode == 0, first.stderr
    (first.out / "metrics.jsonl").unlink()
    deleted = _train(root / "first", *ONE, "trainer.steps=3", cache=cache)
    blocked = root / "blocked"
    blocked.mkdir()
    (blocked / checkpoint.CHECKPOINTS).write_text("")
    unwritable = _train(blocked, *ONE, f"trainer.resume={checkpoint.checkpoint_dir(first.out, 2)}",
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
    line = _error_line(unwritable)
    assert unwritable.returncode == 1
    # Before: a 25-line PermissionError traceback, and no row for the step.
    target = checkpoint.checkpoint_dir(unwritable.out, 3)
    assert line.startswith(f"error: cannot write the checkpoint {target} (FileExistsError: "
                           f"[Errno 17] File exists: '{unwritable.out / checkpoint.CHECKPOINTS}'"
                           f"); newest checkpoint: "
                           f"{checkpoint.checkpoint_dir(outputs['first'].out, 2)}; resume with: "
                           ), line
    assert [r["step"] for r in unwritable.rows] == [2]
    assert unwritable.left == []
