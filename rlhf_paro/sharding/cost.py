"""Closed forms of the paper's Table 2 (memory) and Table 3 (traffic) for all 14 strategies.

Everything is per rank and exact for the engine: a unit's trainable and frozen flat buffers are
each padded to a multiple of N, bytes per element are 4 (fp32) or 2 (bf16) for P and G, and the
optimizer state is K bytes per trainable element, K = 8 in fp32 (Adam moments; the fp32
parameters themselves are the master copy) and K = 12 in bf16 (fp32 master + moments), the K of
Table 2 for mixed precision.

Traffic follows the schedule of DESIGN section 4, one optimizer step of s micro-batches:
  forward   s x (P gather of every unit)
  backward  s x (P gather of every unit + G reduce-scatter of its gradient)
  boundary  the G -> OS collective of every unit, then one fp32 all-reduce of the squared
            gradient norm over the ranks that hold disjoint OS shards
  update    the OS -> P all-gather of every unit
"""

from __future__ import annotations

from typing import Sequence

from rlhf_paro.comm.meter import STEP_PHASES, LinkBytes, native_bytes
from rlhf_paro.sharding.layout import UnitSizes, padded
from rlhf_paro.sharding.strategy import Level, Strategy
from rlhf_paro.sharding.topology import Topology

__all__ = ["UnitSizes", "bytes_per_element", "memory", "optimizer_bytes_per_element", "traffic"]


def bytes_per_element(precision: str) -> int:
    """Bytes of one P or G element."""
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"precision={precision!r} is unknown; allowed: fp32, bf16")
    return 4 if precision == "fp32" else 2


def optimizer_bytes_per_element(precision: str) -> int:
    """K of Table 2: optimizer-state bytes per trainable element."""
    return 8 if bytes_per_element(precision) == 4 else 12


def _ways(level: Level, num_ranks: int, group_size: int) -> int:
    return {Level.N: 1, Level.I: group_size, Level.G: num_ranks}[level]


def memory(strategy: Strategy, units: Sequence[UnitSizes], num_ranks: int, group_size: int,
           precision: str = "fp32") -> dict[str, int]:
    """Bytes held per rank in P, G and OS (Table 2), padding included."""
    Topology(num_ranks, group_size)  # validates M | N
    b = bytes_per_element(precision)
    trainable = sum(padded(u.trainable, num_ranks) for u in units)
    everything = trainable + sum(padded(u.frozen, num_ranks) for u in units)
    params = everything * b // _ways(strategy.params, num_ranks, group_size)
    if strategy.frozen:
        return {"params": params, "grads": 0, "optim": 0}
    grads = trainable * b // _ways(strategy.grads, num_ranks, group_size)
    optim = (trainable * optimizer_bytes_per_element(precision)
             // _ways(strategy.optim, num_ranks, group_size))
    return {"params": params, "grads": grads, "optim": optim}


def _scoped(op: str, numel: int, elem_size: int, scope: str, topo: Topology,
            algorithm: str) -> LinkBytes:
    """Bytes this rank sends in one collective of ``numel`` elements (the full buffer)."""
    if scope == "world" and algorithm != "native" and op != "all_reduce":
        from rlhf_paro.comm import rings

        return rings.ALGORITHMS[algorithm].link_bytes(op, numel, elem_size, topo)
    return native_bytes(op, numel, elem_size, scope, topo)


def _rank_traffic(strategy: Strategy, units: Sequence[UnitSizes], topo: Topology, s: int,
                  precision: str, algorithm: str) -> dict[str, LinkBytes]:
    b = bytes_per_element(precision)
    n, m = topo.num_ranks, topo.group_size
    totals = {phase: [0, 0] for phase in STEP_PHASES}

    def add(phase: str, op: str, numel: int, scope: str, times: int = 1, elem: int = b) -> None:
        if numel == 0:
            return
        sent = _scoped(op, numel, elem, scope, topo, algorithm)
        totals[phase][0] += times * sent.intra
        totals[phase][1] += times * sent.inter

    p_scope = {Level.I: "intra", Level.G: "world"}.get(strategy.params)
    for u in units:
        t, f = padded(u.trainable, n), padded(u.frozen, n)
        if p_scope is not None:
            for numel in (t, f):
                add("forward", "all_gather", numel, p_scope, s)
                if not strategy.frozen:
                    add("backward", "all_gather", numel, p_scope, s)
        if strategy.frozen:
            continue
        if strategy.grads == Level.I:
            add("backward", "reduce_scatter", t, "intra", s)
        elif strategy.grads == Level.G:
            add("backward", "reduce_scatter", t, "world", s)
        g_os = (strategy.grads, strategy.optim)
        if g_os == (Level.N, Level.N):
            add("boundary", "all_reduce", t, "world")
        elif g_os == (Level.N, Level.I):
            add("boundary", "reduce_scatter", t, "intra")
            add("boundary", "all_reduce", t // m, "inter")
        elif g_os == (Level.N, Level.G):
            add("boundary", "reduce_scatter", t, "world")
        elif g_os == (Level.I, Level.I):
            add("boundary", "all_reduce", t // m, "inter")
        elif g_os == (Level.I, Level.G):
            add("boundary", "reduce_scatter", t // m, "inter")
        os_p = (strategy.optim, strategy.params)
        if os_p == (Level.I, Level.N):
            add("update", "all_gather", t, "intra")
        elif os_p == (Level.G, Level.I):
            add("update", "all_gather", t // m, "inter")
        elif os_p == (Level.G, Level.N):
            add("update", "all_gather", t, "world")
    if not strategy.frozen and any(u.trainable for u in units):
        norm_scope = {Level.I: "intra", Level.G: "world"}.get(strategy.optim)
        if norm_scope is not None:
            add("boundary", "all_reduce", 1, norm_scope, elem=4)
    return {phase: LinkBytes(*v) for phase, v in totals.items()}


def traffic(strategy: Strategy, units: Sequence[UnitSizes], num_ranks: int, group_size: int,
            grad_accum_steps: int = 1, precision: str = "fp32", algorithm: str = "native",
            rank: int | None = None) -> dict[str, LinkBytes]:
    """Bytes one rank sends per optimizer step, by phase, on intra and inter links.

    For a frozen (inference-only) strategy the step is ``grad_accum_steps`` forward passes.
    With ``rank=None`` the result is the average over all ranks (Table 3's total divided by N);
    the ranks differ only in which of them cross groups on the world ring.
    """
    topo = Topology(num_ranks, group_size)
    if rank is not None:
        return _rank_traffic(strategy, units, topo.with_rank(rank), grad_accum_steps, precision,
                             algorithm)
    # Every group is laid out alike, so a rank's traffic depends only on its local index j:
    # the mean over the M ranks of one group is the mean over all N.
    per_rank = [_rank_traffic(strategy, units, topo.with_rank(j), grad_accum_steps, precision,
                              algorithm) for j in range(group_size)]
    return {phase: LinkBytes(sum(p[phase].intra for p in per_rank) / group_size,
                             sum(p[phase].inter for p in per_rank) / group_size)
            for phase in STEP_PHASES}
