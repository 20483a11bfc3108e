"""The schedule of all 14 strategies as one table, run by the engine and dry-run by the cost model.

[Note: the schedule]
A collective moves a buffer between two sharding levels. Two rules say on which scope:
  - a level change (all-gather to a coarser level, reduce-scatter to a finer one) runs on the
    scope that separates the two levels: N <-> I on ``intra``, I <-> G on ``inter``,
    N <-> G on ``world`` (the nested chunk order of ``comm/topology.py`` makes each of these
    one collective);
  - an all-reduce runs either over the *replicas* of a level (the ranks holding the same
    shard: ``world`` for N, ``inter`` for I, none for G) or over its *shards* (the ranks holding
    disjoint pieces: none for N, ``intra`` for I, ``world`` for G).
``SCHEDULE`` then lists, in order, what a unit does in each phase, with levels named by the
strategy's letters (P, G, OS) or N (the full buffer). ``plan(strategy)`` resolves the letters and
drops rows that move nothing (the same level on both sides, or a scope of one rank); the engine
executes the result and ``cost.traffic`` runs the same plan on a communicator that only counts.
Adding a phase or a step is one row; a strategy is three letters.

How the rows reproduce the paper's Table 3 for every strategy (docs/design.md, "The schedule"):
forward and backward gather P on its scope; backward reduce-scatters each micro-batch's full
gradient to the G level; the boundary reduce-scatters the G-level sum to the OS level and
all-reduces it over the OS level's replicas, which is the G -> OS table (e.g. N -> I is a
reduce-scatter on intra then an all-reduce on inter; I -> G the two-step reduce-scatter of the
paper's equation 1); the gradient norm is summed over the OS level's shards, so every element
counts once; the update all-gathers the new OS shard back to the P level.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Sequence

from rlhf_paro.comm.meter import BACKWARD, BOUNDARY, FORWARD, UPDATE
from rlhf_paro.sharding.strategy import Level, Strategy

if TYPE_CHECKING:
    import torch

    from rlhf_paro.comm.collectives import Communicator
    from rlhf_paro.comm.topology import Topology

_TRANSITION_SCOPES = {
    frozenset((Level.N, Level.I)): "intra",
    frozenset((Level.I, Level.G)): "inter",
    frozenset((Level.N, Level.G)): "world",
}
_REPLICA_SCOPES = {Level.N: "world", Level.I: "inter", Level.G: None}
_SHARD_SCOPES = {Level.N: None, Level.I: "intra", Level.G: "world"}


def transition_scope(a: Level, b: Level) -> str | None:
    """The scope of a collective that moves a buffer between levels ``a`` and ``b``."""
    return None if a == b else _TRANSITION_SCOPES[frozenset((a, b))]


def ways(level: Level, topo: Topology) -> int:
    """Over how many ranks a level cuts a buffer."""
    scope = transition_scope(Level.N, level)
    return 1 if scope is None else topo.scope_size(scope)


@dataclass(frozen=True)
class Row:
    """One line of the schedule table, with levels named by letter."""

    phase: str  # forward, backward, boundary, update (comm.meter.PHASES)
    op: Literal["all_gather", "reduce_scatter", "all_reduce"]
    # The buffer it moves: every flat buffer of a unit (params), the trainable one (trained),
    # the trainable buffer's gradient (grads), or the squared gradient norm (norm).
    what: Literal["params", "trained", "grads", "norm"]
    src: str  # "P", "G", "OS" (the strategy's levels) or "N" (the full buffer)
    dst: str
    per: Literal["micro", "step"]  # every micro-batch, or once per optimizer step
    over: Literal["replicas", "shards", ""] = ""  # all-reduce only: over which ranks of src
    trained: bool = True  # only for trained models (frozen models run the forward rows only)


SCHEDULE: tuple[Row, ...] = (
    Row(FORWARD, "all_gather", "params", "P", "N", "micro", trained=False),
    Row(BACKWARD, "all_gather", "params", "P", "N", "micro"),
    Row(BACKWARD, "reduce_scatter", "grads", "N", "G", "micro"),
    Row(BOUNDARY, "reduce_scatter", "grads", "G", "OS", "step"),
    Row(BOUNDARY, "all_reduce", "grads", "OS", "OS", "step", over="replicas"),
    Row(BOUNDARY, "all_reduce", "norm", "OS", "OS", "step", over="shards"),
    Row(UPDATE, "all_gather", "trained", "OS", "P", "step"),
)
TRAINING_PHASES = tuple(dict.fromkeys(row.phase for row in SCHEDULE))


@dataclass(frozen=True)
class Collective:
    """A row of the schedule resolved for one strategy: a collective on one scope."""

    phase: str
    op: str
    what: str
    scope: str
    src: Level
    dst: Level
    per: str


def _level(strategy: Strategy, letter: str) -> Level:
    return {"P": strategy.params, "G": strategy.grads, "OS": strategy.optim,
            "N": Level.N}[letter]


def plan(strategy: Strategy) -> tuple[Collective, ...]:
    """The collectives ``strategy`` runs, in schedule order (no-op rows dropped)."""
    out = []
    for row in SCHEDULE:
        if strategy.frozen and row.trained:
            continue
        src, dst = _level(strategy, row.src), _level(strategy, row.dst)
        if row.op == "all_reduce":
            scope = (_REPLICA_SCOPES if row.over == "replicas" else _SHARD_SCOPES)[src]
        else:
            scope = transition_scope(src, dst)
        if scope is not None:
            out.append(Collective(row.phase, row.op, row.what, scope, src, dst, row.per))
    return tuple(out)


# [Note: gradient buckets]
# A unit whose trainable buffer has fewer than BUCKET_NUMEL elements (a LoRA block, a norm, a
# small head) does not reduce its gradient alone: units finishing backward one after another join
# a bucket until it holds BUCKET_NUMEL elements, and the bucket runs one reduce-scatter. Each
# member's buffer is n chunks (padded to N), so the bucket is laid out chunk by chunk (chunk k of
# every member, in order) and rank k's result is its chunk of every member, in order: the same
# numbers as the members' own reduce-scatters, in one message per peer instead of one per unit
# and peer. Bytes are linear in the size, so the bucket sends what its members would have.
# 1 Mi elements (4 MiB in fp32): a transformer block of hidden 256 or more is larger and goes
# alone as soon as its backward is over; LoRA adapters, norms and value heads are smaller.
# ``buckets`` is the rule, which the cost model runs too; the engine applies it as units finish.
BUCKET_NUMEL = 1 << 20


def buckets(sizes: Sequence[int], bucket_numel: int = BUCKET_NUMEL) -> list[list[int]]:
    """Which gradient reductions run together ([Note: gradient buckets]): indices into
    ``sizes`` (the trainable buffers' sizes, in the order their backward finishes), grouped.
    A unit of at least ``bucket_numel`` elements goes alone when it finishes; a smaller one
    joins the open bucket, which runs once it holds ``bucket_numel`` elements, or at the end of
    the backward pass. Units with no trainable elements are in no bucket."""
    out: list[list[int]] = []
    open_bucket: list[int] = []
    held = 0
    for index, size in enumerate(sizes):
        if size <= 0:
            continue
        if size >= bucket_numel:
            out.append([index])
            continue
        open_bucket.append(index)
        held += size
        if held >= bucket_numel:
            out.append(open_bucket)
            open_bucket, held = [], 0
    if open_bucket:
        out.append(open_bucket)
    return out


def select(collectives: tuple[Collective, ...], phase: str, what: str) -> list[Collective]:
    return [c for c in collectives if c.phase == phase and c.what == what]


def run(collectives: list[Collective], tensor: torch.Tensor, comm: Communicator,
        out: torch.Tensor | None = None) -> torch.Tensor:
    """Run a chain of collectives on ``tensor`` and return the result (``out`` if given, which
    receives the last collective's result). All-reduces work in place; a reduce-scatter or an
    all-gather makes a tensor of its output level's size."""
    for k, c in enumerate(collectives):
        last = k == len(collectives) - 1
        if c.op == "all_reduce":
            comm.all_reduce(tensor, c.scope, c.phase)
            continue
        n = comm.size(c.scope)
        numel = tensor.numel() // n if c.op == "reduce_scatter" else tensor.numel() * n
        result = out if last and out is not None else tensor.new_empty(numel)
        if c.op == "reduce_scatter":
            comm.reduce_scatter(result, tensor, c.scope, c.phase)
        else:
            comm.all_gather(result, tensor, c.scope, c.phase)
        tensor = result
    if out is not None and tensor is not out:
        out.copy_(tensor)
        return out
    return tensor
