"""Dashboard of a run: ``python -m rlhf_paro.report <output_dir>`` -> ``<output_dir>/dashboard.png``.

Reads ``metrics.jsonl`` (and ``run.json`` for the title) and draws, on one page: the learning
curves (task score and reward, KL and its coefficient), where the time of a step goes, each
model's throughput, each model's P/G/OS bytes per device, and each model's bytes on intra- and
inter-group links per phase. The models are the run's (``run_roles``): four for PPO, fewer
without a critic or a reference model. Training runs it at the end; it also works on a run in
progress, or one a kill stopped: a line that is not a row (the last one, cut short) is skipped,
so is a row with no metrics (nothing but its step, or NaN and infinite values only), and a
metric a row lacks or holds as NaN or infinity is a gap in its curve, each said in one line on
stderr. Nothing else reaches the console: numpy's and matplotlib's warnings about empty or
non-finite data are the dashboard's gaps, not the user's business.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
import sys
import warnings

import matplotlib

matplotlib.use("Agg")  # files only: no display on training machines

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.colors import LogNorm  # noqa: E402

from rlhf_paro.comm.meter import FORWARD  # noqa: E402
from rlhf_paro.config import ROLES  # noqa: E402
from rlhf_paro.metrics import has_task_score as config_has_task_score  # noqa: E402
from rlhf_paro.metrics import required_keys  # noqa: E402
from rlhf_paro.metrics import reward_kind as config_reward_kind  # noqa: E402

COLORS = {"actor": "#3b6fb6", "critic": "#e07b39", "reward": "#3a9a5b", "ref": "#8e6bbf"}
STATE_COLORS = {"params": "#4c72b0", "grads": "#dd8452", "optim": "#55a868"}
TIMING_COLORS = {"generate": "#4c72b0", "make_experience": "#c44e52", "train": "#55a868"}


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1000
    return f"{n:.3g} TB"


def smooth(y: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over ``window`` steps (shorter at the start), to read a noisy curve; a
    missing value (NaN) is left out of the means it falls in, NaN where a window has none."""
    known = np.isfinite(y)
    c = np.cumsum(np.insert(np.where(known, y, 0.0), 0, 0.0))
    n = np.cumsum(np.insert(known, 0, False))
    idx = np.arange(1, len(y) + 1)
    lo = np.maximum(idx - window, 0)
    count = n[idx] - n[lo]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, (c[idx] - c[lo]) / count, np.nan)


def _value(value: object) -> float:
    """A metric as a float; NaN (a gap) for anything that is not a real number."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    return float(value) if ok else np.nan


def _series(rows: list[dict], key: str) -> np.ndarray:
    return np.array([_value(r.get(key)) for r in rows], dtype=float)


def _latest(rows: list[dict], key: str) -> float:
    """The newest value of ``key`` (rows of a run stopped mid-way may lack it); NaN if none."""
    for row in reversed(rows):
        value = _value(row.get(key))
        if np.isfinite(value):
            return value
    return np.nan


def read_rows(path: str) -> tuple[list[tuple[int, dict]], list[str]]:
    """(rows, notes): each row of a metrics.jsonl with its line number (from 1), and one line
    for each line skipped because it is not a row with a step (the last line of a killed run is
    cut short)."""
    rows, notes = [], []
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                why = "cut short" if not line.endswith("\n") else "not JSON"
                notes.append(f"skipped {path} line {number}: {why}")
                continue
            step = row.get("step") if isinstance(row, dict) else None
            if not (isinstance(step, numbers.Real) and not isinstance(step, bool)
                    and math.isfinite(step)):
                notes.append(f"skipped {path} line {number}: not a row with a numeric 'step'")
                continue
            rows.append((number, row))
    return rows, notes


def _finite(value: object) -> bool:
    return bool(np.isfinite(_value(value)))


def with_metrics(path: str, rows: list[tuple[int, dict]]
                 ) -> tuple[list[tuple[int, dict]], list[str]]:
    """(rows, notes): the rows that hold at least one finite metric besides ``step``, and one
    line naming the others (nothing to draw: no metric, or NaN and infinite values only)."""
    kept, empty = [], []
    for number, row in rows:
        (kept if any(_finite(v) for k, v in row.items() if k != "step") else empty).append(
            (number, row))
    if not empty:
        return kept, []
    named = ", ".join(f"line {number} ({_step_and_nan(row)})" for number, row in empty[:3])
    more = f" and {len(empty) - 3} more" if len(empty) > 3 else ""
    return kept, [f"{path}: skipped {len(empty)} rows with no metrics (nothing but the step, or "
                  f"NaN and infinite values only): {named}{more}"]


def _nan_keys(row: dict) -> list[str]:
    return [k for k, v in row.items() if isinstance(v, numbers.Real)
            and not isinstance(v, bool) and not math.isfinite(v)]


def _step_and_nan(row: dict) -> str:
    """``step S``, and the row's first NaN or infinite metric with how many more there are."""
    keys = _nan_keys(row)
    if not keys:
        return f"step {row['step']:g}"
    extra = f" and {len(keys) - 1} more" if len(keys) > 1 else ""
    return f"step {row['step']:g}: {keys[0]!r} is {row[keys[0]]}{extra}"


def non_finite(path: str, rows: list[tuple[int, dict]]) -> list[str]:
    """One line for the rows holding NaN or infinite metrics, drawn as gaps: which step, which
    metric (the first of each of the first three rows); none if every value is finite."""
    found = [_step_and_nan(row) for _, row in rows if _nan_keys(row)]
    if not found:
        return []
    more = f"; and {len(found) - 3} more rows" if len(found) > 3 else ""
    return [f"{path}: {len(found)} of {len(rows)} rows hold NaN or infinite values, drawn as "
            f"gaps ({'; '.join(found[:3])}{more})"]


def lacking(path: str, rows: list[tuple[int, dict]], roles: tuple[str, ...],
            task_score: bool = True) -> list[str]:
    """One line for the rows that lack metrics every row of a run of ``roles`` (with a task
    score or without) holds (docs/design.md, "Metrics"), which the dashboard draws as gaps; none
    if no row lacks one."""
    expected = required_keys(roles, task_score)
    short = [(number, [k for k in expected if k not in row]) for number, row in rows]
    short = [(number, keys) for number, keys in short if keys]
    if not short:
        return []
    number, keys = short[0]
    return [f"{path}: {len(short)} of {len(rows)} rows lack metrics, drawn as gaps (line "
            f"{number} lacks {len(keys)}, the first {keys[0]!r})"]


def read_run(path: str) -> tuple[dict, list[str]]:
    """(run.json's contents, notes): ``{}`` and one line when it is missing or unreadable."""
    if not os.path.exists(path):
        return {}, []
    try:
        with open(path) as f:
            run = json.load(f)
    except (ValueError, OSError) as err:
        return {}, [f"skipped {path}: {type(err).__name__}: {str(err).splitlines()[0]}"]
    if not isinstance(run, dict):
        return {}, [f"skipped {path}: not a JSON object"]
    return run, []


def _strategy(run: dict, role: str) -> str:
    return str(run.get("strategies", {}).get(role, "?"))


def run_roles(run: dict, rows: list[dict]) -> tuple[str, ...]:
    """The run's models in ``ROLES`` order: those ``run.json`` gives a strategy (the trainer
    writes the run's models only), else those whose memory the rows report."""
    present = run.get("strategies") or {
        role for role in ROLES if any(f"{role}/mem/params_bytes" in row for row in rows)}
    return tuple(role for role in ROLES if role in present)


def draw(output_dir: str, path: str | None = None, notes: list[str] | None = None) -> str:
    """Draw the dashboard of the run in ``output_dir``; returns the PNG's path. What was
    skipped in reading it is appended to ``notes``, one line each."""
    metrics = os.path.join(output_dir, "metrics.jsonl")
    numbered, skipped = read_rows(metrics)
    read = len(numbered)
    numbered, empty = with_metrics(metrics, numbered)
    run, unread = read_run(os.path.join(output_dir, "run.json"))
    rows = [row for _, row in numbered]
    if notes is not None:
        notes += (skipped + empty + unread + lacking(metrics, numbered, run_roles(run, rows)
                                                     or ROLES, has_task_score(run))
                  + non_finite(metrics, numbered))
    if not rows:
        raise ValueError(f"{metrics} has no rows with metrics" if read else
                         f"{metrics} has no rows yet")
    fig = figure(rows, run)
    path = path or os.path.join(output_dir, "dashboard.png")
    fig.savefig(path)
    plt.close(fig)
    return path


def figure(rows: list[dict], run: dict) -> plt.Figure:
    """The dashboard of the metrics rows ``rows`` of the run ``run`` (run.json's contents)."""
    mpl_log = logging.getLogger("matplotlib")
    level = mpl_log.level
    # A metric no row has, or has as NaN, is an empty panel or a gap (said in the notes), not
    # numpy's warning about the mean of nothing nor matplotlib's about a legend with no line or
    # a log scale with no positive value.
    mpl_log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            return _figure(rows, run)
    finally:
        mpl_log.setLevel(level)


def _figure(rows: list[dict], run: dict) -> plt.Figure:
    # A run.json without strategies and rows without memory keys: the four models, as gaps.
    roles = run_roles(run, rows) or ROLES
    # The meters (throughput, memory, traffic) are of the models that ran: not of a reward
    # that is a function, a server or the environment's score.
    metered = tuple(r for r in roles if r != "reward" or reward_kind(run) == "model")
    steps = _series(rows, "step")
    window = max(1, len(rows) // 8)

    plt.rcParams.update({"font.size": 9, "axes.titlesize": 10.5, "axes.titleweight": "bold",
                         "axes.spines.top": False, "axes.spines.right": False})
    # A run with an environment or rollout replicas of their own gets a third row: its
    # episodes, its rollout's pipeline.
    third = []
    if np.isfinite(_series(rows, "env/turns_mean")).any():
        third += [_episodes, _episode_tokens]
    if np.isfinite(_series(rows, "rollout/time_s/generate")).any():
        third.append(_replicas)
    height = 15.5 if third else 10.5
    fig = plt.figure(figsize=(18, height), dpi=110)
    grid = fig.add_gridspec(3 if third else 2, 3, hspace=0.45, wspace=0.32, left=0.05,
                            right=0.98, top=1 - 1.37 / height, bottom=0.95 / height,
                            width_ratios=[1, 1, 1.25])
    fig.suptitle(_title(run, rows), fontsize=13, fontweight="bold", x=0.05, ha="left")
    fig.text(0.05, 1 - 0.79 / height, _subtitle(run, rows, roles), fontsize=9.5, color="#444",
             ha="left")

    _learning(fig.add_subplot(grid[0, 0]), rows, steps, window, run)
    _kl(fig.add_subplot(grid[0, 1]), rows, steps)
    _timing(fig.add_subplot(grid[0, 2]), rows, steps)
    _throughput(fig.add_subplot(grid[1, 0]), rows, steps, run, window, metered)
    _memory(fig.add_subplot(grid[1, 1]), rows, run, metered)
    _traffic(fig, grid[1, 2], rows, run, metered)
    for column, panel in enumerate(third):
        panel(fig.add_subplot(grid[2, column]), rows, steps)
    return fig


def _replicas(ax, rows, steps) -> None:
    """Rollout replicas on devices of their own: what a replica did in each step's wall time,
    how long training waited for a rollout, and how stale the rollouts were."""
    parts = {"generating": "rollout/time_s/generate", "taking weights": "rollout/time_s/sync",
             "idle": "rollout/time_s/idle"}
    ax.stackplot(steps, *(_series(rows, key) for key in parts.values()), labels=list(parts),
                 colors=["#4c72b0", "#dd8452", "#cccccc"], alpha=0.85)
    wait = _series(rows, "timing_s/wait_rollout")
    ax.plot(steps, wait, color="#c44e52", lw=1.8, label="training waits for a rollout")
    ax.set_ylabel("seconds per step (a replica)")
    ax.set_xlabel("step")
    twin = ax.twinx()
    twin.plot(steps, _series(rows, "rollout/staleness_max"), color="#333", lw=1.2, ls=":",
              label="staleness (updates)")
    twin.set_ylabel("staleness (updates)")
    twin.spines["right"].set_visible(True)
    ax.set_title(f"Rollout replicas (training waited {np.nanmean(wait):.2f} s a step)")
    lines = ax.get_legend_handles_labels()
    extra = twin.get_legend_handles_labels()
    ax.legend(lines[0] + extra[0], lines[1] + extra[1], loc="upper left", frameon=False)
    ax.grid(alpha=0.25)


def _episodes(ax, rows, steps) -> None:
    """Multi-turn episodes: turns per episode, and the share cut short by each budget."""
    turns = _series(rows, "env/turns_mean")
    ax.plot(steps, turns, color="#4c72b0", lw=2, label="turns per episode")
    ax.set_ylabel("turns", color="#4c72b0")
    ax.set_xlabel("step")
    twin = ax.twinx()
    for key, color, label in (("env/truncated_fraction_max_turns", "#c44e52", "cut by max_turns"),
                              ("env/truncated_fraction_max_total_tokens", "#8172b2",
                               "cut by max_total_tokens")):
        twin.plot(steps, _series(rows, key), color=color, lw=1.5, ls="--", label=label)
    twin.set_ylim(0, 1.05)
    twin.set_ylabel("fraction of episodes")
    twin.spines["right"].set_visible(True)
    step_s = np.nanmean(_series(rows, "env/step_time_s"))
    ax.set_title(f"Episodes ({np.nanmean(turns):.2f} turns, environment step {step_s * 1e3:.1f} "
                 "ms on average)")
    lines = ax.get_lines() + twin.get_lines()
    ax.legend(lines, [ln.get_label() for ln in lines], loc="upper left", frameon=False)
    ax.grid(alpha=0.25)


def _episode_tokens(ax, rows, steps) -> None:
    """An episode's tokens by whose they are, and its tool calls."""
    actions, observed = (_series(rows, f"env/{k}_tokens") for k in ("action", "observation"))
    ax.stackplot(steps, actions, observed, labels=["actions (trained)", "observations (not)"],
                 colors=["#55a868", "#dd8452"], alpha=0.85)
    ax.set_ylabel("tokens per episode")
    ax.set_xlabel("step")
    calls = _series(rows, "env/tool_calls")
    if np.nansum(calls) > 0:
        twin = ax.twinx()
        twin.plot(steps, calls, color="#333", lw=1.5, label="tool calls")
        twin.plot(steps, _series(rows, "env/tool_errors"), color="#c44e52", lw=1.5, ls="--",
                  label="tool errors")
        twin.set_ylabel("per episode")
        twin.spines["right"].set_visible(True)
        twin.legend(loc="upper right", frameon=False)
    ax.set_title("Episode tokens: the policy's and the environment's")
    ax.legend(loc="upper left", frameon=False)
    ax.grid(alpha=0.25)


def _title(run: dict, rows: list[dict]) -> str:
    name = run.get("name") or "rlhf_paro run"
    # gae is PPO; a critic-free estimator is named as the run names it (GRPO, RLOO, ...).
    algorithm = run.get("algorithm", "gae")
    return f"{name}: {'PPO' if algorithm == 'gae' else algorithm.upper()}, {len(rows)} steps"


def _subtitle(run: dict, rows: list[dict], roles: tuple[str, ...]) -> str:
    parts = []
    if "num_devices" in run:
        n, m = run["num_devices"], run.get("group_size", run["num_devices"])
        replicas = run.get("config", {}).get("rollout", {}).get("num_devices", 0)
        own = f" + {replicas} rollout device{'s' * (replicas > 1)}" if replicas else ""
        parts.append(f"{n} devices = {n // m} groups x {m}{own}")
    if "comm" in run:
        parts.append(f"collectives: {run['comm']}")
    parts.append("strategies (P G OS): " + ", ".join(
        f"{r} {_strategy(run, r)}" if r != "reward" or reward_kind(run) == "model" else
        f"reward: {reward_kind(run)} (no model)" for r in roles))
    parts.append(f"{np.nansum(_series(rows, 'timing_s/step')):.0f} s of steps")
    return "   |   ".join(parts)


# What scores the rollouts (``reward_kind``) -> the name of the reward on the dashboard.
REWARD_LABELS = {"model": "reward model score", "function": "reward function",
                 "server": "reward server's reward", "environment": "environment score"}


def reward_kind(run: dict) -> str:
    """What scored the run's rollouts (``metrics.reward_kind``), from run.json; a run.json
    without the config: ``model``."""
    return config_reward_kind(run.get("config") or {})


def has_task_score(run: dict) -> bool:
    """Whether the run's rows have ``ppo/task_score`` (``metrics.has_task_score``), from
    run.json; a run.json without the config: the default run's, which has one."""
    return config_has_task_score(run.get("config") or {})


def _learning(ax, rows, steps, window, run) -> None:
    """The task score (ground truth) and the reward; the reward alone where the task score is
    the reward itself. The title goes from step 0's value (the first row's) to the mean of the
    last ``window`` steps."""
    reward_label = REWARD_LABELS[reward_kind(run)]
    scored = has_task_score(run)
    score = _series(rows, "ppo/task_score" if scored else "ppo/reward_mean")
    name = "task score" if scored else reward_label
    ax.plot(steps, score, color="#3b6fb6", alpha=0.3, lw=1)
    ax.plot(steps, smooth(score, window), color="#3b6fb6", lw=2.2,
            label="task score (ground truth)" if scored else reward_label)
    ax.set_ylabel(name, color="#3b6fb6")
    ax.set_xlabel("step")
    twin = ax
    if scored:
        twin = ax.twinx()
        reward = _series(rows, "ppo/reward_mean")
        twin.plot(steps, reward, color="#e07b39", alpha=0.3, lw=1)
        twin.plot(steps, smooth(reward, window), color="#e07b39", lw=2.2, label=reward_label)
        twin.set_ylabel(reward_label, color="#e07b39")
        twin.spines["right"].set_visible(True)
    evaluated = _series(rows, "eval/reward_mean")
    if np.isfinite(evaluated).any():
        # Evaluation runs every trainer.eval_every steps: points, not a line through the gaps.
        twin.plot(steps, evaluated, "o", color="#55a868", ms=4, label="eval reward (greedy)")
    known = np.flatnonzero(np.isfinite(score))
    first = f"{score[known[0]]:.3f} at step {steps[known[0]]:.0f}" if known.size else "none"
    last = np.nanmean(score[-window:])
    ax.set_title(f"Learning: {name} {first} \u2192 {last:.3f}"
                 + (f" (last {window} steps)" if window > 1 else ""))
    lines = [ln for ln in ax.get_lines()[1:] + (twin.get_lines()[1:] if scored else [])
             if not ln.get_label().startswith("_")]
    ax.legend(lines, [ln.get_label() for ln in lines], loc="lower right", frameon=False)
    ax.grid(alpha=0.25)


def _kl(ax, rows, steps) -> None:
    length = np.nanmean(_series(rows, "ppo/response_length")[-max(1, len(rows) // 8):])
    ax.set_title(f"Policy drift (responses now {length:.1f} tokens long)")
    kl = _series(rows, "ppo/kl")
    if not np.isfinite(kl).any():  # algorithm.kl_coef=0: no reference model, no KL
        ax.text(0.5, 0.5, "no reference model: no KL", ha="center", va="center",
                transform=ax.transAxes, color="#888")
        ax.set_axis_off()
        return
    coef = _series(rows, "ppo/kl_coef")
    fixed = np.nanmax(coef) == np.nanmin(coef)
    ax.plot(steps, kl, color="#c44e52", lw=1.8,
            label="KL(policy || ref)" + (f", coefficient fixed at {coef[0]:g}" if fixed else ""))
    ax.set_ylabel("KL per response (nats)", color="#c44e52")
    ax.set_xlabel("step")
    lines = ax.get_lines()
    if not fixed:  # an adaptive coefficient gets its own axis
        twin = ax.twinx()
        twin.plot(steps, coef, color="#555", lw=1.5, ls="--", label="KL coefficient")
        twin.set_ylabel("KL coefficient", color="#555")
        twin.spines["right"].set_visible(True)
        lines = lines + twin.get_lines()
    ax.legend(lines, [ln.get_label() for ln in lines], loc="upper left", frameon=False)
    ax.grid(alpha=0.25)


def _timing(ax, rows, steps) -> None:
    parts = [_series(rows, f"timing_s/{k}") for k in TIMING_COLORS]
    ax.stackplot(steps, *parts, labels=[k.replace("_", " ") for k in TIMING_COLORS],
                 colors=list(TIMING_COLORS.values()), alpha=0.85)
    rate = np.nanmean(_series(rows, "perf/samples_per_s"))
    padding = _series(rows, "perf/padding_fraction")
    # Rows of runs from before the metric have none.
    padded = "" if np.isnan(padding).all() else f", {np.nanmean(padding):.0%} padding"
    ax.set_title(f"Time per step ({rate:.1f} samples/s{padded} on average)")
    ax.set_ylabel("seconds")
    ax.set_xlabel("step")
    ax.legend(loc="upper right", frameon=False, ncol=3)
    ax.grid(alpha=0.25)


def _throughput(ax, rows, steps, run, window, roles) -> None:
    for role in roles:
        y = _series(rows, f"{role}/tokens_per_s")
        ax.plot(steps, smooth(y, window), color=COLORS[role], lw=2,
                label=f"{role} ({_strategy(run, role)}): {np.nanmean(y):,.0f}")
    ax.set_yscale("log")
    low, high = ax.get_ylim()
    if np.isfinite([low, high]).all():
        ax.set_ylim(low / 8, high)  # room for the legend below the curves
    ax.set_title("Throughput per model (tokens/s, all ranks)")
    ax.set_xlabel("step")
    ax.legend(loc="lower center", frameon=False, ncol=2, title="model (strategy): mean tokens/s",
              fontsize=8.5, title_fontsize=8.5)
    ax.grid(alpha=0.25, which="both")


def _memory(ax, rows, run, roles) -> None:
    y = np.arange(len(roles))[::-1]
    left = np.zeros(len(roles))
    for state, color in STATE_COLORS.items():
        values = np.nan_to_num([_latest(rows, f"{r}/mem/{state}_bytes") for r in roles])
        ax.barh(y, values, left=left, color=color, label={"params": "P (parameters)",
                "grads": "G (gradients)", "optim": "OS (optimizer state)"}[state], height=0.6)
        left += values
    for yi, role, total in zip(y, roles, left):
        peak = _latest(rows, f"{role}/mem/peak_bytes")
        # Offloaded states (rows of runs before offload have no host keys).
        host = np.nansum([_latest(rows, f"{role}/mem/host_{state}_bytes")
                          for state in STATE_COLORS])
        offloaded = f", host {human_bytes(host)}" if host else ""
        peak = f"process peak {human_bytes(peak)}" if np.isfinite(peak) else "no peak"
        ax.text(total, yi, f"  {human_bytes(total)}  ({peak}{offloaded})", va="center",
                fontsize=8.5, color="#333")
    ax.set_yticks(y, [f"{r}\n{_strategy(run, r)}" for r in roles])
    for tick, role in zip(ax.get_yticklabels(), roles):
        tick.set_color(COLORS[role])
        tick.set_fontweight("bold")
    widest = left.max() * 1.9
    ax.set_xlim(0, widest if 0 < widest < np.inf else 1)
    ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: human_bytes(v)))
    ax.set_title("Model states per device (P / G / OS bytes)")
    ax.legend(loc="lower right", frameon=False, fontsize=8.5)


def _traffic(fig, cell, rows, run, roles) -> None:
    """Two heatmaps (intra, inter): bytes per step, all ranks of the model, by phase."""
    # Phases in the order the metrics list them, those with no traffic at all left out.
    keys = [k.split("/") for k in dict.fromkeys(k for r in rows for k in r)
            if k.endswith("_bytes") and k.count("/") == 3]
    phases = [p for p in dict.fromkeys(k[2] for k in keys if k[1] == "comm")
              if any(np.nan_to_num(_series(rows, f"{m}/comm/{p}/{link}_bytes")).any()
                     for m in roles for link in ("intra", "inter"))] or [FORWARD]
    sub = cell.subgridspec(1, 2, wspace=0.05)
    tables = {}
    for link in ("intra", "inter"):
        tables[link] = np.nan_to_num([[np.nanmean(_series(rows, f"{m}/comm/{p}/{link}_bytes"))
                                       for p in phases] for m in roles])
    positive = np.concatenate([t[t > 0] for t in tables.values()])
    positive = positive[np.isfinite(positive)]
    norm = LogNorm(positive.min(), positive.max()) if positive.size else None
    cmaps = {"intra": plt.get_cmap("Blues"), "inter": plt.get_cmap("Oranges")}
    for k, link in enumerate(("intra", "inter")):
        ax = fig.add_subplot(sub[0, k])
        table = tables[link]
        ax.imshow(np.where(table > 0, table, np.nan), cmap=cmaps[link], norm=norm, aspect="auto")
        for (i, j), value in np.ndenumerate(table):
            # White text on the darker half of the scale, dark text elsewhere.
            dark = value > 0 and norm is not None and norm(value) > 0.55
            ax.text(j, i, human_bytes(value) if value > 0 else "\u00b7", ha="center",
                    va="center", fontsize=8, color="white" if dark else "#222" if value else "#bbb")
        ax.set_xticks(range(len(phases)), phases, rotation=30, ha="right")
        ax.set_yticks(range(len(roles)), [f"{r} {_strategy(run, r)}" for r in roles]
                      if k == 0 else [])
        for tick, role in zip(ax.get_yticklabels(), roles):
            tick.set_color(COLORS[role])
            tick.set_fontweight("bold")
        where = "inside a group" if link == "intra" else "across groups"
        ax.set_title(f"Bytes sent {where}\nper step, all ranks", fontsize=10)
        ax.tick_params(length=0)
        for side in ("left", "bottom"):
            ax.spines[side].set_visible(False)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        sys.exit("usage: python -m rlhf_paro.report <output_dir>")
    output_dir = argv[0]
    if os.path.basename(output_dir) == "metrics.jsonl" and os.path.isfile(output_dir):
        output_dir = os.path.dirname(output_dir) or "."  # the file itself: its run's directory
    metrics = os.path.join(output_dir, "metrics.jsonl")
    if not os.path.isfile(metrics):
        sys.exit(f"no metrics file at {metrics}; pass the trainer.output_dir of a run")
    notes: list[str] = []
    try:
        path = draw(output_dir, notes=notes)
    except ValueError as err:
        path = None
        notes.append(str(err))
    for note in notes:
        print(note, file=sys.stderr)
    if path is None:
        raise SystemExit(1)
    print(path)


if __name__ == "__main__":
    main()
