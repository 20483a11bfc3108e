"""scripts/check_peers.py: its decision on made-up ratios (pure), and, on 4 gloo ranks, that it
flags an engine slowed on purpose (bench_peers' --slow-collectives-ms); and bench_peers'
--free-collectives, the other end: our collectives send nothing, the peer's run as they are."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "check_peers.py"
BENCH = ROOT / "scripts" / "bench_peers.py"
_spec = importlib.util.spec_from_file_location("check_peers", SCRIPT)
check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check)

# Binary fractions, so that ratio + band and ratio - band are exact and the edges are edges.
BASELINE = {
    "zero2": {"wall": {"ratio": 0.75, "band": 0.125}, "cpu": {"ratio": 0.875, "band": 0.0625}},
    "fsdp_full": {"wall": {"ratio": 1.0, "band": 0.25}, "cpu": {"ratio": 0.5, "band": 0.25}},
}


def _verdicts(findings):
    return {(f.pair, f.metric): f.verdict for f in findings}


def test_the_band_is_the_spread_of_the_repeats_around_their_median_but_never_below_the_floor():
    assert check.noise_band([0.90, 0.96, 0.92], 0.03) == pytest.approx((0.92, 0.06))
    assert check.noise_band([0.90, 0.91, 0.90], 0.05) == pytest.approx((0.90, 0.05))
    assert check.noise_band([0.8], 0.05) == (0.8, 0.05)  # one repeat: the floor alone


def test_worse_only_beyond_the_band_above_better_beyond_it_below():
    measured = {
        "zero2": {"wall": 0.875, "cpu": 0.9375 + 2 ** -10},  # at the edge; just past it
        "fsdp_full": {"wall": 0.75, "cpu": 0.25 - 2 ** -10},  # at the lower edge; past it
    }
    assert _verdicts(check.compare(BASELINE, measured, ["wall", "cpu"])) == {
        ("zero2", "wall"): "within", ("zero2", "cpu"): "worse",
        ("fsdp_full", "wall"): "within", ("fsdp_full", "cpu"): "better"}


def test_only_a_pair_that_got_worse_fails_the_check():
    better = {"zero2": {"wall": 0.5, "cpu": 0.5}, "fsdp_full": {"wall": 0.5, "cpu": 0.1}}
    assert check.got_worse(check.compare(BASELINE, better, ["wall", "cpu"])) == []
    worse = {"zero2": {"wall": 0.9, "cpu": 0.875}, "fsdp_full": {"wall": 1.0, "cpu": 0.5}}
    failing = check.got_worse(check.compare(BASELINE, worse, ["wall", "cpu"]))
    assert [(f.pair, f.metric, f.measured) for f in failing] == [("zero2", "wall", 0.9)]


def test_the_measures_not_chosen_do_not_decide():
    slow_wall = {"zero2": {"wall": 2.0, "cpu": 0.875}, "fsdp_full": {"wall": 2.0, "cpu": 0.5}}
    findings = check.compare(BASELINE, slow_wall, ["cpu"])
    assert {f.metric for f in findings} == {"cpu"} and check.got_worse(findings) == []
    assert len(check.got_worse(check.compare(BASELINE, slow_wall, ["wall", "cpu"]))) == 2


def test_a_pair_without_a_baseline_or_without_a_measurement_is_named_and_does_not_fail():
    measured = {"zero2": {"wall": 0.75, "cpu": 0.875}, "zero3": {"wall": 9.0, "cpu": 9.0}}
    findings = check.compare(BASELINE, measured, ["wall"])
    assert _verdicts(findings) == {("zero2", "wall"): "within",
                                   ("fsdp_full", "wall"): "not measured",
                                   ("zero3", "wall"): "no baseline"}
    assert check.got_worse(findings) == []
    assert "no baseline" in check.report(findings)


def test_every_recorded_run_lies_within_its_own_baseline():
    runs = [{"zero1": {"wall": 0.93, "cpu": 0.81}, "hpz": {"wall": 0.7, "cpu": 0.6}},
            {"zero1": {"wall": 1.07, "cpu": 0.83}},  # hpz missing: not recorded
            {"zero1": {"wall": 1.01, "cpu": 0.80}, "hpz": {"wall": 0.7, "cpu": 0.6}}]
    baseline = check.record(runs, 0.02)
    assert list(baseline) == ["zero1"]
    assert baseline["zero1"]["wall"]["ratio"] == pytest.approx(1.01)
    assert baseline["zero1"]["wall"]["band"] == pytest.approx(0.14)  # 1.07 - 0.93
    assert baseline["zero1"]["cpu"]["band"] == pytest.approx(0.03)
    assert baseline["zero1"]["cpu"]["runs"] == [0.81, 0.83, 0.80]
    for run in runs:
        assert check.got_worse(check.compare(baseline, run, check.METRICS)) == []


def test_record_runs_the_defaults_but_those_given_after_the_separator():
    assert check.bench_arguments([]) == check.BENCH_DEFAULTS
    assert check.bench_arguments(["--rounds=5", "--contenders", "zero2"]) == [
        "--steps", "3", "--warmup", "1", "--rounds=5", "--contenders", "zero2"]


@pytest.mark.parametrize("argv, message", [
    (["--metrics", "wall,gpu"], "--metrics 'wall,gpu': allowed: wall, cpu"),
    (["--repeats", "0"], "--repeats must be at least 1"),
])
def test_a_bad_command_line_is_one_line_naming_the_allowed(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        check.main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_a_missing_baseline_says_how_to_make_one(tmp_path, capsys):
    assert check.main(["--baseline", str(tmp_path / "none.json")]) == 2
    assert "record one with --record" in capsys.readouterr().err


# One pair on FSDP2 (no DeepSpeed to start), the smallest model, one round.
TINY = ["--contenders", "fsdp_gradop", "--rounds", "1", "--steps", "2", "--warmup", "1",
        "--hidden", "64", "--layers", "2", "--seq", "32", "--vocab", "512"]


def _script(script: Path, *argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, str(script), *argv], capture_output=True, text=True,
                          env=env, timeout=600)


def _check_peers(*argv: str) -> subprocess.CompletedProcess:
    return _script(SCRIPT, *argv)


@pytest.mark.slow
@pytest.mark.dist
def test_an_engine_slowed_on_purpose_is_flagged_as_worse(tmp_path):
    baseline = tmp_path / "baseline.json"
    # A band of 0.5 around one run's ratio: wider than the tiny model's run-to-run noise on a
    # busy machine (its wall ratio moved between 0.45 and 1.07 in two runs of two steps here).
    made = _check_peers("--record", "--repeats", "1", "--min-band", "0.5",
                        "--baseline", str(baseline), "--", *TINY)
    assert made.returncode == 0, made.stderr[-3000:]
    stored = json.loads(baseline.read_text())
    assert stored["provenance"]["bench_arguments"] == TINY  # given: no defaults added
    assert set(stored["pairs"]) == {"fsdp_gradop"}
    # 200 ms before each collective: NGG runs at least one reduce-scatter per micro-batch (s = 2)
    # and one all-gather of the parameters per step, so each step takes 0.6 s or more longer,
    # several times the tiny model's whole step; FSDP2's side is untouched.
    slowed = _check_peers("--baseline", str(baseline), "--metrics", "wall", "--",
                          "--slow-collectives-ms", "200")
    assert slowed.returncode == 1, slowed.stdout[-3000:] + slowed.stderr[-3000:]
    line = next(line for line in slowed.stdout.splitlines()
                if line.startswith("fsdp_gradop ") and " wall " in line)
    assert line.endswith("worse")
    assert "moved beyond the band: fsdp_gradop wall worse" in slowed.stdout


def test_free_and_slowed_collectives_exclude_each_other():
    done = _script(BENCH, "--free-collectives", "--slow-collectives-ms", "5")
    assert done.returncode == 2
    assert "--slow-collectives-ms and --free-collectives exclude each other" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.slow
@pytest.mark.dist
def test_free_collectives_move_no_byte_and_change_only_our_training(tmp_path):
    out = tmp_path / "free.json"
    done = _script(BENCH, *TINY, "--free-collectives", "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "PaRO's collectives free" in done.stdout
    runs = json.loads(out.read_text())["runs"][""]
    # NGG reduce-scatters every micro-batch and all-gathers its parameters every step: in a
    # normal run of this model it meters about 1.2 MB a step intra and 0.6 MB inter.
    assert runs["NGG"]["sent"] == [0.0, 0.0]
    # Normally both sides of the pair end on the same loss to the last bit (the same training).
    # Here each of our ranks stepped on its own micro-batches' gradient alone, from the first
    # update on: after two updates the loss is off by about 1e-2 on this model.
    assert abs(runs["NGG"]["loss"] - runs["fsdp_gradop"]["loss"]) > 1e-3
