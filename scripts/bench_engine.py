"""Step time, memory and traffic of every PaRO strategy on local gloo ranks.

    python scripts/bench_engine.py                       # 14 strategies, 4 ranks as 2 x 2
    python scripts/bench_engine.py --strategies IGG,GGG --comm horing --steps 10

All strategies run in one process group, one after the other, on the same model and batches, so
their times are comparable. Per strategy it prints the median optimizer-step time (the slowest
rank of each step), the bytes rank 0 holds in P, G and OS, and the bytes sent per step on intra
and inter links (mean over ranks).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                         intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=4, num_key_value_heads=4, use_cache=False)
    return LlamaForCausalLM(config)


def _worker(rank: int, args: argparse.Namespace, port: int) -> None:
    from rlhf_paro.sharding import Strategy, Topology, shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.world)
    topo = Topology.from_process_group(group_size=args.group_size)
    gen = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, args.vocab, (args.micro, args.batch, args.seq), generator=gen)
    rows = []
    for name in args.strategies.split(","):
        strategy = Strategy.parse(name)
        engine = shard(_model(args), strategy, topo, optim=dict(lr=1e-4), max_grad_norm=1.0,
                       grad_accum_steps=args.micro, comm=args.comm, precision=args.precision)
        times, sent = [], []
        for step in range(args.warmup + args.steps):
            engine.meter.reset()
            dist.barrier()
            start = time.perf_counter()
            for k in range(args.micro):
                engine.backward(engine(input_ids=ids[k], labels=ids[k]).loss)
            engine.step()
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if step >= args.warmup:
                times.append(elapsed.item())
                t = engine.meter.totals()
                sent.append((t["intra_bytes"], t["inter_bytes"]))
        traffic = torch.tensor(sent[-1], dtype=torch.float64)
        dist.all_reduce(traffic)
        rows.append((strategy.name, statistics.median(times), engine.memory(),
                     (traffic / args.world).tolist()))
    if rank == 0:
        print(f"{args.world} gloo ranks as {args.world // args.group_size} groups x "
              f"{args.group_size}, comm={args.comm}, {args.precision}, s={args.micro}, "
              f"hidden={args.hidden} layers={args.layers}; median of {args.steps} steps")
        head = f"{'strategy':8} {'step ms':>8} {'P bytes':>10} {'G bytes':>10} {'OS bytes':>10} " \
               f"{'intra B/step':>13} {'inter B/step':>13}"
        print(head)
        print("-" * len(head))
        for name, median, mem, (intra, inter) in rows:
            print(f"{name:8} {median * 1e3:8.1f} {mem['params']:10d} {mem['grads']:10d} "
                  f"{mem['optim']:10d} {intra:13.0f} {inter:13.0f}")
    dist.destroy_process_group()


def main() -> None:
    from rlhf_paro.comm.meter import ALGORITHM_CHOICES
    from rlhf_paro.sharding import all_strategies

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", default=",".join(s.name for s in all_strategies()))
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--comm", default="native", choices=ALGORITHM_CHOICES)
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--micro", type=int, default=2, help="micro-batches per step (s)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=512)
    args = parser.parse_args()
    mp.spawn(_worker, args=(args, _free_port()), nprocs=args.world)


if __name__ == "__main__":
    main()
