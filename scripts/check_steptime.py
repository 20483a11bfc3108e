"""Predicted against measured step time of the 14 strategies, on the ranks of an emulated cluster.

    python scripts/emulate_cluster.py --nodes 2 --gpus-per-node 2 --inter-rate 160MB -- \\
        python scripts/check_steptime.py --rounds 7

Run as every rank (the environment of ``emulate_cluster.py``: RANK, WORLD_SIZE, GROUP_SIZE,
MASTER_ADDR, MASTER_PORT). The step-time model's constants are measured on this cluster,
independently of the strategies: the achieved FLOP/s from the unsharded model's forward and
backward on every rank at once, and for each native collective the engine runs (all-gather,
reduce-scatter, all-reduce) on each scope, the latency and bandwidth that time it at two sizes
(every rank at once, as in training; ``Machine.native``): the library's own algorithms are not
rings on two ports (gloo's all-reduce beats a reduce-scatter then an all-gather, its
reduce-scatter is slower than its all-gather), so each is measured rather than composed. These
probes and the strategies run round by round, one optimizer step each per round, in a rotated
order, so that whatever else the machine does falls on all of them (constants included) alike;
each step is traced as its passes (the s forwards and backwards) and its ``step()``, the slowest
rank of each. Rank 0 prints, per strategy, the predicted and the median measured step and
``step()`` times, the spread of the measurements, the error of the prediction, both as ratios to
GGG (ZeRO-3), and the rank correlation of the two orders.
``tests/sharding/test_steptime_trace.py`` runs the same functions on 4 loopback ranks.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist


def llama(hidden: int, layers: int, vocab: int, seq: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                         use_cache=False, max_position_embeddings=seq)
    return LlamaForCausalLM(config)


# gloo and NCCL name these differently across torch releases (as comm/collectives.py).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = (getattr(dist, "reduce_scatter_single", None)
                          or dist.reduce_scatter_tensor)


def _slowest(seconds: float) -> float:
    elapsed = torch.tensor([seconds])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def _timed(fn: Callable[[], object]) -> float:
    """Seconds of one call of ``fn`` on every rank at once, the slowest rank's."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    return _slowest(time.perf_counter() - start)


SMALL = 64  # elements of a port probe's small shard
# A small probe runs this many collectives back to back: the ranks leave the barrier before it at
# different moments, and that skew (about one latency) falls on one collective in REPEAT.
REPEAT = 8
SCOPES = ("intra", "inter", "world")


def probes(model: torch.nn.Module, ids: torch.Tensor, topo, large: int = 1 << 20
           ) -> dict[str, Callable[[], object]]:
    """What measures the model's constants, independently of the strategies: the unsharded
    ``model``'s forward and backward of one micro-batch ``ids`` (the achieved FLOP/s), and each
    native collective the engine runs (all-gather, reduce-scatter, all-reduce) on each scope,
    with a small and a ``large`` shard per rank (its latency and bandwidth). A small one runs
    REPEAT times back to back (``machine`` divides)."""
    out: dict[str, Callable[[], object]] = {
        "compute": lambda: model(input_ids=ids, labels=ids).loss.backward()}
    for scope in SCOPES:
        group, n = topo.group(scope), topo.scope_size(scope)
        if n == 1:
            continue
        for numel in (SMALL, large):
            shard, full = torch.ones(numel), torch.ones(n * numel)
            repeat = REPEAT if numel == SMALL else 1
            calls = {"all_gather": lambda s=shard, f=full, g=group: _all_gather_single(f, s, group=g),
                     "reduce_scatter": lambda s=shard, f=full, g=group: _reduce_scatter_single(
                         s, f, group=g),
                     "all_reduce": lambda f=full, g=group: dist.all_reduce(f, group=g)}
            for op, call in calls.items():
                out[f"{op} {scope} {numel}"] = (lambda call=call, repeat=repeat:
                                                [call() for _ in range(repeat)])
    return out


def machine(seconds: dict[str, float], workload, batch: int, topo):
    """The model's constants from the probes' seconds (``probes``): FLOP/s from the unsharded
    step (a forward, then a backward at twice its FLOPs); the ports of each native collective
    on each scope fitted to its two sizes (``comm.simulate.fit_port``), and the general ports
    (``Machine.links``, for what was not probed) those of the all-gathers."""
    from rlhf_paro.comm.simulate import Links, fit_port
    from rlhf_paro.sharding.steptime import Machine

    runs: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for key, t in seconds.items():
        if key == "compute":
            continue
        op, scope, numel = key.split()
        numel = int(numel)
        repeat = REPEAT if numel == SMALL else 1
        runs.setdefault((op, scope), []).append((4.0 * numel * topo.scope_size(scope),
                                                 t / repeat))
    native = {(op, scope): fit_port(op, scope, topo.num_groups, topo.group_size, *sorted(pair))
              for (op, scope), pair in runs.items()}
    intra = native.get(("all_gather", "intra"), Links(1e9, 1e9, 0.0, 0.0))
    inter = native.get(("all_gather", "inter"), Links(1e9, 1e9, 0.0, 0.0))
    links = Links(intra.intra_bw, inter.inter_bw, intra.intra_lat, inter.inter_lat)
    flops = 3 * batch * sum(workload.flops) / seconds["compute"]
    return Machine(links, flops, native=native)


def trace(engines: dict, ids: torch.Tensor, rounds: int,
          calibration: dict[str, Callable[[], object]]
          ) -> tuple[dict[str, list[tuple[float, float]]], dict[str, list[float]]]:
    """Per engine, per round: (step seconds, of which ``step()``), the slowest rank of each;
    and per probe of ``calibration``, per round, its seconds: the probes run in the same rounds
    (so the constants see the load the steps see). ``ids`` holds one micro-batch per row of its
    first dimension. One warm-up of everything first (the first forward records the unit
    order), then everything once per round in a rotated order."""
    def passes(engine) -> None:
        for micro in ids:
            engine.backward(engine(input_ids=micro, labels=micro).loss)

    for engine in engines.values():
        passes(engine)
        engine.step()
    for probe in calibration.values():
        probe()
    names = [*engines, *calibration]
    out: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
    probed: dict[str, list[float]] = {name: [] for name in calibration}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            if name in calibration:
                probed[name].append(_timed(calibration[name]))
                continue
            dist.barrier()
            start = time.perf_counter()
            passes(engines[name])
            middle = time.perf_counter()
            engines[name].step()
            end = time.perf_counter()
            out[name].append((_slowest(end - start), _slowest(end - middle)))
    return out, probed


def spearman(a: dict[str, float], b: dict[str, float]) -> float:
    """Rank correlation of two timings of the same names (no ties expected)."""
    names = list(a)
    order_a, order_b = sorted(names, key=a.get), sorted(names, key=b.get)
    n = len(names)
    d2 = sum((order_a.index(x) - order_b.index(x)) ** 2 for x in names)
    return 1 - 6 * d2 / (n * (n * n - 1))


def report(predicted: dict, measured: dict[str, list[tuple[float, float]]], reference: str,
           statistic: Callable[[list[float]], float] = statistics.median
           ) -> tuple[list[str], dict[str, float], float]:
    """The table's lines, each strategy's error of the predicted step (predicted / measured
    - 1, the ``statistic`` of the rounds), and the rank correlation."""
    median = {k: statistic([t for t, _ in v]) for k, v in measured.items()}
    in_step = {k: statistic([s for _, s in v]) for k, v in measured.items()}
    error = {k: predicted[k].total / median[k] - 1 for k in measured}
    lines = [f"{'strategy':8} {'pred ms':>8} {'meas ms':>8} {'min-max ms':>13} {'error':>6} "
             f"{'pred/' + reference:>9} {'meas/' + reference:>9} {'step() pred':>11} "
             f"{'meas':>6}"]
    for name in sorted(measured, key=median.get):
        lo, hi = min(t for t, _ in measured[name]), max(t for t, _ in measured[name])
        p = predicted[name]
        lines.append(f"{name:8} {p.total * 1e3:8.0f} {median[name] * 1e3:8.0f} "
                     f"{lo * 1e3:6.0f}-{hi * 1e3:<6.0f} {error[name]:+6.0%} "
                     f"{p.total / predicted[reference].total:9.2f} "
                     f"{median[name] / median[reference]:9.2f} {p.in_step * 1e3:11.0f} "
                     f"{in_step[name] * 1e3:6.0f}")
    rho = spearman({k: predicted[k].total for k in measured}, median)
    return lines, error, rho


def main(argv: Sequence[str] | None = None) -> None:
    from rlhf_paro.sharding import Strategy, Topology, all_strategies, shard
    from rlhf_paro.sharding.layout import unit_sizes
    from rlhf_paro.sharding.steptime import step_time, transformer_workload

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="steps per strategy")
    parser.add_argument("--comm", default="native")
    parser.add_argument("--micro", type=int, default=2, help="micro-batches per step (s)")
    parser.add_argument("--batch", type=int, default=2, help="sequences per micro-batch (b)")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--strategies", nargs="*", help="default: all 14")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    topo = Topology.from_process_group(group_size=int(os.environ["GROUP_SIZE"]))
    gen = torch.Generator().manual_seed(dist.get_rank())
    ids = torch.randint(0, args.vocab, (args.micro, args.batch, args.seq), generator=gen)

    def make() -> torch.nn.Module:
        return llama(args.hidden, args.layers, args.vocab, args.seq)

    reference = make()
    w = transformer_workload(unit_sizes(reference), hidden=args.hidden, ffn=4 * args.hidden,
                             vocab=args.vocab, seq_len=args.seq, precision="fp32",
                             reduce_dtype="fp32")
    names = args.strategies or [s.name for s in all_strategies()]
    engines = {name: shard(make(), name, topo, optim=dict(lr=1e-4), max_grad_norm=1.0,
                           grad_accum_steps=args.micro, comm=args.comm) for name in names}
    measured, probed = trace(engines, ids, args.rounds, probes(reference, ids[0], topo))
    if dist.get_rank() == 0:
        constants = machine({k: statistics.median(t) for k, t in probed.items()}, w,
                            args.batch, topo)
        model_topo = Topology(topo.num_ranks, topo.group_size)
        predicted = {name: step_time(Strategy.parse(name), w, model_topo, constants, args.batch,
                                     args.micro, args.comm) for name in names}
        ref = "GGG" if "GGG" in names else names[0]
        lines, error, rho = report(predicted, measured, ref)
        links = constants.links
        print(f"{topo.num_groups} x {topo.group_size} ranks, comm {args.comm}, Llama hidden "
              f"{args.hidden} x {args.layers} blocks, b={args.batch}, s={args.micro}, seq "
              f"{args.seq}; {args.rounds} rounds; load average {os.getloadavg()[0]:.1f}")
        print(f"measured constants: {constants.flops / 1e9:.3g} GFLOP/s; intra "
              f"{links.intra_bw / 1e6:.0f} MB/s + {links.intra_lat * 1e6:.0f} us, inter "
              f"{links.inter_bw / 1e6:.0f} MB/s + {links.inter_lat * 1e6:.0f} us")
        print("native collectives: " + "; ".join(
            f"{op} {scope} {port.intra_bw / 1e6:.0f} MB/s + {port.intra_lat * 1e6:.0f} us"
            for (op, scope), port in sorted(constants.native.items())))
        print("\n".join(lines))
        worst = max(error, key=lambda k: abs(error[k]))
        print(f"rank correlation (Spearman) {rho:.2f}; largest error {worst} "
              f"{error[worst]:+.0%}; within 20%: {sum(abs(e) <= 0.2 for e in error.values())} "
              f"of {len(error)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
