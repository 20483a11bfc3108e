"""Multi-turn episodes whose environment takes a varying time a step: the rollout turn by turn
against each episode its own loop (``rollout.streaming``), on vLLM or on the ``hf`` engine, and
both against the critical path, the longest single episode's own chain of generation and
environment steps.

    python scripts/bench_streaming.py                       # 3 rounds, 16 episodes, 4 turns
    python scripts/bench_streaming.py --latency 0.3 --turns 6 --batch 32 --rounds 5
    python scripts/bench_streaming.py --engine hf

Every episode runs --turns turns (its environment ends it after the last); each step takes a
time drawn for its episode and turn, uniform in [0, --latency] seconds (the same draws in every
run: a sandbox, a search); each action samples up to --action tokens at temperature 1 and ends
by chance at the rollout's <eos>, so actions vary in length. The environment answers with
--observation symbols. Turn by turn (``episodes.run``), each turn waits for its longest action,
then for its slowest environment step; streaming (``episodes.stream``), an episode's next
action goes in as a request the moment its own step returns. The critical path is measured: each
episode played alone on the same engine, with the same seeds, so the same actions (the rows are
checked equal), and the longest of those walls taken. The table gives each loop's median wall
time, its ratio to the critical path and the share of it the engine had nothing to decode
(``rollout/engine_idle_fraction``). The loops alternate within each round; the first call of each
warms up and is left out.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_rollout import build_actor, sync  # noqa: E402  (this script's folder)


class Slow:
    """Answers each action with ``length`` symbols after ``delays[turn]`` seconds; the episode
    ends after ``len(delays)`` actions."""

    def __init__(self, delays: list[float], length: int) -> None:
        self.delays, self.length, self.done = delays, length, 0

    def reset(self) -> None:
        return None

    def step(self, action: str) -> tuple[str, float, bool]:
        time.sleep(self.delays[self.done])
        self.done += 1
        return (" ".join("abcdefgh"[(self.done + k) % 8] for k in range(self.length)),
                len(action.split()) / 8, self.done == len(self.delays))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16, help="episodes at once")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--latency", type=float, default=0.3,
                        help="an environment step takes uniform [0, latency] seconds")
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    parser.add_argument("--action", type=int, default=48, help="tokens per action at most")
    parser.add_argument("--observation", type=int, default=8, help="tokens per observation")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine", choices=("vllm", "hf"), default="vllm")
    args = parser.parse_args()

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29533"))
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(os.cpu_count() or 1)
    walls, idle, path = run(args)
    print(f"\n{args.engine}: {args.batch} episodes x {args.turns} turns, steps of uniform "
          f"[0, {args.latency}] s, "
          f"actions of up to {args.action} tokens; a Llama {args.layers} x {args.hidden}, fp32; "
          f"median of {args.rounds} rounds; critical path {statistics.median(path):.2f} s\n")
    print(f"{'loop':<16}{'wall s':>9}{'min':>9}{'max':>9}{'/ path':>9}{'engine idle':>13}")
    for name in walls:
        wall = statistics.median(walls[name])
        print(f"{name:<16}{wall:>9.2f}{min(walls[name]):>9.2f}{max(walls[name]):>9.2f}"
              f"{wall / statistics.median(path):>9.2f}{statistics.median(idle[name]):>13.2f}")


def run(args: argparse.Namespace) -> tuple[dict[str, list[float]], dict[str, list[float]],
                                           list[float]]:
    from rlhf_paro.compose import load_config
    from rlhf_paro.envs import EnvRunner, Observations
    from rlhf_paro.ppo.demo import make_tokenizer
    from rlhf_paro.ppo.task import CountingTask
    from rlhf_paro.resolve import resolve
    from rlhf_paro.rollout import PromptBatch, Sampling, episodes

    tokenizer = make_tokenizer(CountingTask(8))
    vocab = len(tokenizer.get_vocab())
    longest = args.prompt + args.turns * (args.action + args.observation)
    model = (f"{{model_type: llama, hidden_size: {args.hidden}, intermediate_size: "
             f"{2 * args.hidden}, num_hidden_layers: {args.layers}, num_attention_heads: "
             f"{args.heads}, num_key_value_heads: {args.heads}, vocab_size: {vocab}, "
             f"max_position_embeddings: {longest}}}")
    cfg = resolve(load_config([
        f"actor.config={model}", "reward.path=null", "data.train_files=null",
        "cluster.num_devices=1", "cluster.group_size=1", f"data.max_prompt_length={args.prompt}",
        f"ppo.max_new_tokens={longest - args.prompt}", f"ppo.rollout_batch_size={args.batch}",
        f"ppo.mini_batch_size={args.batch}", f"rollout.engine={args.engine}",
        f"trainer.seed={args.seed}",
        "task.num_symbols=8"]))
    actor = build_actor(cfg, "NNN", 1)
    eos = tokenizer.eos_token_id
    if args.engine == "vllm":
        from rlhf_paro.rollout.vllm import VLLMRollout

        engine = VLLMRollout(cfg, actor.module.lm.config, eos, 0, torch.device("cpu"),
                             seed=args.seed)
        sync(engine, actor)
    else:  # on the actor's own parameters, as a run's hf engine
        from rlhf_paro.rollout.hf import HFRollout

        engine = HFRollout(actor, 0, eos, torch.device("cpu"))
    gen = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(3, vocab, (args.batch, args.prompt), generator=gen).tolist()
    draw = random.Random(args.seed)
    delays = [[draw.uniform(0, args.latency) for _ in range(args.turns)]
              for _ in range(args.batch)]
    sampling = Sampling(max_new_tokens=args.action, temperature=1.0)
    budget = episodes.Budget(args.turns, longest)
    observations = Observations(tokenizer, chat=False)
    seeds = [1000 + i for i in range(args.batch)]

    def once(loop: str, rows: list[int]) -> tuple[float, float, Any]:
        runner = EnvRunner(lambda k: Slow(delays[k], args.observation), "Slow", len(rows), 60.0)
        call = (episodes.run if loop == "turn by turn" else
                lambda *a: episodes.stream(*a, sample_seeds=[seeds[k] for k in rows]))
        start = time.perf_counter()
        batch, stats = call(engine, PromptBatch.left_padded([prompts[k] for k in rows], 0),
                            [{"k": k} for k in rows], [0] * len(rows), runner, observations,
                            tokenizer.decode, sampling, budget, 0, str)
        wall = time.perf_counter() - start
        runner.close()
        assert stats["turns"] == args.turns * len(rows), stats
        return wall, stats["engine_idle_s"] / stats["rollout_s"], batch

    loops = ("turn by turn", "streaming")
    walls: dict[str, list[float]] = {name: [] for name in loops}
    idle: dict[str, list[float]] = {name: [] for name in loops}
    path: list[float] = []
    everyone = list(range(args.batch))
    for name in loops:  # warm-up, left out
        once(name, everyone)
    for r in range(args.rounds):
        for name in loops[r % 2:] + loops[:r % 2]:
            wall, share, played = once(name, everyone)
            if name == "streaming":  # what each episode played alone is checked against
                batch = played
            walls[name].append(wall)
            idle[name].append(share)
            print(f"round {r}: {name}: {wall:.2f} s, engine idle {share:.2f}", flush=True)
        alone = []
        for k in everyone:
            wall, _, single = once("streaming", [k])
            alone.append(wall)
            row = single.attention_mask[0].bool()
            same = torch.equal(single.sequences[0][row], batch.sequences[k][
                batch.attention_mask[k].bool()])
            if not same:
                a = single.sequences[0][row].tolist()
                b = batch.sequences[k][batch.attention_mask[k].bool()].tolist()
                at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                print(f"episode {k} alone differs from its run in the batch (token {at} of "
                      f"{len(a)} and {len(b)})", flush=True)
        path.append(max(alone))
        print(f"round {r}: critical path {path[-1]:.2f} s", flush=True)
    return walls, idle, path


if __name__ == "__main__":
    main()
