"""Checks the planner's generation time ([Note: generation time] in rlhf_paro/plan/step.py) on this
device: the achieved memory bandwidth (cluster.memory_gbps), then decoding steps of a Llama model's
shape (its matrices and a key/value cache, random, no checkpoint) at several numbers of sequences at
once, measured against (weights + cache read) / bandwidth.

    python scripts/check_decode.py                      # Llama-2-7B's shape on cuda, bf16
    python scripts/check_decode.py --device cpu --hidden 256 --ffn 688 --layers 4 \\
        --vocab 1000 --context 256 --batches 1 4       # a small shape, to try it on a CPU

A decoding step here is what an engine runs per token: for every layer the q, k, v, o and MLP
projections of the sequences' one new token and attention over their cached keys and values;
then the LM head. Nothing else of an engine (sampling, scheduling, its Python) is in it, so the
measured time is the least a step takes, as the planner's is.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F


def _timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` calls, after one to warm up."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def bandwidth(device: torch.device, dtype: torch.dtype, numel: int, repeats: int) -> float:
    """Bytes per second of reading a large buffer once (a sum over it)."""
    x = torch.ones(numel, dtype=dtype, device=device)
    seconds = _timed(lambda: x.sum(dtype=torch.float32), device, repeats)
    return numel * x.element_size() / seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=11008)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--context", type=int, default=1536, help="cached tokens per sequence")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--repeats", type=int, default=10)
    a = p.parse_args()
    device, dtype = torch.device(a.device), getattr(torch, a.dtype)
    torch.manual_seed(0)
    h, f, head_dim = a.hidden, a.ffn, a.hidden // a.heads

    def matrix(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, device=device, dtype=dtype) * 0.02

    layers = [(matrix(h, 3 * h), matrix(h, h), matrix(h, 2 * f), matrix(f, h))
              for _ in range(a.layers)]
    lm_head = matrix(h, a.vocab)
    weights = sum(w.numel() for layer in layers for w in layer) + lm_head.numel()
    elem = lm_head.element_size()
    bps = bandwidth(device, dtype, min(2 ** 31, max(2 ** 24, weights)), a.repeats)
    print(f"device {device}, {dtype}: {weights:,} parameters ({weights * elem / 2 ** 30:.2f} "
          f"GiB), memory read at {bps / 1e9:.0f} GB/s (cluster.memory_gbps)")
    kv_token = 2 * a.layers * h * elem
    print(f"{'at once':>8} {'measured ms':>12} {'predicted ms':>13} {'error':>7}")
    for b in a.batches:
        cache = [(torch.randn(b, a.heads, a.context, head_dim, device=device, dtype=dtype),
                  torch.randn(b, a.heads, a.context, head_dim, device=device, dtype=dtype))
                 for _ in range(a.layers)]
        x0 = torch.randn(b, h, device=device, dtype=dtype)

        @torch.no_grad()
        def step() -> torch.Tensor:
            x = x0
            for (qkv, o, up, down), (k, v) in zip(layers, cache):
                q = (x @ qkv)[:, :h].view(b, a.heads, 1, head_dim)
                att = F.scaled_dot_product_attention(q, k, v).reshape(b, h)
                x = x + att @ o
                gate, value = (x @ up).chunk(2, dim=-1)
                x = x + (F.silu(gate) * value) @ down
            return x @ lm_head

        measured = _timed(step, device, a.repeats)
        predicted = (weights * elem + b * a.context * kv_token) / bps
        print(f"{b:>8} {measured * 1e3:12.2f} {predicted * 1e3:13.2f} "
              f"{(predicted - measured) / measured:+7.0%}")
        del cache


if __name__ == "__main__":
    main()
