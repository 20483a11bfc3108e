"""Alpha-beta model of a two-level cluster, timing the schedules that ``comm/rings.py`` runs.

    python -m rlhf_paro.comm.simulate --op all_gather --size 1GB --nodes 16 --gpus-per-node 8

[Note: the link model]
Every rank has one intra-group port and one inter-group port (a DGX: NVSwitch, and one NIC per
GPU), full duplex. A step of a schedule is a batch of messages issued together; on each port the
batch costs the port's latency once (its messages are sent back to back) plus its bytes over the
port's bandwidth, the two ports work at the same time, and the step ends when the slowest port of
the slowest rank is done: t_step = max over ranks of max(a_intra + b_intra/B_intra,
a_inter + b_inter/B_inter), a port without bytes costing nothing. Additions of a reduce-scatter
are free. ``native`` is timed as the ring in rank order that the meter attributes it.

[Note: fitting the paper]
The paper's 1 GB all-gather on 16 x 8 A100 took 288 ms with Ring, 183 ms with H-Ring and 162 ms
with HO-Ring (section 4.4). With the latencies fixed (5 us intra, 10 us inter), the two
bandwidths follow in closed form from the first two numbers: every Ring step is bound by the one
inter hop per group, so 288 ms = 127 (a_inter + c/B_inter); H-Ring is 15 such steps plus 7 intra
steps of 16 chunks. That gives B_inter = 3.460 GB/s and B_intra = 5.874 GB/s, the defaults below;
the third number is then a prediction.

[Note: any collective on any scope]
``scope_seconds`` times one collective of the engine's schedule with the same port model:
  - ``intra`` and ``inter``: a ring over the scope's n ranks, n-1 steps (2(n-1) for an
    all-reduce) of S/n bytes each, all on the one kind of port (an inter ring runs on each
    rank's own NIC, and the M rails' rings run side by side);
  - ``world`` all-gather and reduce-scatter: the steps of the algorithm's own schedule
    (``native`` is the ring in rank order, whose one cross-group hop per group makes every
    step wait for a single NIC: the per-NIC concentration that averaged bytes hide);
  - ``world`` all-reduce: always native, the ring's reduce-scatter then its all-gather;
  - ``reduce`` (the whole buffer summed on one rank, NCCL's ring reduce): a chain through the
    scope's ring, pipelined, so n-1 step latencies to fill it and then the whole buffer once
    through the slowest link of the chain (on ``world`` the inter hop, a step's latency that of
    the slower port, as in the ring).
A step's latency is paid once per port, so a collective costs n-1 latencies however small it
is: many small collectives (a LoRA model's, a deep model's) are bound by their count.
"""

from __future__ import annotations

import argparse
import functools
import re
import sys
from dataclasses import dataclass
from typing import NamedTuple

from rlhf_paro.comm.auto import resolve
from rlhf_paro.comm.meter import ALGORITHM_NAMES
from rlhf_paro.comm.rings import (ALGORITHMS, OPS, PIPELINE_PIECES, Algorithm, pipelined,
                                  step_bytes)
from rlhf_paro.comm.topology import Topology

PAPER = {"size": 1e9, "nodes": 16, "gpus_per_node": 8, "ring": 0.288, "hring": 0.183,
         "horing": 0.162}
NAMES = tuple("native-ring" if name == "native" else name for name in ALGORITHM_NAMES)


@dataclass(frozen=True)
class Links:
    """Per-rank port parameters: bandwidths in bytes/s, latencies in seconds."""

    intra_bw: float
    inter_bw: float
    intra_lat: float = 5e-6
    inter_lat: float = 10e-6

    def __post_init__(self) -> None:
        for key in ("intra_bw", "inter_bw"):
            if not getattr(self, key) > 0:
                raise ValueError(f"{key}={getattr(self, key)} must be positive")
        for key in ("intra_lat", "inter_lat"):
            if getattr(self, key) < 0:
                raise ValueError(f"{key}={getattr(self, key)} must not be negative")


class Bounds(NamedTuple):
    """Lower bounds on the time of an all-gather or reduce-scatter, in seconds."""

    two_level: float  # the busier port carrying the (g-1)c inter and g(M-1)c intra bytes alone
    any_algorithm: float  # any schedule, however it splits copies between the two ports


def _algorithm(name: str, num_pieces: int) -> Algorithm:
    if name == "native-ring":
        return ALGORITHMS["ring"]
    if name == "horing_pipelined":
        return pipelined(num_pieces)
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; allowed: {', '.join(NAMES)}")
    return ALGORITHMS[name]


def step_times(name: str, op: str, size: float, nodes: int, gpus_per_node: int, links: Links,
               num_pieces: int = PIPELINE_PIECES) -> list[float]:
    """Seconds of every step of ``name`` for ``op`` on ``size`` bytes (see [Note: the link
    model]). The schedules are those the ranks run, on one-byte elements."""
    topo = Topology(nodes * gpus_per_node, gpus_per_node)
    c = -(-int(size) // topo.num_ranks)
    algo = _algorithm(name, num_pieces)
    per_rank = [algo.steps(op, topo.with_rank(r), c) for r in range(topo.num_ranks)]
    times = []
    for k in range(len(per_rank[0])):
        slowest = 0.0
        for r, steps in enumerate(per_rank):
            intra, inter = step_bytes(steps[k], r, gpus_per_node, 1)
            slowest = max(slowest,
                          links.intra_lat + intra / links.intra_bw if intra else 0.0,
                          links.inter_lat + inter / links.inter_bw if inter else 0.0)
        times.append(slowest)
    return times


def collective_time(name: str, op: str, size: float, nodes: int, gpus_per_node: int,
                    links: Links, num_pieces: int = PIPELINE_PIECES) -> float:
    return sum(step_times(name, op, size, nodes, gpus_per_node, links, num_pieces))


@functools.lru_cache(maxsize=None)
def _step_loads(name: str, op: str, nodes: int, gpus_per_node: int,
                num_pieces: int) -> tuple[frozenset[tuple[float, float]], ...]:
    """Per step of ``name``'s schedule for ``op``, the distinct (intra, inter) loads the ranks
    send, in chunks; a collective's time follows for any chunk size (see ``scope_seconds``)."""
    topo = Topology(nodes * gpus_per_node, gpus_per_node)
    algo = _algorithm(name, num_pieces)
    c = num_pieces  # a whole number of elements per piece, so every load is exact
    per_rank = [algo.steps(op, topo.with_rank(r), c) for r in range(topo.num_ranks)]
    out = []
    for k in range(len(per_rank[0])):
        loads = {(sent.intra / c, sent.inter / c) for r, steps in enumerate(per_rank)
                 for sent in [step_bytes(steps[k], r, gpus_per_node, 1)]}
        # A rank that sends no more than another on either port never decides the step.
        out.append(frozenset(x for x in loads
                             if not any(y != x and y[0] >= x[0] and y[1] >= x[1]
                                        for y in loads)))
    return tuple(out)


def _ring_seconds(steps: int, size: float, lat: float, bw: float) -> float:
    return steps * (lat + size / bw)


def scope_seconds(op: str, scope: str, size: float, nodes: int, gpus_per_node: int,
                  links: Links, algorithm: str = "native",
                  num_pieces: int = PIPELINE_PIECES) -> float:
    """Seconds of one collective on ``scope`` whose full buffer has ``size`` bytes (the
    output of an all-gather, the input of a reduce-scatter, the buffer of an all-reduce or a
    reduce); see [Note: any collective on any scope]. ``algorithm`` applies to world
    all-gathers and reduce-scatters only, as in the communicator (``auto`` resolved by
    ``size``, in bytes, as ``comm.auto.choose`` resolves it there)."""
    if op not in (*OPS, "all_reduce", "reduce"):
        raise ValueError(f"unknown collective {op!r}; allowed: {', '.join(OPS)}, all_reduce, "
                         "reduce")
    topo = Topology(nodes * gpus_per_node, gpus_per_node)
    n = topo.scope_size(scope)
    if n == 1 or size <= 0:
        return 0.0
    if op == "reduce":
        ports = [(links.intra_lat, links.intra_bw)] if scope != "inter" and gpus_per_node > 1 \
            else []
        ports += [(links.inter_lat, links.inter_bw)] if scope != "intra" and nodes > 1 else []
        return (n - 1) * max(lat for lat, _ in ports) + size / min(bw for _, bw in ports)
    rounds = 2 if op == "all_reduce" else 1
    if scope == "intra":
        return _ring_seconds(rounds * (n - 1), size / n, links.intra_lat, links.intra_bw)
    if scope == "inter":
        return _ring_seconds(rounds * (n - 1), size / n, links.inter_lat, links.inter_bw)
    if op == "all_reduce":
        return sum(scope_seconds(part, scope, size, nodes, gpus_per_node, links)
                   for part in OPS)
    name = resolve(algorithm, op, scope, int(size), 1, topo)
    name = "ring" if name == "native" else name
    c = size / n
    total = 0.0
    for loads in _step_loads(name, op, nodes, gpus_per_node, num_pieces):
        total += max(max(links.intra_lat + a * c / links.intra_bw if a else 0.0,
                         links.inter_lat + b * c / links.inter_bw if b else 0.0)
                     for a, b in loads)
    return total


def fit_port(op: str, scope: str, nodes: int, gpus_per_node: int,
             small: tuple[float, float], large: tuple[float, float]) -> Links:
    """Ports (both levels alike) on which ``scope_seconds`` times ``op`` on ``scope`` as
    measured: ``small`` and ``large`` are (buffer bytes, seconds) of two runs. A native
    collective runs its library's own algorithm (gloo's all-reduce, say, is not a reduce-scatter
    then an all-gather over the ring), so measuring it beats composing it from the ports.

    With equal ports, the seconds are ``a * latency + b / bandwidth``, ``a`` and ``b`` read off
    ``scope_seconds`` itself; two runs give both. The latency is at least 0."""
    def seconds(lat: float, bw: float, size: float) -> float:
        return scope_seconds(op, scope, size, nodes, gpus_per_node, Links(bw, bw, lat, lat))

    (s1, t1), (s2, t2) = small, large
    a1, a2 = seconds(1.0, float("inf"), s1), seconds(1.0, float("inf"), s2)
    b1, b2 = seconds(0.0, 1.0, s1), seconds(0.0, 1.0, s2)
    det = a1 * b2 - a2 * b1
    if not (a1 > 0 and det and s2 > s1):
        raise ValueError(f"cannot fit {op} on {scope} from sizes {s1} and {s2}")
    lat = max((t1 * b2 - t2 * b1) / det, 0.0)
    inverse = max((t2 - a2 * lat) / b2, 1e-15)  # seconds per byte, positive
    return Links(1.0 / inverse, 1.0 / inverse, lat, lat)


def lower_bounds(size: float, nodes: int, gpus_per_node: int, links: Links) -> Bounds:
    """Bandwidth-only bounds for an all-gather (a reduce-scatter is its transpose).

    Two-level: H-Ring and both HO-Rings send (g-1)c on each inter port and g(M-1)c on each
    intra port. Any algorithm: a group must import the (g-1)M foreign chunks over its M inter
    ports, so t >= (g-1)c/B_inter, and each rank must receive N-1 chunks over both its ports,
    so t >= (N-1)c/(B_intra + B_inter); both are reachable together, which makes this the
    bound (copies of a chunk may cross inter links more than once when inter is the faster)."""
    g, m = nodes, gpus_per_node
    c = size / (g * m)
    two_level = max((g - 1) * c / links.inter_bw, g * (m - 1) * c / links.intra_bw)
    any_algorithm = max((g - 1) * c / links.inter_bw, (g * m - 1) * c / (links.intra_bw +
                                                                          links.inter_bw))
    return Bounds(two_level, any_algorithm)


def fit(ring_s: float, hring_s: float, size: float, nodes: int, gpus_per_node: int,
        intra_lat: float = 5e-6, inter_lat: float = 10e-6) -> Links:
    """Bandwidths that make Ring take ``ring_s`` and H-Ring ``hring_s`` (see [Note: fitting the
    paper]). Raises ValueError when no such bandwidths exist in this model."""
    g, m = nodes, gpus_per_node
    n = g * m
    if g < 2 or m < 2:
        raise ValueError("fitting needs at least 2 nodes of at least 2 ranks")
    c = size / n
    ring_step = ring_s / (n - 1)
    if ring_step <= inter_lat:
        raise ValueError(f"Ring time {ring_s}s is below its {n - 1} inter latencies")
    inter_bw = c / (ring_step - inter_lat)
    intra_step = (hring_s - (g - 1) * ring_step) / (m - 1)
    if intra_step <= intra_lat:
        raise ValueError(f"H-Ring time {hring_s}s leaves no time for its intra ring")
    links = Links(g * c / (intra_step - intra_lat), inter_bw, intra_lat, inter_lat)
    if intra_lat + c / links.intra_bw > ring_step:
        raise ValueError("the fit makes Ring steps intra-bound, against its own assumption")
    return links


FITTED = fit(PAPER["ring"], PAPER["hring"], PAPER["size"], PAPER["nodes"],
             PAPER["gpus_per_node"])


def parse_size(text: str) -> float:
    """'1GB' (10**9), '64MiB' (2**26), '4096' (bytes)."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)(i?)B?\s*", text, re.IGNORECASE)
    if not match:
        raise ValueError(f"--size {text!r}: expected a number with an optional unit like 64MB, "
                         f"1GiB")
    number, prefix, binary = match.groups()
    power = " KMGT".index(prefix.upper() or " ")
    return float(number) * (1024 if binary else 1000) ** power


def _human(size: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if size >= scale:
            return f"{size / scale:g} {unit}"
    return f"{size:g} B"


def _signed(fraction: float) -> str:
    return f"{round(fraction, 3) + 0.0:+.1%}"  # + 0.0: no "-0.0%" for a fit hit exactly


def report(op: str, size: float, nodes: int, gpus_per_node: int, links: Links,
           num_pieces: int = PIPELINE_PIECES) -> str:
    """The table printed by the command line."""
    times = {name: collective_time(name, op, size, nodes, gpus_per_node, links, num_pieces)
             for name in NAMES}
    bounds = lower_bounds(size, nodes, gpus_per_node, links)
    lines = [
        f"{op} of {_human(size)} on {nodes} x {gpus_per_node}: intra {links.intra_bw / 1e9:.4g}"
        f" GB/s + {links.intra_lat * 1e6:g} us, inter {links.inter_bw / 1e9:.4g} GB/s + "
        f"{links.inter_lat * 1e6:g} us per rank port; pipelined with {num_pieces} pieces",
        f"{'algorithm':<18}{'ms':>10}{'/Ring':>8}{'/H-Ring':>9}{'/bound':>8}",
    ]
    for name in NAMES:
        t = times[name]
        lines.append(f"{name:<18}{t * 1e3:>10.2f}{t / times['ring']:>8.3f}"
                     f"{t / times['hring']:>9.3f}{t / bounds.two_level:>8.3f}")
    lines.append(f"{'bound, two-level':<18}{bounds.two_level * 1e3:>10.2f}")
    lines.append(f"{'bound, any':<18}{bounds.any_algorithm * 1e3:>10.2f}")
    if (op, size, nodes, gpus_per_node) == ("all_gather", PAPER["size"], PAPER["nodes"],
                                            PAPER["gpus_per_node"]):
        lines.append("paper (section 4.4): " + ", ".join(
            f"{name} {PAPER[name] * 1e3:.0f} ms (model {_signed(times[name] / PAPER[name] - 1)})"
            for name in ("ring", "hring", "horing")))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rlhf_paro.comm.simulate",
        description="Alpha-beta model of Ring, H-Ring and HO-Ring on a two-level cluster. "
                    "Defaults: the paper's 16 x 8 A100 and links fitted to its Ring and H-Ring.")
    parser.add_argument("--op", choices=OPS, default="all_gather")
    parser.add_argument("--size", default="1GB", help="buffer size, e.g. 1GB, 64MiB")
    parser.add_argument("--nodes", type=int, default=PAPER["nodes"], help="g")
    parser.add_argument("--gpus-per-node", type=int, default=PAPER["gpus_per_node"], help="M")
    parser.add_argument("--intra-bw", type=float, default=FITTED.intra_bw / 1e9, help="GB/s")
    parser.add_argument("--inter-bw", type=float, default=FITTED.inter_bw / 1e9, help="GB/s")
    parser.add_argument("--intra-lat", type=float, default=FITTED.intra_lat * 1e6, help="us")
    parser.add_argument("--inter-lat", type=float, default=FITTED.inter_lat * 1e6, help="us")
    parser.add_argument("--pieces", type=int, default=PIPELINE_PIECES,
                        help="pieces per chunk of the pipelined HO-Ring")
    parser.add_argument("--fit", nargs=2, type=float, metavar=("RING_MS", "HRING_MS"),
                        help="fit both bandwidths to these Ring and H-Ring times instead")
    args = parser.parse_args(argv)
    try:
        size = parse_size(args.size)
        Topology(args.nodes * args.gpus_per_node, args.gpus_per_node)
        if args.pieces < 1:
            raise ValueError(f"--pieces={args.pieces} must be at least 1")
        if args.fit:
            links = fit(args.fit[0] / 1e3, args.fit[1] / 1e3, size, args.nodes,
                        args.gpus_per_node, args.intra_lat / 1e6, args.inter_lat / 1e6)
        else:
            links = Links(args.intra_bw * 1e9, args.inter_bw * 1e9, args.intra_lat / 1e6,
                          args.inter_lat / 1e6)
    except ValueError as err:
        parser.exit(2, f"error: {err}\n")
    print(report(args.op, size, args.nodes, args.gpus_per_node, links, args.pieces))
    return 0


if __name__ == "__main__":
    sys.exit(main())
