"""The one place every collective of the engine goes through, and its dry run.

Scopes: ``intra`` (the M ranks of this rank's group, buffers in local-rank order), ``inter`` (the
g ranks with this rank's local index, buffers in group order) and ``world`` (all N ranks, buffers
in the nested chunk order). World-scope all-gather and reduce-scatter run on the selected
algorithm (``native``, one of ``rings.ALGORITHMS``, or ``auto``: one of those per collective by
``comm.auto``); everything else runs natively. Every call is recorded in the ``CommMeter`` with
the algorithm that ran and the bytes this rank sent on each kind of link.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from rlhf_paro.comm import rings
from rlhf_paro.comm.auto import resolve
from rlhf_paro.comm.meter import ALGORITHM_CHOICES, VERIFY, CommMeter, LinkBytes, native_bytes
from rlhf_paro.comm.topology import Topology


# gloo and NCCL name these differently across torch releases.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def predicted_bytes(algorithm: str, op: str, numel: int, elem_size: int, scope: str,
                    topo: Topology) -> LinkBytes:
    """Bytes this rank sends in ``op`` on ``numel`` elements of ``scope``: the closed form of
    the algorithm that runs it (``comm.auto.resolve``) for world all-gathers and
    reduce-scatters, the ring model of ``comm.meter`` for everything native. The communicator
    meters what this says, and so does its dry run: the cost model cannot count differently
    from the engine."""
    name = resolve(algorithm, op, scope, numel, elem_size, topo)
    if scope == "world" and op in rings.OPS:
        return rings.predicted_world_bytes(name, op, numel, elem_size, topo)
    return native_bytes(op, numel, elem_size, scope, topo)


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
        if algorithm not in ALGORITHM_CHOICES:
            raise ValueError(f"comm.algorithm={algorithm!r} is unknown; allowed: "
                             f"{', '.join(ALGORITHM_CHOICES)}")
        self.topo = topology
        self.meter = meter if meter is not None else CommMeter()
        self.algorithm = algorithm  # comm.algorithm: a concrete one, or auto

    def size(self, scope: str) -> int:
        return self.topo.scope_size(scope)

    def _algorithm(self, op: str, scope: str, numel: int, elem_size: int) -> str:
        """The concrete algorithm that runs ``op`` on ``numel`` elements of ``scope``."""
        return resolve(self.algorithm, op, scope, numel, elem_size, self.topo)

    def _world_is_nested(self) -> bool:
        # With one group or groups of one, rank order and nested order coincide.
        return self.topo.num_groups == 1 or self.topo.group_size == 1

    def _record(self, phase: str, op: str, scope: str, algorithm: str, sent: LinkBytes,
                start: float) -> None:
        self.meter.record(phase, op, scope, algorithm, sent, time.perf_counter() - start)

    # -- collectives -------------------------------------------------------------------------
    @torch.no_grad()
    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, scope: str, phase: str,
                   async_op: bool = False) -> Pending:
        """Fill ``out`` (n * shard.numel()) with every rank's ``shard`` in the scope's order.
        With ``async_op`` the result is in ``out`` only after ``wait()`` on what this returns,
        and ``shard`` must not change until then."""
        n = self.size(scope)
        start = time.perf_counter()
        if n == 1:
            out.copy_(shard)
            return _done()
        name = self._algorithm("all_gather", scope, out.numel(), out.element_size())
        if name != "native":
            running = rings.ALGORITHMS[name].all_gather(out, shard, self.topo, async_op)
            return _pending(None, lambda: self._record(phase, "all_gather", scope, name,
                                                       running.wait(), start), async_op)
        reorder = scope == "world" and not self._world_is_nested()
        target = torch.empty_like(out) if reorder else out
        work = _all_gather_single(target, shard.contiguous(), group=self.topo.group(scope),
                                  async_op=async_op)
        sent = native_bytes("all_gather", out.numel(), out.element_size(), scope, self.topo)

        def finish() -> None:
            if reorder:
                out.copy_(self.topo.world_to_nested(target))
            self._record(phase, "all_gather", scope, name, sent, start)

        return _pending(work, finish, async_op)

    @torch.no_grad()
    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, scope: str, phase: str,
                       async_op: bool = False, overwrite: bool = False) -> Pending:
        """Sum ``full`` over the scope's ranks and keep this rank's chunk in ``out``. With
        ``async_op`` the result is in ``out`` only after ``wait()`` on what this returns, and
        ``full`` must not change until then. ``overwrite``: ``full`` is scratch that nobody
        reads again, which a ring algorithm may sum in place."""
        n = self.size(scope)
        start = time.perf_counter()
        if n == 1:
            out.copy_(full)
            return _done()
        name = self._algorithm("reduce_scatter", scope, full.numel(), full.element_size())
        if name != "native":
            running = rings.ALGORITHMS[name].reduce_scatter(out, full, self.topo, async_op,
                                                            overwrite)
            return _pending(None, lambda: self._record(phase, "reduce_scatter", scope, name,
                                                       running.wait(), start), async_op)
        if scope == "world" and not self._world_is_nested():
            full = self.topo.nested_to_world(full)
        work = _reduce_scatter_single(out, full.contiguous(), group=self.topo.group(scope),
                                      async_op=async_op)
        sent = native_bytes("reduce_scatter", full.numel(), full.element_size(), scope, self.topo)
        return _pending(work, lambda: self._record(phase, "reduce_scatter", scope, name, sent,
                                                   start), async_op)

    @torch.no_grad()
    def all_reduce(self, buf: torch.Tensor, scope: str, phase: str,
                   async_op: bool = False) -> Pending:
        """Sum ``buf`` in place over the scope's ranks (always native: no order to keep); with
        ``async_op``, the sum is there after ``wait()`` on what this returns."""
        if self.size(scope) == 1:
            return _done()
        start = time.perf_counter()
        work = dist.all_reduce(buf, group=self.topo.group(scope), async_op=async_op)
        sent = native_bytes("all_reduce", buf.numel(), buf.element_size(), scope, self.topo)
        pending = Pending(work if async_op else None,
                          lambda: self._record(phase, "all_reduce", scope, "native", sent, start))
        if not async_op:
            pending.wait()
        return pending

    @torch.no_grad()
    def checksums(self, shard: torch.Tensor, scope: str) -> torch.Tensor:
        """Every rank's fp64 sum of its ``shard``, in the scope's order (the nested order for
        the world), metered in the phase ``verify`` like any other collective."""
        own = shard.detach().double().sum().reshape(1)
        sums = own.new_empty(self.size(scope))
        self.all_gather(sums, own, scope, VERIFY)
        return sums


class DryRunCommunicator(Communicator):
    """A communicator that only counts: each call records what the real one would send, by
    ``predicted_bytes``, and moves no data (its tensors may live on the meta device). The cost
    model runs the engine's schedule on it, as the simulator runs the rings' schedules."""

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, scope: str, phase: str,
                   async_op: bool = False) -> Pending:
        self._count("all_gather", out.numel(), out.element_size(), scope, phase)
        return _done()

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, scope: str, phase: str,
                       async_op: bool = False) -> Pending:
        self._count("reduce_scatter", full.numel(), full.element_size(), scope, phase)
        return _done()

    def all_reduce(self, buf: torch.Tensor, scope: str, phase: str,
                   async_op: bool = False) -> Pending:
        self._count("all_reduce", buf.numel(), buf.element_size(), scope, phase)
        return _done()

    def _count(self, op: str, numel: int, elem_size: int, scope: str, phase: str) -> None:
        if self.size(scope) > 1:
            sent = predicted_bytes(self.algorithm, op, numel, elem_size, scope, self.topo)
            self.meter.record(phase, op, scope, self._algorithm(op, scope, numel, elem_size),
                              sent, 0.0)


def _pending(work: Any, finish: Callable[[], None], async_op: bool) -> Pending:
    """A collective posted as ``work``; finished now unless ``async_op``."""
    pending = Pending(work, finish)
    if not async_op:
        pending.wait()
    return pending


def _done() -> Pending:
    pending = Pending(None, lambda: None)
    pending.done = True
    return pending
