"""The same PPO run under several strategy assignments, interleaved round by round.

    python scripts/bench_ppo.py                                   # ppo_tiny on this machine
    python scripts/bench_ppo.py --rounds 3 --steps 6 -- cluster.num_devices=4 cluster.group_size=2
    python scripts/bench_ppo.py --contenders zero3,deepspeed --mix actor=IIG,critic=NIG,ref=I,reward=I
    python scripts/bench_ppo.py --contenders hf,vllm --rounds 2 --steps 3   # the rollout engines

On an emulated cluster (scripts/emulate_cluster.py --ray) the jobs join it through RAY_ADDRESS,
which a job takes for ray.address (the docstring there has the rest). Here four 10.5M-parameter
Llamas with random weights on 2 nodes x 2 ranks, a budget that uniform DDP does not fit:

    sudo python scripts/emulate_cluster.py --nodes 2 --gpus-per-node 2 --inter-rate 160MB --ray \\
        -- python scripts/bench_ppo.py --contenders zero3,auto --rounds 2 --steps 3 -- \\
        'actor.config={model_type: llama, hidden_size: 512, intermediate_size: 1024,
        num_hidden_layers: 4, num_attention_heads: 8, num_key_value_heads: 8,
        max_position_embeddings: 64}' reward.path=null data.train_files=null cluster.memory_gb=0.4

Contenders (each a set of overrides on top of the given ones):
  zero3      uniform ZeRO-3 on PaRO: GGG for the trained models, G for the frozen ones, as an
             OpenRLHF user would run it
  ddp        uniform data parallel: NNN and N
  auto       the planner's choice per model (strategy=auto)
  deepspeed  every model on DeepSpeed ZeRO-3 (backend=deepspeed), the way OpenRLHF runs today
  mix        the hand mix of --mix
  hf         rollouts by Hugging Face generate on the actor's gathered weights (rollout.engine=hf)
  vllm       rollouts by a vLLM engine on each actor rank, synced after every update
             (rollout.engine=vllm; vLLM installed)
Before the first round, each contender's strategies per model (the planner's where it is auto)
are worked out, and, when the overrides set cluster.memory_gb, whether they fit it as the planner
counts (`python -m rlhf_paro.plan` shows its table): a training job runs a strategy that does
not fit all the same, so the column says which contenders a device of that size could hold.
Every round runs each contender once, in turn, as its own `python -m rlhf_paro.train` job, so
slow drifts of the machine fall on all alike. A job's first step (warm-up) is left out; per
contender the table gives the median of the other steps over all rounds: `perf/samples_per_s`,
each model's wall time per phase (the actor's sync too, where its rollout engine takes the
weights) and the bytes it sent per step on intra and inter links (all ranks).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROLES = ("actor", "critic", "reward", "ref")
FROZEN = ("reward", "ref")


def contender_overrides(name: str, mix: dict[str, str], extra: dict[str, list[str]]
                        ) -> list[str]:
    name = name.split("@", 1)[0]  # the same overrides on another revision's source
    if name in extra:
        return extra[name]
    if name == "given":
        return []
    if name == "zero3":
        return [f"{r}.strategy={'G' if r in FROZEN else 'GGG'}" for r in ROLES]
    if name == "ddp":
        return [f"{r}.strategy={'N' if r in FROZEN else 'NNN'}" for r in ROLES]
    if name == "auto":
        return [f"{r}.strategy=auto" for r in ROLES]
    if name == "deepspeed":
        return [o for r in ROLES for o in (f"{r}.backend=deepspeed", f"{r}.deepspeed.zero_stage=3")]
    if name in ("hf", "vllm"):
        return [f"rollout.engine={name}"]
    if name == "mix":
        if not mix:
            raise SystemExit("error: --contenders mix needs --mix actor=...,critic=...")
        return [f"{r}.strategy={s}" for r, s in mix.items()]
    raise SystemExit(f"error: unknown contender {name!r}; allowed: given, zero3, ddp, auto, "
                     f"deepspeed, mix, hf, vllm, a name given with --also, any of them "
                     f"@REVISION")


def strategies_and_fit(overrides: list[str]) -> tuple[dict[str, str], bool | None]:
    """Each model's strategy in a job with ``overrides`` (``auto`` resolved by the planner), and
    whether the four fit ``cluster.memory_gb`` (None: no budget set)."""
    from rlhf_paro.cli import register_demo_resolver
    from rlhf_paro.compose import load_config
    from rlhf_paro.config import ConfigError
    from rlhf_paro.plan import configured_strategies, make_plan, resolve_auto
    from rlhf_paro.resolve import resolve

    register_demo_resolver()
    cfg = resolve(load_config(overrides))
    try:
        cfg = resolve_auto(cfg)
    except ConfigError:  # auto found nothing that fits; the job will say so itself
        return {r: "auto" for r in ROLES}, False
    fixed = configured_strategies(cfg)
    names = {r: fixed[r].name if r in fixed else "-" for r in ROLES}  # "-": a model not run
    if cfg.cluster.memory_gb is None:
        return names, None
    return names, make_plan(cfg, fixed=fixed).best is not None


def source_tree(revision: str, into: Path) -> Path:
    """The project's files at git ``revision`` under ``into`` (a job that runs from them takes
    the package from there: PYTHONPATH comes before the installed one)."""
    root = Path(__file__).resolve().parents[1]
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(root), "archive", revision],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if archive.returncode:
        raise SystemExit(f"error: no revision {revision!r}: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def run_job(overrides: list[str], output_dir: Path, source: Path | None = None) -> list[dict]:
    """One training job (from the package under ``source``, else the installed one); its
    metrics rows (the job's own errors go to the console)."""
    command = [sys.executable, "-m", "rlhf_paro.train", *overrides,
               f"trainer.output_dir={output_dir}", "logger.wandb.mode=disabled",
               "logger.progress=false", "trainer.save_every=0", "trainer.export_every=0",
               "trainer.eval_every=0"]
    env = dict(os.environ)
    if source is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(source),
                                                          env.get("PYTHONPATH")]))
    # ``python -m`` puts the working directory first on the path: a source's own, so that a
    # checkout's package does not shadow it.
    done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          env=env, cwd=source)
    if done.returncode:
        raise SystemExit(f"error: {' '.join(overrides)} failed:\n{done.stderr[-2000:]}")
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return rows[1:]  # the first step warms up


def summary(rows: list[dict]) -> dict[str, float]:
    """Median over steps of every numeric metric the table shows."""
    keys = [k for k in rows[0] if k in ("perf/samples_per_s", "ppo/response_length",
                                         "perf/padding_fraction") or "/time_s/" in k
            or k.endswith("/comm/intra_bytes") or k.endswith("/comm/inter_bytes")]
    return {k: statistics.median(r[k] for r in rows) for k in keys
            if all(isinstance(r.get(k), (int, float)) for r in rows)}


def table(results: dict[str, list[dict]], plans: dict[str, tuple[dict[str, str], bool | None]],
          budget: str) -> str:
    lines = [f"| contender | strategies (actor critic reward ref) | fits {budget} | samples/s | "
             "response tokens | "
             + " | ".join(
        f"{r} s/step (gen, infer, train[, sync]) | {r} MB/step intra, inter" for r in ROLES)
        + " |",
        "|---" * (5 + 2 * len(ROLES)) + "|"]
    base = None
    for name, rows in results.items():
        s = summary(rows)
        rate = s["perf/samples_per_s"]
        base = base or rate
        strategies, fits = plans[name]
        cells = [name, " ".join(strategies[r] for r in ROLES),
                 "-" if fits is None else ("yes" if fits else "no"),
                 f"{rate:.2f} ({rate / base:.2f}x)", f"{s.get('ppo/response_length', 0):.1f}"]
        for r in ROLES:
            phases = [s.get(f"{r}/time_s/{p}", 0.0) for p in ("generate", "inference", "train")]
            if f"{r}/time_s/sync" in s:  # a rollout engine with weights of its own takes them
                phases.append(s[f"{r}/time_s/sync"])
            cells.append(", ".join(f"{t:.2f}" for t in phases))
            cells.append(f"{s.get(f'{r}/comm/intra_bytes', 0) / 1e6:.1f}, "
                         f"{s.get(f'{r}/comm/inter_bytes', 0) / 1e6:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contenders", default="zero3,ddp,auto,deepspeed",
                        help="comma-separated: given, zero3, ddp, auto, deepspeed, mix, hf, vllm, "
                             "a name of --also; NAME@REV runs NAME from the source of git "
                             "revision REV")
    parser.add_argument("--also", action="append", default=[], metavar="NAME=OVERRIDES",
                        help="a contender of its own overrides (space-separated, shell quoting)")
    parser.add_argument("--mix", default="", help="the hand mix, e.g. actor=IIG,critic=NIG,"
                                                  "ref=I,reward=I")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="PPO steps per job (first: warm-up)")
    parser.add_argument("overrides", nargs="*", help="key=value for every job (after --)")
    args = parser.parse_args()
    if args.steps < 2:
        raise SystemExit("error: --steps must be at least 2 (the first step is warm-up)")
    mix = dict(item.split("=", 1) for item in args.mix.split(",") if item)
    extra = {}
    for item in args.also:
        name, _, overrides = item.partition("=")
        extra[name] = shlex.split(overrides)
    names = [n for n in args.contenders.split(",") if n]
    plans = {n: contender_overrides(n, mix, extra) for n in names}
    fits = {n: strategies_and_fit([*args.overrides, *plans[n]]) for n in names}
    results: dict[str, list[dict]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory(prefix="bench_ppo_") as tmp:
        sources = {n: source_tree(n.split("@", 1)[1], Path(tmp) / f"source_{i}")
                   for i, n in enumerate(names) if "@" in n}
        for round_ in range(args.rounds):
            for i, name in enumerate(names):
                out = Path(tmp) / f"job_{i}_{round_}"
                print(f"round {round_ + 1}/{args.rounds}: {name}", file=sys.stderr, flush=True)
                results[name] += run_job([*args.overrides, *plans[name],
                                          f"trainer.steps={args.steps}"], out,
                                         sources.get(name))
    print(f"overrides: {' '.join(args.overrides) or '(none)'}; {args.rounds} rounds of "
          f"{args.steps} steps, first step of each job left out; ratios against {names[0]}")
    budget = next((o.split("=", 1)[1] for o in reversed(args.overrides)
                   if o.startswith("cluster.memory_gb=")), None)
    print(table(results, fits, f"memory_gb={budget}" if budget else "(no memory_gb)"))


if __name__ == "__main__":
    main()
