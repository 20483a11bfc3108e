"""Time native, Ring, H-Ring, HO-Ring and pipelined HO-Ring side by side on one cluster.

    python scripts/emulate_cluster.py --nodes 2 --gpus-per-node 2 -- \\
        python scripts/bench_collectives.py --sizes 4 16 64 --repeats 7

Runs as every rank of a gloo job (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and GROUP_SIZE = M
in the environment, as ``emulate_cluster.py`` sets them). Every repeat runs each algorithm once,
in a rotating order, so that drift on the machine hits all of them alike; a run's time is the
slowest rank's, from the barrier before it to its own end. Rank 0 prints, per op and size, the
median over the repeats, the ratios to Ring and to H-Ring, the links' lower bound and the
alpha-beta model's prediction, both from the intra and inter bandwidths probed at the start,
and the algorithm ``comm.algorithm=auto`` picks there (``comm/auto.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from rlhf_paro.comm.auto import choose
from rlhf_paro.comm.topology import Topology
from rlhf_paro.comm.collectives import Communicator
from rlhf_paro.comm.meter import ALGORITHM_NAMES
from rlhf_paro.comm.simulate import Links, collective_time, lower_bounds

MB = 1 << 20


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def probe(src: int, dst: int, numel: int, repeats: int = 3) -> float:
    """Median seconds of one message of ``numel`` fp32 from rank ``src`` to ``dst``."""
    buf = torch.zeros(numel)
    times = []
    for _ in range(repeats + 1):  # the first one sets up the connection
        dist.barrier()
        start = time.perf_counter()
        if dist.get_rank() == src:
            dist.send(buf, dst)
        elif dist.get_rank() == dst:
            dist.recv(buf, src)
        times.append(_slowest(time.perf_counter() - start if dist.get_rank() in (src, dst)
                              else 0.0))
    return statistics.median(times[1:])


def measure_links(topo: Topology) -> Links:
    """Bandwidth of one 16 MB message and latency of a 4-byte one, inside and across groups
    (ranks 0 -> 1 and 0 -> M); a level that does not exist gets the other's numbers."""
    pairs = {"intra": (0, 1) if topo.group_size > 1 else None,
             "inter": (0, topo.group_size) if topo.num_groups > 1 else None}
    found: dict[str, tuple[float, float]] = {}
    for kind, pair in pairs.items():
        if pair is not None:
            lat = probe(*pair, 1)
            found[kind] = (16 * MB / max(probe(*pair, 4 * MB) - lat, 1e-9), lat)
    intra = found.get("intra", found.get("inter", (1e9, 0.0)))
    inter = found.get("inter", intra)
    return Links(intra[0], inter[0], intra[1], inter[1])


def run(topo: Topology, sizes_mb: list[float], repeats: int) -> list[dict]:
    comms = {name: Communicator(topo, algorithm=name) for name in ALGORITHM_NAMES}
    n, k = topo.num_ranks, topo.chunk_index()
    rows = []
    for op in ("all_gather", "reduce_scatter"):
        for size_mb in sizes_mb:
            c = -(-int(size_mb * MB) // 4 // n)
            full = torch.randn(n * c)
            shard = full[k * c:(k + 1) * c].clone()
            out = torch.empty(n * c) if op == "all_gather" else torch.empty(c)
            times: dict[str, list[float]] = {name: [] for name in ALGORITHM_NAMES}
            for rep in range(repeats + 1):  # repeat 0 warms up every algorithm
                shift = rep % len(ALGORITHM_NAMES)
                order = ALGORITHM_NAMES[shift:] + ALGORITHM_NAMES[:shift]
                for name in order:
                    dist.barrier()
                    start = time.perf_counter()
                    if op == "all_gather":
                        comms[name].all_gather(out, shard, "world", "bench")
                    else:
                        comms[name].reduce_scatter(out, full, "world", "bench")
                    elapsed = _slowest(time.perf_counter() - start)
                    if rep:
                        times[name].append(elapsed)
            rows.append({"op": op, "size_mb": size_mb,
                         "median_s": {name: statistics.median(t) for name, t in times.items()},
                         "all_s": times})
    return rows


def table(rows: list[dict], topo: Topology, links: Links, rate_bps: float | None) -> str:
    g, m = topo.num_groups, topo.group_size
    lines = [f"{g} nodes x {m} ranks; probed: intra {links.intra_bw / 1e6:.0f} MB/s "
             f"+ {links.intra_lat * 1e3:.2f} ms, inter {links.inter_bw / 1e6:.0f} MB/s "
             f"+ {links.inter_lat * 1e3:.2f} ms"
             + (f"; NICs shaped to {rate_bps / 1e6:.0f} MB/s" if rate_bps else "")]
    header = (f"{'op':<15}{'MB':>5} {'algorithm':<17}{'median ms':>10}{'/Ring':>7}"
              f"{'/H-Ring':>8}{'/bound':>7}{'model ms':>10}")
    lines.append(header)
    for row in rows:
        med = row["median_s"]
        size = row["size_mb"] * MB
        bound = lower_bounds(size, g, m, links).two_level
        for name in ALGORITHM_NAMES:
            model = collective_time("native-ring" if name == "native" else name, row["op"], size,
                                    g, m, links)
            lines.append(f"{row['op']:<15}{row['size_mb']:>5g} {name:<17}{med[name] * 1e3:>10.1f}"
                         f"{med[name] / med['ring']:>7.3f}{med[name] / med['hring']:>8.3f}"
                         f"{med[name] / bound:>7.2f}{model * 1e3:>10.1f}")
        lines.append(f"{row['op']:<15}{row['size_mb']:>5g} {'bound (links)':<17}"
                     f"{bound * 1e3:>10.1f}")
        numel = topo.num_ranks * -(-int(size) // 4 // topo.num_ranks)  # fp32, as run() has it
        lines.append(f"{row['op']:<15}{row['size_mb']:>5g} {'auto runs':<17}"
                     f"{choose(row['op'], 'world', numel, 4, topo)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[4, 16, 64],
                        help="MB (2**20), e.g. 0.25 1 4")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", help="also write the raw times here (rank 0)")
    args = parser.parse_args(argv)
    if "GROUP_SIZE" not in os.environ:
        parser.error("run under scripts/emulate_cluster.py, or set GROUP_SIZE=M next to the "
                     "usual RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        topo = Topology.from_process_group(group_size=int(os.environ["GROUP_SIZE"]))
        links = measure_links(topo)
        rows = run(topo, args.sizes, args.repeats)
        if topo.rank == 0:
            rate = float(os.environ["EMU_INTER_RATE_BPS"]) if "EMU_INTER_RATE_BPS" in os.environ \
                else None
            print(table(rows, topo, links, rate), flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"nodes": topo.num_groups, "gpus_per_node": topo.group_size,
                               "links": dataclasses.asdict(links), "rows": rows}, f, indent=1)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
