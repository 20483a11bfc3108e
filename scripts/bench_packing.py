"""One forward and backward of the actor's log-probs, padded against packed, on one CPU thread.

    python scripts/bench_packing.py

A 4-block, 256-wide random Llama; micro-batches of B sequences of a 5-token prompt and a
response whose length is drawn from an exponential of the given mean, capped at 256; the
padded layout is as wide as the longest. Prints the best of 3 runs of each
(docs/design.md, "Batching").
"""

from __future__ import annotations

import time

import torch
import transformers

from rlhf_paro.models import CausalLM

PROMPT, BUDGET = 5, 256


def micro_batch(size: int, mean: float, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    lengths = (torch.empty(size).exponential_(1 / mean, generator=gen).long() + 1).clamp(
        max=BUDGET)
    width = PROMPT + int(lengths.max())
    mask = (torch.arange(width) < PROMPT + lengths[:, None]).long()
    ids = torch.randint(3, 64, (size, width), generator=gen) * mask
    return ids, mask, lengths


def main() -> None:
    torch.set_num_threads(1)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=256, intermediate_size=512,
                                      num_hidden_layers=4, num_attention_heads=8,
                                      num_key_value_heads=8, max_position_embeddings=512)
    torch.manual_seed(0)
    model = CausalLM(transformers.AutoModelForCausalLM.from_config(config))
    gen = torch.Generator().manual_seed(0)
    print(f"{'B':>3}{'mean':>7}{'longest':>9}{'padded s':>10}{'packed s':>10}{'ratio':>7}")
    for size, mean in [(16, 30), (16, 130), (4, 130)]:
        ids, mask, lengths = micro_batch(size, mean, gen)
        best = {}
        for packed in (False, True):
            times = []
            for _ in range(3):
                start = time.perf_counter()
                model(ids, mask, response_len=ids.shape[1] - PROMPT, packed=packed).sum().backward()
                times.append(time.perf_counter() - start)
            best[packed] = min(times)
        print(f"{size:>3}{float(lengths.float().mean()):>7.1f}{int(lengths.max()):>9}"
              f"{best[False]:>10.3f}{best[True]:>10.3f}{best[False] / best[True]:>7.2f}")


if __name__ == "__main__":
    main()
