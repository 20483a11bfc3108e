"""One record per collective: which model, which phase, which links, how many bytes, how long.

Bytes are what *this rank sent*. Native collectives are attributed by the ring model (the
algorithm NCCL and gloo use for large buffers): on a group of n ranks a rank sends (n-1)/n of
the buffer for an all-gather or a reduce-scatter and 2(n-1)/n for an all-reduce. On the world
ring, whose ranks are in rank order, a rank sends across groups exactly when its successor is
in another group, i.e. when it is the last rank of its group and there is more than one group:
g of the N ranks send on inter links and N-g on intra links.
"""

from __future__ import annotations

from typing import NamedTuple

from rlhf_paro.comm.topology import Topology

# The algorithms a collective can run on: native collectives or a schedule of comm/rings.py (its
# ALGORITHMS, held to this list at import). comm.algorithm takes one of them, or AUTO: one of
# them per collective, by comm/auto.py. Kept here, torch-free, so that the config checks it
# without importing torch.
ALGORITHM_NAMES = ("native", "ring", "hring", "horing", "horing_pipelined")
AUTO = "auto"
ALGORITHM_CHOICES = (AUTO, *ALGORITHM_NAMES)  # the values of comm.algorithm

# The phases a collective is metered under, the <phase> of m/comm/<phase>/* (docs/design.md,
# "Metrics"). The schedule's four come first, in the order of a step (sharding/schedule.py's rows
# name them); the others happen outside a training step.
FORWARD, BACKWARD, BOUNDARY, UPDATE = "forward", "backward", "boundary", "update"
GENERATE = "generate"  # every unit gathered for the actor's generation
SYNC = "sync"  # every unit gathered, one at a time, into the actor's rollout engine
TRANSFER = "transfer"  # the gathered weights sent on to rollout replicas on devices of their own
# A LoRA actor's base weights, gathered (BASE_SYNC) and sent on to replicas (BASE_TRANSFER) once,
# for engines that take only its adapters at each sync after that.
BASE_SYNC, BASE_TRANSFER = "base_sync", "base_transfer"
GATHER = "gather"  # every unit gathered for anything else: a full state dict, an export
VERIFY = "verify"  # checksums of gathered chunks (verify_gathers)
CHECKPOINT = "checkpoint"  # a DeepSpeed model saving or loading its own checkpoint
OTHER = "other"  # a DeepSpeed collective outside the engine's calls (its setup)
PHASES = (FORWARD, BACKWARD, BOUNDARY, UPDATE, GENERATE, SYNC, TRANSFER, BASE_SYNC, BASE_TRANSFER,
          GATHER, VERIFY, CHECKPOINT, OTHER)


class CommRecord(NamedTuple):
    model: str
    phase: str
    op: str  # all_gather, reduce_scatter, all_reduce
    scope: str  # intra, inter, world
    algorithm: str  # the one that ran (never "auto")
    intra_bytes: int
    inter_bytes: int
    seconds: float


class LinkBytes(NamedTuple):
    """Bytes one rank sends on intra-group and on inter-group links in one collective."""

    intra: int
    inter: int


def ring_bytes(op: str, numel: int, elem_size: int, group_ranks: int) -> int:
    """Bytes a rank sends in a ring collective on ``group_ranks`` ranks; the buffer is cut in
    ``group_ranks`` chunks of ceil(numel / group_ranks) elements (the last one padded)."""
    if group_ranks <= 1:
        return 0
    chunk = -(-numel // group_ranks) * elem_size
    steps = group_ranks - 1
    if op == "all_reduce":
        return 2 * steps * chunk
    if op in ("all_gather", "reduce_scatter"):
        return steps * chunk
    raise ValueError(f"unknown collective {op!r}; allowed: all_gather, reduce_scatter, all_reduce")


def sends_across_groups(topo: Topology) -> bool:
    """Whether this rank's successor on the world ring (rank order) is in another group."""
    return topo.num_groups > 1 and topo.local_index == topo.group_size - 1


def native_bytes(op: str, numel: int, elem_size: int, scope: str, topo: Topology) -> LinkBytes:
    """What this rank sends in a native collective on ``scope``, by the ring model."""
    sent = ring_bytes(op, numel, elem_size, topo.scope_size(scope))
    crosses = scope == "inter" or (scope == "world" and sends_across_groups(topo))
    return LinkBytes(0, sent) if crosses else LinkBytes(sent, 0)


class CommMeter:
    """Collects a ``CommRecord`` per collective of one model on this rank."""

    def __init__(self, model: str = "model") -> None:
        self.model = model
        self.records: list[CommRecord] = []

    def record(self, phase: str, op: str, scope: str, algorithm: str, sent: LinkBytes,
               seconds: float) -> None:
        self.records.append(CommRecord(self.model, phase, op, scope, algorithm, int(sent.intra),
                                       int(sent.inter), float(seconds)))

    def totals(self, phase: str | None = None) -> dict[str, float]:
        rows = [r for r in self.records if phase is None or r.phase == phase]
        return {
            "intra_bytes": sum(r.intra_bytes for r in rows),
            "inter_bytes": sum(r.inter_bytes for r in rows),
            "calls": len(rows),
            "seconds": sum(r.seconds for r in rows),
        }

    def by_phase(self) -> dict[str, dict[str, float]]:
        return {phase: self.totals(phase) for phase in dict.fromkeys(r.phase for r in self.records)}

    def reset(self) -> None:
        self.records.clear()
