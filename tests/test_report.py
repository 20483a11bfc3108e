"""The dashboard draws from metrics.jsonl alone, and its command line fails cleanly."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import matplotlib.pyplot as plt
import pytest
from matplotlib.text import Text

from rlhf_paro.metrics import COMM_PHASES, ROLES, read_jsonl, required_keys
from rlhf_paro.report import draw, figure, human_bytes, read_rows, run_roles

STRATEGIES = {"actor": "IGG", "critic": "NIG", "reward": "I", "ref": "G"}


def _write_run(path, steps: int = 6, roles: tuple[str, ...] = ROLES) -> None:
    path.mkdir()
    (path / "run.json").write_text(json.dumps({
        "name": "t", "num_devices": 4, "group_size": 2, "comm": "native",
        "strategies": {role: STRATEGIES[role] for role in roles}}))
    with open(path / "metrics.jsonl", "w") as f:
        for step in range(steps):
            row = {k: 1.0 + step for k in required_keys(roles)}
            for role in roles:
                for phase in COMM_PHASES:
                    row[f"{role}/comm/{phase}/intra_bytes"] = 1000.0 * (phase == "forward")
                    row[f"{role}/comm/{phase}/inter_bytes"] = 0.0
            f.write(json.dumps({"step": step, **row}) + "\n")


def test_dashboard_is_a_png(tmp_path):
    _write_run(tmp_path / "run")
    path = draw(str(tmp_path / "run"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("roles", [("actor", "reward", "ref"), ("actor", "reward")])
def test_a_run_without_critic_or_ref_draws_only_its_models(tmp_path, roles):
    _write_run(tmp_path / "run", roles=roles)
    rows = read_jsonl(str(tmp_path / "run" / "metrics.jsonl"))
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run_roles(run, rows) == roles
    assert run_roles({}, rows) == roles  # a run.json without strategies: the rows' models
    fig = figure(rows, run)
    text = " ".join(t.get_text() for t in fig.findobj(Text))
    plt.close(fig)
    # Every panel names the run's models and no other ("reference" is not the word "ref").
    assert set(re.findall(r"\w+", text)) & set(ROLES) == set(roles)
    # No reference model: no KL keys in the rows, and the KL panel says so.
    assert ("no reference model: no KL" in text) == ("ref" not in roles)
    with open(draw(str(tmp_path / "run")), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("algorithm, reward, title, label", [
    ("gae", {"path": "rm", "function": None}, "t: PPO, 6 steps", "reward model score"),
    ("grpo", {"path": None, "config": None, "function": "f.py:score"}, "t: GRPO, 6 steps",
     "reward function"),
])
def test_the_title_names_the_algorithm_and_the_legend_what_the_reward_is(tmp_path, algorithm,
                                                                          reward, title, label):
    _write_run(tmp_path / "run", roles=("actor", "reward", "ref"))
    rows = read_jsonl(str(tmp_path / "run" / "metrics.jsonl"))
    run = {**json.loads((tmp_path / "run" / "run.json").read_text()), "algorithm": algorithm,
           "config": {"reward": reward}}
    fig = figure(rows, run)
    texts = [t.get_text() for t in fig.findobj(Text)]
    plt.close(fig)
    assert title in texts and label in texts
    assert ("reward model score" in texts) == (label == "reward model score")


def _texts(run_dir, config: dict) -> list[str]:
    rows = read_jsonl(str(run_dir / "metrics.jsonl"))
    run = {**json.loads((run_dir / "run.json").read_text()), "config": config}
    fig = figure(rows, run)
    texts = [t.get_text() for t in fig.findobj(Text)]
    plt.close(fig)
    return texts


def test_the_learning_panel_names_what_was_measured_from_step_0(tmp_path):
    # Before: a reward model's score was plotted as "task score (ground truth)", and the title
    # began at the mean of the first steps (0.634 for a step 0 of 0.449).
    _write_run(tmp_path / "run", steps=16)  # task score 1 + step: the window is 2 steps
    (tmp_path / "run" / "metrics.jsonl").write_text("".join(
        json.dumps({**row, "ppo/reward_mean": 10.0 + row["step"]}) + "\n"
        for row in read_jsonl(str(tmp_path / "run" / "metrics.jsonl"))))
    scored = _texts(tmp_path / "run", {"reward": {"path": "rm", "score_function": "s.py:f"},
                                       "data": {"train_files": "p.jsonl"}})
    assert "task score (ground truth)" in scored and "reward model score" in scored
    assert "Learning: task score 1.000 at step 0 \u2192 15.500 (last 2 steps)" in scored
    model_only = _texts(tmp_path / "run", {"reward": {"path": "rm", "score_function": None},
                                           "data": {"train_files": "p.jsonl"}})
    assert not any("task score" in t for t in model_only), model_only
    assert "Learning: reward model score 10.000 at step 0 \u2192 24.500 (last 2 steps)" in \
        model_only


@pytest.mark.parametrize("reward, kind", [({"env_score": True}, "environment"),
                                          ({"function": "f.py:score"}, "function"),
                                          ({"url": "http://r"}, "server")])
def test_a_reward_that_runs_no_model_gets_no_meter(tmp_path, reward, kind):
    # Before: the agent demo showed "reward I: 0 B" and 89,761,157 reward tokens/s.
    _write_run(tmp_path / "run", roles=("actor", "reward", "ref"))
    texts = _texts(tmp_path / "run", {"reward": {"path": None, **reward}})
    metered = [t for t in texts if t.startswith(("reward (", "reward\n", "reward I"))]
    assert metered == [], metered
    assert any(f"reward: {kind} (no model)" in t for t in texts), texts
    assert any(t.startswith("actor (IGG): ") for t in texts)  # the models that ran keep theirs


def test_human_bytes():
    assert human_bytes(0) == "0 B"
    assert human_bytes(1500) == "1.5 KB"
    assert human_bytes(2.5e9) == "2.5 GB"


def test_cli_without_metrics_exits_with_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "rlhf_paro.report", str(tmp_path / "none")],
                          capture_output=True, text=True)
    assert proc.returncode != 0
    assert proc.stderr.strip().count("\n") == 0 and "metrics" in proc.stderr
    assert "Traceback" not in proc.stderr


def _report(run) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlhf_paro.report", str(run)],
                          capture_output=True, text=True)


def test_a_last_line_cut_by_a_kill_is_skipped_and_named(tmp_path):
    # Before: "Unterminated string ... column 492", naming no file, and no dashboard.
    run = tmp_path / "run"
    _write_run(run)
    metrics = run / "metrics.jsonl"
    text = metrics.read_text()
    metrics.write_text(text[:len(text) - len(text.splitlines()[-1]) // 2])
    proc = _report(run)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == [f"skipped {metrics} line 6: cut short"]
    assert proc.stdout.strip() == str(run / "dashboard.png")
    with open(run / "dashboard.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_rows_that_lack_metrics_are_drawn_with_gaps_and_said_in_one_line(tmp_path):
    # Before: a KeyError traceback for a row without the memory keys.
    run = tmp_path / "run"
    _write_run(run)
    metrics = run / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    del rows[1]["step"]  # line 2: no step, no place on the x axis
    del rows[3]["actor/mem/params_bytes"], rows[3]["timing_s/train"]  # line 4
    for role in ROLES:  # line 6, the newest row: no memory at all
        for key in [k for k in rows[5] if k.startswith(f"{role}/mem/")]:
            del rows[5][key]
    rows[2]["ppo/task_score"] = "high"  # not a number: a gap too
    metrics.write_text("".join(json.dumps(row) + "\n" for row in rows))
    (run / "run.json").write_text("{")
    proc = _report(run)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert lines[0] == f"skipped {metrics} line 2: not a row with a numeric 'step'"
    assert lines[1].startswith(f"skipped {run / 'run.json'}: JSONDecodeError: ")
    assert lines[2] == (f"{metrics}: 2 of 5 rows lack metrics, drawn as gaps (line 4 lacks 2, "
                        "the first 'actor/mem/params_bytes')")
    assert len(lines) == 3 and (run / "dashboard.png").is_file()
    numbered, _ = read_rows(str(metrics))
    fig = figure([row for _, row in numbered], {})
    text = " ".join(t.get_text() for t in fig.findobj(Text))
    plt.close(fig)
    # The memory panel shows each model's newest values, line 5's (step 4: 5 bytes each of P, G
    # and OS, on the device and on the host, peak 5 bytes), and the title the 5 rows drawn.
    assert text.count("15 B  (process peak 5 B, host 15 B)") == len(ROLES)
    assert "PPO, 5 steps" in text


def test_no_rows_at_all_is_one_line_naming_the_file(tmp_path):
    run = tmp_path / "run"
    _write_run(run)
    metrics = run / "metrics.jsonl"
    metrics.write_text('{"step": 0, "ppo/task_')
    proc = _report(run)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines() == [f"skipped {metrics} line 1: cut short",
                                        f"{metrics} has no rows yet"]


def test_rows_with_no_metrics_and_nan_values_are_skipped_or_gaps_and_named(tmp_path):
    # Before: "2 of 2 rows lack metrics" and then numpy's "zero-size array to reduction
    # operation maximum which has no identity", no dashboard.
    run = tmp_path / "run"
    _write_run(run)
    metrics = run / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    rows[1] = {"step": 1}  # line 2: nothing but its step
    rows[2] = {k: (float("nan") if k != "step" else 2) for k in rows[2]}  # line 3: NaN only
    rows[3]["ppo/task_score"], rows[3]["ppo/kl"] = float("nan"), float("inf")  # line 4
    rows[5]["ppo/kl"] = float("-inf")  # line 6
    metrics.write_text("".join(json.dumps(row) + "\n" for row in rows))
    proc = _report(run)
    assert proc.returncode == 0, proc.stderr
    nans = len(rows[2]) - 1
    assert proc.stderr.splitlines() == [
        f"{metrics}: skipped 2 rows with no metrics (nothing but the step, or NaN and infinite "
        f"values only): line 2 (step 1), line 3 (step 2: 'actor/tokens_per_s' is nan and "
        f"{nans - 1} more)",
        f"{metrics}: 2 of 4 rows hold NaN or infinite values, drawn as gaps (step 3: "
        "'ppo/task_score' is nan and 1 more; step 5: 'ppo/kl' is -inf)"]
    # The metrics file itself, given instead of its run's directory, is read the same.
    again = _report(metrics)
    assert (again.returncode, again.stderr) == (0, proc.stderr)
    numbered, _ = read_rows(str(metrics))
    fig = figure([row for _, row in numbered if row["step"] not in (1, 2)], {})
    text = " ".join(t.get_text() for t in fig.findobj(Text))
    plt.close(fig)
    assert "PPO, 4 steps" in text


def test_the_report_says_nothing_but_its_own_lines_whatever_the_file_holds(tmp_path):
    # Rows no run writes, each in its own run directory: only this module's notes (a file, a
    # line, a count) reach stderr, never numpy's or matplotlib's own warnings.
    nan, inf = float("nan"), float("inf")
    keys = required_keys(ROLES)
    cases = {
        "only_steps": [{"step": s} for s in range(3)],
        "all_nan": [{"step": s, **dict.fromkeys(keys, nan)} for s in range(3)],
        "one_metric": [{"step": s, "ppo/task_score": 0.5} for s in range(3)],
        "zeros": [{"step": s, **dict.fromkeys(keys, 0.0)} for s in range(3)],
        "negative": [{"step": s, **dict.fromkeys(keys, -1.0)} for s in range(3)],
        "huge": [{"step": s, **dict.fromkeys(keys, 1e30), "ppo/kl": inf} for s in range(3)],
        "mixed_types": [{"step": 0, "ppo/task_score": "x", "ppo/kl": [1], "ppo/kl_coef": None,
                         "actor/tokens_per_s": True, "perf/padding_fraction": 0.5}],
    }
    dirs = []
    for name, rows in cases.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in rows) + "garbage\n\x00\xff{[\n")
        dirs.append(str(tmp_path / name))
    code = ("import sys\nfrom rlhf_paro import report\nfor d in sys.argv[1:]:\n"
            "    try:\n        report.main([d])\n    except SystemExit:\n        pass\n")
    proc = subprocess.run([sys.executable, "-c", code, *dirs], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    ours = re.compile(r"^(skipped \S+ line \d+: |\S+/metrics\.jsonl(: | has no rows))")
    foreign = [line for line in proc.stderr.splitlines() if not ours.match(line)]
    assert foreign == [], proc.stderr
    # Each directory either drew its dashboard or said in one line that it has no rows to draw.
    drawn = proc.stdout.split()
    for name, d in zip(cases, dirs):
        assert (f"{d}/dashboard.png" in drawn) != (f"{d}/metrics.jsonl has no rows with metrics"
                                                    in proc.stderr), name
