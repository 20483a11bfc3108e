"""The PaRO engine: one schedule for all 14 P/G/OS strategies.

Each unit (see ``layout.py``) keeps its parameters in up to two flat buffers, one for trainable
and one for frozen parameters, each padded to a multiple of N and cut into N chunks in the nested
order of ``topology.py``. The module's parameters are views into the unit's *full* buffer, whose
storage is allocated only while the unit is gathered (P = I or G) or always (P = N).

[Note: unit lifecycle in one micro-batch]
  pre-forward    gather P (intra or world all-gather), wait on a prefetch if one is in flight,
                 then start the next unit's gather (prefetch); wrap the unit's inputs so that
                 autograd tells us when the unit's backward is over
  post-forward   free P (P != N), and hook the outputs so backward can re-gather first
  pre-backward   gather P again (first hook on the unit's outputs); prefetch the unit before it
  post-backward  (autograd reached the unit's inputs: every node that used its parameters has
                 run, and AccumulateGrad nodes run first when ready) flatten the gradients,
                 reduce them to the G level, add them to the accumulator, free P
  end of backward  a queued autograd callback finishes units whose inputs needed no gradient
                 (the root, the first block of a LoRA model) and resets the pass state
The root unit is the model itself: its pre-forward runs before every block and its post-forward
after all of them, so it stays gathered for the whole forward and (re-gathered) backward.

[Note: waits]
Every consumer waits on its producer: a unit's forward or backward waits on the gather that
fills its buffer (``Pending.wait``), a free waits on any gather in flight into that buffer, and
gradients are read only after autograd has finished writing them. There is no device-wide
synchronisation: on GPU the collective library orders a collective after the copy that filled
its input on the same stream.

[Note: exactness]
Gradients are divided by N before the reduction and the loss by s in ``backward``, so the
accumulated gradient is the mean over the N*s micro-batches, as in the unsharded reference fed
the whole global batch. The squared norm is summed over this rank's OS shard and all-reduced
over the ranks whose OS shards are disjoint (intra for OS=I, world for OS=G), so each element
counts once. The update is ``torch.optim.AdamW`` itself on the OS shard, element for element the
same arithmetic as on the unsharded model.
"""

from __future__ import annotations

import contextlib
import enum
from typing import Any, Iterator

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from rlhf_paro.comm.collectives import Communicator, Pending, _all_gather_single
from rlhf_paro.comm.meter import CommMeter
from rlhf_paro.sharding.layout import UnitSpec, padded, split_units
from rlhf_paro.sharding.strategy import Level, Strategy
from rlhf_paro.sharding.topology import Topology


class EngineError(RuntimeError):
    """A call in the wrong order (an early ``step()``, a ``backward()`` of a frozen model, ...)."""


class TrainingState(enum.Enum):
    IDLE = "idle"  # between passes, or inside forward
    BACKWARD = "backward"  # from the first pre-backward hook to the end-of-backward callback


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class _FlatBuffer:
    """The trainable or the frozen parameters of one unit as one padded flat buffer."""

    def __init__(self, params: list[nn.Parameter], topo: Topology, p_level: Level,
                 dtype: torch.dtype) -> None:
        self.params = params
        self.topo = topo
        self.p_level = p_level
        self.shapes = [p.shape for p in params]
        self.numels = [p.numel() for p in params]
        self.offsets = [sum(self.numels[:k]) for k in range(len(params))]
        self.numel = sum(self.numels)
        self.size = padded(self.numel, topo.num_ranks)  # S
        self.device = params[0].device
        # fp32 copy of the initial values, kept only until the optimizer took its master shard.
        initial = torch.zeros(self.size, dtype=torch.float32, device=self.device)
        for p, off, n in zip(params, self.offsets, self.numels):
            initial[off:off + n].copy_(p.detach().reshape(-1))
        self.initial: torch.Tensor | None = initial
        # The gathered buffer; the module's parameters are views into it.
        self.full = initial.to(dtype)
        for p, off, n, shape in zip(params, self.offsets, self.numels, self.shapes):
            p.data = self.full[off:off + n].view(shape)
        self.storage_bytes = self.size * self.full.element_size()
        self.shard = self.full if p_level == Level.N else self.full[self.p_slice()].clone()
        self.gathered = p_level == Level.N
        self.pending: Pending | None = None
        if p_level != Level.N:
            self.full.untyped_storage().resize_(0)

    # -- the nested layout -------------------------------------------------------------------
    def p_slice(self) -> slice:
        """This rank's P shard inside the full buffer."""
        return self.level_slice(self.p_level)

    def level_slice(self, level: Level) -> slice:
        t = self.topo
        if level == Level.N:
            return slice(0, self.size)
        if level == Level.I:
            block = self.size // t.group_size
            return slice(t.local_index * block, (t.local_index + 1) * block)
        chunk = self.size // t.num_ranks
        start = t.chunk_index() * chunk
        return slice(start, start + chunk)

    # -- gather and free ---------------------------------------------------------------------
    def start_gather(self, comm: Communicator, phase: str, async_op: bool) -> None:
        if self.gathered or self.pending is not None:
            return
        self.full.untyped_storage().resize_(self.storage_bytes)
        scope = "intra" if self.p_level == Level.I else "world"
        self.pending = comm.all_gather(self.full, self.shard, scope, phase, async_op=async_op)

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

    def flat_grad(self, dtype: torch.dtype) -> torch.Tensor:
        """The parameters' gradients as one padded flat ``dtype`` tensor (zeros where none);
        clears them. A bf16 gradient widens to fp32 exactly."""
        out = torch.zeros(self.size, dtype=dtype, device=self.device)
        for p, off, n in zip(self.params, self.offsets, self.numels):
            if p.grad is not None:
                out[off:off + n].copy_(p.grad.reshape(-1))
                p.grad = None
        return out


class _Unit:
    """Runtime state of one unit."""

    def __init__(self, spec: UnitSpec, index: int, buffers: list[_FlatBuffer],
                 trainable: _FlatBuffer | None) -> None:
        self.name = spec.name
        self.module = spec.module
        self.index = index
        self.buffers = buffers  # trainable and frozen buffers that are not empty
        self.trainable = trainable  # the trainable buffer, if any
        self.armed = False  # inputs wrapped in this pass: a post-backward will fire
        self.backward_gathered = False  # pre-backward ran in this pass
        self.backward_done = False  # post-backward ran in this pass
        # fp32 gradient accumulator at the G level, and optimizer state at the OS level.
        self.grad_acc: torch.Tensor | None = None
        self.master: torch.Tensor | None = None


def _tensors_requiring_grad(obj: Any) -> list[torch.Tensor]:
    """Tensors that require grad inside nested tuples, lists and mappings (model outputs)."""
    if isinstance(obj, torch.Tensor):
        return [obj] if obj.requires_grad else []
    if isinstance(obj, dict) or hasattr(obj, "values") and hasattr(obj, "keys"):
        items = obj.values()
    elif isinstance(obj, (list, tuple)):
        items = obj
    else:
        return []
    return [t for item in items for t in _tensors_requiring_grad(item)]


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs whose backward marks the end of the unit's backward."""

    @staticmethod
    def forward(ctx: Any, hook: Any, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.hook = hook
        return tuple(x.view_as(x) for x in inputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.hook()
        return (None, *grads)


class ShardedEngine:
    """A model sharded by one PaRO strategy; the surface of DESIGN section 5."""

    def __init__(self, module: nn.Module, strategy: Strategy, topology: Topology, *,
                 optim: dict | None = None, max_grad_norm: float | None = None,
                 grad_accum_steps: int = 1, comm: str = "native", precision: str = "fp32",
                 reduce_dtype: str = "fp32", model_name: str = "model",
                 unit_classes: list[str] | None = None, prefetch: bool = True,
                 verify_gathers: bool = False) -> None:
        if precision not in _DTYPES:
            raise ValueError(f"precision={precision!r} is unknown; allowed: fp32, bf16")
        if reduce_dtype not in _DTYPES:
            raise ValueError(f"reduce_dtype={reduce_dtype!r} is unknown; allowed: fp32, bf16")
        if grad_accum_steps < 1:
            raise ValueError(f"grad_accum_steps={grad_accum_steps} must be a positive integer")
        if topology.world is None and topology.num_ranks > 1:
            raise ValueError("the topology has no process groups; build it with "
                             "Topology.from_process_group(group_size=M)")
        self.module = module
        self.strategy = strategy
        self.topo = topology
        self.precision = precision
        self.dtype = _DTYPES[precision]
        # [Note: gradient precision] Gradients are summed over micro-batches in fp32 whatever the
        # parameter precision: a bf16 accumulator rounds every addition to 8 bits, so the result
        # would depend on the order in which ranks and micro-batches are added. The reductions
        # between ranks run in ``reduce_dtype``: fp32 keeps the whole sum in fp32 (the error
        # bound of docs/design.md), bf16 halves the gradient traffic.
        self.reduce_dtype = _DTYPES[reduce_dtype]
        self.grad_accum_steps = grad_accum_steps
        self.max_grad_norm = max_grad_norm
        self.meter = CommMeter(model_name)
        self.comm = Communicator(topology, self.meter, comm)
        self.prefetch = prefetch
        self.verify_gathers = verify_gathers
        self.state = TrainingState.IDLE
        self._micro_batches = 0  # backward() calls since the last step()
        self._hold = 0  # > 0 inside gathered(): hooks neither gather nor free
        self._gather_phase: str | None = None  # phase label of gathers inside gathered()
        self._order: list[_Unit] = []  # blocks in forward order, recorded on the first forward
        self._order_known = False
        if strategy.frozen:
            for p in module.parameters():
                p.requires_grad_(False)
        self.units = self._build_units(unit_classes)
        self._optimizer = None if strategy.frozen else self._build_optimizer(optim or {})
        for unit in self.units:
            for buf in unit.buffers:
                buf.initial = None  # only the optimizer's fp32 master needed it
        self._register_hooks()

    # -- construction ------------------------------------------------------------------------
    def _build_units(self, unit_classes: list[str] | None) -> list[_Unit]:
        units = []
        for index, spec in enumerate(split_units(self.module, unit_classes)):
            trainable = [p for p in spec.params if p.requires_grad]
            frozen = [p for p in spec.params if not p.requires_grad]
            buffers, train_buf = [], None
            for group in (trainable, frozen):
                if group:
                    buffers.append(_FlatBuffer(group, self.topo, self.strategy.params, self.dtype))
            if trainable:
                train_buf = buffers[0]
            units.append(_Unit(spec, index, buffers, train_buf))
        return units

    def _ways(self, level: Level) -> int:
        return {Level.N: 1, Level.I: self.topo.group_size, Level.G: self.topo.num_ranks}[level]

    def _build_optimizer(self, optim: dict) -> torch.optim.Optimizer | None:
        masters = []
        for unit in self.units:
            buf = unit.trainable
            if buf is None:
                continue
            unit.grad_acc = torch.zeros(buf.size // self._ways(self.strategy.grads),
                                        dtype=torch.float32, device=buf.device)
            os_slice = buf.level_slice(self.strategy.optim)
            if self.dtype == torch.float32:
                # The fp32 parameters are their own master: the OS shard is a view of P.
                p_level_view = buf.shard[self._os_within_p(buf)]
                unit.master = nn.Parameter(p_level_view)
            else:
                unit.master = nn.Parameter(buf.initial[os_slice].clone())
            masters.append(unit.master)
        if not masters:
            return None
        kwargs = {"lr": 1e-5, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
        unknown = set(optim) - set(kwargs)
        if unknown:
            raise ValueError(f"unknown optimizer key(s) {sorted(unknown)}; allowed: "
                             f"{', '.join(kwargs)}")
        kwargs.update(optim)
        kwargs["betas"] = tuple(kwargs["betas"])
        optimizer = torch.optim.AdamW(masters, **kwargs)
        # Allocate the moments now, so memory() is the steady state from the start.
        for p in masters:
            optimizer.state[p] = {
                "step": torch.tensor(0.0),
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
            }
        return optimizer

    def _os_within_p(self, buf: _FlatBuffer) -> slice:
        """Where this rank's OS shard lies inside its P-level buffer (nested order: contiguous)."""
        os_slice = buf.level_slice(self.strategy.optim)
        p_start = buf.p_slice().start
        return slice(os_slice.start - p_start, os_slice.stop - p_start)

    # -- hooks -------------------------------------------------------------------------------
    def _register_hooks(self) -> None:
        for unit in self.units:
            unit.module.register_forward_pre_hook(
                lambda mod, args, kwargs, unit=unit: self._pre_forward(unit, args, kwargs),
                with_kwargs=True, prepend=True)
            unit.module.register_forward_hook(
                lambda mod, args, out, unit=unit: self._post_forward(unit, out))

    def _phase(self) -> str:
        if self._gather_phase is not None:
            return self._gather_phase
        return "backward" if self.state == TrainingState.BACKWARD else "forward"

    def _gather(self, unit: _Unit, phase: str, async_op: bool = False) -> None:
        for buf in unit.buffers:
            buf.start_gather(self.comm, phase, async_op)

    def _wait(self, unit: _Unit) -> None:
        for buf in unit.buffers:
            if buf.finish_gather() and self.verify_gathers:
                self._verify(unit, buf)

    def _free(self, unit: _Unit) -> None:
        for buf in unit.buffers:
            buf.free()

    def _prefetch(self, unit: _Unit, step: int) -> None:
        """Start the gather of the unit ``step`` places after ``unit`` in forward order."""
        if not (self.prefetch and self._order_known) or unit not in self._order:
            return
        k = self._order.index(unit) + step
        if 0 <= k < len(self._order):
            self._gather(self._order[k], self._phase(), async_op=True)

    def _pre_forward(self, unit: _Unit, args: tuple, kwargs: dict) -> tuple | None:
        if unit.index and not self._order_known and unit not in self._order:
            self._order.append(unit)
        self._gather(unit, self._phase())
        self._wait(unit)
        if self.state != TrainingState.BACKWARD:
            self._prefetch(unit, +1)
        if not torch.is_grad_enabled() or unit.armed or unit.index == 0:
            return None
        flat, spec = tree_flatten((args, kwargs))
        positions = [k for k, x in enumerate(flat)
                     if isinstance(x, torch.Tensor) and x.requires_grad]
        if not positions:
            return None
        unit.armed = True
        wrapped = _PostBackward.apply(lambda: self._post_backward(unit),
                                      *[flat[k] for k in positions])
        for k, x in zip(positions, wrapped):
            flat[k] = x
        return tree_unflatten(flat, spec)

    def _post_forward(self, unit: _Unit, output: Any) -> None:
        if unit.index == 0:
            self._order_known = True
        if self.state == TrainingState.BACKWARD or self._hold:
            return  # recomputation inside backward: the parameters are still needed
        self._free(unit)
        if unit.index == 0:
            for other in self._order:  # a prefetch nobody consumed (a skipped block)
                self._free(other)
        if torch.is_grad_enabled():
            for x in _tensors_requiring_grad(output):
                x.register_hook(lambda grad, unit=unit: self._pre_backward(unit))

    def _pre_backward(self, unit: _Unit) -> None:
        if self.state != TrainingState.BACKWARD:
            self.state = TrainingState.BACKWARD
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        if unit.backward_gathered:
            return
        unit.backward_gathered = True
        self._gather(unit, "backward")
        self._wait(unit)
        self._prefetch(unit, -1)

    @torch.no_grad()
    def _post_backward(self, unit: _Unit) -> None:
        if unit.backward_done:
            return
        unit.backward_done = True
        buf = unit.trainable
        if buf is not None:
            grad = buf.flat_grad(self.reduce_dtype)
            grad.div_(self.topo.num_ranks)
            level = self.strategy.grads
            if level == Level.N:
                unit.grad_acc.add_(grad)
            else:
                part = unit.grad_acc.new_empty(unit.grad_acc.shape, dtype=self.reduce_dtype)
                scope = "intra" if level == Level.I else "world"
                self.comm.reduce_scatter(part, grad, scope, "backward")
                unit.grad_acc.add_(part)
        self._free(unit)

    def _end_of_backward(self) -> None:
        # Reverse forward order, then the rest: the same on every rank, so collectives line up.
        rest = [u for u in self.units[1:] if u not in self._order]
        for unit in [*reversed(self._order), *rest, self.units[0]]:
            if not unit.backward_done:
                self._post_backward(unit)
        for unit in self.units:
            unit.armed = unit.backward_gathered = unit.backward_done = False
        self.state = TrainingState.IDLE

    # -- debug -------------------------------------------------------------------------------
    def _verify(self, unit: _Unit, buf: _FlatBuffer) -> None:
        """Compare every chunk of a gathered buffer against its owner's checksum."""
        scope = "intra" if buf.p_level == Level.I else "world"
        group = self.topo.intra if scope == "intra" else self.topo.world
        n = self.comm.size(scope)
        own = buf.shard.detach().double().sum().reshape(1)
        sums = own.new_empty(n)
        if n > 1:
            _all_gather_single(sums, own, group=group)
        else:
            sums.copy_(own)
        chunk = buf.size // n
        t = self.topo
        for k in range(n):
            got = buf.full[k * chunk:(k + 1) * chunk].double().sum()
            if not torch.isclose(got, sums[k], rtol=1e-12, atol=0.0):
                if scope == "intra":
                    owner = t.group_index * t.group_size + k
                else:  # nested chunk k belongs to rank (i = k % g, j = k // g)
                    owner = (k % t.num_groups) * t.group_size + k // t.num_groups
                raise EngineError(
                    f"unit {unit.name!r}: the chunk gathered from rank {owner} does not match "
                    f"its owner's checksum on rank {t.rank} ({got.item()} != {sums[k].item()})"
                )

    # -- public surface ----------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch; the loss is scaled by 1/grad_accum_steps."""
        if self._optimizer is None:
            raise EngineError(f"model {self.meter.model!r} is frozen (strategy "
                              f"{self.strategy.name}); it has no backward")
        if self._micro_batches >= self.grad_accum_steps:
            raise EngineError(f"backward() called {self._micro_batches + 1} times without "
                              f"step(); grad_accum_steps={self.grad_accum_steps}")
        (loss / self.grad_accum_steps).backward()
        self._micro_batches += 1

    @torch.no_grad()
    def step(self) -> float:
        """Reduce gradients to the OS level, clip, AdamW on the OS shard, refresh P.

        Returns the global gradient norm before clipping.
        """
        if self._optimizer is None:
            raise EngineError(f"model {self.meter.model!r} has no optimizer (strategy "
                              f"{self.strategy.name}); step() is for trained models")
        if self._micro_batches != self.grad_accum_steps:
            raise EngineError(f"step() called after {self._micro_batches} of "
                              f"grad_accum_steps={self.grad_accum_steps} backward() calls; "
                              "call it once at the accumulation boundary")
        if self._hold:
            raise EngineError("step() inside gathered(): the gathered copies would go stale")
        # The optimizer writes the shards that gathers read: finish every gather still in
        # flight (a prefetch nobody consumed) and free it, before any shard changes.
        for unit in self.units:
            self._free(unit)
        trained = [u for u in self.units if u.trainable is not None]
        grads = [self._boundary_reduce(u) for u in trained]
        sq = torch.zeros(1, dtype=torch.float32, device=grads[0].device if grads else None)
        for g in grads:
            sq += g.pow(2).sum()
        norm_scope = {Level.I: "intra", Level.G: "world"}.get(self.strategy.optim)
        if norm_scope is not None:
            self.comm.all_reduce(sq, norm_scope, "boundary")
        norm = sq.sqrt()
        if self.max_grad_norm is not None:
            # torch.nn.utils.clip_grad_norm_: scale by max_norm / (norm + 1e-6), capped at 1.
            coef = torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0)
            for g in grads:
                g.mul_(coef)
        for unit, g in zip(trained, grads):
            unit.master.grad = g
        self._optimizer.step()
        for unit in trained:
            unit.master.grad = None
            unit.grad_acc.zero_()
            self._refresh(unit)
        self._micro_batches = 0
        return float(norm)

    def _boundary_reduce(self, unit: _Unit) -> torch.Tensor:
        """The globally summed gradient of this rank's OS shard, in fp32 (DESIGN 4, G -> OS)."""
        g_os = (self.strategy.grads, self.strategy.optim)
        if g_os == (Level.G, Level.G):  # the accumulator already is the OS shard's sum
            return unit.grad_acc.clone()
        acc, m = unit.grad_acc.to(self.reduce_dtype), self.topo.group_size
        if g_os == (Level.N, Level.N):
            self.comm.all_reduce(acc, "world", "boundary")
            out = acc
        elif g_os == (Level.N, Level.I):
            out = acc.new_empty(acc.numel() // m)
            self.comm.reduce_scatter(out, acc, "intra", "boundary")
            self.comm.all_reduce(out, "inter", "boundary")
        elif g_os == (Level.N, Level.G):
            out = acc.new_empty(acc.numel() // self.topo.num_ranks)
            self.comm.reduce_scatter(out, acc, "world", "boundary")
        elif g_os == (Level.I, Level.I):
            self.comm.all_reduce(acc, "inter", "boundary")
            out = acc
        elif g_os == (Level.I, Level.G):
            out = acc.new_empty(acc.numel() // self.topo.num_groups)
            self.comm.reduce_scatter(out, acc, "inter", "boundary")
        return out.to(torch.float32, copy=True)

    def _refresh(self, unit: _Unit) -> None:
        """Bring the updated OS shard back to the P level (DESIGN 4, OS -> P)."""
        buf = unit.trainable
        within = self._os_within_p(buf)
        if self.dtype != torch.float32:
            buf.shard[within].copy_(unit.master)
        os_p = (self.strategy.optim, self.strategy.params)
        if os_p == (Level.I, Level.N):
            self.comm.all_gather(buf.shard, buf.shard[within].clone(), "intra", "update")
        elif os_p == (Level.G, Level.I):
            self.comm.all_gather(buf.shard, buf.shard[within].clone(), "inter", "update")
        elif os_p == (Level.G, Level.N):
            self.comm.all_gather(buf.shard, buf.shard[within].clone(), "world", "update")

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds in P, G and OS (persistent buffers; gathered copies excluded)."""
        params = sum(buf.shard.numel() * buf.shard.element_size()
                     for u in self.units for buf in u.buffers)
        grads = sum(u.grad_acc.numel() * u.grad_acc.element_size()
                    for u in self.units if u.grad_acc is not None)
        optim = 0
        if self._optimizer is not None:
            for unit in self.units:
                if unit.master is None:
                    continue
                state = self._optimizer.state[unit.master]
                optim += sum(state[k].numel() * state[k].element_size()
                             for k in ("exp_avg", "exp_avg_sq"))
                if self.dtype != torch.float32:
                    optim += unit.master.numel() * unit.master.element_size()
        return {"params": params, "grads": grads, "optim": optim}

    @contextlib.contextmanager
    def gathered(self, phase: str = "gather") -> Iterator[nn.Module]:
        """Full parameters of every unit (for generation or evaluation), freed afterwards."""
        if self.state == TrainingState.BACKWARD:
            raise EngineError("gathered() cannot be used during backward")
        outer = self._hold == 0
        if outer:
            self._gather_phase = phase
            for unit in self.units:
                self._gather(unit, phase)
            for unit in self.units:
                self._wait(unit)
        self._hold += 1
        try:
            yield self.module
        finally:
            self._hold -= 1
            if outer:
                self._gather_phase = None
                for unit in self.units:
                    self._free(unit)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded copies of every entry of ``module.state_dict()``, same keys."""
        with self.gathered("gather"):
            return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    @property
    def lr(self) -> float:
        return 0.0 if self._optimizer is None else float(self._optimizer.param_groups[0]["lr"])


def shard(model: nn.Module, strategy: Strategy | str, topology: Topology, *,
          optim: dict | None = None, max_grad_norm: float | None = None,
          grad_accum_steps: int = 1, comm: str = "native", precision: str = "fp32",
          reduce_dtype: str = "fp32", model_name: str = "model",
          unit_classes: list[str] | None = None, prefetch: bool = True,
          verify_gathers: bool = False) -> ShardedEngine:
    """Shard ``model`` in place by ``strategy`` over ``topology`` (DESIGN section 5).

    A frozen strategy (one P level, e.g. ``Strategy.parse("G", frozen=True)``) gives an
    inference-only engine. ``comm`` picks the algorithm of world-scope collectives.
    """
    if isinstance(strategy, str):
        strategy = Strategy.parse(strategy, frozen=len(strategy.strip()) == 1)
    return ShardedEngine(model, strategy, topology, optim=optim, max_grad_norm=max_grad_norm,
                         grad_accum_steps=grad_accum_steps, comm=comm, precision=precision,
                         reduce_dtype=reduce_dtype, model_name=model_name, unit_classes=unit_classes, prefetch=prefetch,
                         verify_gathers=verify_gathers)
