"""GRPO on the demo task in one process: rlhf_paro against TRL's GRPOTrainer, interleaved.

    python scripts/bench_grpo.py --trl-python /path/to/venv/bin/python
    python scripts/bench_grpo.py --micro-batch 16,64 --rounds 3 --steps 20 --trl-python ...

Both train the demo's SFT actor (``conf=grpo_tiny``'s assets, made on first use) on the counting
task with the same rule reward (the task score, ``rlhf_paro/ppo/task.py:counting_score``): 16
prompts x 4 samples a step, ``ppo.max_new_tokens`` (default 8) tokens at temperature 1, no KL
(no reference model), AdamW at the conf's learning rate, one optimizer step per 64 samples in
micro-batches of ``--micro-batch`` samples, fp32 on the CPU, world size 1. TRL needs its own
environment (``pip install trl`` pulls its own pins); ``--trl-python`` names its interpreter,
which must also be able to import this project (an editable install, or a virtualenv made with
``--system-site-packages`` over ours).

Every round runs each contender once, in turn, as its own process, so slow drifts of the machine
fall on all alike. A step's samples/s is 64 over its wall time (rollout, reward, update); the
first ``--warmup`` steps of a job are left out and the table gives the median of the rest over
all rounds, with the last step's mean task score of each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPTS, SAMPLES = 16, 4

# Run by --trl-python: TRL's GRPOTrainer on the demo's actor, prompts and score; prints one JSON
# line of per-step wall times and the last logged reward.
TRL_JOB = r"""
import json, sys, time
import datasets, transformers
from trl import GRPOConfig, GRPOTrainer
from rlhf_paro.ppo.task import counting_score

actor, train_file, out, steps, micro, new_tokens, lr = sys.argv[1:8]
steps, micro, new_tokens, lr = int(steps), int(micro), int(new_tokens), float(lr)
data = datasets.load_dataset("json", data_files=train_file, split="train")
tok = transformers.AutoTokenizer.from_pretrained(actor)
tok.pad_token = tok.pad_token or tok.eos_token
tok.padding_side = "left"
model = transformers.AutoModelForCausalLM.from_pretrained(actor)

def reward(prompts, completions, **columns):
    return counting_score(prompts, completions, **columns)

times, scores = [], []

class Clock(transformers.TrainerCallback):
    def on_step_begin(self, args, state, control, **kw):
        self.start = time.perf_counter()
    def on_step_end(self, args, state, control, **kw):
        times.append(time.perf_counter() - self.start)
    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "reward" in logs:
            scores.append(logs["reward"])

args = GRPOConfig(output_dir=out, max_steps=steps, per_device_train_batch_size=micro,
                  gradient_accumulation_steps=%(samples)d // micro, num_generations=%(n)d,
                  max_completion_length=new_tokens, temperature=1.0, top_k=0, beta=0.0,
                  learning_rate=lr, adam_beta1=0.9, adam_beta2=0.95, weight_decay=0.0,
                  max_grad_norm=1.0, lr_scheduler_type="constant", logging_steps=1,
                  report_to=[], save_strategy="no", use_cpu=True, seed=0,
                  dataloader_num_workers=0, disable_tqdm=True)
trainer = GRPOTrainer(model=model, args=args, reward_funcs=reward, train_dataset=data,
                      processing_class=tok, callbacks=[Clock()])
trainer.train()
print(json.dumps({"times": times, "score": scores[-1] if scores else None}))
""" % {"samples": PROMPTS * SAMPLES, "n": SAMPLES}


def ours(python: str, steps: int, micro: int, new_tokens: int, out: Path) -> dict:
    cmd = [python, "-m", "rlhf_paro.train", "conf=grpo_tiny", "cluster.num_devices=1",
           "cluster.group_size=1", "algorithm.kl_coef=0", f"actor.micro_batch_size={micro}",
           f"ppo.rollout_batch_size={PROMPTS}", f"rollout.n={SAMPLES}",
           f"ppo.mini_batch_size={PROMPTS * SAMPLES}", f"ppo.max_new_tokens={new_tokens}",
           f"trainer.steps={steps}", "trainer.save_every=0", "trainer.eval_every=0",
           "logger.wandb.mode=disabled", "logger.progress=false", f"trainer.output_dir={out}"]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"times": [r["timing_s/step"] for r in rows], "score": rows[-1]["ppo/task_score"]}


def trl(python: str, steps: int, micro: int, new_tokens: int, out: Path, assets: dict) -> dict:
    done = subprocess.run([python, "-c", TRL_JOB, assets["actor"], assets["train"], str(out),
                           str(steps), str(micro), str(new_tokens), str(assets["lr"])],
                          check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def demo_assets(new_tokens: int) -> dict:
    """The conf's actor and prompt file, made now if missing (the entry point resolves them)."""
    from rlhf_paro.cli import register_demo_resolver
    from rlhf_paro.compose import load_config
    from rlhf_paro.ppo import demo

    register_demo_resolver()  # the conf names ${demo:score}, as the entry points resolve it
    # Only the task section and the learning rate are read: no model or file is looked at.
    cfg = load_config(["conf=grpo_tiny", "actor.config={model_type: llama}",
                       "data.train_files=null"])
    return {"actor": demo.asset("actor", cfg.task, new_tokens),
            "train": demo.asset("train", cfg.task, new_tokens), "lr": cfg.actor.optim.lr}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trl-python", default=sys.executable)
    parser.add_argument("--micro-batch", default="16", help="comma-separated sample counts")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    micros = [int(m) for m in args.micro_batch.split(",")]
    assets = demo_assets(args.max_new_tokens)
    times: dict[tuple[str, int], list[float]] = {}
    scores: dict[tuple[str, int], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for micro in micros:
                for name in ("rlhf_paro", "trl"):
                    out = Path(tmp) / f"{name}-{micro}-{r}"
                    start = time.perf_counter()
                    if name == "trl":
                        got = trl(args.trl_python, args.steps, micro, args.max_new_tokens, out,
                                  assets)
                    else:
                        got = ours(sys.executable, args.steps, micro, args.max_new_tokens, out)
                    times.setdefault((name, micro), []).extend(got["times"][args.warmup:])
                    scores.setdefault((name, micro), []).append(got["score"])
                    print(f"round {r + 1}: {name} micro-batch {micro}: "
                          f"{time.perf_counter() - start:.0f} s", flush=True)
    print(f"\nGRPO, {PROMPTS} prompts x {SAMPLES}, {args.max_new_tokens} new tokens, world "
          f"size 1; median over {args.rounds} rounds x {args.steps - args.warmup} steps")
    print(f"{'contender':<12}{'micro':>6}{'samples/s':>11}{'s/step':>9}{'last score':>12}")
    for (name, micro), ts in times.items():
        step = statistics.median(ts)
        score = statistics.mean(s for s in scores[(name, micro)] if s is not None)
        print(f"{name:<12}{micro:>6}{PROMPTS * SAMPLES / step:>11.0f}{step:>9.4f}{score:>12.3f}")
    for micro in micros:
        ratio = (statistics.median(times[("trl", micro)])
                 / statistics.median(times[("rlhf_paro", micro)]))
        print(f"micro-batch {micro}: rlhf_paro {ratio:.2f}x TRL's samples/s")


if __name__ == "__main__":
    main()
