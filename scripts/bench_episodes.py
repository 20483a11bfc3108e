"""Multi-turn episodes per second on the rollout engines: vLLM with and without prefix caching
across turns, and hf, on one model, one set of prompts and one deterministic environment.

    python scripts/bench_episodes.py                       # 3 rounds, 6 turns
    python scripts/bench_episodes.py --turns 4 --rounds 5 --batch 32
    python scripts/bench_episodes.py --hf-only             # hf keeping its cache, and not

Every episode runs exactly --turns turns: the environment answers each action with
--observation symbols and ends the episode after the last turn, and every action is exactly
--action tokens long (the rollout's <eos> is an id outside the model's vocabulary, which no
engine can sample). So every engine generates the same number of tokens and its context grows
the same way: a prompt of --prompt tokens, then per turn an action and an observation. With
prefix caching (``rollout.enable_prefix_caching``, vLLM's default here) a turn's prefill reads
the earlier turns' keys and values from the cache and computes only the new observation;
without it, every turn computes its whole context again. hf keeps each episode's keys and
values from one turn to the next the same way ([Note: keys and values across turns]); "hf,
recomputing" is hf as it was, every turn's context computed whole. All engines run each round,
in an order that rotates from round to round; the first call of each engine warms up and is left
out. The table gives each engine's median generated tokens/s (action tokens over the wall time of
``episodes.run``, environment steps included) and the ratio to vLLM without prefix caching (with
--hf-only: to hf recomputing).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_rollout import build_actor, sync  # noqa: E402  (this script's folder)

ENGINES = ("vllm, prefix cache", "vllm, no prefix cache", "hf", "hf, recomputing")
HF_ONLY = ENGINES[2:]


class Recomputing:
    """The hf engine as it was before it kept its cache across turns: ``turns`` holds
    nothing, so each turn's ``generate`` gathers the weights and computes its whole context."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.eos_token_id = engine.eos_token_id

    def generate(self, prompts: Any, sampling: Any) -> Any:
        return self.engine.generate(prompts, sampling)

    def turns(self) -> Any:
        return contextlib.nullcontext()


class Relay:
    """Answers each action with ``length`` symbols; the episode ends after ``turns`` actions."""

    def __init__(self, turns: int, length: int) -> None:
        self.turns, self.length, self.done = turns, length, 0

    def reset(self) -> None:
        return None

    def step(self, action: str) -> tuple[str, float, bool]:
        self.done += 1
        return " ".join("abcdefgh"[(self.done + k) % 8] for k in range(self.length)), 0.0, \
            self.done == self.turns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16, help="episodes at once")
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    parser.add_argument("--action", type=int, default=16, help="tokens per action")
    parser.add_argument("--observation", type=int, default=16, help="tokens per observation")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hf-only", action="store_true",
                        help="hf and hf recomputing only (no vLLM engine built)")
    args = parser.parse_args()

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29531"))
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(os.cpu_count() or 1)
    results = run(args)
    print(f"\n{args.batch} episodes x {args.turns} turns, prompt {args.prompt} tokens, actions of "
          f"{args.action}, observations of {args.observation}; a Llama {args.layers} x "
          f"{args.hidden}, fp32; median of {args.rounds} rounds\n")
    base = statistics.median(results[ENGINES[3 if args.hf_only else 1]])
    print(f"{'engine':<24}{'tokens/s':>10}{'min':>10}{'max':>10}{'ratio':>8}")
    for name in results:
        values = results[name]
        print(f"{name:<24}{statistics.median(values):>10.1f}{min(values):>10.1f}"
              f"{max(values):>10.1f}{statistics.median(values) / base:>8.2f}")


def run(args: argparse.Namespace) -> dict[str, list[float]]:
    from rlhf_paro.compose import load_config
    from rlhf_paro.envs import EnvRunner, Observations
    from rlhf_paro.ppo.demo import make_tokenizer
    from rlhf_paro.ppo.task import CountingTask
    from rlhf_paro.resolve import resolve
    from rlhf_paro.rollout import PromptBatch, Sampling, episodes
    from rlhf_paro.rollout.hf import HFRollout
    from rlhf_paro.rollout.vllm import VLLMRollout

    tokenizer = make_tokenizer(CountingTask(8))
    vocab = len(tokenizer.get_vocab())
    longest = args.prompt + args.turns * (args.action + args.observation)
    model = (f"{{model_type: llama, hidden_size: {args.hidden}, intermediate_size: "
             f"{2 * args.hidden}, num_hidden_layers: {args.layers}, num_attention_heads: "
             f"{args.heads}, num_key_value_heads: {args.heads}, vocab_size: {vocab}, "
             f"max_position_embeddings: {longest}}}")
    base = [f"actor.config={model}", "reward.path=null", "data.train_files=null",
            "cluster.num_devices=1", "cluster.group_size=1",
            f"data.max_prompt_length={args.prompt}",
            f"ppo.max_new_tokens={longest - args.prompt}", f"ppo.rollout_batch_size={args.batch}",
            f"ppo.mini_batch_size={args.batch}", "rollout.engine=vllm",
            f"trainer.seed={args.seed}", "task.num_symbols=8"]
    cfgs = {True: resolve(load_config(base)),
            False: resolve(load_config([*base, "rollout.enable_prefix_caching=false"]))}
    actor = build_actor(cfgs[True], "NNN", 1)
    never = vocab + 1  # an <eos> no engine samples: every action runs its whole budget
    hf = HFRollout(actor, 0, never, torch.device("cpu"))
    engines = {ENGINES[2]: hf, ENGINES[3]: Recomputing(hf)}
    names = HF_ONLY if args.hf_only else ENGINES
    for cached, name in ((True, ENGINES[0]), (False, ENGINES[1]))[:0 if args.hf_only else 2]:
        engine = VLLMRollout(cfgs[cached], actor.module.lm.config, never, 0,
                             torch.device("cpu"), seed=args.seed)
        sync(engine, actor)
        engines[name] = engine
    gen = torch.Generator().manual_seed(args.seed)
    prompts = PromptBatch.left_padded(
        torch.randint(3, vocab, (args.batch, args.prompt), generator=gen).tolist(), 0)
    sampling = Sampling(max_new_tokens=args.action, temperature=1.0)
    budget = episodes.Budget(args.turns, longest)
    observations = Observations(tokenizer, chat=False)

    def once(engine: Any) -> float:
        runner = EnvRunner(lambda **_: Relay(args.turns, args.observation), "Relay", 8, 60.0)
        start = time.perf_counter()
        batch, stats = episodes.run(engine, prompts, [{}] * args.batch, [0] * args.batch, runner,
                                    observations, tokenizer.decode, sampling, budget, 0, str)
        elapsed = time.perf_counter() - start
        runner.close()
        assert stats["turns"] == args.turns * args.batch, stats
        return float(batch.action_mask.sum()) / elapsed

    results: dict[str, list[float]] = {name: [] for name in names}
    for name in names:  # warm-up, left out
        once(engines[name])
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            results[name].append(once(engines[name]))
            print(f"round {r}: {name}: {results[name][-1]:.1f} tokens/s", flush=True)
    return results


if __name__ == "__main__":
    main()
