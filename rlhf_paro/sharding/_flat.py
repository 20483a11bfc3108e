"""A unit's trainable or frozen parameters as one padded flat buffer, and its gather and free.

The buffer holds S elements (the parameters' total padded to a multiple of N), cut into N chunks
in the nested order of ``comm/topology.py``. ``shard`` is this rank's P-level slice, kept all the
time; ``full`` is the gathered buffer, whose storage exists only while the unit is gathered
(always for P = N, where ``full`` is the shard). The module's parameters are views into ``full``.

[Note: filling a buffer]  (docs/design.md, "Setup")
A buffer is filled from ``read(name, start, stop)``, elements start..stop of a flattened
parameter: the parameters' own values, or files when the module was built on the meta device.
Only what this rank keeps is read, straight into the P shard (and, for a bf16 model that trains
it, into the fp32 master at the OS level), a piece of one parameter at a time, each piece at
most S * (bytes of the precision) / 4 elements: a read of up to 4 bytes an element never holds
more than the gathered buffer would. The gathered buffer is allocated only after the reads, and
freed at once (P != N). So filling a buffer costs at most the buffer gathered on top of what the
strategy keeps. ``copy_`` does the one rounding to the buffer's precision, the same as widening
to fp32 first and then rounding.

[Note: gradients land in flat buffers]  (docs/design.md, "The unit lifecycle")
The reductions read a unit's gradient as one padded flat buffer. For an fp32 model whose
gradients stay at the N level, every trained parameter's ``.grad`` is made a view of the fp32
accumulator when the unit's backward begins (``attach_grads``), and autograd, which adds into an
existing ``.grad`` in place, sums the micro-batches there without any pass of our own (the
division by N waits for the step). Otherwise ``.grad`` is left unset: autograd hands each
parameter the gradient tensor it computed, without a copy, and when the unit's backward ends
``take_grad`` copies them into a scratch buffer (kept for the next micro-batch on a CPU: [Note:
a pool of gradient buffers] in _pool.py), one pass over the unit's gradient. A zeroed buffer
attached in advance would cost three: zeroing it, and autograd's in-place addition reading both
operands (0 + g is g exactly, so the numbers are the same bits either way). Sampled with perf on
4 gloo ranks (NGG, hidden 256, s = 2; 1.6 s of CPU per step over the ranks), copying instead
saves 33 ms of zeroing, 31 ms of additions and 40 ms of the kernel clearing fresh pages, and
costs 28 ms of copies. The price: a unit's gradients exist twice while they are copied, one unit
at a time. A gradient that autograd put outside an attached accumulator (``.grad`` reset
meanwhile, or the unit's backward began without its hook) is added in when the unit's backward
ends.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from rlhf_paro.comm.collectives import Communicator, Pending
from rlhf_paro.comm.topology import Topology
from rlhf_paro.sharding._host import Transfers, host_zeros
from rlhf_paro.sharding.errors import EngineError
from rlhf_paro.sharding.layout import padded
from rlhf_paro.sharding.schedule import Collective, transition_scope
from rlhf_paro.sharding.strategy import Level


# Parameter and reduction precisions by name (config values, cost model, engine).
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# (parameter name, start, stop) -> elements start..stop of the flattened parameter, any dtype.
Read = Callable[[str, int, int], torch.Tensor]


class FlatBuffer:
    """The trainable or the frozen parameters of one unit as one padded flat buffer."""

    def __init__(self, params: list[nn.Parameter], names: list[str], topo: Topology,
                 p_level: Level, dtype: torch.dtype, gather: Collective | None, *,
                 read: Read, device: torch.device, master_level: Level | None = None,
                 master_on_host: bool = False, host_copy: bool = False) -> None:
        self.params = params
        self.names = names  # the parameters' qualified names: what a checkpoint is keyed by
        self.topo = topo
        self.p_level = p_level
        self.gather_op = gather  # the schedule's P -> N all-gather; None for P = N
        self.shapes = [p.shape for p in params]
        self.numels = [p.numel() for p in params]
        self.offsets = [sum(self.numels[:k]) for k in range(len(params))]
        self.numel = sum(self.numels)
        self.size = padded(self.numel, topo.num_ranks)  # S
        self.device = device
        # [Note: filling a buffer] The shard first, then the master, then the gathered buffer.
        most = max(1, self.size * dtype.itemsize // 4)  # elements read at a time, at most
        self.shard = self._filled(self.level_slice(p_level), dtype, read, most)
        # fp32 OS shard of a bf16 model's trained values, until the optimizer takes it as master;
        # read straight into host memory when the optimizer lives there (offload=optimizer).
        self.master: torch.Tensor | None = (
            None if master_level is None
            else self._filled(self.level_slice(master_level), torch.float32, read, most,
                              on_host=master_on_host))
        self.full = self.shard if p_level == Level.N else torch.empty(
            self.size, dtype=dtype, device=device)
        for p, off, n, shape in zip(params, self.offsets, self.numels, self.shapes):
            _point(p, self.full[off:off + n].view(shape))
        self.storage_bytes = self.size * self.full.element_size()
        self.gathered = p_level == Level.N
        self.pending: Pending | None = None  # a gather in flight into ``full``
        if p_level != Level.N:
            self.full.untyped_storage().resize_(0)
        # The P shard's home in host memory (offload=params; _host.py, [Note: offload modes]).
        self.host = host_zeros(self.shard.numel(), dtype, device) if host_copy else None
        self.parked = False  # the P shard is in ``host`` and its device storage is freed
        self.grad: torch.Tensor | None = None  # where autograd adds this pass's gradients
        self._grad_is_acc = False  # ``grad`` is the unit's accumulator (attach_grads(into=...))

    def _filled(self, span: slice, dtype: torch.dtype, read: Read, most: int,
                on_host: bool = False) -> torch.Tensor:
        """Elements ``span`` of the flat buffer (in host memory with ``on_host``), read
        ``most`` elements at most at a time; the padding is zero."""
        numel = span.stop - span.start
        out = (host_zeros(numel, dtype, self.device) if on_host
               else torch.zeros(numel, dtype=dtype, device=self.device))
        for name, first, last, at in self.pieces(span):
            for start in range(first, last, most):
                stop = min(last, start + most)
                values = read(name, start, stop)
                if values.numel() != stop - start:
                    raise EngineError(f"parameter {name!r}: elements {start}..{stop} came as "
                                      f"{values.numel()} values")
                out[at + start - first:at + stop - first].copy_(values.reshape(-1))
        return out

    def pieces(self, span: slice) -> list[tuple[str, int, int, int]]:
        """The parameters that the flat range ``span`` crosses, as (name, start, stop, at):
        elements start..stop of the flattened parameter lie at offset ``at`` of the range."""
        out = []
        for name, offset, numel in zip(self.names, self.offsets, self.numels):
            lo, hi = max(span.start, offset), min(span.stop, offset + numel)
            if lo < hi:
                out.append((name, lo - offset, hi - offset, lo - span.start))
        return out

    # -- the nested layout -------------------------------------------------------------------
    def level_slice(self, level: Level) -> slice:
        """This rank's shard at ``level`` inside the full buffer (contiguous in nested order)."""
        t = self.topo
        scope = transition_scope(Level.N, level)
        if scope is None:
            return slice(0, self.size)
        if scope == "intra":
            block = self.size // t.group_size
            return slice(t.local_index * block, (t.local_index + 1) * block)
        chunk = self.size // t.num_ranks
        start = t.chunk_index() * chunk
        return slice(start, start + chunk)

    def within_shard(self, level: Level) -> slice:
        """Where this rank's shard at a level finer than P lies inside its P shard."""
        inner, outer = self.level_slice(level), self.level_slice(self.p_level)
        return slice(inner.start - outer.start, inner.stop - outer.start)

    # -- gather and free ---------------------------------------------------------------------
    def start_gather(self, comm: Communicator, phase: str, async_op: bool) -> None:
        if self.gathered or self.pending is not None:
            return
        self.full.untyped_storage().resize_(self.storage_bytes)
        op = self.gather_op
        self.pending = comm.all_gather(self.full, self.shard, op.scope, phase, async_op=async_op)

    def finish_gather(self) -> bool:
        """Wait for the gather in flight; True when one completed now."""
        if self.pending is None:
            return False
        self.pending.wait()
        self.pending = None
        self.gathered = True
        return True

    def free(self) -> None:
        if self.p_level == Level.N:
            return
        self.finish_gather()  # never free a buffer a collective is still writing
        if self.gathered:
            self.full.untyped_storage().resize_(0)
            self.gathered = False

    # -- offload=params ----------------------------------------------------------------------
    def park(self, transfers: Transfers) -> None:
        """Copy the P shard to its host home and free its device storage (for P = N that is
        the gathered buffer the module's parameters point into). The tensor keeps its identity:
        the parameters' views and an fp32 master view of it stay valid after ``unpark``."""
        if self.parked:
            return
        self.free()
        transfers.to_host(self.host, self.shard)
        self.shard.untyped_storage().resize_(0)
        self.parked = True

    def unpark(self, transfers: Transfers) -> None:
        if not self.parked:
            return
        self.shard.untyped_storage().resize_(self.shard.numel() * self.shard.element_size())
        transfers.to_device(self.shard, self.host)
        self.parked = False

    @property
    def p_values(self) -> torch.Tensor:
        """The P shard where it lives now: host memory while parked, else the device."""
        return self.host if self.parked else self.shard

    # -- gradients: [Note: gradients land in flat buffers] ------------------------------------
    def attach_grads(self, accumulator: torch.Tensor) -> None:
        """Point every parameter's ``.grad`` at its slice of ``accumulator``, the unit's padded
        fp32 accumulator of S elements, for a model whose gradients stay at the N level:
        autograd then adds each gradient into it in place. No-op when already attached."""
        if self.grad is not None:
            return
        self.grad = accumulator
        self._grad_is_acc = True
        for p, off, n, shape in zip(self.params, self.offsets, self.numels, self.shapes):
            p.grad = self.grad[off:off + n].view(shape)

    def take_grad(self, empty: Callable[[int, torch.dtype], torch.Tensor]
                  ) -> tuple[torch.Tensor, bool]:
        """The parameters' gradients as one padded flat tensor, and whether it is the
        accumulator given to ``attach_grads`` (then they were added to it). Detaches the
        parameters' ``.grad``. Without an attached accumulator the gradients are copied into
        ``empty(S, dtype)``, a buffer of undefined contents (a parameter without a gradient and
        the padding give zeros); with one, a gradient autograd put elsewhere is added in."""
        flat, is_acc = self.grad, self._grad_is_acc
        if flat is None:
            flat, is_acc = empty(self.size, self.full.dtype), False
            for p, off, n, shape in zip(self.params, self.offsets, self.numels, self.shapes):
                if p.grad is None:
                    flat[off:off + n].zero_()
                else:
                    flat[off:off + n].view(shape).copy_(p.grad)
                p.grad = None
            flat[self.numel:].zero_()
        else:
            for p, off, n in zip(self.params, self.offsets, self.numels):
                g = p.grad
                if g is not None and g.data_ptr() != flat[off:off + n].data_ptr():
                    flat[off:off + n].add_(g.reshape(-1))
                p.grad = None
        self.grad, self._grad_is_acc = None, False
        return flat, is_acc

    def verify(self, comm: Communicator, unit_name: str) -> None:
        """Compare every chunk of the gathered buffer against its owner's checksum."""
        scope = self.gather_op.scope
        sums = comm.checksums(self.shard, scope)
        n = sums.numel()
        chunk = self.size // n
        t = self.topo
        for k in range(n):
            got = self.full[k * chunk:(k + 1) * chunk].double().sum()
            if not torch.isclose(got, sums[k], rtol=1e-12, atol=0.0):
                if scope == "intra":
                    owner = t.group_index * t.group_size + k
                else:  # nested chunk k belongs to rank (i = k % g, j = k // g)
                    owner = (k % t.num_groups) * t.group_size + k // t.num_groups
                raise EngineError(
                    f"unit {unit_name!r}: the chunk gathered from rank {owner} does not match "
                    f"its owner's checksum on rank {t.rank} ({got.item()} != {sums[k].item()})"
                )


def _point(param: nn.Parameter, view: torch.Tensor) -> None:
    """Make ``param`` the view ``view`` of a flat buffer, keeping the Python object (modules,
    tied weights and hooks hold it)."""
    if param.is_meta:
        # A meta tensor cannot take data of another device: swap in an empty tensor of the
        # buffer's device first. Not the view itself: it would share the buffer's version
        # counter, and every gather into the buffer would look to autograd like a write to a
        # parameter that a backward still needs; ``.data`` keeps the parameter's own counter.
        empty = nn.Parameter(view.new_empty(0), requires_grad=param.requires_grad)
        empty.__dict__.update(param.__dict__)
        torch.utils.swap_tensors(param, empty)
    param.data = view
