"""Start-up of a run, phase by phase: where the seconds from the command to the first step go.

    python scripts/bench_startup.py                       # the default tiny run and an own model
    python scripts/bench_startup.py --rounds 3 --baseline <dir>
    python scripts/bench_startup.py --jobs tiny -- ray.num_cpus=4

Jobs (--jobs, default both), each ``python -m rlhf_paro.train ... trainer.steps=1`` on this
machine's private Ray, its assets made first (not timed):

  tiny   the default run (conf/ppo_tiny: four models on 4 devices), its demo assets cached
         (a first ``python -m rlhf_paro.train`` makes them)
  own    the same conf with a user's own tiny models (README, "Your own model"): a random Llama
         policy and a Llama sequence classifier as the reward model, both over a word-level
         tokenizer, and a prompt file

Each job runs under a probe (this script with ``--probe``) that times the driver's calls
without changing them, and the table gives, per phase, the median seconds over --rounds:

  driver     interpreter start to the config resolved (imports, the demo's assets checked,
             tokenizers read)
  ray        Ray started (``init_ray``)
  place      the devices reserved
  workers    the run's worker processes started and their modules imported (every worker has
             answered a call)
  setup      process groups joined, the models built and sharded, the actor's rollout engines
  rest       the rollout source's start, the prompts, the logger, up to the first step
  first      the first step to the command to its first step, as the command's whole start
  step       the first step itself
  exit       the last step to the command's exit (export, dashboard, Ray's shutdown)
  total      the command, start to exit

--baseline DIR runs each job again from another checkout of the project (its ``rlhf_paro``
first on the path, Ray's workers included), interleaved with this tree's, as "<job>
(baseline)": a change measured side by side with the tree before it, e.g. ``git worktree add
<dir> HEAD~1``. The probe's extra call to every worker (``workers``) costs a round trip.

Overrides after ``--`` go to every job.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PHASES = ("driver", "ray", "place", "workers", "setup", "rest", "first", "step", "exit",
          "total")
# The probe's marks, in the order a run reaches them: each phase ends at its mark.
MARKS = {"driver": "prepared", "ray": "ray", "place": "placed", "workers": "workers",
         "setup": "setup", "rest": "step_start", "step": "step_end"}
# The own model's prompts: words of its tokenizer.
WORDS = [chr(ord("a") + k) for k in range(16)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=1, help="runs of every job")
    parser.add_argument("--jobs", default="tiny,own", help="comma-separated, of tiny,own")
    parser.add_argument("--baseline", default=None,
                        help="another checkout whose jobs run beside this tree's")
    parser.add_argument("--output-dir", default=None,
                        help="keep every job's output under this directory (default: a "
                             "temporary one, removed)")
    parser.add_argument("overrides", nargs="*", help="key=value for every job (after --)")
    args = parser.parse_args(argv)
    args.jobs = [j for j in args.jobs.split(",") if j]
    if not args.jobs or any(j not in ("tiny", "own") for j in args.jobs):
        parser.error(f"--jobs takes tiny or own, comma-separated; got {','.join(args.jobs)}")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.baseline is not None and not (Path(args.baseline) / "rlhf_paro").is_dir():
        parser.error(f"--baseline {args.baseline} holds no rlhf_paro package; allowed: a "
                     "checkout of this project")
    return args


# -- the probe, in the job's driver ------------------------------------------------------------

def probe(marks_path: str, argv: list[str]) -> None:
    """``python -m rlhf_paro.train ARGV``, writing ``{mark: time.time()}`` to ``marks_path``
    as the driver reaches each mark. The trainer's modules are wrapped when the run imports
    them (``train._run`` does, first thing), so the driver's imports happen as they would."""
    marks: dict[str, float] = {}

    def mark(name: str) -> None:
        marks.setdefault(name, time.time())
        Path(marks_path).write_text(json.dumps(marks))

    from rlhf_paro import cli, train

    prepare, run = train.prepare, train._run

    def prepared(*args, **kwargs):
        cfg = prepare(*args, **kwargs)
        mark("prepared")
        return cfg

    def wrapped_run(*args, **kwargs):
        import ray

        from rlhf_paro import sources, trainer
        from rlhf_paro.actors import group

        init_ray, place, make, step = group.init_ray, trainer.place, sources.make, \
            trainer.PPOTrainer.step
        groups: list = []
        model_group_init, rendezvous = group.ModelGroup.__init__, group.ModelGroup.rendezvous

        def timed_init_ray(*a, **k):
            init_ray(*a, **k)
            mark("ray")

        def timed_place(*a, **k):
            placement = place(*a, **k)
            mark("placed")
            return placement

        def made_group(self, *a, **k):
            model_group_init(self, *a, **k)
            groups.append(self)

        def timed_rendezvous(self):
            if "workers" not in marks:  # the first model's: every worker answers first
                ray.get([w.node.remote() for g in groups for w in g.workers])
                mark("workers")
            return rendezvous(self)

        def timed_make(*a, **k):
            source = make(*a, **k)
            start = source.start

            def timed_start():
                mark("setup")
                return start()

            source.start = timed_start
            return source

        def timed_step(self, *a, **k):
            mark("step_start")
            row = step(self, *a, **k)
            mark("step_end")
            return row

        group.init_ray = trainer.init_ray = timed_init_ray
        trainer.place = timed_place
        group.ModelGroup.__init__ = made_group
        group.ModelGroup.rendezvous = timed_rendezvous
        sources.make = trainer.sources.make = timed_make
        trainer.PPOTrainer.step = timed_step
        return run(*args, **kwargs)

    train.prepare, train._run = prepared, wrapped_run
    sys.argv = ["rlhf_paro.train", *argv]
    cli.exit_when_done(train.main)  # as the module's ``__main__`` does


# -- the jobs ----------------------------------------------------------------------------------

def own_assets(into: Path) -> list[str]:
    """A user's own tiny policy, reward model and prompts under ``into``; their overrides."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import (
        LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification, PreTrainedTokenizerFast,
    )

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.train_from_iterator([" ".join(WORDS) + " count :"], trainers.WordLevelTrainer(
        special_tokens=["<pad>", "<s>", "</s>", "<unk>"]))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                        pad_token="<pad>", unk_token="<unk>")

    def config(**extra) -> LlamaConfig:
        return LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
                           eos_token_id=2, **extra)

    torch.manual_seed(0)
    for name, model in (("policy", LlamaForCausalLM(config())),
                        ("rm", LlamaForSequenceClassification(config(num_labels=1)))):
        model.save_pretrained(into / name)
        tokenizer.save_pretrained(into / name)
    gen = torch.Generator().manual_seed(0)
    with open(into / "prompts.jsonl", "w") as f:
        for _ in range(64):
            start, length = (int(torch.randint(0, n, (1,), generator=gen)) for n in (16, 6))
            words = [WORDS[(start + k) % 16] for k in range(length + 1)]
            f.write(json.dumps({"prompt": "count : " + " ".join(words)}) + "\n")
    return [f"actor.path={into / 'policy'}", f"reward.path={into / 'rm'}",
            f"data.train_files={into / 'prompts.jsonl'}"]


def run_job(overrides: list[str], output_dir: Path, tree: str | None) -> dict[str, float]:
    """One ``python -m rlhf_paro.train`` under the probe, of this tree or of the checkout
    ``tree``; its phases in seconds (its own errors end the benchmark)."""
    marks_path = output_dir.with_suffix(".marks.json")
    command = [sys.executable, os.path.abspath(__file__), "--probe", str(marks_path), *overrides,
               f"trainer.output_dir={output_dir}", "trainer.steps=1",
               "logger.wandb.mode=disabled", "logger.progress=false"]
    root = Path(tree or Path(__file__).resolve().parent.parent).resolve()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(root), *filter(None, [os.environ.get("PYTHONPATH")])])}
    start = time.time()
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          cwd=root, env=env)
    end = time.time()
    if done.returncode:
        raise SystemExit(f"error: {' '.join(overrides)} failed:\n{done.stderr[-3000:]}")
    marks = {"start": start, **json.loads(marks_path.read_text()), "end": end}
    phases, before = {}, "start"
    for phase, name in MARKS.items():
        phases[phase] = marks[name] - marks[before]
        before = name
    phases["exit"] = end - marks["step_end"]
    phases["first"] = marks["step_start"] - start
    phases["total"] = end - start
    return phases


def table(results: dict[str, list[dict[str, float]]]) -> str:
    width = max(len(name) for name in results) + 2
    lines = [f"{'job':<{width}}" + "".join(f"{p:>9}" for p in PHASES)]
    for name, runs in results.items():
        lines.append(f"{name:<{width}}" + "".join(
            f"{statistics.median(r[p] for r in runs):>9.1f}" for p in PHASES))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    trees = [None] + ([args.baseline] if args.baseline is not None else [])
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        root = Path(args.output_dir or tmp)
        root.mkdir(parents=True, exist_ok=True)
        jobs = {"tiny": [], "own": own_assets(root) if "own" in args.jobs else []}
        results: dict[str, list[dict[str, float]]] = {}
        for round_ in range(args.rounds):
            for job in args.jobs:
                for tree in trees:
                    name = job + (" (baseline)" if tree else "")
                    out = root / f"{job}_{round_}{'_baseline' if tree else ''}"
                    phases = run_job([*jobs[job], *args.overrides], out, tree)
                    results.setdefault(name, []).append(phases)
                    print(f"round {round_} {name}: " + " ".join(
                        f"{p}={phases[p]:.1f}" for p in PHASES), flush=True)
        print(f"\nmedian seconds over {args.rounds} round(s):")
        print(table(results))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--probe":
        sys.path[0] = os.getcwd()  # as ``python -m`` from the job's tree
        probe(sys.argv[2], sys.argv[3:])
    else:
        main()
