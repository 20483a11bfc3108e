"""The optimizer step at the accumulation boundary: reduce the gradients to the OS level, clip by
the global norm, AdamW on the OS shards, bring the new parameters back to the P level.

[Note: exactness]  (docs/design.md, "Exactness")
Gradients are summed over ranks and divided by N once, on the OS shard (engine.py,
[Note: one division by N]), and the loss by s in ``backward``, so the accumulated gradient is
the mean over the N*s micro-batches, as in the unsharded reference fed
the whole global batch. The squared norm is summed over this rank's OS shard and all-reduced
over the ranks whose OS shards are disjoint (the schedule's norm row), so each element counts
once. The update is ``torch.optim.AdamW`` itself on the OS shard, element for element the same
arithmetic as on the unsharded model. With offload=optimizer it is ``DeepSpeedCPUAdam`` on a
host copy of the OS shard: the same fp32 AdamW formula in another order of operations (fused
multiply-adds, beta^t and the bias corrections in fp32), a few roundings per element and step
apart (docs/design.md, "Offload").

[Note: a step skipped on bad numbers]  (docs/design.md, "Exactness")
A non-finite loss or gradient norm skips the step: no AdamW update (its step count stays), no
refresh, the accumulators zeroed; ``step()`` still returns the norm. Every rank of the model
must decide alike, and no collective is added for it: the decision is taken on the global norm,
which is the same number on every rank for all 14 strategies.
  - OS = G (NNG NIG NGG ING IIG IGG GNG GIG GGG): the squared norms of the OS shards are
    all-reduced over the world, so every rank holds the one result of one all-reduce.
  - OS = I (NNI NII INI III): the OS-level gradient was all-reduced over inter just before, so
    the g groups hold identical replicas, and each group's intra all-reduce of the squared
    norms sums the same values (and a non-finite value makes any order's sum non-finite).
  - OS = N (NNN): no norm all-reduce, but the gradient itself was all-reduced over the world,
    so every rank squares the same full gradient.
A non-finite number anywhere reaches every rank: any element of any rank's accumulator is summed
into some OS shard's element, whose square every rank's norm counts (once). A non-finite loss
may come with finite gradients (a constant NaN added to it), so ``poison`` puts a NaN into one
element of that rank's accumulator, which then takes the same path: no flag to all-reduce, and
no host synchronisation in ``backward``.
"""

from __future__ import annotations

import torch
from torch import nn

from rlhf_paro.comm.collectives import Communicator, Pending
from rlhf_paro.comm.meter import BOUNDARY, UPDATE
from rlhf_paro.sharding._checkpoint import OPTIMIZER_KINDS, Slot
from rlhf_paro.sharding._host import Transfers, cpu_adam, host_zeros
from rlhf_paro.sharding._unit import Unit
from rlhf_paro.sharding.schedule import Collective, run, select, ways
from rlhf_paro.sharding.strategy import Strategy

OPTIM_DEFAULTS = {"lr": 1e-5, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}


class BoundaryStep:
    """The OS shards of a trained model's units, their AdamW state, and the boundary step."""

    def __init__(self, units: list[Unit], strategy: Strategy, comm: Communicator,
                 collectives: tuple[Collective, ...], optim: dict,
                 max_grad_norm: float | None, reduce_dtype: torch.dtype,
                 transfers: Transfers, offload_optimizer: bool = False) -> None:
        unknown = set(optim) - set(OPTIM_DEFAULTS)
        if unknown:
            raise ValueError(f"unknown optimizer key(s) {sorted(unknown)}; allowed: "
                             f"{', '.join(OPTIM_DEFAULTS)}")
        self.units = [u for u in units if u.trainable is not None]
        self.strategy = strategy
        self.comm = comm
        self.max_grad_norm = max_grad_norm
        self.reduce_dtype = reduce_dtype
        self._reduce = select(collectives, BOUNDARY, "grads")
        self._norm = select(collectives, BOUNDARY, "norm")
        self._update = select(collectives, UPDATE, "trained")
        self.transfers = transfers
        # offload=optimizer: masters, moments and a copy of the OS gradient live in host memory
        # (_host.py, [Note: offload modes]); the masters are then never views of P.
        self.offload = offload_optimizer
        self.masters: list[nn.Parameter] = []  # the OS shard of each trained unit
        # Reductions to the OS level started before the step: unit -> (pending, input, output).
        self._started: dict[Unit, tuple[Pending, torch.Tensor, torch.Tensor]] = {}
        self.host_grads: list[torch.Tensor] = []  # offload: where each OS gradient is stepped
        for unit in self.units:
            buf = unit.trainable
            unit.grad_acc = torch.zeros(buf.size // ways(strategy.grads, comm.topo),
                                        dtype=torch.float32, device=buf.device)
            own = buf.shard[buf.within_shard(strategy.optim)]
            if buf.master is not None:  # a bf16 model's, read when the buffer was filled
                # (_flat.py, [Note: filling a buffer]), on the host already with offload
                master, buf.master = buf.master, None
            elif offload_optimizer:
                master = host_zeros(own.numel(), torch.float32, buf.device)
                master.copy_(own)
            else:  # the fp32 parameters are their own master: the OS shard is a view of P
                master = own
            self.masters.append(nn.Parameter(master))
            if offload_optimizer:
                self.host_grads.append(host_zeros(master.numel(), torch.float32, buf.device))
        kwargs = {**OPTIM_DEFAULTS, **optim}
        kwargs["betas"] = tuple(kwargs["betas"])
        self.optimizer = (None if not self.masters
                          else cpu_adam(self.masters, **kwargs) if offload_optimizer
                          else torch.optim.AdamW(self.masters, **kwargs))
        self.skipped_steps = 0  # steps skipped on a non-finite loss or norm, in total
        self.last_skipped = False  # whether the latest step was one of them
        # Allocate the moments now, so memory() is the steady state from the start. Both
        # optimizers take a state they find; DeepSpeedCPUAdam counts steps in a Python int.
        for p in self.masters:
            self.optimizer.state[p] = {
                "step": 0 if offload_optimizer else torch.tensor(0.0),
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
            }

    @torch.no_grad()
    def __call__(self) -> float:
        """One optimizer step; returns the global gradient norm before clipping."""
        grads = [self._reduce_to_os(u) for u in self.units]
        sq = torch.zeros(1, dtype=torch.float32, device=grads[0].device if grads else None)
        for g in grads:
            sq += g.pow(2).sum()
        run(self._norm, sq, self.comm)
        norm = sq.sqrt()
        self.last_skipped = not bool(torch.isfinite(norm))  # [Note: a step skipped on bad numbers]
        if self.last_skipped:
            self.skipped_steps += 1
            for unit in self.units:
                unit.grad_acc.zero_()
            return float(norm)
        if self.max_grad_norm is not None:
            # torch.nn.utils.clip_grad_norm_: scale by max_norm / (norm + 1e-6), capped at 1.
            coef = torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0)
            for g in grads:
                g.mul_(coef)
        for k, (master, g) in enumerate(zip(self.masters, grads)):
            if self.offload:
                self.transfers.to_host(self.host_grads[k], g)
                g = self.host_grads[k]
            master.grad = g
        if self.optimizer is not None:
            self.optimizer.step()
        for unit, master in zip(self.units, self.masters):
            master.grad = None
            unit.grad_acc.zero_()
            self._refresh(unit, master)
        return float(norm)

    @torch.no_grad()
    def poison(self, loss: torch.Tensor) -> None:
        """Make this step's norm non-finite on every rank if ``loss`` is not finite
        ([Note: a step skipped on bad numbers]); adds 0 otherwise, without a host sync."""
        bad = torch.where(torch.isfinite(loss.detach()).all(), 0.0, float("nan"))
        self.units[0].grad_acc[:1].add_(bad)

    def start(self, unit: Unit) -> None:
        """Start the first collective of the unit's reduction to the OS level, asynchronously,
        once its accumulator holds the step's whole sum (engine.py, [Note: the boundary starts
        in the last backward]); ``__call__`` finishes it."""
        if not self._reduce or unit in self._started:
            return
        c = self._reduce[0]
        # The input is scratch: in fp32 it is the accumulator, which the step zeroes anyway,
        # else a rounded copy. So an all-reduce sums in place, and a ring reduce-scatter keeps
        # its partial sums in it (``overwrite``) instead of in a zeroed copy of the gradient.
        tensor = unit.grad_acc.to(self.reduce_dtype)
        if c.op == "all_reduce":
            out = tensor
            pending = self.comm.all_reduce(tensor, c.scope, c.phase, async_op=True)
        else:  # the reduce-scatter of a level change
            out = tensor.new_empty(tensor.numel() // self.comm.size(c.scope))
            pending = self.comm.reduce_scatter(out, tensor, c.scope, c.phase, async_op=True,
                                               overwrite=True)
        self._started[unit] = (pending, tensor, out)

    def _reduce_to_os(self, unit: Unit) -> torch.Tensor:
        """The globally summed gradient of this rank's OS shard, in fp32 (schedule, boundary)."""
        n = self.comm.topo.num_ranks  # engine.py, [Note: one division by N]
        if not self._reduce:  # G = OS: the accumulator already is the OS shard's sum, and
            return unit.grad_acc.div_(n)  # is zeroed after the step, so it may be scaled in place
        self.start(unit)  # a no-op when the last backward started it
        pending, _, out = self._started.pop(unit)
        pending.wait()
        out = run(self._reduce[1:], out, self.comm)
        # A fresh tensor, or the fp32 accumulator (reduced in place, zeroed after the step), or
        # a copy where the reduction ran in bf16: scratch either way.
        return out.to(torch.float32).div_(n)

    def _refresh(self, unit: Unit, master: torch.Tensor) -> None:
        """Bring the updated OS shard back to the P level (schedule, update)."""
        buf = unit.trainable
        within = buf.within_shard(self.strategy.optim)
        if self.offload:
            self.transfers.to_device(buf.shard[within], master)
        elif buf.full.dtype != torch.float32:
            buf.shard[within].copy_(master)
        if self._update:
            run(self._update, buf.shard[within].clone(), self.comm, out=buf.shard)

    def memory(self) -> dict[str, int]:
        """Bytes of the optimizer's state: ``optim`` on the device (Adam moments, and the fp32
        masters where they are not the parameters themselves), ``host_optim`` and
        ``host_grads`` in host memory (offload=optimizer: masters and moments, the OS
        gradient's copy)."""
        state = sum(self.optimizer.state[m][k].numel() * self.optimizer.state[m][k].element_size()
                    for m in self.masters for k in OPTIMIZER_KINDS)
        state += sum(m.numel() * m.element_size() for unit, m in zip(self.units, self.masters)
                     if self.offload or unit.trainable.full.dtype != torch.float32)
        grads = sum(g.numel() * g.element_size() for g in self.host_grads)
        if self.offload:
            return {"optim": 0, "host_optim": state, "host_grads": grads}
        return {"optim": state, "host_optim": 0, "host_grads": 0}

    def sync_masters(self) -> None:
        """After a load: fp32 masters of their own (offload) take the loaded parameters, which
        a checkpoint holds for them (fp32 parameters are their own master there)."""
        for unit, master in zip(self.units, self.masters):
            buf = unit.trainable
            if self.offload and buf.full.dtype == torch.float32:
                master.detach().copy_(buf.p_values[buf.within_shard(self.strategy.optim)])

    def slots(self) -> list[Slot]:
        """This rank's optimizer state for a checkpoint, on the OS shard: the fp32 master (bf16
        models; fp32 parameters are their own master) and both moments."""
        out = []
        for unit, master in zip(self.units, self.masters):
            buf, state = unit.trainable, self.optimizer.state[master]
            if buf.full.dtype != torch.float32:  # an offloaded fp32 master equals P: not saved
                out.append(Slot("master", buf, self.strategy.optim, master.detach()))
            out += [Slot(kind, buf, self.strategy.optim, state[kind]) for kind in OPTIMIZER_KINDS]
        return out

    @property
    def step_count(self) -> int | None:
        """AdamW steps taken (skipped ones not counted); None without an optimizer."""
        if self.optimizer is None:
            return None
        return int(self.optimizer.state[self.masters[0]]["step"])

    def restore_counts(self, step_count: int, skipped_steps: int) -> None:
        for master in self.masters:
            state = self.optimizer.state[master]
            if isinstance(state["step"], torch.Tensor):
                state["step"].fill_(step_count)
            else:  # DeepSpeedCPUAdam's Python int; its kernel recomputes beta^t on a jump
                state["step"] = step_count
        self.skipped_steps = skipped_steps
        self.last_skipped = False

    @property
    def lr(self) -> float:
        return 0.0 if self.optimizer is None else float(self.optimizer.param_groups[0]["lr"])
