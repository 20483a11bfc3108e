"""How the trainer words a run's end, on a trainer without Ray (its steps are
tests/test_trainer.py's and tests/actors/test_reward_range_job.py's): the skipped-step stops,
and SIGTERM's line beside the checkpoint it leaves."""

from __future__ import annotations

import pytest

from rlhf_paro.actors import checkpoint
from rlhf_paro.compose import load_config
from rlhf_paro.trainer import PPOTrainer


def _trainer(tmp_path, *args: str, start_step: int = 0) -> PPOTrainer:
    """A trainer of the command line ``args`` as far as its end reads it: no workers."""
    trainer = object.__new__(PPOTrainer)
    trainer.cfg = load_config([f"trainer.output_dir={tmp_path}", *args])
    trainer.start_step, trainer.resumed_from = start_step, None
    trainer.skip_runs, trainer.applied = {}, {}
    return trainer


@pytest.mark.parametrize("start_step, steps", [(0, "steps 0-2"), (2, "step 2"), (1, "steps 1-2")])
def test_a_model_that_skipped_every_optimizer_step_of_the_run_stops_it_after_its_last_step(
        tmp_path, start_step, steps):
    # Two skipped in a row, within the limit: the run ended with exit 0 and its metric lines.
    trainer = _trainer(tmp_path, "trainer.steps=3", start_step=start_step)
    trainer.skip_runs, trainer.applied = {"actor": 3, "critic": 0}, {"actor": 0, "critic": 3}
    assert trainer._skip_stop(1) is None  # steps are still to come
    assert trainer._skip_stop(2) == (
        f"actor skipped every optimizer step of {steps} (non-finite loss or gradient norm), no "
        "more than trainer.max_skipped_steps=5 in a row: it trained nothing")


def test_a_model_that_applied_one_optimizer_step_ends_the_run_as_usual(tmp_path):
    trainer = _trainer(tmp_path, "trainer.steps=3")
    trainer.skip_runs, trainer.applied = {"actor": 2, "critic": 0}, {"actor": 1, "critic": 3}
    assert trainer._skip_stop(2) is None


def test_more_skips_in_a_row_than_the_limit_stop_at_any_step(tmp_path):
    trainer = _trainer(tmp_path, "trainer.steps=9", "trainer.max_skipped_steps=1")
    trainer.skip_runs, trainer.applied = {"actor": 0, "critic": 2}, {"actor": 5, "critic": 3}
    assert trainer._skip_stop(4) == (
        "critic skipped 2 optimizer steps in a row (non-finite loss or gradient norm) at step 4, "
        "more than trainer.max_skipped_steps=1")


def test_sigterm_s_line_counts_the_steps_done_as_its_checkpoint_s_name_does(tmp_path):
    # After the step of row 2 it said "after step 2" beside step_3.
    trainer = _trainer(tmp_path, "trainer.save_on_preempt=true")
    saved: list[int] = []
    trainer.save = saved.append
    line = str(trainer._preempted(2))
    assert saved == [3] and checkpoint.checkpoint_dir(tmp_path, 3).name == "step_3"
    assert line.startswith("stopped by SIGTERM after 3 steps;"), line
    assert str(trainer._preempted(0)).startswith("stopped by SIGTERM after 1 step;")
