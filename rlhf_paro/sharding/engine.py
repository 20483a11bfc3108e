"""The PaRO engine: hooks that run the schedule of ``schedule.py`` around a model's units.

The parts: ``layout.py`` cuts the model into units; ``_flat.py`` keeps each unit's trainable and
frozen parameters in padded flat buffers in the nested chunk order and gathers and frees them;
``_unit.py`` is a unit's state in one pass; ``_step.py`` is the optimizer step at the boundary.
This module wires them to the module's forward and autograd's backward.

[Note: hooks in one micro-batch]  (docs/design.md, "The unit lifecycle")
  pre-forward    gather P (the schedule's forward all-gather), wait on a prefetch if one is in
                 flight, then start the next unit's gather (prefetch); wrap the unit's inputs so
                 that autograd tells us when the unit's backward is over
  post-forward   free P (P != N), and hook the outputs so backward can re-gather first
  pre-backward   point the trained parameters' .grad at the fp32 accumulator when gradients
                 stay at the N level (_flat.py, [Note: gradients land in flat buffers]), gather
                 P again (first hook on the unit's outputs); prefetch the unit before it
  post-backward  (autograd reached the unit's inputs: every node that used its parameters has
                 run, and AccumulateGrad nodes run first when ready) copy the gradients into a
                 flat buffer unless they are in the accumulator, start reducing it to the G level (the schedule's backward reduce-scatter, waited for
                 later: [Note: gradient reduction in flight]), free P
  end of backward  a queued autograd callback finishes units whose inputs needed no gradient
                 (the root, the first block of a LoRA model) and resets the pass state

[Note: waits]  (docs/design.md, "Waits")
Every consumer waits on its producer: a unit's forward or backward waits on the gather that
fills its buffer (``Pending.wait``), a free waits on any gather in flight into that buffer,
``step()`` finishes and frees every gather still in flight before the optimizer writes the
shards they read, and gradients are read only after autograd has finished writing them. There is
no device-wide synchronisation: on GPU the collective library orders a collective after the copy
that filled its input on the same stream.

[Note: setup memory]  (docs/design.md, "Setup")
The engine fills the units one after another, each from ``read`` (a ``source``, or the
parameters' own values): a unit's P shard, and for a bf16 model the fp32 master of its trained
values at the OS level, are read piece by piece (_flat.py, [Note: filling a buffer]), no piece
larger in bytes than the unit's gathered buffer; then that buffer is allocated and, for P != N,
freed. The gradient accumulators and the Adam moments come after the last unit. So while it
sets up, a rank holds at most what its strategy keeps (``cost.memory``) plus one unit gathered
(``cost.setup_memory``). A module built with its parameters on the meta device and a source
that reads files is never whole on any rank; without a source the caller built it whole.

[Note: gradient precision]
Gradients are summed over micro-batches in fp32 whatever the parameter precision: a bf16
accumulator rounds every addition to 8 bits, so the result would depend on the order in which
ranks and micro-batches are added. The reductions between ranks run in ``reduce_dtype``: fp32
keeps the whole sum in fp32 (the error bound of docs/design.md, "bf16"), bf16 halves the
gradient traffic.
"""

from __future__ import annotations

import contextlib
import enum
import os
from pathlib import Path
from typing import Any, Iterator, Mapping, NamedTuple, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from rlhf_paro.comm.collectives import Communicator, Pending
from rlhf_paro.comm.meter import BACKWARD, FORWARD, GATHER, CommMeter
from rlhf_paro.comm.topology import Topology
from rlhf_paro.sharding import _checkpoint
from rlhf_paro.sharding._flat import DTYPES, FlatBuffer, Read
from rlhf_paro.sharding._host import OFFLOAD_MODES, Transfers
from rlhf_paro.sharding._pool import BufferPool
from rlhf_paro.sharding._step import BoundaryStep
from rlhf_paro.sharding._unit import PostBackward, Unit, UnitState, tensors_requiring_grad
from rlhf_paro.sharding.contract import (EngineOptions, MicroBatches, ModelFactory, full_state_dict,
                                         no_memory)
from rlhf_paro.sharding.errors import EngineError
from rlhf_paro.sharding.layout import split_units
from rlhf_paro.sharding.schedule import BUCKET_NUMEL, plan, select
from rlhf_paro.sharding.strategy import Strategy


# [Note: gradient reduction in flight]
# A unit's backward reduce-scatter is started in its post-backward hook and waited for only when
# its result is needed: when more than REDUCTIONS_IN_FLIGHT are in flight (the oldest is
# finished first), and in ``step()`` before the boundary reads the accumulators. So the
# reduction of one unit runs while autograd computes the units before it, and the last ones
# while the next micro-batch runs forward. Each reduction holds its unsharded gradient (the
# input, which must not change until the wait) and its G-level result, so the cap bounds the
# extra memory to REDUCTIONS_IN_FLIGHT unsharded gradients of a unit. The sums enter a unit's
# accumulator in micro-batch order, as before: finishing in issue order keeps every addition
# where it was, so the numbers are the same bits as reducing synchronously. Every rank issues
# the same reductions in the same order (units finish backward in the same order everywhere).
REDUCTIONS_IN_FLIGHT = 2

# [Note: one division by N]  (docs/design.md, "Exactness")
# The mean over the N ranks is the step's sum divided by N once, on this rank's OS shard after
# the boundary's reduction (``BoundaryStep._reduce_to_os``): every path into an accumulator adds
# undivided gradients (autograd's direct additions, a reduce-scatter's sums, a gradient added in
# place), and the boundary reduces undivided sums. Dividing each micro-batch's unsharded
# gradient cost a pass over the whole unit per micro-batch, and dividing the accumulator a pass
# over the G level per step (the whole unit for G = N); the OS shard is the smallest of the
# three. For N a power of two all are the same bits (a division by 2^k is exact); otherwise they
# differ by the rounding of one division, far inside the reference's 1e-6.

# [Note: the boundary starts in the last backward]
# In the step's last micro-batch a unit's accumulator is complete as soon as its own gradient is
# in: at its post-backward when gradients stay at the N level, when its last reduce-scatter is
# added otherwise. The first collective of its boundary chain (the reduction to the OS level)
# starts then (``BoundaryStep.start``), while autograd computes the units before it, instead of
# in ``step()`` after the whole backward; ``step()`` waits for it and runs the rest of the
# chain, the norm and AdamW. The accumulator is only read from then on: nothing adds to it
# before the step (the NaN of a bad loss goes in before the backward). Every rank starts the
# same collectives in the same order, since units finish in the same order everywhere.


class _Reduction(NamedTuple):
    units: list[Unit]  # one, or a bucket's members in their order
    pending: Pending  # the reduce-scatter
    grad: torch.Tensor  # its input, kept alive until it is finished
    out: torch.Tensor  # this rank's G-level sum
    last: bool  # of the step's last micro-batch: the accumulators are complete once it is added


class TrainingState(enum.Enum):
    IDLE = "idle"  # between passes, or inside forward
    BACKWARD = "backward"  # from the first pre-backward hook to the end-of-backward callback


class ShardedEngine:
    """A model sharded by one PaRO strategy; a ``TrainEngine``
    (docs/design.md, "The engine contract").

    A frozen strategy (one P level, e.g. ``Strategy.parse("G", frozen=True)``) gives an
    inference-only engine. ``comm`` picks the algorithm of world-scope collectives (``auto``:
    one per collective, by ``comm/auto.py``); ``reduce_dtype`` the precision of gradient
    reductions (fp32 accumulation is fixed).

    ``source(name, start, stop)`` gives elements start..stop of the flattened parameter
    ``name`` (as ``model.named_parameters()`` names it), e.g. from files (``TensorFiles``);
    with it the parameters may be on the meta device, and each rank reads only what it keeps,
    one unit at a time (docs/design.md, "Setup"). Without it the parameters' own values are
    used. The shards are made on ``device`` (default: where the parameters are), and the
    module's buffers are moved there.

    ``offload`` (docs/design.md, "Offload"): ``none``; ``optimizer`` keeps the OS level (fp32
    masters, Adam moments) in host memory and steps it with DeepSpeedCPUAdam (trained models);
    ``params`` gives the P shards a home in host memory, used by ``offload_params()`` and
    ``onload_params()`` between the model's phases.

    ``bucket_numel``: units with fewer trainable elements reduce their gradients together, in
    buckets of at least that many elements (``schedule.py``, [Note: gradient buckets]); 1 makes
    every unit reduce alone.

    ``unit_classes`` names the module classes cut into units (default: the model's
    ``_no_split_modules``); ``prefetch`` starts the next unit's gather early; ``verify_gathers``
    checks every gathered unit against its owners' checksums (tests).
    """

    def __init__(self, module: nn.Module, strategy: Strategy, topology: Topology, *,
                 optim: dict | None = None, max_grad_norm: float | None = None,
                 grad_accum_steps: int = 1, comm: str = "auto", precision: str = "fp32",
                 reduce_dtype: str = "fp32", model_name: str = "model",
                 unit_classes: list[str] | None = None, prefetch: bool = True,
                 verify_gathers: bool = False, source: Read | None = None,
                 device: torch.device | str | None = None, offload: str = "none",
                 bucket_numel: int = BUCKET_NUMEL) -> None:
        for key, value in (("precision", precision), ("reduce_dtype", reduce_dtype)):
            if value not in DTYPES:
                raise ValueError(f"{key}={value!r} is unknown; allowed: {', '.join(DTYPES)}")
        if offload not in OFFLOAD_MODES:
            raise ValueError(f"offload={offload!r} is unknown; allowed: "
                             f"{', '.join(OFFLOAD_MODES)}")
        if offload == "optimizer" and strategy.frozen:
            raise ValueError(f"offload='optimizer' needs a trained model; strategy "
                             f"{strategy.name} is frozen (allowed: none, params)")
        if bucket_numel < 1:
            raise ValueError(f"bucket_numel={bucket_numel} must be a positive integer")
        if topology.world is None and topology.num_ranks > 1:
            raise ValueError("the topology has no process groups; build it with "
                             "Topology.from_process_group(group_size=M)")
        self.module = module
        self.strategy = strategy
        self.topo = topology
        self.precision = precision
        self._micro = MicroBatches(model_name, grad_accum_steps)  # backward() calls this step
        self.reduce_dtype = DTYPES[reduce_dtype]  # [Note: gradient precision]
        self.meter = CommMeter(model_name)
        self.offload = offload  # _host.py, [Note: offload modes]
        self.transfers = Transfers()  # device <-> host copies, apart from the comm meter
        self._parked = False  # offload_params() moved the P shards to host memory
        self.comm = Communicator(topology, self.meter, comm)
        self.schedule = plan(strategy)  # the collectives this strategy runs (schedule.py)
        self._grad_reduce = select(self.schedule, BACKWARD, "grads")
        # Gradients that stay at the N level (G = N) of an fp32 model are added by autograd
        # straight into the fp32 accumulator ([Note: gradients land in flat buffers]).
        self._direct_grads = not self._grad_reduce and precision == "fp32"
        self._reductions: list[_Reduction] = []  # backward reduce-scatters in flight, in order
        self._bucket: list[tuple[Unit, torch.Tensor]] = []  # small gradients waiting to go
        self.bucket_numel = bucket_numel  # schedule.py, [Note: gradient buckets]
        self.prefetch = prefetch
        self.verify_gathers = verify_gathers
        self.state = TrainingState.IDLE
        self._hold = 0  # > 0 inside gathered(), which runs the module without the hooks
        self._order: list[Unit] = []  # blocks in forward order, recorded on the first forward
        self._order_known = False
        if strategy.frozen:
            for p in module.parameters():
                p.requires_grad_(False)
        read, device = _values(module, source, device)
        self.units = self._build_units(unit_classes, DTYPES[precision], read, device)
        self.root = self.units[0]
        # Gradient buffers of one micro-batch, kept for the next ([Note: a pool of gradient
        # buffers] in _pool.py).
        self._pool = BufferPool(torch.device(device))
        # The parameters are views into the flat buffers on ``device`` now; the buffers follow.
        module.to(device)
        self._boundary = None if strategy.frozen else BoundaryStep(
            self.units, strategy, self.comm, self.schedule, optim or {}, max_grad_norm,
            self.reduce_dtype, self.transfers, offload_optimizer=offload == "optimizer")
        self._register_hooks()

    # -- construction ------------------------------------------------------------------------
    def _build_units(self, unit_classes: list[str] | None, dtype: torch.dtype, read: Read,
                     device: torch.device) -> list[Unit]:
        """The units, filled one at a time from ``read`` ([Note: setup memory])."""
        gather = select(self.schedule, FORWARD, "params")
        names = {id(p): name for name, p in self.module.named_parameters()}
        # A bf16 model's optimizer keeps fp32 masters of the trained values at the OS level.
        master = (self.strategy.optim if not self.strategy.frozen and dtype != torch.float32
                  else None)
        units = []
        for index, spec in enumerate(split_units(self.module, unit_classes)):
            trainable = [p for p in spec.params if p.requires_grad]
            frozen = [p for p in spec.params if not p.requires_grad]
            buffers = [FlatBuffer(group, [names[id(p)] for p in group], self.topo,
                                  self.strategy.params, dtype, gather[0] if gather else None,
                                  read=read, device=device,
                                  master_level=master if group is trainable else None,
                                  master_on_host=self.offload == "optimizer",
                                  host_copy=self.offload == "params")
                       for group in (trainable, frozen) if group]
            units.append(Unit(spec.name, spec.module, buffers,
                              buffers[0] if trainable else None, is_root=index == 0))
        return units

    # -- hooks -------------------------------------------------------------------------------
    def _register_hooks(self) -> None:
        self._hooks = [handle for unit in self.units for handle in (
            unit.module.register_forward_pre_hook(
                lambda mod, args, kwargs, unit=unit: self._pre_forward(unit, args, kwargs),
                with_kwargs=True, prepend=True),
            unit.module.register_forward_hook(
                lambda mod, args, out, unit=unit: self._post_forward(unit, out)))]

    def _remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _phase(self) -> str:
        return BACKWARD if self.state == TrainingState.BACKWARD else FORWARD

    def _gather_now(self, unit: Unit, phase: str) -> None:
        unit.gather(self.comm, phase)
        unit.wait(self.comm, self.verify_gathers)

    def _prefetch(self, unit: Unit, step: int) -> None:
        """Start the gather of the unit ``step`` places after ``unit`` in forward order."""
        if not (self.prefetch and self._order_known) or unit not in self._order:
            return
        k = self._order.index(unit) + step
        if 0 <= k < len(self._order):
            self._order[k].gather(self.comm, self._phase(), async_op=True)

    def _pre_forward(self, unit: Unit, args: tuple, kwargs: dict) -> tuple | None:
        self._check_on_device("forward")
        if not unit.is_root and not self._order_known and unit not in self._order:
            self._order.append(unit)
        self._gather_now(unit, self._phase())
        if self.state != TrainingState.BACKWARD:
            self._prefetch(unit, +1)
        if not torch.is_grad_enabled() or unit.is_root or unit.state != UnitState.READY:
            return None
        flat, spec = tree_flatten((args, kwargs))
        positions = [k for k, x in enumerate(flat)
                     if isinstance(x, torch.Tensor) and x.requires_grad]
        if not positions:
            return None
        unit.state = UnitState.ARMED
        wrapped = PostBackward.apply(lambda: self._post_backward(unit),
                                     *[flat[k] for k in positions])
        for k, x in zip(positions, wrapped):
            flat[k] = x
        return tree_unflatten(flat, spec)

    def _post_forward(self, unit: Unit, output: Any) -> None:
        if unit.is_root:
            self._order_known = True
        if self.state == TrainingState.BACKWARD:
            return  # recomputation inside backward: the parameters are still needed
        unit.free()
        if unit.is_root:
            for other in self._order:  # a prefetch nobody consumed (a skipped block)
                other.free()
        if torch.is_grad_enabled():
            for x in tensors_requiring_grad(output):
                x.register_hook(lambda grad, unit=unit: self._pre_backward(unit))

    def _pre_backward(self, unit: Unit) -> None:
        if self.state != TrainingState.BACKWARD:
            self.state = TrainingState.BACKWARD
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        if unit.state not in (UnitState.READY, UnitState.ARMED):
            return
        unit.state = UnitState.BACKWARD
        if unit.trainable is not None and self._boundary is not None and self._direct_grads:
            unit.trainable.attach_grads(unit.grad_acc)  # [Note: gradients land in flat buffers]
        self._gather_now(unit, BACKWARD)
        self._prefetch(unit, -1)

    @torch.no_grad()
    def _post_backward(self, unit: Unit) -> None:
        if unit.state == UnitState.DONE:
            return
        unit.state = UnitState.DONE
        buf = unit.trainable
        if buf is not None and self._boundary is not None:
            grad, added = buf.take_grad(self._pool.empty)
            if added and self._last_micro_batch:
                self._accumulated(unit)
            elif not added:
                # Accumulators hold undivided sums, divided on the OS shard in the step
                # ([Note: one division by N]); a gradient that missed a direct
                # accumulator (its unit's backward began without ``_pre_backward``, as under a
                # reentrant checkpoint that runs the module hooks inside it) joins it undivided.
                reduced = grad.to(self.reduce_dtype)
                if reduced is not grad:
                    self._pool.give(grad)
                grad = reduced
                if not self._grad_reduce:
                    unit.grad_acc.add_(grad)
                    self._pool.give(grad)
                    if self._last_micro_batch:
                        self._accumulated(unit)
                elif grad.numel() >= self.bucket_numel:  # schedule.buckets: a large one alone
                    self._reduce_async([(unit, grad)])
                else:
                    self._bucket.append((unit, grad))
                    if sum(g.numel() for _, g in self._bucket) >= self.bucket_numel:
                        self._flush_bucket()
        unit.free()

    def _flush_bucket(self) -> None:
        if self._bucket:
            members, self._bucket = self._bucket, []
            self._reduce_async(members)

    def _reduce_async(self, members: list[tuple[Unit, torch.Tensor]]) -> None:
        """Start the schedule's backward reduce-scatter (N -> G) of one micro-batch's gradient of
        one unit, or of a bucket of small ones laid out chunk by chunk ([Note: gradient
        buckets] in schedule.py); the sums are added to the accumulators when it is waited for
        ([Note: gradient reduction in flight])."""
        (c,) = self._grad_reduce  # one row: N -> G on the scope between them
        n = self.comm.size(c.scope)
        if len(members) == 1:
            grad = members[0][1]
        else:
            grad = self._pool.empty(sum(g.numel() for _, g in members), members[0][1].dtype)
            torch.cat([g.view(n, -1) for _, g in members], dim=1, out=grad.view(n, -1))
            self._pool.give(*(g for _, g in members))
        out = self._pool.empty(grad.numel() // n, grad.dtype)
        # The input is this micro-batch's scratch: a ring may sum in it.
        pending = self.comm.reduce_scatter(out, grad, c.scope, c.phase, async_op=True,
                                           overwrite=True)
        self._reductions.append(_Reduction([u for u, _ in members], pending, grad, out,
                                           self._last_micro_batch))
        while len(self._reductions) > REDUCTIONS_IN_FLIGHT:
            self._finish_reduction()

    def _finish_reduction(self) -> None:
        """Wait for the oldest gradient reduction in flight and add it to its accumulators."""
        reduction = self._reductions.pop(0)
        reduction.pending.wait()
        parts = reduction.out.split([u.grad_acc.numel() for u in reduction.units])
        for unit, part in zip(reduction.units, parts):
            unit.grad_acc.add_(part)
            if reduction.last:
                self._accumulated(unit)
        self._pool.give(reduction.grad, reduction.out)

    def _accumulated(self, unit: Unit) -> None:
        """The unit's accumulator holds this step's whole sum (undivided: [Note: one division
        by N]): start its boundary reduction ([Note: the boundary starts in the last
        backward])."""
        self._boundary.start(unit)

    def _end_of_backward(self) -> None:
        # Reverse forward order, then the rest: the same on every rank, so collectives line up.
        rest = [u for u in self.units if not u.is_root and u not in self._order]
        for unit in [*reversed(self._order), *rest, self.root]:
            self._post_backward(unit)
        self._flush_bucket()  # [Note: gradient buckets]: what is left goes at the end
        for unit in self.units:
            unit.state = UnitState.READY
        self.state = TrainingState.IDLE

    # -- public surface ----------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def set_micro_batches(self, num_micro: int) -> None:
        """``num_micro`` backward() calls per step from the next step on (between steps)."""
        self._micro.set_per_step(num_micro)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch; the loss is scaled by 1/grad_accum_steps.

        A non-finite ``loss`` on any rank makes the next ``step()`` skip on every rank.
        """
        self._micro.check_backward(self._trained)
        # [Note: a step skipped on bad numbers] (_step.py). Before the backward: the boundary's
        # reductions may start inside it ([Note: the boundary starts in the last backward]).
        self._boundary.poison(loss)
        (loss / self.grad_accum_steps).backward()
        self._micro.done += 1

    @torch.no_grad()
    def step(self) -> float:
        """Reduce gradients to the OS level, clip, AdamW on the OS shard, refresh P.

        Returns the global gradient norm before clipping. When that norm or a loss of this step
        is not finite (on any rank), the step is skipped on every rank of the model alike: no
        update, the accumulated gradients dropped, ``skipped_steps`` counts it.
        """
        self._micro.check_step(self._trained)
        if self._hold:
            raise EngineError("step() inside gathered(): the gathered copies would go stale")
        # [Note: waits] The optimizer writes the shards that gathers read: finish every gather
        # still in flight (a prefetch nobody consumed) and free it, before any shard changes.
        for unit in self.units:
            unit.free()
        while self._reductions:  # [Note: gradient reduction in flight]
            self._finish_reduction()
        norm = self._boundary()
        self._micro.done = 0
        return norm

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds now (persistent buffers; gathered copies excluded), by state and
        by place: ``params``, ``grads``, ``optim`` on the device (P, G, OS); ``host_params``,
        ``host_grads``, ``host_optim`` in host memory: the P shards' home (offload=params, held
        whether parked or not), and the OS gradient's copy and the masters and moments
        (offload=optimizer): the keys of ``contract.MEMORY_KEYS``. ``cost.offload_memory`` is
        the same dictionary from sizes alone."""
        bufs = [buf for u in self.units for buf in u.buffers]
        params = sum(buf.shard.numel() * buf.shard.element_size() for buf in bufs
                     if not buf.parked)
        host_params = sum(buf.host.numel() * buf.host.element_size() for buf in bufs
                          if buf.host is not None)
        grads = sum(u.grad_acc.numel() * u.grad_acc.element_size()
                    for u in self.units if u.grad_acc is not None)
        out = no_memory()
        if self._boundary is not None:
            out.update(self._boundary.memory())  # optim, host_optim, host_grads
        out.update(params=params, grads=grads, host_params=host_params)
        return out

    # -- offload=params: _host.py, [Note: offload modes] --------------------------------------
    @property
    def params_offloaded(self) -> bool:
        """Whether the P shards are parked in host memory (``offload_params()``)."""
        return self._parked

    @torch.no_grad()
    def offload_params(self) -> None:
        """Park every P shard in host memory and free its device storage, until
        ``onload_params()``. Forward and ``gathered()`` raise ``EngineError`` while parked (so
        no backward or step can follow); checkpoints read and write the host copies. Local: no collective; the copies are
        counted in ``transfers`` (one per flat buffer, its P shard's bytes)."""
        self._micro.check_offload(self.offload)
        if self._hold or self.state == TrainingState.BACKWARD:
            raise EngineError("offload_params() inside gathered() or backward: the parameters "
                              "are in use")
        for unit in self.units:  # [Note: waits] a prefetch in flight reads the shards
            unit.free()
            for buf in unit.buffers:
                buf.park(self.transfers)
        self._parked = True

    @torch.no_grad()
    def onload_params(self) -> None:
        """Bring the parked P shards back to the device (no-op when they are there)."""
        for unit in self.units:
            for buf in unit.buffers:
                buf.unpark(self.transfers)
        self._parked = False

    def _check_on_device(self, what: str) -> None:
        if self.params_offloaded:
            raise EngineError(f"{what} on model {self.meter.model!r} while its parameters are "
                              "offloaded to host memory; call onload_params() first")

    @contextlib.contextmanager
    def gathered(self, phase: str = GATHER) -> Iterator[nn.Module]:
        """Full parameters of every unit (for generation or evaluation), freed afterwards.

        Inside it the module is the plain model: the engine's hooks are taken off (a decoding
        step of generation calls every unit once per token, and each hook call is Python on
        that path) and put back on the way out. So it is for forward passes without backward.
        """
        if self.state == TrainingState.BACKWARD:
            raise EngineError("gathered() cannot be used during backward")
        self._check_on_device("gathered()")
        outer = self._hold == 0
        if outer:
            for unit in self.units:
                unit.gather(self.comm, phase)
            for unit in self.units:
                unit.wait(self.comm, self.verify_gathers)
            self._remove_hooks()
        self._hold += 1
        try:
            yield self.module
        finally:
            self._hold -= 1
            if outer:
                self._register_hooks()
                for unit in self.units:
                    unit.free()

    def unit_parameters(self, phase: str = GATHER, trainable_only: bool = False
                        ) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter, full, one unit gathered at a time: ``(name, tensor)`` with the names
        of ``module.named_parameters()`` (a shared parameter once). ``trainable_only``: the
        trained parameters alone, each unit's trainable buffer gathered and its frozen one not
        (a LoRA actor's adapters, for an engine that holds its base weights already).

        [Note: a unit at a time]  (docs/design.md, "Rollout")
        A unit is gathered (at its P scope, metered under ``phase``) and waited for before its
        first tensor is handed out, and freed only when the consumer asks for the next unit's
        first tensor or stops: a tensor is a view of the gathered buffer, valid until then, so
        a consumer that keeps one copies it. No gather is in flight while the consumer reads,
        and at most one unit is held beyond the shards.
        """
        if self.state == TrainingState.BACKWARD or self._hold:
            raise EngineError("unit_parameters() between steps only, outside gathered()")
        self._check_on_device("unit_parameters()")
        for unit in self.units:
            if not trainable_only:
                self._gather_now(unit, phase)
                buffers = unit.buffers
            elif unit.trainable is None:
                continue
            else:
                buffers = [unit.trainable]
                unit.trainable.start_gather(self.comm, phase, async_op=False)
                if unit.trainable.finish_gather() and self.verify_gathers:
                    unit.trainable.verify(self.comm, unit.name)
            try:
                for buf in buffers:
                    for name, param in zip(buf.names, buf.params):
                        yield name, param.detach()
            finally:
                for buf in buffers:
                    buf.free()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded copies of every entry of ``module.state_dict()``, same keys."""
        return full_state_dict(self)

    # -- checkpoints: _checkpoint.py, [Note: checkpoint format] --------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's share of the engine's state, in a form no layout depends on
        (docs/design.md, "Checkpoints"). Local: no collective.

        Returns ``{"meta": dict, "tensors": {"<kind>/<parameter name>": 1-D tensor}}``: copies
        of the pieces of every parameter that this rank's nested G-chunk crosses, so the ranks'
        state dicts together hold each element once. Kinds: ``params`` (as held, fp32 or bf16),
        ``master`` (the fp32 master of a bf16 model), ``exp_avg`` and ``exp_avg_sq`` (AdamW's
        moments). ``meta`` is plain JSON: each piece's ``[start, stop)`` in its flattened
        parameter, every parameter's shape, dtype and whether it is trained, the AdamW ``step``
        count, ``skipped_steps``, and the saving layout. Module buffers that are not parameters
        are no part of it. Not between ``backward()`` and ``step()``: accumulated gradients are
        not saved.
        """
        self._check_between_steps("state_dict()")
        return _checkpoint.snapshot(self._slots(), self._meta())

    def load_state_dict(self, states: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
        """Load state dicts saved under any strategy, N and M: ``states`` are the saved ranks'
        ``state_dict()`` results (all of them, or those that hold what this rank needs), in any
        order. This rank takes its P shard of the parameters and its OS shard of the master and
        moments from them, and the step counts. Local: no collective.

        Raises ``CheckpointError`` (a ``ValueError``) naming what does not fit (another model's
        names or shapes, a missing piece, mixed checkpoints) before anything is changed.
        """
        if isinstance(states, Mapping):
            states = [states]
        self._load([_checkpoint.from_state_dict(state, f"state dict {k}")
                    for k, state in enumerate(states)])

    def save_checkpoint(self, directory: str | os.PathLike) -> Path:
        """Write this rank's ``state_dict()`` to ``<directory>/rank_<rank, 5 digits>.safetensors``
        (JSON metadata in the safetensors header) and return that path. Every rank of the model
        calls it; no collective. The directory is created if needed; the file is written under a
        temporary name, fsynced and renamed, so it is complete once this returns.
        """
        self._check_between_steps("save_checkpoint()")  # the contract's message, as DeepSpeed's
        return _checkpoint.write(self.state_dict(), directory, self.topo.rank)

    def load_checkpoint(self, directory: str | os.PathLike) -> None:
        """Load a directory written by ``save_checkpoint`` under any strategy, N and M; every
        rank of the model calls it once every file is written. Reads the headers of all rank
        files and, lazily, only the slices this rank owns; no collective, nothing unpickled.
        Raises ``CheckpointError`` before anything is changed if a file is missing or unreadable
        or the checkpoint does not fit the model (as ``load_state_dict``).
        """
        handles: list = []  # the open files, closed when the load is over
        try:
            self._load(_checkpoint.open_directory(directory, handles))
        finally:
            handles.clear()

    def _check_between_steps(self, what: str) -> None:
        if self.state == TrainingState.BACKWARD:
            raise EngineError(f"{what} inside backward: accumulated gradients are not part of "
                              "the state")
        self._micro.check_between_steps(what)

    @torch.no_grad()
    def _load(self, saved: list[_checkpoint.Saved]) -> None:
        self._check_between_steps("loading a checkpoint")
        if self._hold:
            raise EngineError("loading a checkpoint inside gathered(): the gathered copies "
                              "would go stale")
        # [Note: waits] A prefetch in flight reads the shards about to be written.
        for unit in self.units:
            unit.free()
        writes, meta = _checkpoint.read(self._slots(), self._table(), saved)
        for target, offset, values in writes:
            target[offset:offset + values.numel()].copy_(values)
        if self._boundary is not None and self._boundary.optimizer is not None:
            self._boundary.restore_counts(meta["step"], meta["skipped_steps"])
            self._boundary.sync_masters()

    def _slots(self) -> list[_checkpoint.Slot]:
        """What this rank holds, slot by slot: the P shards (their host copies while parked),
        then the optimizer's OS shards."""
        slots = [_checkpoint.Slot("params", buf, self.strategy.params, buf.p_values)
                 for unit in self.units for buf in unit.buffers]
        return slots + ([] if self._boundary is None else self._boundary.slots())

    def _table(self) -> dict[str, dict[str, Any]]:
        """Every parameter's shape, dtype and whether this engine trains it."""
        return {name: {"shape": list(shape), "dtype": self.precision,
                       "trained": buf is unit.trainable and self._boundary is not None}
                for unit in self.units for buf in unit.buffers
                for name, shape in zip(buf.names, buf.shapes)}

    def _meta(self) -> dict[str, Any]:
        t = self.topo
        return {"format": _checkpoint.FORMAT, "rank": t.rank, "num_ranks": t.num_ranks,
                "group_size": t.group_size, "strategy": self.strategy.name,
                "precision": self.precision,
                "kinds": sorted({slot.kind for slot in self._slots()}),
                "step": None if self._boundary is None else self._boundary.step_count,
                "skipped_steps": self.skipped_steps, "params": self._table()}

    @property
    def _last_micro_batch(self) -> bool:
        """Inside the backward of the step's last micro-batch (backward() counts it after)."""
        return self._micro.last

    @property
    def _trained(self) -> bool:
        return self._boundary is not None and self._boundary.optimizer is not None

    @property
    def grad_accum_steps(self) -> int:
        """backward() calls per step()."""
        return self._micro.per_step

    @property
    def lr(self) -> float:
        return 0.0 if self._boundary is None else self._boundary.lr

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped on a non-finite loss or gradient norm, in total (a loaded
        checkpoint's count included); the same on every rank of the model."""
        return 0 if self._boundary is None else self._boundary.skipped_steps

    @property
    def last_step_skipped(self) -> bool:
        """Whether the latest ``step()`` was skipped (the same on every rank of the model)."""
        return self._boundary is not None and self._boundary.last_skipped


def shard(model: nn.Module, strategy: Strategy | str, topology: Topology, **options: Any
          ) -> ShardedEngine:
    """Shard ``model`` in place by ``strategy`` over ``topology``
    (docs/design.md, "The engine in parts"); ``options`` are ``ShardedEngine``'s keywords. A
    string names a strategy, one letter a frozen one."""
    if isinstance(strategy, str):
        strategy = Strategy.parse(strategy, frozen=len(strategy.strip()) == 1)
    return ShardedEngine(model, strategy, topology, **options)


def from_options(factory: ModelFactory, topology: Topology, options: EngineOptions
                 ) -> ShardedEngine:
    """The PaRO engine of ``options`` (``contract.BACKENDS["paro"]``): the model built with its
    source, so that each rank reads only what it keeps."""
    if options.strategy is None:
        raise ValueError("backend 'paro' needs a strategy; allowed: a triple such as IGG, a "
                         "preset, or one P level for a frozen model")
    module, source = factory.with_source()
    return ShardedEngine(module, Strategy.parse(options.strategy, frozen=options.frozen),
                         topology, optim=options.optim, max_grad_norm=options.max_grad_norm,
                         grad_accum_steps=options.grad_accum_steps, comm=options.comm,
                         precision=options.precision, reduce_dtype=options.reduce_dtype,
                         model_name=options.model_name, source=source, device=options.device,
                         offload=options.offload)


def _values(module: nn.Module, source: Read | None, device: torch.device | str | None
            ) -> tuple[Read, torch.device]:
    """Where the engine reads parameter values (``source``, or the parameters themselves) and
    the device its shards live on."""
    params = dict(module.named_parameters())
    on_meta = sorted(name for name, p in params.items() if p.is_meta)
    if source is None and on_meta:
        raise ValueError(f"parameter {on_meta[0]!r} is on the meta device and no source was "
                         "given; allowed: source=, a reader of the parameters' values")
    if device is None:
        devices = {p.device for p in params.values() if not p.is_meta}
        if len(devices) != 1:
            raise ValueError(f"the parameters are on {sorted(map(str, devices)) or 'meta'}; "
                             "allowed: device=, the device of the shards")
        device = devices.pop()
    if source is not None:
        return source, torch.device(device)

    def own(name: str, start: int, stop: int) -> torch.Tensor:
        return params[name].detach().reshape(-1)[start:stop]

    return own, torch.device(device)
