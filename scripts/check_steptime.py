"""Predicted against measured step time of the 14 strategies, on the ranks of an emulated cluster.

    python scripts/emulate_cluster.py --nodes 2 --gpus-per-node 2 --inter-rate 40MB -- \\
        python scripts/check_steptime.py --rounds 7

Run as every rank (the environment of ``emulate_cluster.py``: RANK, WORLD_SIZE, GROUP_SIZE,
MASTER_ADDR, MASTER_PORT). First the step-time model's constants are measured on this cluster,
independently of the strategies: the achieved FLOP/s from the unsharded model's forward and
backward on every rank at once, and each port's latency and bandwidth from native all-gathers of
two sizes on its scope (every rank at once, as in training). Then the 14 strategies run round by
round, one optimizer step each per round, in a rotated order, so that whatever else the machine
does falls on all of them alike. Rank 0 prints, per strategy, the predicted step time, the
median measured one (the slowest rank of each step) and the spread of the measurements, and
both as ratios to GGG (ZeRO-3).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist


def _model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                         intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=4, num_key_value_heads=4, use_cache=False,
                         max_position_embeddings=args.seq)
    return LlamaForCausalLM(config)


# gloo and NCCL name these differently across torch releases (as comm/collectives.py).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _timed(fn, repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` calls, the slowest rank of each."""
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(elapsed.item())
    return statistics.median(times)


def _port(topo, scope: str, repeats: int) -> tuple[float, float]:
    """(latency, bandwidth) of a scope's port from native ring all-gathers of a small and a
    large shard: n-1 steps of (latency + shard bytes / bandwidth)."""
    group, n = topo.group(scope), topo.scope_size(scope)
    per_step = {}
    for numel in (64, 4 << 20):
        shard = torch.ones(numel)
        out = torch.empty(n * numel)
        per_step[numel] = _timed(lambda: _all_gather_single(out, shard, group=group),
                                 repeats) / (n - 1)
    small, large = 64 * 4, (4 << 20) * 4
    bandwidth = (large - small) / max(per_step[4 << 20] - per_step[64], 1e-9)
    return max(per_step[64] - small / bandwidth, 0.0), bandwidth


def main() -> None:
    from rlhf_paro.comm.simulate import Links
    from rlhf_paro.sharding import Strategy, Topology, all_strategies, shard
    from rlhf_paro.sharding.layout import unit_sizes
    from rlhf_paro.sharding.steptime import Machine, step_time, transformer_workload

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="steps per strategy")
    parser.add_argument("--comm", default="native")
    parser.add_argument("--micro", type=int, default=2, help="micro-batches per step (s)")
    parser.add_argument("--batch", type=int, default=2, help="sequences per micro-batch (b)")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=512)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    topo = Topology.from_process_group(group_size=int(os.environ["GROUP_SIZE"]))
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, args.vocab, (args.micro, args.batch, args.seq), generator=gen)

    # The model's constants, measured here.
    reference = _model(args)
    w = transformer_workload(unit_sizes(reference), hidden=args.hidden, ffn=4 * args.hidden,
                             vocab=args.vocab, seq_len=args.seq, precision="fp32",
                             reduce_dtype="fp32")

    def unsharded() -> None:
        reference(input_ids=ids[0], labels=ids[0]).loss.backward()

    unsharded()
    compute = _timed(unsharded, 5)
    flops = 3 * args.batch * sum(w.flops) / compute  # forward, then backward at twice that
    intra_lat, intra_bw = _port(topo, "intra", 5)
    inter_lat, inter_bw = _port(topo, "inter", 5)
    machine = Machine(Links(intra_bw, inter_bw, intra_lat, inter_lat), flops)
    del reference

    engines = {s.name: shard(_model(args), s, topo, optim=dict(lr=1e-4), max_grad_norm=1.0,
                             grad_accum_steps=args.micro, comm=args.comm)
               for s in all_strategies()}
    names = list(engines)
    measured: dict[str, list[float]] = {name: [] for name in names}

    def one_step(engine) -> None:
        for k in range(args.micro):
            engine.backward(engine(input_ids=ids[k], labels=ids[k]).loss)
        engine.step()

    for name in names:  # warm-up: the first forward records the unit order
        one_step(engines[name])
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            measured[name].append(_timed(lambda: one_step(engines[name]), 1))

    if rank == 0:
        predicted = {name: step_time(Strategy.parse(name), w, Topology(topo.num_ranks,
                                                                       topo.group_size),
                                     machine, args.batch, args.micro, args.comm).total
                     for name in names}
        median = {name: statistics.median(t) for name, t in measured.items()}
        print(f"{topo.num_groups} x {topo.group_size} ranks, comm {args.comm}, Llama hidden "
              f"{args.hidden} x {args.layers} blocks, b={args.batch}, s={args.micro}, seq "
              f"{args.seq}; {args.rounds} rounds")
        print(f"measured constants: {flops / 1e9:.3g} GFLOP/s; intra {intra_bw / 1e6:.0f} MB/s "
              f"+ {intra_lat * 1e6:.0f} us, inter {inter_bw / 1e6:.0f} MB/s + "
              f"{inter_lat * 1e6:.0f} us")
        print(f"{'strategy':8} {'predicted ms':>12} {'measured ms':>12} {'min-max ms':>14} "
              f"{'pred/GGG':>9} {'meas/GGG':>9}")
        for name in sorted(names, key=median.get):
            lo, hi = min(measured[name]), max(measured[name])
            print(f"{name:8} {predicted[name] * 1e3:12.0f} {median[name] * 1e3:12.0f} "
                  f"{lo * 1e3:6.0f}-{hi * 1e3:<7.0f} {predicted[name] / predicted['GGG']:9.2f} "
                  f"{median[name] / median['GGG']:9.2f}")
        order_p = sorted(names, key=predicted.get)
        order_m = sorted(names, key=median.get)
        n = len(names)
        d2 = sum((order_p.index(x) - order_m.index(x)) ** 2 for x in names)
        print(f"rank correlation (Spearman) {1 - 6 * d2 / (n * (n * n - 1)):.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
