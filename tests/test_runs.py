"""The output directory of a run (``runs.check_output_dir``, ``runs.locked``,
``runs.check_definition``): checked before anything starts, used by one run at a time, and
gone on with only by a run of the same definition."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys

import pytest
import torch

from rlhf_paro import cli, runs
from rlhf_paro.compose import load_config
from rlhf_paro.config import ConfigError, NothingToRun
from tests.confs import INLINE

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


def test_a_definition_leaves_out_what_a_resume_may_change_and_the_diff_names_the_rest():
    base = runs.definition(load_config(INLINE))
    # Before, a run in a used directory went on from whatever checkpoint it found there.
    resumable = ["trainer.steps=7", "trainer.save_every=3", "trainer.eval_every=0",
                 "logger.progress=false", "actor.strategy=GGG", "critic.micro_batch_size=2",
                 "cluster.num_devices=2", "cluster.group_size=1", "ray.num_cpus=2",
                 "reward.timeout_s=5", "trainer.output_dir=elsewhere", "trainer.resume=none"]
    assert runs.definition_diff(base, runs.definition(load_config([*INLINE, *resumable]))) == {}
    other = runs.definition(load_config([*INLINE, "rollout.engine=vllm", "actor.optim.lr=2e-3",
                                         "+actor.config.rms_norm_eps=1e-5"]))
    assert runs.definition_diff(base, other) == {
        "actor.config.rms_norm_eps": ("(not set)", 1e-5), "actor.optim.lr": (1e-3, 2e-3),
        "rollout.engine": ("hf", "vllm")}
    assert runs.definition_diff(other, base)["actor.config.rms_norm_eps"] == (1e-5, "(not set)")


def test_resume_auto_goes_on_only_with_a_run_of_the_same_definition_until_it_is_finished(
        tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    argv = [*INLINE, f"trainer.output_dir={out}", "trainer.steps=4"]
    runs.record_definition(load_config(argv))  # a YAML round trip: the same run is the same
    runs.check_definition(load_config([*argv, "trainer.steps=9", "actor.strategy=GGG"]))
    with pytest.raises(ConfigError) as info:
        runs.check_definition(load_config([*argv, "rollout.engine=vllm"]))
    assert str(info.value) == (
        f"trainer.output_dir: {out} holds another run (rollout.engine: hf there, vllm now), "
        "which trainer.resume=auto would go on with; allowed: a fresh trainer.output_dir="
        f"{out}_2, or trainer.resume=none to replace it")
    runs.check_definition(load_config([*argv, "rollout.engine=vllm", "trainer.resume=none"]))
    runs.mark_finished(str(out), 4)
    with pytest.raises(NothingToRun, match=rf"^{out}: finished, 4 of 4 steps .*; "
                                           r"trainer.steps above 4 starts again at step 0 "):
        runs.check_definition(load_config(argv))
    runs.check_definition(load_config([*argv, "trainer.steps=6"]))  # extends it
    runs.record_definition(load_config([*argv, "trainer.steps=6"]))  # and is not finished
    runs.check_definition(load_config(argv))


# train.main with Ray, transformers and vLLM unimportable: a refusal that needed any of them
# (the run's start, resolving the config) would fail here with an ImportError instead.
NO_SLOW_IMPORTS = """
import sys
for name in ("ray", "transformers", "vllm"):
    sys.modules[name] = None
from rlhf_paro import train
train.main(sys.argv[1:])
"""


def _main(argv: list[str]) -> tuple[subprocess.CompletedProcess, float]:
    """The command's result and the CPU seconds it took: its wall time on a shared machine
    measures the neighbours (4 s here alone, 21 s under a load of 40)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run([sys.executable, "-c", NO_SLOW_IMPORTS, *argv], capture_output=True,
                          text=True, timeout=120)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return done, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def test_a_used_output_dir_is_refused_or_said_finished_in_seconds_before_ray(tmp_path):
    # Before, a second run waited out the models' checks and Ray's start (66-68 s) for the lock,
    # and another run in the directory was refused only when its checkpoint failed to load.
    out = tmp_path / "run"
    out.mkdir()
    argv = [*INLINE, f"trainer.output_dir={out}", "trainer.steps=3"]
    cli.register_demo_resolver()
    runs.record_definition(load_config(argv))
    other, other_s = _main([*argv, "ppo.max_new_tokens=4"])
    assert other.returncode == 2 and other.stderr.count("\n") == 1, other.stderr
    assert other.stderr.startswith(f"error: trainer.output_dir: {out} holds another run "
                                   "(ppo.max_new_tokens: 8 there, 4 now)")
    runs.mark_finished(str(out), 3)
    finished, finished_s = _main(argv)
    assert finished.returncode == 0 and finished.stderr == "", finished.stderr
    assert finished.stdout.startswith(f"{out}: finished, 3 of 3 steps") and \
        finished.stdout.count("\n") == 1, finished.stdout
    holder = hold(out)
    try:
        held, held_s = _main([*argv, "trainer.resume=none"])
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    assert held.returncode == 2 and held.stderr == (
        f"error: trainer.output_dir: {out} is in use by the run of process {holder.pid} (it "
        f"holds {runs.LOCK_FILE} there); allowed: another trainer.output_dir, or the same once "
        "that run ends\n"), held.stderr
    # The bound of 10 s from the command to its line, in CPU time: about 4 s each here.
    assert max(other_s, finished_s, held_s) < 10, (other_s, finished_s, held_s)
