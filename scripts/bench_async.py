"""Asynchronous rollouts against the colocated synchronous run, at equal total devices.

    python scripts/bench_async.py                               # speed: 3 rounds of 8 steps
    python scripts/bench_async.py --rounds 1 --steps 4 --warmup 2 --slow-reward-s 0
    python scripts/bench_async.py --curve --steps 50 --at 0,9,19,29,49 --seeds 0,1

Speed (the default). GRPO (``conf=grpo_tiny``'s algorithm: 16 prompts x 4 samples a step, one
optimizer step, the reference's KL in the loss) at a realistic length mix: a random Llama
(--layers x --hidden, fp32) over a word-level tokenizer of --vocab tokens (110), so that at
temperature 1, with near-uniform logits, each step samples the <eos> with a chance of about
1/--vocab and responses end by chance, about geometric, mean about 100 under the --budget of 256.
The learning rate is --lr (1e-6), small enough that the policy stays where it started: at the
conf's 1e-3 the score (correct successors over the budget) pays longer responses, lengths grow by
half in three steps, and a rollout one step stale would be shorter than a fresh one, which would
flatter the asynchronous run; a benchmark of speed wants the same length mix in every step of every
job. Rollouts by --engine (vllm). Its prompts are the counting task's (a prompt file with the
columns the score reads) and its reward is the task's score, by a reward function that first sleeps
--slow-reward-s seconds per call (a batch), as an LLM judge or a code sandbox takes wall
time to answer. Contenders, two devices each:

  sync   colocated synchronous: cluster.num_devices=2, the engines in the actor's ranks
  async  cluster.num_devices=1 rollout.num_devices=1 rollout.max_staleness=1: the rollout of
         step t + 1 generates on a device of its own (and is scored, slow reward included)
         while step t trains

each once per --slow-reward-s value. Every round runs every job once, in turn, as its own
``python -m rlhf_paro.train``, so slow drifts of the machine fall on all alike. The first
--warmup steps of every job are left out (start-up, and the pipeline filling), and so is its last
step: the one-step-off run launches no rollout beyond the run's end, so its last step trains with
nothing generating beside it, faster than any step before (the pipeline draining). The table gives
the median over the other steps of all rounds of the step's wall time (``timing_s/step``) and
its parts, samples/s as the samples of a step over that median, and each async job's ratio to
the sync job with the same reward (> 1: async is faster). The parts say where the time goes:
``timing_s/generate`` (launching and waiting for the rollout; for async the wait alone is
``timing_s/wait_rollout``), ``make_experience`` (which holds the wait for a reward scored
ahead: collecting a rollout waits for its tokens only), ``train``, and the replicas'
``rollout/time_s`` ``generate``, ``sync`` and ``idle``.

Curve (--curve): ``conf=grpo_tiny`` for --steps steps, ``cluster.num_devices=1`` colocated and
synchronous against ``rollout.num_devices=1 rollout.max_staleness=1``, once per --seeds seed:
``ppo/task_score`` (the step's sampled responses) and ``eval/score_mean`` (greedy responses to
the validation prompts, every ``trainer.eval_every`` steps) at the steps of --at, side by side,
with the samples trained on before each step. Runs of one seed differ only by the asynchrony
(every run is deterministic); several seeds show the run-to-run noise to judge it against.

--contenders picks among them (default both). --baseline DIR runs each contender again from
another checkout of the project (its ``rlhf_paro`` first on the path, Ray's workers included),
interleaved with this tree's jobs, as "<contender> (baseline)": a change measured side by side
with the tree before it, e.g. ``git worktree add /tmp/before HEAD~1`` then ``--contenders sync
--baseline /tmp/before``.

Overrides after ``--`` go to every job, e.g. ``-- rollout.tis_cap=2``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

PROMPTS, SAMPLES = 16, 4
STEP_SAMPLES = PROMPTS * SAMPLES

# The two contenders at equal total devices (two), as overrides.
CONTENDERS = {
    "sync": ["cluster.num_devices=2", "cluster.group_size=2"],
    "async": ["cluster.num_devices=1", "cluster.group_size=1", "rollout.num_devices=1",
              "rollout.max_staleness=1"],
}
# --curve: the synchronous run on the same training device, and the one-step-off run.
CURVE_CONTENDERS = {
    "sync": ["cluster.num_devices=1", "cluster.group_size=1"],
    "async": ["cluster.num_devices=1", "cluster.group_size=1", "rollout.num_devices=1",
              "rollout.max_staleness=1"],
}
# Steps at a job's end left out: the async contender's last max_staleness steps have no rollout
# generating beside them.
DRAIN = 1
# Per-step metrics the speed table shows: (column, metric).
PARTS = (("generate", "timing_s/generate"), ("wait", "timing_s/wait_rollout"),
         ("experience", "timing_s/make_experience"), ("train", "timing_s/train"),
         ("rep gen", "rollout/time_s/generate"), ("rep sync", "rollout/time_s/sync"),
         ("rep idle", "rollout/time_s/idle"))

# The reward of the speed jobs: the counting task's score, after a fixed wait per call.
REWARD = '''import time
from rlhf_paro.ppo.task import counting_score


def reward(prompts, responses, **columns):
    time.sleep({seconds!r})  # the wall time a judge or a sandbox takes to answer
    return counting_score(prompts, responses, **columns)
'''


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--curve", action="store_true",
                        help="the task-score curve of conf=grpo_tiny instead of the speed")
    parser.add_argument("--rounds", type=int, default=3, help="speed: rounds of all jobs")
    parser.add_argument("--steps", type=int, default=None,
                        help="steps per job (default: 8 for the speed, 50 for --curve)")
    parser.add_argument("--warmup", type=int, default=2,
                        help="speed: first steps of each job left out")
    parser.add_argument("--slow-reward-s", type=floats, default=[0.0, 1.0],
                        help="speed: comma-separated seconds the reward sleeps per call; "
                             "every contender runs with each")
    parser.add_argument("--engine", default="vllm", help="speed: rollout.engine")
    parser.add_argument("--contenders", type=names, default=list(CONTENDERS),
                        help=f"speed: comma-separated, of {','.join(CONTENDERS)}")
    parser.add_argument("--baseline", default=None,
                        help="speed: another checkout whose contenders run beside this tree's")
    parser.add_argument("--vocab", type=int, default=110,
                        help="speed: tokens of the word-level vocabulary (<eos> 1 of them)")
    parser.add_argument("--budget", type=int, default=256, help="speed: ppo.max_new_tokens")
    parser.add_argument("--lr", type=float, default=1e-6,
                        help="speed: actor.optim.lr, small so that the length mix stays")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--at", type=ints, default=[0, 9, 19, 29, 49],
                        help="--curve: the steps to show")
    parser.add_argument("--seeds", type=ints, default=[0], help="--curve: trainer.seed values")
    parser.add_argument("--output-dir", default=None,
                        help="keep every job's output (metrics.jsonl) under this directory "
                             "(default: a temporary one, removed)")
    parser.add_argument("overrides", nargs="*", help="key=value for every job (after --)")
    args = parser.parse_args(argv)
    if args.steps is None:
        args.steps = 50 if args.curve else 8
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if not args.curve and args.steps < args.warmup + DRAIN + 1:
        parser.error(f"--steps ({args.steps}) must be at least --warmup ({args.warmup}) + "
                     f"{DRAIN + 1}: a job's first --warmup steps and its last are left out")
    if args.curve and any(not 0 <= s < args.steps for s in args.at):
        parser.error(f"--at steps must be in 0..{args.steps - 1} (--steps {args.steps})")
    if any(s < 0 for s in args.slow_reward_s) or not args.slow_reward_s:
        parser.error("--slow-reward-s takes seconds >= 0, e.g. 0,1")
    if not args.contenders or any(c not in CONTENDERS for c in args.contenders):
        parser.error(f"--contenders takes {' or '.join(CONTENDERS)}, comma-separated; got "
                     f"{','.join(args.contenders) or 'none'}")
    if args.baseline is not None and not (Path(args.baseline) / "rlhf_paro").is_dir():
        parser.error(f"--baseline {args.baseline} holds no rlhf_paro package; allowed: a "
                     "checkout of this project")
    if args.vocab < 5:  # pad, bos, eos, unk and one symbol
        parser.error("--vocab must be at least 5")
    return args


@contextlib.contextmanager
def workspace(args: argparse.Namespace, prefix: str) -> Iterator[Path]:
    """--output-dir (made, kept), else a temporary directory."""
    if args.output_dir is not None:
        path = Path(args.output_dir)
        # A job's directory from an earlier run would mix its rows into this one's.
        if path.exists() and any(path.iterdir()):
            raise SystemExit(f"error: --output-dir {path} is not empty; allowed: a new or "
                             "empty directory")
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        yield Path(tmp)


# -- the jobs ----------------------------------------------------------------------------------

def run_job(overrides: list[str], output_dir: Path, tree: str | None = None) -> list[dict]:
    """One training job, of this tree or of the checkout ``tree`` (run from there, its package
    first on the path of the job and of its Ray workers); its metrics rows (its own errors end
    the benchmark, with its stderr's tail)."""
    command = [sys.executable, "-m", "rlhf_paro.train", *overrides,
               f"trainer.output_dir={output_dir}", "logger.wandb.mode=disabled",
               "logger.progress=false", "trainer.save_every=0", "trainer.export_every=0"]
    env = None if tree is None else {**os.environ, "PYTHONPATH": str(Path(tree).resolve())}
    done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          cwd=tree, env=env)
    if done.returncode:
        raise SystemExit(f"error: {' '.join(overrides)} failed:\n{done.stderr[-2000:]}")
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def speed_assets(args: argparse.Namespace, into: Path) -> list[str]:
    """The word-level tokenizer and the prompt file of the speed jobs under ``into``; the
    overrides every speed job shares (the reward function is per job: ``reward_file``)."""
    from rlhf_paro.ppo.demo import make_tokenizer
    from rlhf_paro.ppo.task import CountingTask

    # <pad>, <bos>, <eos>, the symbols and <unk>: --vocab in all.
    counting = CountingTask(args.vocab - 4, response_len=args.budget)
    tokenizer = make_tokenizer(counting)
    assert len(tokenizer.get_vocab()) == args.vocab
    tokenizer.save_pretrained(into / "tokenizer")
    prompts = counting.sample_prompts(2048, __import__("torch").Generator().manual_seed(0))
    with open(into / "prompts.jsonl", "w") as f:
        for row in prompts:
            f.write(json.dumps({"prompt": counting.tokenizer.decode(row[1:]),
                                "num_symbols": counting.num_symbols,
                                "response_len": counting.response_len}) + "\n")
    prompt_len = counting.prompt_len
    model = (f"{{model_type: llama, hidden_size: {args.hidden}, intermediate_size: "
             f"{2 * args.hidden}, num_hidden_layers: {args.layers}, num_attention_heads: "
             f"{args.heads}, num_key_value_heads: {args.heads}, "
             f"max_position_embeddings: {prompt_len + args.budget}}}")
    return ["conf=grpo_tiny", "actor.path=null", f"actor.config={model}",
            f"actor.tokenizer={into / 'tokenizer'}", f"data.train_files={into / 'prompts.jsonl'}",
            "data.val_files=null", "trainer.eval_every=0", f"data.max_prompt_length={prompt_len}",
            f"ppo.max_new_tokens={args.budget}", f"rollout.engine={args.engine}",
            f"actor.optim.lr={args.lr:g}"]


def reward_file(seconds: float, into: Path) -> str:
    """``reward.function`` of a reward that sleeps ``seconds`` per call."""
    path = into / f"reward_{seconds:g}.py".replace(".", "p", f"{seconds:g}".count("."))
    path.write_text(REWARD.format(seconds=seconds))
    return f"{path}:reward"


def kept_rows(rows: list[dict], warmup: int) -> list[dict]:
    """A job's rows without its first ``warmup`` and its last ``DRAIN``."""
    return rows[warmup:len(rows) - DRAIN]


BASELINE = " (baseline)"  # a contender's label when it runs from --baseline's checkout


def job_name(contender: str, slow_s: float) -> str:
    return f"{contender}, reward +{slow_s:g} s"


# -- the tables --------------------------------------------------------------------------------

def speed_summary(rows: list[dict]) -> dict[str, float]:
    """Median over the kept steps (all rounds) of the step's wall time and its parts."""
    out = {"step": statistics.median(r["timing_s/step"] for r in rows),
           "length": statistics.median(r["ppo/response_length"] for r in rows)}
    for column, key in PARTS:
        if all(key in r for r in rows):
            out[column] = statistics.median(r[key] for r in rows)
    return out


def speed_table(results: dict[tuple[str, float], list[dict]]) -> str:
    """One line per job: samples/s, s/step (and its ratio to the sync job with the same
    reward), the response length, the parts of the step."""
    sums = {key: speed_summary(rows) for key, rows in results.items()}
    head = (f"{'job':<30}{'samples/s':>10}{'s/step':>8}{'ratio':>7}{'resp len':>9}"
            + "".join(f"{c:>11}" for c, _ in PARTS))
    lines = [head]
    for (contender, slow), s in sums.items():
        base = sums.get(("sync", slow))
        ratio = f"{base['step'] / s['step']:.2f}x" if base else "-"
        lines.append(f"{job_name(contender, slow):<30}{STEP_SAMPLES / s['step']:>10.2f}"
                     f"{s['step']:>8.3f}{ratio:>7}{s['length']:>9.1f}"
                     + "".join(f"{s[c]:>11.3f}" if c in s else f"{'-':>11}" for c, _ in PARTS))
    return "\n".join(lines)


def ratio_lines(results: dict[tuple[str, float], list[dict]]) -> list[str]:
    """Per reward, samples/s ratios (= inverse s/step ratios of medians): async against sync,
    and each contender against its run from the baseline; then what each slow reward costs
    each job's step against the same job's with the instant reward (+0 s)."""
    step = {key: speed_summary(rows)["step"] for key, rows in results.items()}
    out = []
    slows = sorted({slow for _, slow in results})
    for slow in slows:
        if ("sync", slow) in step and ("async", slow) in step:
            sync, asyn = step[("sync", slow)], step[("async", slow)]
            out.append(f"reward +{slow:g} s: async {sync / asyn:.2f}x sync's samples/s "
                       f"({asyn:.3f} against {sync:.3f} s/step)")
        for contender in CONTENDERS:
            ours, base = step.get((contender, slow)), step.get((contender + BASELINE, slow))
            if ours is not None and base is not None:
                out.append(f"reward +{slow:g} s: {contender} {base / ours:.2f}x the baseline's "
                           f"samples/s ({ours:.3f} against {base:.3f} s/step)")
    for label in dict.fromkeys(label for label, _ in results):
        for slow in slows:
            if slow > 0 and (label, 0.0) in step and (label, slow) in step:
                cost = step[(label, slow)] - step[(label, 0.0)]
                out.append(f"{label}: the reward of +{slow:g} s costs the step {cost:+.3f} s "
                           f"({step[(label, slow)]:.3f} against {step[(label, 0.0)]:.3f})")
    return out


def curve_table(runs: dict[tuple[str, int], list[dict]], at: list[int]) -> str:
    """Per step of ``at``: samples trained on before it, then each run's ppo/task_score (the
    reward where the run has no task score apart from it: prompt files without
    reward.score_function) and eval/score_mean ('-' where the step did not evaluate)."""
    names = list(runs)
    head = f"{'step':>5}{'samples':>9}" + "".join(
        f"{f'{c} s{seed} task':>17}{'eval':>7}" for c, seed in names)
    lines = [head]
    for step in at:
        cells = [f"{step:>5}{step * STEP_SAMPLES:>9}"]
        for name in names:
            row = runs[name][step]
            ev = row.get("eval/score_mean")
            cells.append(f"{row.get('ppo/task_score', row['ppo/reward_mean']):>17.3f}"
                         + (f"{ev:>7.3f}" if ev is not None else f"{'-':>7}"))
        lines.append("".join(cells))
    return "\n".join(lines)


# -- the two modes -----------------------------------------------------------------------------

def speed(args: argparse.Namespace) -> None:
    results: dict[tuple[str, float], list[dict]] = {}
    with workspace(args, "bench_async_") as root:
        shared = speed_assets(args, root)
        rewards = {slow: reward_file(slow, root) for slow in args.slow_reward_s}
        trees = [None] + ([args.baseline] if args.baseline is not None else [])
        jobs = [(c, slow, tree) for slow in args.slow_reward_s for c in args.contenders
                for tree in trees]
        for round_ in range(args.rounds):
            # Which job goes first turns from round to round.
            turn = round_ % len(jobs)
            for contender, slow, tree in jobs[turn:] + jobs[:turn]:
                label = contender if tree is None else f"{contender}{BASELINE}"
                print(f"round {round_ + 1}/{args.rounds}: {job_name(label, slow)}",
                      file=sys.stderr, flush=True)
                out = root / f"{contender}_{slow:g}_{round_}{'_baseline' if tree else ''}"
                rows = run_job([*shared, f"reward.function={rewards[slow]}",
                                *CONTENDERS[contender], *args.overrides,
                                f"trainer.steps={args.steps}"], out, tree)
                results.setdefault((label, slow), []).extend(kept_rows(rows, args.warmup))
    load = os.getloadavg()
    print(f"\nGRPO {PROMPTS} prompts x {SAMPLES}, a random Llama {args.layers} x {args.hidden} "
          f"over {args.vocab} tokens, budget {args.budget}, rollout.engine={args.engine}; "
          f"median of {args.rounds} rounds x {args.steps - args.warmup - DRAIN} steps (first "
          f"{args.warmup} and last {DRAIN} left out); overrides: "
          f"{' '.join(args.overrides) or '(none)'}; load average "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; seconds per step\n")
    print(speed_table(results))
    print()
    print("\n".join(ratio_lines(results)))


def curve(args: argparse.Namespace) -> None:
    runs: dict[tuple[str, int], list[dict]] = {}
    with workspace(args, "bench_async_curve_") as root:
        for seed in args.seeds:
            for contender, overrides in CURVE_CONTENDERS.items():
                print(f"seed {seed}: {contender}", file=sys.stderr, flush=True)
                out = root / f"{contender}_{seed}"
                runs[(contender, seed)] = run_job(
                    ["conf=grpo_tiny", *overrides, *args.overrides, f"trainer.seed={seed}",
                     f"trainer.steps={args.steps}"], out)
    print(f"\nconf=grpo_tiny, {args.steps} steps of {STEP_SAMPLES} samples; sync: "
          f"{' '.join(CURVE_CONTENDERS['sync'])}; async: {' '.join(CURVE_CONTENDERS['async'])}; "
          f"overrides: {' '.join(args.overrides) or '(none)'}; task: ppo/task_score, eval: "
          f"eval/score_mean; samples: trained on before the step\n")
    print(curve_table(runs, args.at))


def main() -> None:
    args = parse_args()
    curve(args) if args.curve else speed(args)


if __name__ == "__main__":
    main()
