"""GRPO at world size 1: rlhf_paro against TRL's GRPOTrainer, interleaved, each job its own process.

    python scripts/bench_grpo.py --trl-python /path/to/venv/bin/python
    python scripts/bench_grpo.py --micro-batch 16,64 --rounds 3 --steps 20 --trl-python ...
    python scripts/bench_grpo.py --episodes --rounds 2 --steps 8 --trl-python ...
    python scripts/bench_grpo.py --episodes --engines hf,vllm --trl-python ...
    python scripts/bench_grpo.py --episodes --engines hf,hf-stream,vllm --trl-python ...

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

``--episodes``: multi-turn episodes instead. Both train the same random Llama (4 blocks, 128
wide, fp32, a word-level vocabulary of 48: ``SYMBOLS`` symbols, 3 special tokens and <unk>, so a
response sampled at temperature 1 ends by chance at varied lengths) on the same prompts (6
distinct symbols) against the same deterministic environment, ``Recall``: ``--turns`` actions of
up to ``--max-new-tokens`` (default 64) tokens each; each action is rewarded by the share of its
symbols that are lowercase letters and answered by up to 3 of the prompt's symbols that no
action has said yet (observation tokens: attended, never trained on). An episode's score is the
sum of its rewards, in [0, 1]. AdamW at 3e-3, the rest as above. rlhf_paro runs
``python -m rlhf_paro.train`` with ``env.function=...:Recall``. TRL 1.16's own multi-turn loop
(``environment_factory`` / ``tools``) goes on only while the model's turn parses as a tool call
of a chat template it recognises (Qwen, Llama 3.1, ...; it refuses a tokenizer whose template
cannot render tool calls), and its environment can neither end an episode nor answer a turn
that calls no tool; so TRL runs the same episodes through ``rollout_func``, its hook for custom
(multi-turn) rollouts: each turn generates the next action of every running episode in one
batched call of the trainer's own generation (``GRPOTrainer._generate_single_turn``, what its
tool loop calls each turn) on the exact token ids of the episode so far, and ``env_mask`` marks
the observation tokens (``trl_rollout``). A sample in the table is an episode.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import string
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

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

SYMBOLS = 44  # the episodes' vocabulary: 44 symbols, <pad> <bos> <eos>, <unk>
PROMPT_SYMBOLS = 6
LOWERCASE = frozenset(string.ascii_lowercase)


class Recall:
    """The episodes' environment: ``turns`` actions; each is rewarded by the share of its symbols
    that are lowercase letters (26 of the ``SYMBOLS``; over the turns the score is in [0, 1]),
    and answered by up to 3 of the prompt's symbols that no action has said yet (the first 3 of
    the prompt once all have been said). Deterministic: the same actions get the same answers
    and rewards."""

    def __init__(self, prompt: str, turns: int = 3, **row: object) -> None:
        self.symbols = prompt.split()
        self.turns = turns
        self.said: set[str] = set()
        self.turn = 0

    def reset(self) -> None:
        return None

    def step(self, action: str) -> tuple[str, float, bool]:
        words = action.split()
        self.turn += 1
        self.said.update(words)
        reward = sum(w in LOWERCASE for w in words) / max(len(words), 1) / self.turns
        missed = [s for s in self.symbols if s not in self.said] or self.symbols
        return " ".join(missed[:3]), reward, self.turn == self.turns


def trl_rollout(prompts: list[str], generate: Callable[[list[list[int]]], list[list[int]]],
                tokenizer: Any, turns: int) -> dict[str, list]:
    """The episodes of ``prompts`` (one ``Recall`` each) as TRL's ``rollout_func`` returns them.
    Each turn, ``generate`` takes the exact token ids of every running episode (its prompt, its
    actions and the observations' tokens) and returns each one's next action, through its first
    <eos>; ``env_mask`` is 1 on the actions, 0 on the observations; ``episode_score`` goes to
    the reward function."""
    envs = [Recall(prompt=p, turns=turns) for p in prompts]
    contexts = [list(tokenizer(p)["input_ids"]) for p in prompts]
    starts = [len(c) for c in contexts]
    masks: list[list[int]] = [[] for _ in prompts]
    scores = [0.0] * len(prompts)
    for env in envs:
        env.reset()  # None: the prompt alone starts the episode
    running = list(range(len(prompts)))
    for turn in range(turns):
        going = []
        for i, action in zip(running, generate([contexts[i] for i in running])):
            contexts[i] += action
            masks[i] += [1] * len(action)
            obs, reward, done = envs[i].step(tokenizer.decode(action, skip_special_tokens=True))
            scores[i] += reward
            if done or turn == turns - 1:
                continue
            obs = tokenizer(obs, add_special_tokens=False)["input_ids"]
            contexts[i] += obs
            masks[i] += [0] * len(obs)
            going.append(i)
        running = going
        if not running:
            break
    return {"prompt_ids": [c[:n] for c, n in zip(contexts, starts)],
            "completion_ids": [c[n:] for c, n in zip(contexts, starts)], "logprobs": None,
            "env_mask": masks, "episode_score": scores}


# Run by --trl-python for --episodes: TRL's GRPOTrainer on the episodes through rollout_func;
# prints one JSON line of per-step wall times, the last logged reward and episode length.
TRL_EPISODES_JOB = r"""
import json, sys, time
import datasets, transformers
from trl import GRPOConfig, GRPOTrainer
import importlib.util

actor, train_file, out, steps, micro, new_tokens, lr, script, turns = sys.argv[1:10]
steps, micro, new_tokens, lr, turns = int(steps), int(micro), int(new_tokens), float(lr), int(turns)
spec = importlib.util.spec_from_file_location("bench_grpo", script)
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
data = datasets.load_dataset("json", data_files=train_file, split="train")
tok = transformers.AutoTokenizer.from_pretrained(actor)
tok.padding_side = "left"
model = transformers.AutoModelForCausalLM.from_pretrained(actor)

generated = []  # seconds of each step's rollout_func: generation and environment

def rollout(prompts, trainer):
    start = time.perf_counter()
    out = bench.trl_rollout(prompts, lambda contexts: trainer._generate_single_turn(
        contexts, None, {}, 1)[0], tok, turns)
    generated.append(time.perf_counter() - start)
    return out

def reward(prompts, completions, episode_score, **columns):
    return episode_score

times, scores, lengths = [], [], []

class Clock(transformers.TrainerCallback):
    def on_step_begin(self, args, state, control, **kw):
        self.start = time.perf_counter()
    def on_step_end(self, args, state, control, **kw):
        times.append(time.perf_counter() - self.start)
    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "reward" in logs:
            scores.append(logs["reward"])
            lengths.append(logs.get("completions/mean_length"))

args = GRPOConfig(output_dir=out, max_steps=steps, per_device_train_batch_size=micro,
                  gradient_accumulation_steps=%(samples)d // micro, num_generations=%(n)d,
                  max_completion_length=new_tokens, temperature=1.0, top_k=0, beta=0.0,
                  learning_rate=lr, adam_beta1=0.9, adam_beta2=0.95, weight_decay=0.0,
                  max_grad_norm=1.0, lr_scheduler_type="constant", logging_steps=1,
                  report_to=[], save_strategy="no", use_cpu=True, seed=0,
                  dataloader_num_workers=0, disable_tqdm=True)
trainer = GRPOTrainer(model=model, args=args, reward_funcs=reward, train_dataset=data,
                      processing_class=tok, callbacks=[Clock()], rollout_func=rollout)
trainer.train()
print(json.dumps({"times": times, "scores": scores, "lengths": lengths, "generate": generated}))
""" % {"samples": PROMPTS * SAMPLES, "n": SAMPLES}


def positions(new_tokens: int) -> list[str]:
    """The demo actor's positions for responses of ``new_tokens``: the conf's where a prompt (up
    to ``data.max_prompt_length``) and the response fit, else enough for both (a run refuses a
    sequence longer than its model); the asset is made for them on first use."""
    from rlhf_paro.compose import load_config

    cfg = load_config(["conf=grpo_tiny", "actor.config={model_type: llama}",
                       "data.train_files=null", "reward.function=null"])
    longest = cfg.data.max_prompt_length + new_tokens
    return [] if longest <= cfg.task.model["max_position_embeddings"] else \
        [f"task.model.max_position_embeddings={longest}"]


def ours(python: str, steps: int, micro: int, new_tokens: int, out: Path) -> dict:
    cmd = [python, "-m", "rlhf_paro.train", "conf=grpo_tiny", *positions(new_tokens),
           "cluster.num_devices=1",
           "cluster.group_size=1", "algorithm.kl_coef=0", f"actor.micro_batch_size={micro}",
           f"actor.max_micro_batch_size={micro}",
           f"ppo.rollout_batch_size={PROMPTS}", f"rollout.n={SAMPLES}",
           f"ppo.mini_batch_size={PROMPTS * SAMPLES}", f"ppo.max_new_tokens={new_tokens}",
           f"trainer.steps={steps}", "trainer.save_every=0", "trainer.eval_every=0",
           "logger.wandb.mode=disabled", "logger.progress=false", f"trainer.output_dir={out}"]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"times": [r["timing_s/step"] for r in rows], "score": rows[-1]["ppo/task_score"]}


def ours_episodes(python: str, steps: int, micro: int, new_tokens: int, out: Path,
                  assets: dict, engine: str = "hf") -> dict:
    # "<engine>-turns" / "<engine>-stream": its episodes turn by turn (rollout.streaming=false)
    # or each its own loop (true); "<engine>" alone: the default (auto).
    engine, _, loop = engine.partition("-")
    streaming = {"": [], "turns": ["rollout.streaming=false"],
                 "stream": ["rollout.streaming=true"]}[loop]
    cmd = [python, "-m", "rlhf_paro.train", "conf=grpo_tiny", f"rollout.engine={engine}",
           *streaming, "cluster.num_devices=1",
           "cluster.group_size=1", "algorithm.kl_coef=0", f"actor.micro_batch_size={micro}",
           f"actor.max_micro_batch_size={micro}",
           f"ppo.rollout_batch_size={PROMPTS}", f"rollout.n={SAMPLES}",
           f"ppo.mini_batch_size={PROMPTS * SAMPLES}", f"ppo.max_new_tokens={new_tokens}",
           f"actor.path={assets['actor']}", f"data.train_files={assets['train']}",
           "data.val_files=null", "reward.function=null", "reward.path=null",
           f"actor.optim.lr={assets['lr']}", f"env.function={Path(__file__).resolve()}:Recall",
           f"env.max_turns={assets['turns']}",
           f"trainer.steps={steps}", "trainer.save_every=0", "trainer.eval_every=0",
           "logger.wandb.mode=disabled", "logger.progress=false", f"trainer.output_dir={out}"]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"times": [r["timing_s/step"] for r in rows],
            # The environment's score is the reward (no task score apart from it).
            "scores": [r["ppo/reward_mean"] for r in rows],
            "lengths": [r["env/action_tokens"] for r in rows],
            "generate": [r["timing_s/generate"] for r in rows],
            "experience": [r["timing_s/make_experience"] for r in rows]}


def trl_episodes(python: str, steps: int, micro: int, new_tokens: int, out: Path,
                 assets: dict) -> dict:
    done = subprocess.run([python, "-c", TRL_EPISODES_JOB, assets["actor"], assets["train"],
                           str(out), str(steps), str(micro), str(new_tokens), str(assets["lr"]),
                           str(Path(__file__).resolve()), str(assets["turns"])],
                          check=True, capture_output=True, text=True, env=trl_env(assets))
    return json.loads(done.stdout.strip().splitlines()[-1])


def trl_env(assets: dict) -> dict[str, str]:
    """The TRL job's environment: with ``--trl-threads``, torch's thread count."""
    threads = assets.get("threads")
    return dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))


def episode_assets(folder: Path, turns: int, lr: float, seed: int = 0) -> dict:
    """The random actor (weights from ``seed``, the word-level tokenizer of ``SYMBOLS`` symbols)
    and a prompt file, written under ``folder``."""
    import random

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhf_paro.ppo import demo
    from rlhf_paro.ppo.task import CountingTask, SymbolTokenizer

    counting = CountingTask(num_symbols=SYMBOLS)
    tok = demo.make_tokenizer(counting)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
        bos_token_id=SymbolTokenizer.bos_token_id, eos_token_id=SymbolTokenizer.eos_token_id,
        pad_token_id=SymbolTokenizer.pad_token_id, tie_word_embeddings=False))
    actor = folder / "actor"
    model.save_pretrained(actor)
    tok.save_pretrained(actor)
    rng = random.Random(seed)
    symbols = counting.tokenizer.symbols
    train = folder / "train.jsonl"
    train.write_text("".join(
        json.dumps({"prompt": " ".join(rng.sample(symbols, PROMPT_SYMBOLS)), "turns": turns})
        + "\n" for _ in range(1024)))
    return {"actor": str(actor), "train": str(train), "lr": lr, "turns": turns}


def trl(python: str, steps: int, micro: int, new_tokens: int, out: Path, assets: dict) -> dict:
    done = subprocess.run([python, "-c", TRL_JOB, assets["actor"], assets["train"], str(out),
                           str(steps), str(micro), str(new_tokens), str(assets["lr"])],
                          check=True, capture_output=True, text=True, env=trl_env(assets))
    return json.loads(done.stdout.strip().splitlines()[-1])


def demo_assets(new_tokens: int) -> dict:
    """The conf's actor and prompt file, made now if missing (the entry point resolves them)."""
    from rlhf_paro.cli import register_demo_resolver
    from rlhf_paro.compose import load_config
    from rlhf_paro.ppo import demo

    register_demo_resolver()  # the conf names ${demo:score}, as the entry points resolve it
    # Only the task section and the learning rate are read: no model or file is looked at.
    cfg = load_config(["conf=grpo_tiny", "actor.config={model_type: llama}",
                       "data.train_files=null", *positions(new_tokens)])
    return {"actor": demo.asset("actor", cfg.task, new_tokens),
            "train": demo.asset("train", cfg.task, new_tokens), "lr": cfg.actor.optim.lr}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trl-python", default=sys.executable)
    parser.add_argument("--micro-batch", default="16", help="comma-separated sample counts")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="per response (per action with --episodes); default 8 (64)")
    parser.add_argument("--episodes", action="store_true",
                        help="multi-turn episodes on a random Llama (the module's docstring)")
    parser.add_argument("--turns", type=int, default=3, help="actions per episode (--episodes)")
    parser.add_argument("--engines", default="hf",
                        help="--episodes: rlhf_paro's rollout engines, comma-separated (hf, "
                             "vllm; hf-turns, hf-stream, ...: rollout.streaming=false, true)")
    parser.add_argument("--trl-threads", type=int, default=None,
                        help="torch threads of the TRL job (default: torch's; each rlhf_paro "
                             "worker on a CPU runs one)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    micros = [int(m) for m in args.micro_batch.split(",")]
    new_tokens = args.max_new_tokens or (64 if args.episodes else 8)
    times: dict[tuple[str, int], list[float]] = {}
    scores: dict[tuple[str, int], list[list[float]]] = {}
    lengths: dict[tuple[str, int], list[float]] = {}
    generate: dict[tuple[str, int], list[float]] = {}  # --episodes: the rollout's s/step
    experience: dict[tuple[str, int], list[float]] = {}  # rlhf_paro's make_experience s/step
    # rlhf_paro with each rollout engine asked for (rlhf_paro/vllm: rollout.engine=vllm), then TRL.
    engines = args.engines.split(",") if args.episodes else ["hf"]
    names = [f"rlhf_paro{'' if e == 'hf' else '/' + e}" for e in engines] + ["trl"]
    with tempfile.TemporaryDirectory() as tmp:
        if args.episodes:
            # 3e-3 rather than the demo conf's 1e-3: a random policy's score then rises clearly
            # within ten steps.
            assets = episode_assets(Path(tmp), args.turns, lr=3e-3)
        else:
            assets = demo_assets(new_tokens)
        assets["threads"] = args.trl_threads
        for r in range(args.rounds):
            for micro in micros:
                for name in names:
                    out = Path(tmp) / f"{name}-{micro}-{r}"
                    start = time.perf_counter()
                    if args.episodes:
                        if name == "trl":
                            got = trl_episodes(args.trl_python, args.steps, micro, new_tokens,
                                               out, assets)
                        else:
                            got = ours_episodes(sys.executable, args.steps, micro, new_tokens,
                                                out, assets, name.partition("/")[2] or "hf")
                    elif name == "trl":
                        got = trl(args.trl_python, args.steps, micro, new_tokens, out, assets)
                        got["scores"] = [got["score"]]
                    else:
                        got = ours(sys.executable, args.steps, micro, new_tokens, out)
                        got["scores"] = [got["score"]]
                    times.setdefault((name, micro), []).extend(got["times"][args.warmup:])
                    scores.setdefault((name, micro), []).append(got["scores"])
                    lengths.setdefault((name, micro), []).extend(got.get("lengths", []))
                    generate.setdefault((name, micro), []).extend(
                        got.get("generate", [])[args.warmup:])
                    experience.setdefault((name, micro), []).extend(
                        got.get("experience", [])[args.warmup:])
                    print(f"round {r + 1}: {name} micro-batch {micro}: "
                          f"{time.perf_counter() - start:.0f} s", flush=True)
    what = (f"{args.turns}-turn episodes, up to {new_tokens} tokens an action"
            if args.episodes else f"{new_tokens} new tokens")
    print(f"\nGRPO, {PROMPTS} prompts x {SAMPLES}, {what}, world size 1; median over "
          f"{args.rounds} rounds x {args.steps - args.warmup} steps")
    head = f"{'contender':<16}{'micro':>6}{'samples/s':>11}{'s/step':>9}"
    if args.episodes:
        # Action tokens: per episode, mean over all steps; tokens/s: all the step's action tokens
        # over its median time; rollout: median s/step of the episodes' generation and
        # environment steps; score: the mean episode score of the first and the last step.
        print(head + f"{'action tokens':>15}{'tokens/s':>10}{'rollout s':>11}"
                     f"{'first score':>13}{'last score':>12}")
    else:
        print(head + f"{'last score':>12}")
    for (name, micro), ts in times.items():
        step = statistics.median(ts)
        runs = scores[(name, micro)]
        last = statistics.mean(s[-1] for s in runs if s and s[-1] is not None)
        line = f"{name:<16}{micro:>6}{PROMPTS * SAMPLES / step:>11.1f}{step:>9.4f}"
        if args.episodes:
            first = statistics.mean(s[0] for s in runs)
            tokens = statistics.mean(lengths[(name, micro)])
            rollout = statistics.median(generate[(name, micro)])
            print(line + f"{tokens:>15.1f}{PROMPTS * SAMPLES * tokens / step:>10.0f}"
                         f"{rollout:>11.2f}{first:>13.3f}{last:>12.3f}")
        else:
            print(line + f"{last:>12.3f}")
    for micro in micros:
        for name in names[:-1]:
            ratio = (statistics.median(times[("trl", micro)])
                     / statistics.median(times[(name, micro)]))
            print(f"micro-batch {micro}: {name} {ratio:.2f}x TRL's samples/s")
            if experience.get((name, micro)):
                # The old log-probs' forward (and the advantages), which TRL skips when it
                # updates once per rollout.
                print(f"micro-batch {micro}: {name}'s make_experience "
                      f"{statistics.median(experience[(name, micro)]):.2f} s/step")


if __name__ == "__main__":
    main()
