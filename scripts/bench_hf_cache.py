"""The hf engine's two caches side by side: its own decoding loop on the dynamic cache against
Hugging Face ``generate`` on the static cache with its decoding step compiled
(``rollout.hf_cache``), on the same weights and prompts.

    python scripts/bench_hf_cache.py                 # 64 prompts, 256 tokens, 3 rounds
    python scripts/bench_hf_cache.py --device cuda --rounds 5

A random Llama (--layers x --hidden, fp32) samples at temperature 1 from a vocabulary of
--vocab tokens, so its near-uniform logits sample the <eos> (id 2) with a chance of about
1/--vocab a step: response lengths are about geometric, capped at --budget, as varied as a
rollout's. Each path's first call (the compilation, for the static one) is reported apart; then
each round runs both, back to back, the one that goes first taking turns. The table gives each
path's median tokens/s (response tokens through the <eos>) and the median of the rounds' ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time

import torch

from rlhf_paro import models
from rlhf_paro.config import ModelConfig
from rlhf_paro.rollout import PromptBatch, Sampling
from rlhf_paro.rollout.hf import HFRollout, StaticDecode

PAD, EOS = 0, 2


class Weights:
    """The module as the hf engine reads an engine's weights: gathered already."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def gathered(self, phase: str | None = None) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext(self.module)


def prompts(batch: int, vocab: int, longest: int, seed: int) -> PromptBatch:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, longest + 1, (batch,), generator=gen).tolist()
    return PromptBatch.left_padded(
        [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths], PAD)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--max-prompt", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    device = torch.device(args.device)
    config = {"model_type": "llama", "hidden_size": args.hidden,
              "intermediate_size": 2 * args.hidden, "num_hidden_layers": args.layers,
              "num_attention_heads": 4, "num_key_value_heads": 4,
              "max_position_embeddings": args.max_prompt + args.budget}
    module = models.build_model("actor", ModelConfig(config=config), args.vocab, seed=0)
    module = module.to(device).eval()
    engines = {
        "loop (dynamic)": HFRollout(Weights(module), PAD, EOS, device),
        "generate (static, compiled)": HFRollout(
            Weights(module), PAD, EOS, device,
            static=StaticDecode.for_run(args.max_prompt + args.budget)),
    }
    sampling = Sampling(args.budget, temperature=1.0)

    def run(name: str, seed: int) -> tuple[float, int]:
        batch = prompts(args.batch, args.vocab, args.max_prompt, seed)
        torch.manual_seed(seed)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = engines[name].generate(batch, sampling)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start, int(out.action_mask.sum())

    names = list(engines)
    for name in names:
        seconds, tokens = run(name, seed=-1)
        print(f"first call, {name}: {seconds:.1f} s ({tokens} tokens)", flush=True)
    runs: dict[str, list[tuple[float, int]]] = {name: [] for name in names}
    for round_ in range(args.rounds):
        print(f"round {round_ + 1}/{args.rounds}", file=sys.stderr, flush=True)
        for name in names if round_ % 2 == 0 else names[::-1]:
            runs[name].append(run(name, seed=round_))
    print(f"{args.layers} x {args.hidden} Llama, vocab {args.vocab}, fp32, {args.device}, "
          f"{args.batch} prompts, budget {args.budget}, threads {torch.get_num_threads()}; "
          f"median of {args.rounds} rounds")
    print("| path | tokens/s | mean response | seconds |\n|---|---|---|---|")
    for name in names:
        rate = statistics.median(t / s for s, t in runs[name])
        mean = statistics.mean(t for _, t in runs[name]) / args.batch
        seconds = statistics.median(s for s, _ in runs[name])
        print(f"| {name} | {rate:.0f} | {mean:.0f} | {seconds:.2f} |")
    loop, static = runs.values()
    ratio = statistics.median(b[0] / a[0] for a, b in zip(loop, static))
    print(f"static seconds / loop seconds, median of the rounds' ratios: {ratio:.2f}")


if __name__ == "__main__":
    main()
