"""What a user reads of the vLLM demo (``conf=grpo_tiny rollout.engine=vllm``): the console's three
lines, and a workers.log whose known-harmless library lines are summarised, one line a kind
(``actors/group.py``, ``NOISE``), their text in workers.noise.log."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from rlhf_paro.rollout import vllm as vllm_engine

pytestmark = [pytest.mark.ray, pytest.mark.slow,
              pytest.mark.skipif(not vllm_engine.installed(),
                                 reason='needs the vllm extra: pip install -e ".[vllm]"')]


def test_the_vllm_demo_prints_three_lines_and_a_short_workers_log_without_traceback(tmp_path):
    # Before: 812 lines in workers.log (334 of them warnings or tracebacks) for a run that is
    # right; 2 steps show every kind, since the kinds that repeat do so every step.
    # On 2 devices of the demo's 4: each kind of line comes from every engine and worker alike,
    # and half the engines take half the suite's time (the 4-device command is the guide's).
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "-m", "rlhf_paro.train", "conf=grpo_tiny",
                          "rollout.engine=vllm", "cluster.num_devices=2", "trainer.steps=2",
                          f"trainer.output_dir={out}"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    # The console's 3 lines: the progress bar on stderr (redrawn in place on a terminal, a line a
    # redraw into a pipe), the metrics and the dashboard on stdout; nothing else, but a line for
    # each phase of the start that took more than a few seconds (actors/group.py, phase).
    redraws = [part for part in re.split(r"[\r\n]", run.stderr) if part.strip()]
    assert redraws and all(part.startswith("ppo: ") for part in redraws), run.stderr
    lines = run.stdout.splitlines()
    assert lines[-2:] == [f"metrics: {out}/metrics.jsonl", f"dashboard: {out}/dashboard.png"], \
        run.stdout
    assert set(lines[:-2]) <= {"starting Ray on this machine",
                               "starting 6 worker processes (actor, reward, ref)",
                               "building the models on 2 devices (process groups, weights, "
                               "engines)"}, run.stdout
    log = (out / "workers.log").read_text()
    assert log.count("\n") < 60 and "Traceback" not in log, log
    assert "(rlhf_paro) " in log and "Traceback" in (out / "workers.noise.log").read_text()
