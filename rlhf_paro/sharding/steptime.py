"""Predicted step time of one model under a strategy: compute, the schedule's collectives on the
port model of ``comm/simulate.py``, what the engine overlaps, and the memory that bounds the
micro-batch.

[Note: the step-time model]
One optimizer step of s micro-batches of b sequences on one device (docs/design.md, "The
schedule", "The unit lifecycle", "Gradients: flat buffers, reductions in flight, buckets"), run
as the engine runs it on two resources: a compute stream, and one communication lane on which
collectives run one at a time in the order they were posted (the ports are shared, so two at
once would take as long as one after the other). A collective posted asynchronously occupies
the lane and compute goes on until something waits for it; a synchronous one stops compute
until it is done. What runs when is read from the schedule (``schedule.plan``), each
collective timed by ``comm.simulate.scope_seconds`` on the bytes the engine hands it (a unit's
padded flat buffer at the coarser of the two levels, or a bucket):

  - forward: the root is gathered first (it wraps the model); each block is gathered, or waited
    for when prefetched, and the next block's gather is posted before it computes; the root's
    own arithmetic (the head) comes last;
  - backward: the root is gathered again and the head runs first, then the blocks in reverse,
    each prefetching the one before it. As a unit finishes, its gradient reduce-scatter is
    posted asynchronously, small units together by ``schedule.buckets`` (the engine's rule and
    BUCKET_NUMEL); compute waits for the oldest only when more than REDUCTIONS_IN_FLIGHT (the
    engine's constant) are in flight, so the last reductions of a micro-batch run into the next
    one's forward;
  - in the last micro-batch a unit's boundary starts when its accumulator is complete (at its
    post-backward when gradients stay at N, when its last reduction is waited for otherwise):
    the first collective of its chain to the OS level is posted then;
  - ``step()`` waits for every reduction in flight and every started boundary collective, runs
    the rest of each unit's chain and the norm, then the update (OS -> P), all synchronously.
Every collective the engine posts asynchronously runs so, ring schedules of ours included (the
group's lane of ``comm/rings.py``). ``StepTime.in_step`` is what ``step()`` takes after the
last backward.

[Note: reductions of other systems]
To predict runs of another system, ``Overlap`` describes what it overlaps; ``ENGINE`` is this
engine's, with its cap and bucket size imported from the engine and the schedule:
  - ``reductions_in_flight``: 0 runs each reduction inline; 1 is a training stack with a
    separate reduction stream that waits for the previous reduction before posting the next
    (DeepSpeed's ``overlap_comm``);
  - ``boundary_in_backward``: whether the boundary's first collective starts in the backward;
  - ``async_rings``: whether our ring schedules run asynchronously (a system that runs them on
    the caller's thread hides nothing behind them);
  - ``bucket_numel``: the bucket size (1: every unit alone);
  - ``reduce_per_owner``: a gradient reduce-scatter over n ranks becomes one ``reduce`` to each
    rank that owns a piece of it, the pieces being one flat partition of the whole model (what
    DeepSpeed's ZeRO-1/2 optimizer issues for every bucket). A unit with a share q of the
    model's gradient overlaps 1 + n q partitions on average; each reduce is a pipelined chain
    of n-1 steps, so the unit costs (1 + n q)(n-1) step latencies plus its bytes once through
    the slowest link, against n-1 latencies for a ring. Over the model that is n + (units)
    reduces per micro-batch, each n-1 steps long: latency that grows as n^2.
``Machine.ring_links`` gives our ring schedules other port constants than the native
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

from dataclasses import dataclass
from typing import Mapping, NamedTuple, Sequence

from rlhf_paro.comm.auto import resolve
from rlhf_paro.comm.meter import AUTO, BACKWARD, BOUNDARY, FORWARD, UPDATE
from rlhf_paro.comm.rings import OPS
from rlhf_paro.comm.simulate import Links, scope_seconds
from rlhf_paro.comm.topology import Topology
from rlhf_paro.sharding.cost import GRAD_BYTES, bytes_per_element, memory
from rlhf_paro.sharding.layout import UnitSizes, padded
from rlhf_paro.sharding.engine import REDUCTIONS_IN_FLIGHT
from rlhf_paro.sharding.schedule import BUCKET_NUMEL, Collective, buckets, plan, select, ways
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
    # Ports fitted to the native collective ``op`` on ``scope`` (comm.simulate.fit_port) where
    # it was measured: the library runs its own algorithm, which the ports compose only roughly
    # (gloo's all-reduce beats a reduce-scatter and an all-gather, its reduce-scatter is slower
    # than its all-gather). Keyed by (op, scope); absent: ``links``.
    native: Mapping[tuple[str, str], Links] | None = None

    def links_for(self, op: str, scope: str, algorithm: str) -> Links:
        """The links that carry ``op`` on ``scope`` (ours only for world gathers/scatters);
        ``algorithm`` is the one that runs it, never ``auto``."""
        assert algorithm != AUTO, "resolve auto first (collective_algorithm)"
        if algorithm == "native" and self.native and (op, scope) in self.native:
            return self.native[op, scope]
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
    # Of total: what ``step()`` takes after the last backward (the reductions still in flight,
    # the boundary, the update); the rest is the s forward and backward passes.
    in_step: float = 0.0


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


def asynchronous(c: Collective, algorithm: str, system: Overlap) -> bool:
    """Whether ``system`` runs this collective asynchronously; ``algorithm`` is the one that
    runs it (``collective_algorithm``). The engine posts ring schedules on their group's lane
    like native collectives (docs/design.md, "Collectives"); another system may not."""
    return system.async_rings or c.scope != "world" or algorithm == "native"


@dataclass(frozen=True)
class Overlap:
    """What a training system overlaps, and how it reduces gradients. ``ENGINE`` is this
    engine's, read from the engine itself; the others describe other systems
    ([Note: reductions of other systems])."""

    reductions_in_flight: int  # backward reductions waited for only beyond this many; 0: inline
    boundary_in_backward: bool  # the boundary's first collective starts in the last backward
    async_rings: bool  # ring schedules (world gathers and reduce-scatters) run asynchronously
    bucket_numel: int = BUCKET_NUMEL  # small gradients reduce together (schedule.buckets)
    reduce_per_owner: bool = False  # a gradient reduced as one reduce to each owner


ENGINE = Overlap(REDUCTIONS_IN_FLIGHT, boundary_in_backward=True, async_rings=True)


class _Timed(NamedTuple):
    """The schedule's collectives of one model, timed (seconds on the lane) in engine order."""

    gather: list[float]  # per unit: its parameter gather (forward, and again in backward)
    gather_async: list[bool]  # whether that gather can be a prefetch
    # The backward reduce-scatters, one per bucket: its units, seconds, whether asynchronous,
    # and whether it is full (posted when its last unit finishes; the open one at the end).
    reductions: list[tuple[list[int], float, bool, bool]]
    boundary_first: list[float]  # per unit: the boundary chain's first collective
    boundary_rest: list[float]  # per unit: the rest of the chain
    update: list[float]  # per unit: the new parameters gathered from OS to P
    norm: float
    per_micro: float  # collectives per forward + backward
    per_step: float  # collectives per boundary + update


def _timed(strategy: Strategy, w: Workload, topo: Topology, machine: Machine, algorithm: str,
           system: Overlap) -> _Timed:
    collectives = [c for c in plan(strategy) if topo.scope_size(c.scope) > 1]
    elem = {"params": bytes_per_element(w.precision), "trained": bytes_per_element(w.precision),
            "grads": bytes_per_element(w.reduce_dtype)}
    n = topo.num_ranks
    trained = [padded(u.trainable, n) for u in w.units]
    buffers = [{"params": [padded(x, n) for x in (u.trainable, u.frozen) if x],
                "trained": [t] if t else []} for u, t in zip(w.units, trained)]

    def seconds(c: Collective, numel: int) -> float:
        return collective_seconds(c, numel, elem[c.what], topo, machine, algorithm)

    def async_(c: Collective, numel: int) -> bool:
        return asynchronous(c, collective_algorithm(c, numel, elem[c.what], topo, algorithm),
                            system)

    gathers = select(collectives, FORWARD, "params")
    gather = [sum(seconds(c, x) for c in gathers for x in b["params"]) for b in buffers]
    gather_async = [all(async_(c, x) for c in gathers for x in b["params"]) for b in buffers]
    per_micro = 2.0 * sum(len(gathers) * len(b["params"]) for b in buffers)
    # The backward reduce-scatters, bucket by bucket in the order backward finishes the units
    # (the blocks in reverse, the root last): the rule the engine applies (schedule.buckets).
    finishing = [*range(len(w.units) - 1, 0, -1), 0]
    reductions = []
    for c in select(collectives, BACKWARD, "grads"):
        for bucket in buckets([trained[k] for k in finishing], system.bucket_numel):
            members = [finishing[i] for i in bucket]
            numel = sum(trained[k] for k in members)
            if system.reduce_per_owner and c.op == "reduce_scatter":
                t, count = owner_reduces(c, numel, numel / sum(trained), elem["grads"], topo,
                                         machine)
            else:
                t, count = seconds(c, numel), 1.0
            reductions.append((members, t, async_(c, numel), numel >= system.bucket_numel))
            per_micro += count
    chain = select(collectives, BOUNDARY, "grads")
    boundary_first = [seconds(chain[0], t) if chain and t else 0.0 for t in trained]
    boundary_rest = [sum(seconds(c, t) for c in chain[1:]) if t else 0.0 for t in trained]
    updates = select(collectives, UPDATE, "trained")
    update = [sum(seconds(c, t) for c in updates) if t else 0.0 for t in trained]
    norms = select(collectives, BOUNDARY, "norm")
    norm = sum(scope_seconds(c.op, c.scope, NORM_BYTES, topo.num_groups, topo.group_size,
                             machine.links_for(c.op, c.scope, "native")) for c in norms)
    per_step = (len(chain) + len(updates)) * sum(1 for t in trained if t) + len(norms)
    return _Timed(gather, gather_async, reductions, boundary_first, boundary_rest, update,
                  norm, per_micro, per_step)


class _Lane:
    """One rank's communication lane: collectives run one at a time, in the order posted (the
    ports are shared, so two at once would take as long as one after the other)."""

    def __init__(self) -> None:
        self.free = 0.0

    def post(self, now: float, seconds: float) -> float:
        """A collective posted at ``now``; returns when it is done."""
        self.free = max(now, self.free) + seconds
        return self.free


def _forward(t: float, lane: _Lane, c: _Timed, computes: Sequence[float]) -> float:
    """One forward pass from time ``t``: the root gathered first (it wraps the model), each
    block gathered (or waited for, when prefetched) and the next one prefetched, the root's
    own arithmetic (the head) last (docs/design.md, "The engine in parts")."""
    ready: dict[int, float] = {}

    def gather(k: int, now: float) -> float:
        if not c.gather[k]:
            return now
        return ready.pop(k) if k in ready else lane.post(now, c.gather[k])

    t = gather(0, t)
    for k in range(1, len(computes)):
        t = max(t, gather(k, t))
        if k + 1 < len(computes) and c.gather[k + 1] and c.gather_async[k + 1]:
            ready[k + 1] = lane.post(t, c.gather[k + 1])
        t += computes[k]
    return t + computes[0]


def _simulate(c: _Timed, fwd: Sequence[float], bwd: Sequence[float], num_micro: int,
              system: Overlap) -> tuple[float, float]:
    """One optimizer step on one compute stream and one lane ([Note: the step-time model]):
    when the last backward ends and when ``step()`` does."""
    lane = _Lane()
    units = len(fwd)
    in_flight: list[tuple[float, list[int], bool]] = []  # done at, units, of the last micro
    started: dict[int, float] = {}  # unit -> when its boundary's first collective is done
    grads_reduced = bool(c.reductions)

    def start_boundary(members: list[int], now: float) -> None:
        for k in members:
            if c.boundary_first[k] and system.boundary_in_backward:
                started[k] = lane.post(now, c.boundary_first[k])

    def finish_oldest(now: float) -> float:
        done, members, last = in_flight.pop(0)
        now = max(now, done)
        if last:
            start_boundary(members, now)
        return now

    def post(members: list[int], secs: float, async_: bool, now: float, last: bool) -> float:
        in_flight.append((lane.post(now, secs), members, last))
        cap = system.reductions_in_flight if async_ else 0
        while len(in_flight) > cap:
            now = finish_oldest(now)
        return now

    t = 0.0
    for micro in range(num_micro):
        last = micro == num_micro - 1
        t = _forward(t, lane, c, fwd)
        # Backward: the root's head first, then the blocks in reverse, each prefetching the one
        # before it; a unit's gradient goes out as it finishes (alone or closing a bucket).
        ready: dict[int, float] = {}
        t = lane.post(t, c.gather[0]) if c.gather[0] else t
        t += bwd[0]
        full = {r[0][-1]: r for r in c.reductions if r[3]}
        for k in [*range(units - 1, 0, -1), 0]:
            if k:
                if c.gather[k]:
                    t = max(t, ready.pop(k) if k in ready else lane.post(t, c.gather[k]))
                if k > 1 and c.gather[k - 1] and c.gather_async[k - 1]:
                    ready[k - 1] = lane.post(t, c.gather[k - 1])
                t += bwd[k]
            if not grads_reduced and last:  # the accumulator is complete at post-backward
                start_boundary([k], t)
            if k in full:
                members, secs, async_, _ = full[k]
                t = post(members, secs, async_, t, last)
        for members, secs, async_, closed in c.reductions:  # the open bucket goes at the end
            if not closed:
                t = post(members, secs, async_, t, last)
    backward_end = t
    while in_flight:  # step(): every reduction in flight, then the boundary and the update
        t = finish_oldest(t)
    for k in range(units):
        if c.boundary_first[k]:
            t = max(t, started.pop(k) if k in started else lane.post(t, c.boundary_first[k]))
        if c.boundary_rest[k]:
            t = lane.post(t, c.boundary_rest[k])
    if c.norm:
        t = lane.post(t, c.norm)
    for k in range(units):
        if c.update[k]:
            t = lane.post(t, c.update[k])
    return backward_end, t


# -- the model -------------------------------------------------------------------------------
def forward_time(strategy: Strategy, w: Workload, topo: Topology, machine: Machine,
                 micro_batch: int, algorithm: str = "native", system: Overlap = ENGINE
                 ) -> StepTime:
    """One forward of ``micro_batch`` sequences without gradients (an inference pass); only the
    P level of ``strategy`` matters."""
    c = _timed(Strategy(strategy.params), w, topo, machine, algorithm, system)
    computes = [micro_batch * f / machine.flops for f in w.flops]
    total = _forward(0.0, _Lane(), c, computes)
    compute = sum(computes)
    return StepTime(total, compute, total - compute, max(0.0, compute + sum(c.gather) - total),
                    {"forward": sum(c.gather)}, round(c.per_micro / 2), micro_batch, 1)


def gather_seconds(strategy: Strategy, w: Workload, topo: Topology, machine: Machine,
                   algorithm: str = "native") -> float:
    """Every unit gathered once, inline: the engine's ``gathered()`` (to generate on the
    parameters) or ``unit_parameters()`` (a sync into a rollout engine's copy, a unit at a
    time). Both wait for each gather before anything runs, so neither hides one."""
    return sum(_timed(Strategy(strategy.params), w, topo, machine, algorithm, ENGINE).gather)


def step_time(strategy: Strategy, w: Workload, topo: Topology, machine: Machine,
              micro_batch: int, num_micro: int, algorithm: str = "native",
              system: Overlap = ENGINE) -> StepTime:
    """One optimizer step of ``num_micro`` micro-batches of ``micro_batch`` sequences, run as
    ``system`` overlaps it (this engine by default; [Note: reductions of other systems])."""
    c = _timed(strategy, w, topo, machine, algorithm, system)
    fwd = [micro_batch * f / machine.flops for f in w.flops]
    bwd = []
    for k, (u, f) in enumerate(zip(w.units, fwd)):
        trained = u.trainable / (u.trainable + u.frozen) if u.trainable + u.frozen else 0.0
        recompute = f if w.checkpointing and k > 0 else 0.0
        bwd.append(f * (1.0 + trained) + recompute)
    backward_end, total = _simulate(c, fwd, bwd, num_micro, system)
    by_phase = {"forward": num_micro * sum(c.gather),
                "backward": num_micro * (sum(c.gather) + sum(r[1] for r in c.reductions)),
                "boundary": sum(c.boundary_first) + sum(c.boundary_rest) + c.norm,
                "update": sum(c.update)}
    compute = num_micro * (sum(fwd) + sum(bwd))
    hidden = max(0.0, compute + sum(by_phase.values()) - total)
    return StepTime(total, compute, total - compute, hidden, by_phase,
                    round(num_micro * c.per_micro + c.per_step), micro_batch, num_micro,
                    total - backward_end)


# -- memory ----------------------------------------------------------------------------------
class Memory(NamedTuple):
    """Peak bytes of one model on one device, its states included."""

    states: int  # P + G + OS (cost.memory, the paper's Table 2)
    train: float  # while training (states alone for a frozen model)
    inference: float  # in a forward without gradients
    gathered: float  # with every unit gathered at once (``gathered()``, to generate)
    # With its largest unit gathered (``unit_parameters()``, to sync a rollout engine's copy).
    unit: float


def peak_memory(strategy: Strategy, w: Workload, topo: Topology, micro_batch: int) -> Memory:
    """[Note: activation memory]."""
    held = memory(strategy, w.units, topo.num_ranks, topo.group_size, w.precision,
                  grad_bytes=w.grad_bytes)
    states = held["params"] + held["grads"] + held["optim"]
    e = bytes_per_element(w.precision)
    n = topo.num_ranks
    sizes = [padded(u.trainable, n) + padded(u.frozen, n) for u in w.units]
    gathered = full = unit = 0.0
    if strategy.params != Level.N:
        gathered = e * (sizes[0] + sum(sorted(sizes[1:], reverse=True)[:2]))
        full = e * sum(sizes) - held["params"]
        unit = e * max(sizes)
    inference = states + gathered + micro_batch * w.inference_bytes
    if strategy.frozen:
        return Memory(states, states, inference, states + full, states + unit)
    r = bytes_per_element(w.reduce_dtype)
    trained = [padded(u.trainable, n) for u in w.units]
    activations = micro_batch * (w.saved_bytes + w.working_bytes) + gathered \
        + (e + r) * max(trained)
    boundary = (4 * sum(trained) / ways(strategy.optim, topo)
                + r * max(trained) / ways(strategy.grads, topo))
    return Memory(states, states + max(activations, boundary), inference, states + full,
                  states + unit)


def max_micro_batch(strategy: Strategy, w: Workload, topo: Topology, budget: float,
                    allowed: Sequence[int], inference: bool = False) -> int | None:
    """The largest of ``allowed`` micro-batch sizes whose peak fits in ``budget`` bytes."""
    def peak(b: int) -> float:
        mem = peak_memory(strategy, w, topo, b)
        return mem.inference if inference else mem.train
    fits = [b for b in allowed if peak(b) <= budget]
    return max(fits) if fits else None
