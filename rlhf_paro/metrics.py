"""Per-model metrics of a PPO step, to the console, ``<output_dir>/metrics.jsonl`` and wandb.

Every rank of every model sends the driver one ``RankReport`` per step (``actors/worker.py``);
``model_metrics`` folds the N reports of a model into the names of docs/design.md, "Metrics":

- ``m/comm/*`` are **summed over the model's N ranks**: the bytes that all of the model's ranks
  put on intra-group and on inter-group links during this step (each rank counts what it sent,
  so nothing is counted twice). ``m/comm/<phase>/{intra,inter}_bytes`` split them by phase.
  ``m/comm/time_s`` is the slowest rank's time inside collectives.
- ``m/mem/*`` are **per rank**, the largest over the model's ranks: what one device must hold
  (``params``, ``grads``, ``optim``) and what host memory holds for it under offload
  (``host_params``, ``host_grads``, ``host_optim``), at the end of the step.
- ``m/offload/*`` are summed over the model's ranks: bytes copied between device and host
  memory (``d2h_bytes``, ``h2d_bytes``) and the copies (``transfers``) under offload; kept apart
  from ``m/comm/*``, which is traffic between ranks.
- ``m/time_s/<phase>`` is the slowest rank's wall time in that phase; ``m/tokens_per_s`` is every
  token position the model computed on (all ranks, all phases: the real tokens of a packed
  forward, every position of a padded one) over the model's busy time (slowest rank).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from rlhf_paro.comm.meter import GENERATE, SYNC
from rlhf_paro.sharding.contract import MEMORY_KEYS
from rlhf_paro.sharding.schedule import TRAINING_PHASES
from rlhf_paro.config import ROLES, TRAINED_ROLES

# Wall-time phases of a role (m/time_s/<phase>), timed by the workers; the actor's generation
# is a comm phase too (comm/meter.py).
INFERENCE, TRAIN = "inference", "train"
ROLE_PHASES = {
    "actor": (GENERATE, SYNC, INFERENCE, TRAIN),
    "critic": (INFERENCE, TRAIN),
    "reward": (INFERENCE,),
    "ref": (INFERENCE,),
}
# Comm phases every row has a column for: the engine's four and the actor's generation. Any
# other phase a meter reports (comm.meter.PHASES, e.g. a checkpoint's GATHER) gets columns when
# it occurs.
COMM_PHASES = (*TRAINING_PHASES, GENERATE)
# The actor's own: its weights into a rollout engine with a copy of its own (0 bytes otherwise).
ACTOR_COMM_PHASES = (*COMM_PHASES, SYNC)
# engine.transfers' keys (m/offload/<key>); memory()'s (m/mem/<key>_bytes) are the contract's.
OFFLOAD_KEYS = ("d2h_bytes", "h2d_bytes", "transfers")
LOOP_KEYS = (
    "ppo/reward_mean", "ppo/advantage_mean", "ppo/return_mean",
    "ppo/response_length",
    "timing_s/generate", "timing_s/make_experience", "timing_s/train", "timing_s/step",
    "perf/samples_per_s", "perf/tokens_per_s", "perf/padding_fraction",
)
# Loop keys of a run with a reference policy (ppo/algorithms.py drops ref when no KL is used).
KL_KEYS = ("ppo/kl", "ppo/kl_coef")
# The loop key of a run with a task score of its own (``has_task_score``).
TASK_SCORE_KEY = "ppo/task_score"
# What scores the rollouts (``reward_kind``) -> the reward's name on the progress bar, one word
# each; the dashboard's are report.py's ``REWARD_LABELS``.
BAR_REWARD_LABELS = {"model": "rm_score", "function": "fn_reward", "server": "server_reward",
                     "environment": "env_score"}


def reward_kind(config: dict[str, Any]) -> str:
    """What scored a run's rollouts, from its resolved config as a dict (run.json's
    ``config``): ``model``, or ``function``, ``server`` or ``environment`` (``env.reward=env``),
    which run no model. An empty config: ``model``."""
    reward = config.get("reward", {})
    if reward.get("env_score"):
        return "environment"
    if reward.get("function") is not None:
        return "function"
    return "server" if reward.get("url") is not None else "model"


def has_task_score(config: dict[str, Any]) -> bool:
    """Whether a run, by its resolved config as a dict, has a task score of its own
    (``reward.score_function``, or the task's rule on the task's own prompts: no
    ``data.train_files``). Without one the reward worker's ``task_score`` sums are the reward
    itself (``actors/reward.py``), which a row and the bar would only repeat under a name that
    claims a ground truth, so neither has it. An empty config: the default run's, which has one."""
    if not config:
        return True
    return (config.get("reward", {}).get("score_function") is not None
            or config.get("data", {}).get("train_files") is None)


def model_keys(role: str) -> list[str]:
    """The keys of one model (docs/design.md, "Metrics") (the per-phase comm split comes on top)."""
    keys = [f"{role}/tokens_per_s", *(f"{role}/time_s/{p}" for p in ROLE_PHASES[role])]
    keys += [f"{role}/comm/{k}" for k in ("intra_bytes", "inter_bytes", "time_s", "calls")]
    if role == "actor":
        keys += [f"actor/comm/{SYNC}/{k}" for k in ("intra_bytes", "inter_bytes")]
    keys += [f"{role}/mem/{k}_bytes" for k in (*MEMORY_KEYS, "peak")]
    keys += [f"{role}/offload/{k}" for k in OFFLOAD_KEYS]
    if role in TRAINED_ROLES:
        keys += [f"{role}/{k}" for k in ("loss", "grad_norm", "lr", "skipped_steps")]
        keys.append("actor/clipfrac" if role == "actor" else "critic/vf_clipfrac")
    return keys


def required_keys(roles: tuple[str, ...] = ROLES, task_score: bool = True) -> list[str]:
    """Every key docs/design.md, "Metrics", promises in every row of metrics.jsonl of a run of
    the models ``roles`` (``ppo/algorithms.roles``), with a task score or without
    (``has_task_score``)."""
    keys = [k for role in roles for k in model_keys(role)] + list(LOOP_KEYS)
    return keys + [TASK_SCORE_KEY] * task_score + list(KL_KEYS) * ("ref" in roles)


@dataclass
class RankReport:
    """What one rank of one model did during one step."""

    tokens: int  # token positions the model computed on (prompt + response), every phase
    time_s: dict[str, float]  # wall time per role phase
    comm: dict[str, dict[str, float]]  # CommMeter.by_phase()
    memory: dict[str, int]  # engine.memory(): bytes on the device and in host memory
    peak_bytes: int  # process peak: CUDA max allocated, or peak RSS on CPU
    # engine.transfers: bytes and copies between device and host memory (offload)
    offload: dict[str, int] = field(default_factory=dict)
    train: dict[str, float] = field(default_factory=dict)  # loss, grad_norm, lr, clipfrac...
    # Trained models: the longest run of optimizer steps skipped in a row (a non-finite loss or
    # gradient norm) that this step saw, counting a run that began in earlier steps.
    skip_run: int = 0
    real_tokens: int = 0  # of ``tokens``, the real ones: the rest is padding
    # Trained models: the optimizer steps this step applied, not skipped (a run whose models
    # applied none ends in one line, not exit 0: trainer.py, ``_skip_stop``).
    applied: int = 0


def model_metrics(role: str, reports: list[RankReport]) -> dict[str, float]:
    """Fold the reports of a model's ranks into its metrics (see the module docstring)."""
    row: dict[str, float] = {}
    busy = max(sum(r.time_s.values()) for r in reports)
    row[f"{role}/tokens_per_s"] = sum(r.tokens for r in reports) / busy if busy > 0 else 0.0
    for phase in ROLE_PHASES[role]:
        row[f"{role}/time_s/{phase}"] = max(r.time_s.get(phase, 0.0) for r in reports)
    for key in ("intra_bytes", "inter_bytes", "calls"):
        row[f"{role}/comm/{key}"] = sum(t[key] for r in reports for t in r.comm.values())
    row[f"{role}/comm/time_s"] = max(sum(t["seconds"] for t in r.comm.values()) for r in reports)
    columns = ACTOR_COMM_PHASES if role == "actor" else COMM_PHASES
    phases = list(columns) + [p for r in reports for p in r.comm if p not in columns]
    for phase in dict.fromkeys(phases):
        for key in ("intra_bytes", "inter_bytes"):
            row[f"{role}/comm/{phase}/{key}"] = sum(r.comm.get(phase, {}).get(key, 0)
                                                    for r in reports)
    for key in MEMORY_KEYS:
        row[f"{role}/mem/{key}_bytes"] = max(r.memory.get(key, 0) for r in reports)
    for key in OFFLOAD_KEYS:
        row[f"{role}/offload/{key}"] = sum(r.offload.get(key, 0) for r in reports)
    row[f"{role}/mem/peak_bytes"] = max(r.peak_bytes for r in reports)
    # Loss-like numbers are means of rank means: every rank trains on as many samples.
    for key in dict.fromkeys(k for r in reports for k in r.train):
        values = [r.train[key] for r in reports if key in r.train]
        name = key if "/" in key else f"{role}/{key}"
        row[name] = sum(values) / len(values)
    return row


def logprob_diff(sums: Sums | None) -> dict[str, float]:
    """``rollout/logprob_diff_{max,mean}``: how far the engine's log-probs of the sampled tokens
    are from the trainer's (the actor's ``mismatch``: the largest difference, and their sum and
    count), over the real response tokens of all ranks; nothing when the engine gives none. In
    fp32 the two differ by summation order (1e-5 for hf); in bf16 by rounding, within
    (16 L + 2) Z / 32 for L layers and logits of magnitude up to Z (docs/design.md,
    "Rollout")."""
    if sums is None or "logprob_diff" not in sums.most:
        return {}
    count = sums.total["logprob_diff_count"]
    return {"rollout/logprob_diff_max": sums.most["logprob_diff"],
            "rollout/logprob_diff_mean": (sums.total["logprob_diff_sum"] / count
                                          if count else 0.0)}


def engine_mask(sums: Sums) -> dict[str, float]:
    """``rollout/masked_fraction``: of the step's samples (all ranks), the share
    ``rollout.mask`` left out of the policy loss, and of them those above and below the band
    (``_high``, ``_low``); ``rollout/mask_log_ratio_{mean,min,max}``: the log of the ratio the
    band bounds (a sample's trainer / engine, or its geometric mean per token), whose mean
    estimates minus the KL from the engine's distribution to the trainer's (per sample, or per
    token). From the actor's ``mask_sums``; nothing without a mask. A fraction over ranks is
    their counts' sum over their samples', not a mean of the ranks' fractions."""
    total = sums.total
    samples = total.get("mask_samples")
    if not samples:
        return {}
    return {"rollout/masked_fraction": total["mask_masked"] / samples,
            "rollout/masked_fraction_high": total["mask_masked_high"] / samples,
            "rollout/masked_fraction_low": total["mask_masked_low"] / samples,
            "rollout/mask_log_ratio_mean": total["mask_log_ratio_sum"] / samples,
            "rollout/mask_log_ratio_min": sums.least["mask_log_ratio"],
            "rollout/mask_log_ratio_max": sums.most["mask_log_ratio"]}


@dataclass
class Sums:
    """What ranks send the driver to add up, each kind folded over ranks its own way
    (``fold``): ``total`` summed; ``least`` and ``most`` the least or the most of the ranks
    that have the key; ``each`` every rank's values in one list (a value per call, such as an
    environment step's seconds); ``counts`` how many samples have a key that not every sample
    has (a reward function's extra), summed, the divisor of its mean; ``env`` a multi-turn
    rollout's own sums (``env_metrics``), folded alike."""

    total: dict[str, float] = field(default_factory=dict)
    least: dict[str, float] = field(default_factory=dict)
    most: dict[str, float] = field(default_factory=dict)
    each: dict[str, list[float]] = field(default_factory=dict)
    counts: dict[str, float] = field(default_factory=dict)
    env: Sums | None = None

    @classmethod
    def fold(cls, parts: list[Sums]) -> Sums:
        """The ranks' ``parts`` as one: a key some ranks lack counts 0 in a total and is left
        out of a least or most."""
        out = cls()
        for part in parts:
            for key, value in part.total.items():
                out.total[key] = out.total.get(key, 0.0) + value
            for key, value in part.counts.items():
                out.counts[key] = out.counts.get(key, 0.0) + value
            for key, value in part.least.items():
                out.least[key] = min(out.least.get(key, value), value)
            for key, value in part.most.items():
                out.most[key] = max(out.most.get(key, value), value)
            for key, values in part.each.items():
                out.each.setdefault(key, []).extend(values)
        envs = [p.env for p in parts if p.env is not None]
        out.env = cls.fold(envs) if envs else None
        return out

    def to_dict(self) -> dict[str, Any]:
        """Plain data, for a checkpoint's JSON (``from_dict`` is the way back)."""
        return {"total": self.total, "least": self.least, "most": self.most, "each": self.each,
                "counts": self.counts, "env": None if self.env is None else self.env.to_dict()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Sums:
        env = data.get("env")
        return cls(total=dict(data["total"]), least=dict(data["least"]),
                   most=dict(data["most"]), each={k: list(v) for k, v in data["each"].items()},
                   counts=dict(data["counts"]), env=None if env is None else cls.from_dict(env))


def env_metrics(sums: Sums | None) -> dict[str, float]:
    """``env/*`` of a step's episodes from the generators' ``env`` sums (``episodes``): per
    episode its turns, observation and action tokens, observations dropped for the budget, tool
    calls and tool errors; the fraction of episodes cut short by ``env.max_turns`` or
    ``env.max_total_tokens`` (each, and both as ``env/truncated_fraction``); the mean seconds of
    one environment step. None without an environment."""
    episodes = sums.total.get("episodes") if sums is not None else None
    if not episodes:
        return {}
    total = sums.total
    turns, tokens = total["truncated_max_turns"], total["truncated_max_total_tokens"]
    return {
        "env/turns_mean": total["turns"] / episodes,
        "env/truncated_fraction": (turns + tokens) / episodes,
        "env/truncated_fraction_max_turns": turns / episodes,
        "env/truncated_fraction_max_total_tokens": tokens / episodes,
        "env/step_time_s": total["step_time_s"] / max(total["steps"], 1.0),
        "env/observation_tokens": total["observation_tokens"] / episodes,
        # (absent from the sums of a rollout launched ahead by an older version, then resumed)
        "env/dropped_observations": total.get("dropped_observations", 0.0) / episodes,
        "env/action_tokens": total["action_tokens"] / episodes,
        "env/tool_calls": total["tool_calls"] / episodes,
        "env/tool_errors": total["tool_errors"] / episodes,
        **rollout_timing(sums),
    }


def rollout_timing(sums: Sums) -> dict[str, float]:
    """How an episodes' rollout spent its time (the ``env`` sums): the share of it the engine
    had nothing to decode (``rollout/engine_idle_fraction``, over the ranks' seconds), the
    seconds to the first and the last episode's end, and percentiles of one environment step's
    seconds (nearest rank). Empty for the sums of a rollout launched ahead by an older version,
    then resumed."""
    if "rollout_s" not in sums.total:
        return {}
    latencies = sorted(sums.each.get("step_latencies_s", []))
    out = {"rollout/engine_idle_fraction": sums.total["engine_idle_s"] / sums.total["rollout_s"],
           "rollout/first_sample_s": sums.least["first_sample_s"],
           "rollout/last_sample_s": sums.most["last_sample_s"]}
    if latencies:
        for q in (50, 90, 99):
            out[f"env/step_latency_p{q}_s"] = latencies[max(math.ceil(q / 100 * len(latencies)),
                                                            1) - 1]
    return out


def reward_extras(sums: Sums) -> dict[str, float]:
    """``reward/<name>``: the mean of a reward function's extra ``name`` over the samples that
    have it (its total over its ``counts``)."""
    return {key: sums.total[key] / count for key, count in sums.counts.items() if count}


def step_row(cfg: Any, gen: Sums, exp: Sums, scored: Sums, mismatch: Sums | None,
             reports: dict[str, list[RankReport]], staleness: int, kl_coef: float,
             times: dict[str, float], now: float) -> dict[str, float]:
    """A step's row from its folded sums (``gen``: the generators'; ``exp``: the experience's
    and the update's; ``scored``: the reward's; ``mismatch``: the engine's distance), every
    model's reports, the rollout's ``staleness``, the step's ``kl_coef`` and the seconds of its
    stages (``times``, with the step's ``start``; ``now``: its end)."""
    row: dict[str, float] = {}
    for role, per_rank in reports.items():
        row.update(model_metrics(role, per_rank))
    total, step_s = exp.total, now - times["start"]
    if "ref" in reports:
        row.update({"ppo/kl": total["kl"] / total["count"], "ppo/kl_coef": kl_coef})
    if has_task_score(cfg.to_dict()):
        row[TASK_SCORE_KEY] = scored.total["task_score"] / scored.total["count"]
    row.update(reward_extras(scored))
    row.update(env_metrics(gen.env))
    row.update(logprob_diff(mismatch))
    row.update(engine_mask(exp))
    generated = gen.total
    row.update({
        "ppo/reward_mean": total["reward"] / total["count"],
        "ppo/advantage_mean": total["advantage"] / total["tokens"],
        "ppo/return_mean": total["return"] / total["tokens"],
        "ppo/response_length": generated["response_length"] / generated["count"],
        # Updates between the policy that generated the rollout and the one it trains.
        "rollout/staleness_mean": float(staleness),
        "rollout/staleness_max": float(staleness),
        "timing_s/generate": times["launch"] + times["collect"],
        "timing_s/wait_rollout": times["collect"],
        "timing_s/make_experience": times["experience"],
        "timing_s/train": times["train"],
        "timing_s/step": step_s,
        "perf/samples_per_s": generated["count"] / step_s,
        # The rollout's real tokens (prompts and responses, all ranks) over the step.
        "perf/tokens_per_s": generated["real_tokens"] / step_s,
        "perf/padding_fraction": padding_fraction(reports),
    })
    return row


def run_info(cfg: Any, roles: tuple[str, ...]) -> dict[str, Any]:
    """What the dashboard's title and the wandb run's config say about the run of the models
    ``roles``."""
    return {
        "name": cfg.logger.wandb.name or cfg.trainer.output_dir.rstrip("/").split("/")[-1],
        "num_devices": cfg.cluster.num_devices,
        "group_size": cfg.cluster.group_size,
        "comm": cfg.comm.algorithm,
        "algorithm": cfg.algorithm.adv_estimator,
        "strategies": {role: cfg.model(role).strategy for role in roles},
        "config": cfg.to_dict(),
    }


def padding_fraction(reports: dict[str, list[RankReport]]) -> float:
    """``perf/padding_fraction``: of the token positions every model computed on during the
    step (all ranks, all phases), the fraction that were padding (none in a packed forward, nor
    in generation by an engine that computes on real tokens only, ``Rollout.computes_padding``)."""
    computed = sum(r.tokens for per_rank in reports.values() for r in per_rank)
    real = sum(r.real_tokens for per_rank in reports.values() for r in per_rank)
    return 1.0 - real / computed if computed else 0.0


class MetricsLogger:
    """Writes each step's row to metrics.jsonl, the progress bar and wandb.

    wandb is offline unless ``wandb_mode`` says otherwise: an offline run lands in
    ``<output_dir>/wandb`` and ``wandb sync`` uploads it later.

    A run resumed at ``start_step`` keeps the rows of the steps before it and replaces any after
    (they belong to the run it replaces), the bar starts at ``start_step``, and wandb goes on
    with the run ``wandb_id`` (``wandb_id`` is the id of the run logged to, new or resumed).
    """

    def __init__(self, output_dir: str, num_steps: int, run_info: dict[str, Any],
                 wandb_mode: str = "offline", wandb_init: dict[str, Any] | None = None,
                 show_progress: bool = True, start_step: int = 0,
                 wandb_id: str | None = None) -> None:
        """``wandb_init``: extra ``wandb.init`` arguments (project, entity, name, tags); the
        run is named after the output directory unless it gives a name."""
        from tqdm.auto import tqdm

        os.makedirs(output_dir, exist_ok=True)
        self.output_dir = output_dir
        with open(os.path.join(output_dir, "run.json"), "w") as f:
            json.dump(run_info, f, indent=2, default=str)
        path = os.path.join(output_dir, "metrics.jsonl")
        if start_step and os.path.isfile(path):
            with open(path) as f:
                kept = [line for line in f if _step_of(line) < start_step]
            with open(path + ".tmp", "w") as f:  # renamed over: a kill keeps the old rows
                f.writelines(kept)
            os.replace(path + ".tmp", path)
        self._jsonl = open(path, "a" if start_step else "w")
        config = run_info.get("config") or {}
        self._reward_label = BAR_REWARD_LABELS[reward_kind(config)]
        self._bar = tqdm(total=num_steps, initial=start_step, desc="ppo", unit="step",
                         dynamic_ncols=True, disable=not show_progress)
        self._wandb = None
        self.wandb_id = wandb_id
        if wandb_mode != "disabled":
            # The driver imports vLLM (openai with it) for its engine check, and wandb then
            # advertises Weave, its LLM call tracer, on the console: a run calls no LLM API.
            os.environ.setdefault("WANDB_DISABLE_WEAVE", "true")
            import wandb

            init = {"project": "rlhf_paro", **(wandb_init or {})}
            init["name"] = init.get("name") or os.path.basename(os.path.normpath(output_dir))
            self._wandb = wandb.init(dir=output_dir, mode=wandb_mode, config=run_info, **init,
                                     id=wandb_id, resume="allow" if wandb_id else None,
                                     # Quiet, and no system sampler: on small machines it steals
                                     # a core from the workers.
                                     settings=wandb.Settings(silent=True, console="off",
                                                             x_disable_stats=True))
            self.wandb_id = self._wandb.id
            # One section per model and per loop group, all against the PPO step.
            wandb.define_metric("step")
            for prefix in (*ROLES, "ppo", "rollout", "timing_s", "perf", "checkpoint"):
                wandb.define_metric(f"{prefix}/*", step_metric="step")

    def log(self, step: int, row: dict[str, float]) -> None:
        self._jsonl.write(json.dumps({"step": step, **row}) + "\n")
        self._jsonl.flush()
        if self._wandb is not None:
            self._wandb.log({"step": step, **row})
        self._bar.set_postfix_str(
            (f"score={row[TASK_SCORE_KEY]:.3f} " if TASK_SCORE_KEY in row else "")
            + f"{self._reward_label}={row['ppo/reward_mean']:.2f} "
            + (f"kl={row['ppo/kl']:.3f} " if "ppo/kl" in row else "")
            + f"{row['timing_s/step']:.1f}s", refresh=False)
        # The bar's last state is drawn once, by close (which always draws it, the time spent
        # after the last step, on the export and the dashboard, included): drawn here too, it
        # was the console's last line twice.
        self._bar.n += 1
        if self._bar.n < self._bar.total:
            self._bar.refresh()

    def close(self) -> None:
        self._bar.close()
        self._jsonl.close()
        if self._wandb is not None:
            self._wandb.finish()


def _step_of(line: str) -> float:
    """The step of a metrics.jsonl line; infinity for a line a kill cut short."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError):
        return math.inf


def missing_steps(path: str, before: int) -> list[int]:
    """The steps below ``before`` that have no row in the metrics.jsonl at ``path`` (all of them
    when it is gone)."""
    logged = set()
    if os.path.isfile(path):
        with open(path) as f:
            logged = {_step_of(line) for line in f}
    return [step for step in range(before) if step not in logged]


def read_jsonl(path: str) -> list[dict[str, float]]:
    """Rows of a metrics.jsonl, in step order."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
