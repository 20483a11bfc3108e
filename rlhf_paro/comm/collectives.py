"""The one place every collective of the engine goes through.

Scopes: ``intra`` (the M ranks of this rank's group, buffers in local-rank order), ``inter`` (the
g ranks with this rank's local index, buffers in group order) and ``world`` (all N ranks, buffers
in the nested chunk order). World-scope all-gather and reduce-scatter run on the selected
algorithm (``native`` or one of ``rings.ALGORITHMS``); everything else runs natively.
Every call is recorded in the ``CommMeter`` with the bytes this rank sent on each kind of link.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

from rlhf_paro.comm import rings
from rlhf_paro.comm.meter import ALGORITHM_NAMES, CommMeter, LinkBytes, native_bytes

if TYPE_CHECKING:  # sharding imports comm; only the type is needed here
    from rlhf_paro.sharding.topology import Topology

SCOPES = ("intra", "inter", "world")


# gloo and NCCL name these differently across torch releases.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Pending:
    """A collective in flight. ``wait()`` finishes it (reorders world buffers, meters it)."""

    def __init__(self, work: Any, finish: Callable[[], None]) -> None:
        self._work = work
        self._finish = finish
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        if self._work is not None:
            self._work.wait()
        self._finish()
        self.done = True


class Communicator:
    """Collectives of one model on this rank, on its three groups, metered."""

    def __init__(self, topology: Topology, meter: CommMeter | None = None,
                 algorithm: str = "native") -> None:
        if algorithm not in ALGORITHM_NAMES:
            raise ValueError(
                f"comm.algorithm={algorithm!r} is unknown; allowed: {', '.join(ALGORITHM_NAMES)}"
            )
        self.topo = topology
        self.meter = meter if meter is not None else CommMeter()
        self.algorithm = algorithm

    # -- helpers -----------------------------------------------------------------------------
    def size(self, scope: str) -> int:
        t = self.topo
        return {"intra": t.group_size, "inter": t.num_groups, "world": t.num_ranks}[scope]

    def _group(self, scope: str) -> Any:
        return {"intra": self.topo.intra, "inter": self.topo.inter, "world": self.topo.world}[scope]

    def _native_bytes(self, op: str, numel: int, elem_size: int, scope: str) -> LinkBytes:
        return native_bytes(op, numel, elem_size, scope, self.topo)

    def _world_is_nested(self) -> bool:
        # With one group or groups of one, rank order and nested order coincide.
        return self.topo.num_groups == 1 or self.topo.group_size == 1

    # -- collectives -------------------------------------------------------------------------
    @torch.no_grad()
    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, scope: str, phase: str,
                   async_op: bool = False) -> Pending:
        """Fill ``out`` (n * shard.numel()) with every rank's ``shard`` in the scope's order."""
        n = self.size(scope)
        start = time.perf_counter()
        if n == 1:
            out.copy_(shard)
            return _done()
        if scope == "world" and self.algorithm != "native":
            sent = rings.ALGORITHMS[self.algorithm].all_gather(out, shard, self.topo)
            self.meter.record(phase, "all_gather", scope, self.algorithm, sent,
                              time.perf_counter() - start)
            return _done()
        reorder = scope == "world" and not self._world_is_nested()
        target = torch.empty_like(out) if reorder else out
        work = _all_gather_single(target, shard.contiguous(), group=self._group(scope),
                                  async_op=async_op)
        sent = self._native_bytes("all_gather", out.numel(), out.element_size(), scope)

        def finish() -> None:
            if reorder:
                out.copy_(self.topo.world_to_nested(target))
            self.meter.record(phase, "all_gather", scope, "native", sent,
                              time.perf_counter() - start)

        pending = Pending(work if async_op else None, finish)
        if not async_op:
            pending.wait()
        return pending

    @torch.no_grad()
    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, scope: str, phase: str) -> None:
        """Sum ``full`` over the scope's ranks and keep this rank's chunk in ``out``."""
        n = self.size(scope)
        start = time.perf_counter()
        if n == 1:
            out.copy_(full)
            return
        if scope == "world" and self.algorithm != "native":
            sent = rings.ALGORITHMS[self.algorithm].reduce_scatter(out, full, self.topo)
            self.meter.record(phase, "reduce_scatter", scope, self.algorithm, sent,
                              time.perf_counter() - start)
            return
        if scope == "world" and not self._world_is_nested():
            full = self.topo.nested_to_world(full)
        _reduce_scatter_single(out, full.contiguous(), group=self._group(scope))
        sent = self._native_bytes("reduce_scatter", full.numel(), full.element_size(), scope)
        self.meter.record(phase, "reduce_scatter", scope, "native", sent,
                          time.perf_counter() - start)

    @torch.no_grad()
    def all_reduce(self, buf: torch.Tensor, scope: str, phase: str) -> None:
        """Sum ``buf`` in place over the scope's ranks (always native: no order to keep)."""
        if self.size(scope) == 1:
            return
        start = time.perf_counter()
        dist.all_reduce(buf, group=self._group(scope))
        sent = self._native_bytes("all_reduce", buf.numel(), buf.element_size(), scope)
        self.meter.record(phase, "all_reduce", scope, "native", sent, time.perf_counter() - start)


def _done() -> Pending:
    pending = Pending(None, lambda: None)
    pending.done = True
    return pending
