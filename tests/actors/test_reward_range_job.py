"""Numbers from a reward function that float32 cannot carry through a step, run as a user runs
them: ``python -m rlhf_paro.train conf=grpo_tiny reward.function=file.py:score``.

    far      every score 1e300: finite as Python returns it, inf in the scores' float32 tensor
    largest  every score 3e38: float32 holds it, but a group's mean of four (their sum first)
             does not, so every advantage, every loss NaN and every optimizer step skipped
    skipped  a run whose every optimizer step was skipped, fewer than
             trainer.max_skipped_steps in a row

Each ran to exit 0 with its usual metric lines (``actor/loss`` NaN, ``actor/skipped_steps``
1, 2, 3): the run trained nothing and said nothing.
"""

from __future__ import annotations

import pytest

from tests.actors.test_grpo_job import SMALL
from tests.conftest import demo_cache, error_line, train

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def _run(root, score: str, steps: int):
    fns = root / "fns.py"
    fns.write_text(f"def score(prompts, responses, **columns):\n"
                   f"    return [{score}] * len(responses)\n")
    spec = f"{fns}:score"
    return spec, train(root / "run", *SMALL, f"trainer.steps={steps}",
                       f"reward.function={spec}", cache=demo_cache())


def test_a_reward_past_float32_stops_at_its_step_in_one_line_naming_function_and_item(
        tmp_path_factory):
    spec, run = _run(tmp_path_factory.mktemp("far"), "1e300", steps=3)
    assert run.returncode == 1, run.stderr
    assert error_line(run).startswith(
        f"error: reward function {spec} at step 0: item 0 is 1e+300; allowed: a finite real "
        "number within float32's range (|x| <= 3.403e+38); no checkpoint yet")
    assert run.rows == [] and run.left == []


def test_scores_float32_holds_whose_step_overflows_stop_in_one_line_naming_the_function(
        tmp_path_factory):
    # 3e38 each: float32 holds every score, not a group's sum of four (GRPO's mean): every
    # advantage non-finite. It read as a skipped step after another, naming only the actor.
    spec, run = _run(tmp_path_factory.mktemp("largest"), "3e38", steps=2)
    assert run.returncode == 1, (run.returncode, run.stdout[-2000:], run.stderr[-2000:])
    assert error_line(run).startswith(
        f"error: reward function {spec} at step 0: the scores (largest |x| 3e+38) overflow "
        "float32 in the step's advantages; allowed: scores whose squares, summed over a step's "
        "samples, stay within float32's range (3.403e+38); no checkpoint yet")
    assert run.rows == [] and run.left == []


def test_a_run_whose_every_optimizer_step_was_skipped_ends_in_one_line_not_exit_0(tmp_path):
    # The actor's loss NaN at its only step (the debugging aid of tests/test_trainer.py): one
    # skip, within the default limit of 5 in a row, and nothing trained. It exited 0.
    run = train(tmp_path / "run", *SMALL, "trainer.steps=1", cache=demo_cache(),
                nan_loss="actor:0:0")
    assert run.returncode == 1, (run.returncode, run.stdout[-2000:], run.stderr[-2000:])
    # As a stop for too many skips: no checkpoint after them.
    assert error_line(run).startswith(
        "error: actor skipped every optimizer step of step 0 (non-finite loss or gradient "
        "norm), no more than trainer.max_skipped_steps=5 in a row: it trained nothing; no "
        "checkpoint yet")
    assert [r["actor/skipped_steps"] for r in run.rows] == [1]
    assert not (run.out / "checkpoints").exists()
    assert "dashboard:" not in run.stdout and run.left == []
