"""scripts/bench_async.py's pure parts: its command-line checks and the ratio it reports."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_async.py"
_spec = importlib.util.spec_from_file_location("bench_async", SCRIPT)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def _rows(*steps: float) -> list[dict]:
    return [{"timing_s/step": s, "ppo/response_length": 100.0, "timing_s/train": s / 2}
            for s in steps]


def test_ratio_is_sync_median_over_async_median_per_reward():
    # sync: median of 4, 6, 5 = 5 s; async: median of 2, 9, 2.5 = 2.5 s (the outlier 9 left
    # aside by the median) -> async does 5 / 2.5 = 2.00x sync's samples/s. With the slow reward
    # sync 8 s, async 4 s -> 2.00x too; each async job is set against the sync job with its own
    # reward, never the other's (8 / 2.5 = 3.20x would be).
    results = {("sync", 0.0): _rows(4, 6, 5), ("async", 0.0): _rows(2, 9, 2.5),
               ("sync", 1.0): _rows(8), ("async", 1.0): _rows(4)}
    assert bench.ratio_lines(results) == [
        "reward +0 s: async 2.00x sync's samples/s (2.500 against 5.000 s/step)",
        "reward +1 s: async 2.00x sync's samples/s (4.000 against 8.000 s/step)",
        # What the slow reward costs each job: its step against its own with +0 s.
        "sync: the reward of +1 s costs the step +3.000 s (8.000 against 5.000)",
        "async: the reward of +1 s costs the step +1.500 s (4.000 against 2.500)"]
    table = bench.speed_table(results).splitlines()
    # 64 samples a step over the 2.5 s median: 25.60 samples/s; a part no row has is '-'.
    assert table[2].split()[:8] == ["async,", "reward", "+0", "s", "25.60", "2.500", "2.00x",
                                    "100.0"]
    assert table[2].split()[-1] == "-" and table[2].split()[-4] == "1.250"


def test_a_baseline_run_is_set_against_the_same_contender_of_this_tree():
    # This tree's sync 4 s a step with the slow reward, the baseline's 5 s: 1.25x its
    # samples/s; its reward costs it 2 s a step, this tree's 1 s.
    results = {("sync", 0.0): _rows(3), ("sync (baseline)", 0.0): _rows(3),
               ("sync", 1.0): _rows(4), ("sync (baseline)", 1.0): _rows(5)}
    assert bench.ratio_lines(results) == [
        "reward +0 s: sync 1.00x the baseline's samples/s (3.000 against 3.000 s/step)",
        "reward +1 s: sync 1.25x the baseline's samples/s (4.000 against 5.000 s/step)",
        "sync: the reward of +1 s costs the step +1.000 s (4.000 against 3.000)",
        "sync (baseline): the reward of +1 s costs the step +2.000 s (5.000 against 3.000)"]


@pytest.mark.parametrize("argv, message", [
    (["--contenders", "sync,fast"], "--contenders takes sync or async, comma-separated; got "
                                    "sync,fast"),
    (["--baseline", "/nonexistent"], "--baseline /nonexistent holds no rlhf_paro package"),
    (["--steps", "3", "--warmup", "2"], "must be at least --warmup (2) + 2"),
    (["--rounds", "0"], "--rounds must be at least 1"),
    (["--slow-reward-s", "-1"], "--slow-reward-s takes seconds >= 0"),
    (["--curve", "--steps", "10", "--at", "0,10"], "--at steps must be in 0..9"),
])
def test_bad_arguments_are_refused_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench.parse_args(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_a_job_keeps_its_steps_but_the_warmup_and_the_drained_last():
    rows = [{"step": k} for k in range(6)]
    assert [r["step"] for r in bench.kept_rows(rows, 2)] == [2, 3, 4]


def test_the_steps_default_by_mode():
    assert bench.parse_args([]).steps == 8
    assert bench.parse_args(["--curve"]).steps == 50
    assert bench.parse_args(["--", "rollout.tis_cap=2"]).overrides == ["rollout.tis_cap=2"]
