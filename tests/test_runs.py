"""The output directory of a run (``runs.check_output_dir``, ``runs.locked``): checked before
anything starts, and used by one run at a time."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

from rlhf_paro import runs
from rlhf_paro.config import ConfigError

# A process that holds DIR's lock until it is killed: another run, as far as the lock can tell.
HOLDER = """
import sys, time
from rlhf_paro import runs
with runs.locked(sys.argv[1]):
    print("locked", flush=True)
    time.sleep(600)
"""


def hold(directory) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(directory)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "locked\n"
    return proc


def test_an_output_dir_under_a_file_is_refused_naming_it_and_nothing_is_made(tmp_path):
    (tmp_path / "notes").write_text("x")
    with pytest.raises(ConfigError, match=rf"^trainer.output_dir: {tmp_path}/notes/run is under "
                                          rf"{tmp_path}/notes, which is a file, not a directory"):
        runs.check_output_dir(str(tmp_path / "notes" / "run"))
    with pytest.raises(ConfigError, match=rf"{tmp_path}/notes is a file, not a directory"):
        runs.check_output_dir(str(tmp_path / "notes"))
    runs.check_output_dir(str(tmp_path / "new" / "run"))  # made later, by the run
    assert os.listdir(tmp_path) == ["notes"]


def test_a_directory_of_the_users_own_files_is_refused_and_a_runs_or_an_empty_one_is_not(
        tmp_path):
    # Before, a run wrote its run.json, hf/actor/ and checkpoints over whatever was there.
    mine = tmp_path / "mine"
    (mine / "hf").mkdir(parents=True)
    for name in ("notes.txt", "run.json.bak", "a.csv", "b.csv"):
        (mine / name).write_text("x")
    with pytest.raises(ConfigError) as info:
        runs.check_output_dir(str(mine))
    assert str(info.value) == (f"trainer.output_dir: {mine} holds files no run wrote (a.csv, "
                               "b.csv, hf and 2 more), which a run would write among or over; "
                               "allowed: a new or empty directory, or one a run wrote (with "
                               "run.json or metrics.jsonl)")
    assert sorted(os.listdir(mine)) == ["a.csv", "b.csv", "hf", "notes.txt", "run.json.bak"]
    (tmp_path / "empty").mkdir()
    runs.check_output_dir(str(tmp_path / "empty"))
    for mark in runs.RUN_MARKS:  # a run's: it goes on there, or starts over
        run = tmp_path / f"run_{mark}"
        run.mkdir()
        (run / "notes.txt").write_text("x")
        (run / mark).write_text("")
        runs.check_output_dir(str(run))


def test_a_locked_output_dir_is_refused_naming_the_holder_and_freed_when_it_is_killed(tmp_path):
    out = tmp_path / "run"
    holder = hold(out)
    try:
        with pytest.raises(ConfigError, match=rf"^trainer.output_dir: {out} is in use by the run "
                                              rf"of process {holder.pid} "):
            with runs.locked(str(out)):
                pytest.fail("a second holder got the lock")
        assert (out / runs.LOCK_FILE).read_text() == f"{holder.pid}\n"  # not touched
    finally:
        os.kill(holder.pid, signal.SIGKILL)  # a crash: the kernel releases the lock
        holder.wait()
    with runs.locked(str(out)):
        assert (out / runs.LOCK_FILE).read_text() == f"{os.getpid()}\n"


def test_prompt_rows_are_dealt_as_the_rollout_rows_are():
    rows = [{"texts": ["a", "b"], "columns": {"k": [1, 2]}},
            {"texts": ["c", "d"], "columns": {"k": [3, 4]}}]
    dealt = runs.deal_rows(rows, [torch.tensor([3, 0]), torch.tensor([1, 2])])
    assert dealt == [{"texts": ["d", "a"], "columns": {"k": [4, 1]}},
                     {"texts": ["b", "c"], "columns": {"k": [2, 3]}}]
