"""Predicted step time of one model under a strategy: compute, the schedule's collectives on the
port model of ``comm/simulate.py``, what the engine overlaps, and the memory that bounds the
micro-batch.

[Note: the step-time model]
One optimizer step of s micro-batches of b sequences on one device (docs/design.md, "The
schedule" and "The unit lifecycle"):

    T_step  = s * (T_fwd + T_bwd) + T_boundary + T_update
    T_fwd   = g_0 + c_0 + g_1 + sum_k lane(c_k, g_{k+1})           forward, units in order
    T_bwd   = g_0 + c_0 + r_0 + g_n + sum_k [lane(c_k, g_{k-1}) + r_k]   blocks in reverse
    lane(c, g) = max(c, g)  when the next unit's gather is asynchronous (a prefetch)
               = c + g      when it is not

Unit 0 is the root, gathered first and without prefetch; g_k is unit k's parameter gather,
c_k its compute, r_k its gradient reduce-scatter. What runs where is read from the schedule
(``schedule.plan``), each collective timed by ``comm.simulate.scope_seconds`` on the bytes the
engine hands it (a unit's padded flat buffer at the coarser of the two levels):

  - gathers are prefetched one unit ahead, so they hide behind the compute of the unit before;
    the model takes only native collectives as asynchronous, so a world gather on a ring
    schedule of ours (``comm.algorithm`` other than native) runs inline and hides nothing;
  - the backward reduce-scatter is synchronous: the next unit's compute waits for it, and it
    waits for the prefetch in flight (one communication lane per rank);
  - the boundary (reduce to the OS level, the norm) and the update (gather OS -> P) run
    between micro-batches with nothing to hide behind.
The engine overlaps more (async ring collectives, reductions in flight, buckets, the boundary
started in the last backward: docs/design.md, "Step time"); the model overstates what a step
leaves exposed.

[Note: reductions of other systems]
The model reduces a unit's gradient with one reduce-scatter, synchronously, and our ring
schedules share the native collectives' links. To predict runs of another system the model
takes three departures, each off by default:
  - ``overlap_reduce``: the reduction of unit k runs on the communication lane during unit
    k+1's compute (after the prefetch issued with it), only the last one exposed:
        lane_k = max(c_k, r_{k-1} + g_{k+1})
    as a training stack with a separate reduction stream does (DeepSpeed's ``overlap_comm``).
    Only native collectives run so; a world reduce-scatter on a ring schedule stays inline.
  - ``reduce_per_owner``: a gradient reduce-scatter over n ranks becomes one ``reduce`` to each
    rank that owns a piece of it, the pieces being one flat partition of the whole model (what
    DeepSpeed's ZeRO-1/2 optimizer issues for every bucket). A unit with a share q of the
    model's gradient overlaps 1 + n q partitions on average; each reduce is a pipelined chain
    of n-1 steps, so the unit costs (1 + n q)(n-1) step latencies plus its bytes once through
    the slowest link, against n-1 latencies for a ring. Over the model that is n + (units)
    reduces per micro-batch, each n-1 steps long: latency that grows as n^2.
  - ``Machine.ring_links``: other port constants for our ring schedules than for the native
    collectives, where the two implementations differ (the paper's rings against NCCL).

Compute: c_k = b * F_k / flops, with F_k the unit's forward FLOPs per sequence (2 per
parameter per token, plus causal attention's 2 L h per token per block); the backward costs
the forward again for activation gradients and the trainable share of it for weight
gradients, and once more for recomputation under gradient checkpointing. The optimizer's own
arithmetic (memory-bound, a few ms for a 7B shard) is left out.

[Note: activation memory]
Per sequence of L tokens, with e bytes per activation element, hidden size h, MLP width F,
vocabulary V (1 for a value head) and l blocks (``transformer_workload``):
  saved for backward:  L * l * (8h + 4F) * e            (each block: its input, the two norm
                                                        outputs, q, k, v, attention output, the
                                                        second residual, and four MLP tensors)
                       L * l * h * e                    with checkpointing (block inputs only)
  working set:         L * V * (e + 8)                  logits, their fp32 log-softmax, its grad
                       + L * (8h + 4F) * e              one block recomputed (checkpointing)
  inference (no grad): L * ((2h + 2F) * e + V * (e + 4))
Attention scores are not kept (fused attention). On top come buffers that depend on the
strategy, not on b: gathered parameters (root and two blocks: the one running and the one
prefetched) when P is not N, one unit's gradient in the parameter dtype and again in
``reduce_dtype``, and at the boundary the fp32 gradient of the OS shard of every unit. A
strategy that holds less leaves more for b: ``max_micro_batch`` takes the largest allowed b
that fits, and fewer micro-batches per step mean fewer per-micro-batch collectives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Sequence

from rlhf_paro.comm.auto import resolve
from rlhf_paro.comm.meter import AUTO, BACKWARD, BOUNDARY, FORWARD, UPDATE
from rlhf_paro.comm.rings import OPS
from rlhf_paro.comm.simulate import Links, scope_seconds
from rlhf_paro.comm.topology import Topology
from rlhf_paro.sharding.cost import GRAD_BYTES, bytes_per_element, memory
from rlhf_paro.sharding.layout import UnitSizes, padded
from rlhf_paro.sharding.schedule import Collective, plan, ways
from rlhf_paro.sharding.strategy import Level, Strategy

NORM_BYTES = 4  # the fp32 squared gradient norm


@dataclass(frozen=True)
class Machine:
    """One device and its links, as the model sees them."""

    links: Links  # per-rank intra and inter ports (comm.simulate) of native collectives
    flops: float  # achieved FLOP/s of one device on the model's arithmetic
    # The ports as our ring schedules see them (comm.algorithm other than native, world
    # all-gathers and reduce-scatters), where their implementation gets other constants than
    # the native collectives; None: ``links``.
    ring_links: Links | None = None

    def links_for(self, op: str, scope: str, algorithm: str) -> Links:
        """The links that carry ``op`` on ``scope`` (ours only for world gathers/scatters);
        ``algorithm`` is the one that runs it, never ``auto``."""
        assert algorithm != AUTO, "resolve auto first (collective_algorithm)"
        ring = scope == "world" and op in OPS and algorithm != "native"
        return self.ring_links if ring and self.ring_links is not None else self.links

    def __post_init__(self) -> None:
        if not self.flops > 0:
            raise ValueError(f"flops={self.flops} must be positive")


@dataclass(frozen=True)
class Workload:
    """One model on one device: its units and the work and memory of one sequence."""

    units: tuple[UnitSizes, ...]  # root first, then the blocks in forward order (layout.py)
    flops: tuple[float, ...]  # forward FLOPs of each unit for one sequence
    saved_bytes: float  # activations one sequence keeps for backward
    working_bytes: float  # one sequence's transient peak inside a unit's forward or backward
    inference_bytes: float  # one sequence's transient peak in a forward without gradients
    precision: str = "bf16"  # of parameters and activations
    reduce_dtype: str = "fp32"  # of gradient reductions
    checkpointing: bool = False  # blocks recomputed in backward
    grad_bytes: int = GRAD_BYTES  # per element of the gradient accumulator (the engine's fp32)

    def __post_init__(self) -> None:
        if len(self.flops) != len(self.units):
            raise ValueError(f"{len(self.flops)} FLOP counts for {len(self.units)} units")


class StepTime(NamedTuple):
    """Predicted seconds of one optimizer step (or one inference pass) on one device."""

    total: float
    compute: float  # forward, backward and recomputation
    exposed: float  # communication that nothing hides: total - compute
    hidden: float  # communication behind compute (prefetched gathers)
    by_phase: dict[str, float]  # communication seconds per schedule phase, hidden or not
    messages: int  # collectives this device takes part in
    micro_batch: int  # b
    num_micro: int  # s


def transformer_workload(units: Sequence[UnitSizes], *, hidden: int, ffn: int, vocab: int,
                         seq_len: int, precision: str = "bf16", reduce_dtype: str = "fp32",
                         checkpointing: bool = False, grad_bytes: int = GRAD_BYTES) -> Workload:
    """A decoder-only transformer ([Note: activation memory]); ``vocab`` is the width of the
    output head (1 for a value head), ``units`` come from ``layout.unit_sizes``."""
    e = bytes_per_element(precision)
    length, blocks = seq_len, len(units) - 1
    # The root's arithmetic is its output head (the embedding is a lookup).
    flops = [2.0 * length * hidden * vocab]
    flops += [2.0 * length * (u.trainable + u.frozen) + 2.0 * length * length * hidden
              for u in units[1:]]
    block = (8 * hidden + 4 * ffn) * e
    kept = hidden * e if checkpointing else block
    saved = length * (blocks * kept + 2 * hidden * e)  # + the root's embedding and norm input
    working = length * (vocab * (e + 8) + (block if checkpointing else 0))
    inference = length * ((2 * hidden + 2 * ffn) * e + vocab * (e + 4))
    return Workload(tuple(units), tuple(flops), saved, working, inference, precision,
                    reduce_dtype, checkpointing, grad_bytes)


# -- communication ---------------------------------------------------------------------------
def collective_algorithm(c: Collective, numel: int, elem: int, topo: Topology,
                         algorithm: str) -> str:
    """The algorithm that runs a collective of the schedule on a unit buffer of ``numel``
    padded elements (``comm.algorithm=auto`` resolved by its size, as the engine resolves it)."""
    return resolve(algorithm, c.op, c.scope, numel // ways(min(c.src, c.dst), topo), elem, topo)


def collective_seconds(c: Collective, numel: int, elem: int, topo: Topology, machine: Machine,
                       algorithm: str) -> float:
    """One collective of the schedule on a unit buffer of ``numel`` padded elements: its full
    buffer is the shard at the coarser of its two levels."""
    size = numel // ways(min(c.src, c.dst), topo) * elem
    name = collective_algorithm(c, numel, elem, topo, algorithm)
    return scope_seconds(c.op, c.scope, size, topo.num_groups, topo.group_size,
                         machine.links_for(c.op, c.scope, name), name)


def owner_reduces(c: Collective, numel: int, share: float, elem: int, topo: Topology,
                  machine: Machine) -> tuple[float, float]:
    """A gradient reduce-scatter run as one reduce to each rank that owns a piece of the
    buffer, the pieces being those of one flat partition of the whole model over the scope
    ([Note: reductions of other systems]); ``share`` is the unit's part of the model. Returns
    the seconds and the number of reduces."""
    n = topo.scope_size(c.scope)
    size = numel // ways(min(c.src, c.dst), topo) * elem
    owners = 1.0 + n * share  # partitions an interval of this length overlaps, on average
    return owners * scope_seconds("reduce", c.scope, size / owners, topo.num_groups,
                                  topo.group_size, machine.links), owners


def asynchronous(c: Collective, algorithm: str) -> bool:
    """Whether the engine can run this collective asynchronously (native collectives only);
    ``algorithm`` is the one that runs it (``collective_algorithm``)."""
    return c.scope != "world" or algorithm == "native"


class _UnitComm(NamedTuple):
    """One unit's collectives, timed: seconds per micro-batch and per step."""

    gather: float  # the parameter gather of one pass (forward, or backward again)
    prefetch: bool  # whether that gather runs asynchronously
    reduce: float  # backward reduce-scatter of the gradient, per micro-batch
    reduce_async: bool  # whether that reduction can run asynchronously
    boundary: float  # per step: the gradient reduced to the OS level
    update: float  # per step: the new parameters gathered from OS to P
    per_micro: float  # collectives per forward + backward
    per_step: float  # collectives per boundary + update


def _unit_comm(strategy: Strategy, w: Workload, topo: Topology, machine: Machine,
               algorithm: str, reduce_per_owner: bool = False) -> list[_UnitComm]:
    collectives = [c for c in plan(strategy)
                   if c.what != "norm" and topo.scope_size(c.scope) > 1]
    elem = {"params": bytes_per_element(w.precision), "trained": bytes_per_element(w.precision),
            "grads": bytes_per_element(w.reduce_dtype)}
    n = topo.num_ranks
    trained = sum(padded(u.trainable, n) for u in w.units)
    timed: dict[UnitSizes, _UnitComm] = {}  # the blocks of a model are alike
    for u in dict.fromkeys(w.units):
        buffers = {"params": [padded(x, n) for x in (u.trainable, u.frozen) if x],
                   "trained": [padded(u.trainable, n)] if u.trainable else []}
        buffers["grads"] = buffers["trained"]
        secs = dict.fromkeys(("gather", "reduce", "boundary", "update"), 0.0)
        prefetch = reduce_async = True
        per_micro = per_step = 0.0
        for c in collectives:
            key = {"params": "gather", "grads": "reduce"}.get(c.what, "update")
            if c.phase == BOUNDARY:
                key = "boundary"
            for numel in buffers[c.what]:
                count = 1.0
                if reduce_per_owner and c.what == "grads" and c.op == "reduce_scatter":
                    t, count = owner_reduces(c, numel, numel / trained, elem["grads"], topo,
                                             machine)
                else:
                    t = collective_seconds(c, numel, elem[c.what], topo, machine, algorithm)
                runs = collective_algorithm(c, numel, elem[c.what], topo, algorithm)
                if c.phase == FORWARD:  # the backward gathers the same again
                    secs["gather"] += t
                    prefetch = prefetch and asynchronous(c, runs)
                elif c.phase != BACKWARD or c.what != "params":
                    secs[key] += t
                if c.phase == BACKWARD and c.what == "grads":
                    reduce_async = reduce_async and asynchronous(c, runs)
                if c.per == "micro":
                    per_micro += count
                else:
                    per_step += count
        timed[u] = _UnitComm(secs["gather"], prefetch, secs["reduce"], reduce_async,
                             secs["boundary"], secs["update"], per_micro, per_step)
    return [timed[u] for u in w.units]


def _pass(gathers: list[float], prefetch: list[bool], computes: list[float],
          reduces: list[float], behind: list[bool] | None = None) -> float:
    """One pass over units in execution order, the root first ([Note: the step-time model]).
    ``behind[k]``: unit k's reduction runs behind the next unit's compute, not before it."""
    behind = behind or [False] * len(gathers)
    t = gathers[0] + (gathers[1] if len(gathers) > 1 else 0.0)
    pending = 0.0  # the reduction in flight on the communication lane
    for k in range(len(gathers)):
        nxt = gathers[k + 1] if 0 < k < len(gathers) - 1 else 0.0
        ahead = nxt if nxt and prefetch[k + 1] else 0.0  # a prefetch shares the lane
        t += max(computes[k], pending + ahead) + nxt - ahead
        pending = reduces[k] if behind[k] else 0.0
        t += reduces[k] - pending
    return t + pending


# -- the model -------------------------------------------------------------------------------
def forward_time(strategy: Strategy, w: Workload, topo: Topology, machine: Machine,
                 micro_batch: int, algorithm: str = "native") -> StepTime:
    """One forward of ``micro_batch`` sequences without gradients (an inference pass); only the
    P level of ``strategy`` matters."""
    comm = _unit_comm(Strategy(strategy.params), w, topo, machine, algorithm)
    computes = [micro_batch * f / machine.flops for f in w.flops]
    gathers = [u.gather for u in comm]
    total = _pass(gathers, [u.prefetch for u in comm], computes, [0.0] * len(comm))
    compute = sum(computes)
    return StepTime(total, compute, total - compute, max(0.0, compute + sum(gathers) - total),
                    {FORWARD: sum(gathers)}, round(sum(u.per_micro for u in comm)),
                    micro_batch, 1)


def gather_seconds(strategy: Strategy, w: Workload, topo: Topology, machine: Machine,
                   algorithm: str = "native") -> float:
    """Every unit gathered at once, inline (the engine's ``gathered()``, e.g. to generate)."""
    return sum(u.gather for u in _unit_comm(Strategy(strategy.params), w, topo, machine,
                                            algorithm))


def step_time(strategy: Strategy, w: Workload, topo: Topology, machine: Machine,
              micro_batch: int, num_micro: int, algorithm: str = "native", *,
              overlap_reduce: bool = False, reduce_per_owner: bool = False) -> StepTime:
    """One optimizer step of ``num_micro`` micro-batches of ``micro_batch`` sequences.

    The defaults are this engine's; ``overlap_reduce`` and ``reduce_per_owner`` describe
    other systems ([Note: reductions of other systems])."""
    comm = _unit_comm(strategy, w, topo, machine, algorithm, reduce_per_owner)
    fwd = [micro_batch * f / machine.flops for f in w.flops]
    bwd = []
    for k, (u, f) in enumerate(zip(w.units, fwd)):
        trained = u.trainable / (u.trainable + u.frozen) if u.trainable + u.frozen else 0.0
        recompute = f if w.checkpointing and k > 0 else 0.0
        bwd.append(f * (1.0 + trained) + recompute)
    gathers, prefetch = [u.gather for u in comm], [u.prefetch for u in comm]
    t_fwd = _pass(gathers, prefetch, fwd, [0.0] * len(comm))
    order = [0, *range(len(comm) - 1, 0, -1)]  # backward: the root (the head), then blocks
    t_bwd = _pass([gathers[k] for k in order], [prefetch[k] for k in order],
                  [bwd[k] for k in order], [comm[k].reduce for k in order],
                  [overlap_reduce and comm[k].reduce_async for k in order])
    norm = sum(scope_seconds(c.op, c.scope, NORM_BYTES, topo.num_groups, topo.group_size,
                             machine.links)
               for c in plan(strategy) if c.what == "norm")
    by_phase = {FORWARD: num_micro * sum(gathers),
                BACKWARD: num_micro * sum(u.gather + u.reduce for u in comm),
                BOUNDARY: sum(u.boundary for u in comm) + norm,
                UPDATE: sum(u.update for u in comm)}
    total = num_micro * (t_fwd + t_bwd) + by_phase[BOUNDARY] + by_phase[UPDATE]
    compute = num_micro * (sum(fwd) + sum(bwd))
    messages = (num_micro * sum(u.per_micro for u in comm) + sum(u.per_step for u in comm)
                + sum(1 for c in plan(strategy)
                      if c.what == "norm" and topo.scope_size(c.scope) > 1))
    hidden = max(0.0, compute + sum(by_phase.values()) - total)
    return StepTime(total, compute, total - compute, hidden, by_phase, round(messages),
                    micro_batch, num_micro)


# -- memory ----------------------------------------------------------------------------------
class Memory(NamedTuple):
    """Peak bytes of one model on one device, its states included."""

    states: int  # P + G + OS (cost.memory, the paper's Table 2)
    train: float  # while training (states alone for a frozen model)
    inference: float  # in a forward without gradients
    gathered: float  # with every unit gathered at once (``gathered()``, to generate)


def peak_memory(strategy: Strategy, w: Workload, topo: Topology, micro_batch: int) -> Memory:
    """[Note: activation memory]."""
    held = memory(strategy, w.units, topo.num_ranks, topo.group_size, w.precision,
                  grad_bytes=w.grad_bytes)
    states = held["params"] + held["grads"] + held["optim"]
    e = bytes_per_element(w.precision)
    n = topo.num_ranks
    sizes = [padded(u.trainable, n) + padded(u.frozen, n) for u in w.units]
    gathered = full = 0.0
    if strategy.params != Level.N:
        gathered = e * (sizes[0] + sum(sorted(sizes[1:], reverse=True)[:2]))
        full = e * sum(sizes) - held["params"]
    inference = states + gathered + micro_batch * w.inference_bytes
    if strategy.frozen:
        return Memory(states, states, inference, states + full)
    r = bytes_per_element(w.reduce_dtype)
    trained = [padded(u.trainable, n) for u in w.units]
    activations = micro_batch * (w.saved_bytes + w.working_bytes) + gathered \
        + (e + r) * max(trained)
    boundary = (4 * sum(trained) / ways(strategy.optim, topo)
                + r * max(trained) / ways(strategy.grads, topo))
    return Memory(states, states + max(activations, boundary), inference, states + full)


def max_micro_batch(strategy: Strategy, w: Workload, topo: Topology, budget: float,
                    allowed: Sequence[int], inference: bool = False) -> int | None:
    """The largest of ``allowed`` micro-batch sizes whose peak fits in ``budget`` bytes."""
    def peak(b: int) -> float:
        mem = peak_memory(strategy, w, topo, b)
        return mem.inference if inference else mem.train
    fits = [b for b in allowed if peak(b) <= budget]
    return max(fits) if fits else None
