"""A model on DeepSpeed ZeRO as a ``TrainEngine`` (docs/design.md, "DeepSpeed backend").

``deepspeed_engine(...)`` wraps ``deepspeed.initialize`` so that a worker drives it exactly as it
drives ``shard(...)``, through the contract of ``contract.py``: ``engine(**inputs)``,
``backward(loss)`` once per micro-batch, ``step()`` at the accumulation boundary (returning the
gradient norm), ``gathered(phase)`` for generation, ``memory()``, ``meter`` and checkpoints.
What runs underneath is DeepSpeed's own ZeRO stage 0-3 (ZeRO++ hpZ and optimizer offload
included); nothing of PaRO's schedule.

[Note: metering DeepSpeed]
DeepSpeed's comms logger records each collective's name and message size but not the process
group it ran on, and it synchronises the device around every call. Every DeepSpeed collective
passes through one object, ``deepspeed.comm.comm.cdb``; wrapping its methods gives each call
with its group, so the bytes a rank sends are attributed by the same ring model as the PaRO
engine's native collectives (``comm/meter.py``), on intra or inter links by where this rank's
successor on the group's ring sits. tests/sharding/test_deepspeed.py holds the calls recorded
here to the ones DeepSpeed's comms logger counts, op by op.

[Note: DeepSpeed's phases]
Collectives are labelled with the PaRO phase they serve: ``forward`` and ``backward`` inside
those calls; inside ``step()`` an all-gather brings updated parameters back (``update``) and
anything else reduces gradients or the norm (``boundary``); ``gathered(phase)`` uses its phase.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from rlhf_paro.comm.meter import (BACKWARD, BOUNDARY, CHECKPOINT, FORWARD, GATHER, OTHER, UPDATE,
                                  CommMeter, LinkBytes, ring_bytes)
from rlhf_paro.comm.topology import Topology
from rlhf_paro.sharding._host import Transfers
from rlhf_paro.sharding.contract import (EngineOptions, MicroBatches, ModelFactory, full_state_dict,
                                         no_memory)
from rlhf_paro.sharding.errors import EngineError

ZERO_STAGES = (0, 1, 2, 3)
_TAG = "deepspeed"  # the one checkpoint tag this adapter writes under its directory
_FROZEN_MARKER = "deepspeed_frozen"  # what a frozen model's checkpoint holds
# Inside step(): not a phase of its own, each collective is BOUNDARY or UPDATE by its op
# ([Note: DeepSpeed's phases]).
_IN_STEP = "step"

# cdb method -> the PaRO op whose ring model counts it, the buffer that op counts (the whole
# gathered or reduced buffer), and the method's leading parameters. DeepSpeed's wrappers hide
# the signatures (``(self, *args, **kwargs)``), so DeepSpeed's TorchBackend order is written out.
_METERED: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "all_reduce": ("all_reduce", "tensor", ("tensor", "op", "group")),
    "inference_all_reduce": ("all_reduce", "tensor", ("tensor", "op", "group")),
    "all_reduce_coalesced": ("all_reduce", "tensors", ("tensors", "op", "group")),
    # A ring reduce sends what a reduce-scatter does.
    "reduce": ("reduce_scatter", "tensor", ("tensor", "dst", "op", "group")),
    "all_gather_into_tensor": ("all_gather", "output_tensor",
                               ("output_tensor", "input_tensor", "group")),
    "all_gather_base": ("all_gather", "output_tensor", ("output_tensor", "input_tensor", "group")),
    "all_gather": ("all_gather", "tensor_list", ("tensor_list", "tensor", "group")),
    "all_gather_coalesced": ("all_gather", "output_tensors",
                             ("output_tensors", "input_tensors", "group")),
    "reduce_scatter_tensor": ("reduce_scatter", "input_tensor",
                              ("output_tensor", "input_tensor", "op", "group")),
    "reduce_scatter": ("reduce_scatter", "input_list", ("output", "input_list", "op", "group")),
    # A pipelined ring broadcast: (n-1)/n of the buffer per rank.
    "broadcast": ("all_gather", "tensor", ("tensor", "src", "group")),
    "all_to_all_single": ("all_gather", "input", ("output", "input", "output_split_sizes",
                                                  "input_split_sizes", "group")),
}


def _import_deepspeed() -> Any:
    """deepspeed, told to use the CPU when there is no GPU (it picks its accelerator at
    import)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    return deepspeed


def ds_config(*, zero_stage: int, hpz_partition_size: int = 1, offload_optimizer: bool = False,
              optim: dict | None = None, max_grad_norm: float | None = None,
              grad_accum_steps: int = 1, precision: str = "fp32", reduce_dtype: str = "fp32",
              num_ranks: int = 1, frozen: bool = False, cpu: bool = True,
              extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """DeepSpeed's JSON config for one model: its ZeRO stage, precision, AdamW and clipping
    (the same hyperparameters as the PaRO engine), gradients accumulated in fp32; ``extra`` is
    merged over it, key by key (any other DeepSpeed setting)."""
    if zero_stage not in ZERO_STAGES:
        raise ValueError(f"zero_stage={zero_stage} is unknown; allowed: 0, 1, 2, 3")
    if hpz_partition_size > 1 and zero_stage != 3:
        raise ValueError(f"hpz_partition_size={hpz_partition_size} needs zero_stage=3 "
                         "(ZeRO++ hpZ partitions parameters)")
    if hpz_partition_size > 1 and frozen:
        # DeepSpeed's inference-only ZeRO-3 fails to set up hpZ's groups.
        raise ValueError("hpz_partition_size > 1 needs a trained model on DeepSpeed")
    if offload_optimizer and (frozen or zero_stage == 0):
        raise ValueError("offload_optimizer needs a trained model on zero_stage 1, 2 or 3")
    zero: dict[str, Any] = {"stage": zero_stage if not frozen or zero_stage == 3 else 0}
    if hpz_partition_size > 1:
        zero["zero_hpz_partition_size"] = hpz_partition_size
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": not cpu}
    config: dict[str, Any] = {
        # DeepSpeed checks micro x accumulation x ranks = batch; the worker feeds the batches.
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": grad_accum_steps,
        "train_batch_size": grad_accum_steps * num_ranks,
        "zero_optimization": zero,
        "bf16": {"enabled": precision == "bf16"},
        # As the PaRO engine: micro-batch gradients add up in fp32 ([Note: gradient precision]).
        "data_types": {"grad_accum_dtype": "fp32"},
        "communication_data_type": reduce_dtype,
        "steps_per_print": 2 ** 31 - 1,
        "zero_allow_untested_optimizer": True,
    }
    if not frozen:
        params = dict(optim or {})
        params["betas"] = list(params.get("betas", (0.9, 0.999)))
        # torch's AdamW on the CPU (DeepSpeed's fused kernel needs CUDA); DeepSpeedCPUAdam
        # when the optimizer is offloaded.
        if not offload_optimizer:
            params["torch_adam"] = cpu
        config["optimizer"] = {"type": "AdamW", "params": params}
        config["gradient_clipping"] = float(max_grad_norm or 0.0)
    return _merged(config, extra or {})


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


class DeepSpeedEngine:
    """One model on DeepSpeed ZeRO; a ``TrainEngine``."""

    def __init__(self, module: nn.Module, topology: Topology, config: dict[str, Any], *,
                 model_name: str = "model", frozen: bool = False,
                 device: torch.device | str = "cpu") -> None:
        deepspeed = _import_deepspeed()
        if not deepspeed.comm.is_initialized():
            # Joins the process group the worker already made (no discovery from MPI).
            deepspeed.init_distributed(dist_backend=torch.distributed.get_backend(),
                                       auto_mpi_discovery=False)
        # DeepSpeed picks its device by LOCAL_RANK; a worker sees one device, its own.
        os.environ.setdefault("LOCAL_RANK", str(torch.device(device).index or 0))
        self.topo = topology
        self.meter = CommMeter(model_name)
        self.zero_stage = config["zero_optimization"]["stage"]
        self.offload_optimizer = "offload_optimizer" in config["zero_optimization"]
        # Host copies DeepSpeed makes are its own: none are counted here (m/offload/* stay 0).
        self.transfers = Transfers()
        self._micro = MicroBatches(model_name, config["gradient_accumulation_steps"])
        self.frozen = frozen
        self._phase: str | None = None
        self._own_skips = 0  # stage 0 skips done here (DeepSpeed skips only under ZeRO)
        self._last_skipped = False
        _install_recorder(deepspeed)
        if frozen:
            for p in module.parameters():
                p.requires_grad_(False)
        module.to(device)
        trained = [p for p in module.parameters() if p.requires_grad]
        # Not metered: setup's broadcasts are no step's traffic (as for the PaRO engine).
        self.ds, *_ = deepspeed.initialize(model=module, config=config,
                                           model_parameters=None if frozen else trained)
        self.module = self.ds.module
        if frozen:
            self.module.eval()

    # -- metering ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def _metering(self, phase: str) -> Iterator[None]:
        outer = _Recorder.engine
        _Recorder.engine, previous, self._phase = self, self._phase, phase
        try:
            yield
        finally:
            _Recorder.engine, self._phase = outer, previous

    def _record(self, method: str, numel: int, elem_size: int, group_ranks: list[int],
                seconds: float) -> None:
        op = _METERED[method][0]
        phase = self._phase or OTHER
        if phase == _IN_STEP:  # [Note: DeepSpeed's phases]
            phase = UPDATE if op == "all_gather" else BOUNDARY
        sent = ring_bytes(op, numel, elem_size, len(group_ranks))
        me = group_ranks.index(self.topo.rank)
        successor = group_ranks[(me + 1) % len(group_ranks)]
        node = self.topo.group_size
        crosses = successor // node != self.topo.rank // node
        scope = "world" if len(group_ranks) == self.topo.num_ranks else (
            "inter" if crosses else "intra")
        self.meter.record(phase, op, scope, "deepspeed",
                          LinkBytes(0, sent) if crosses else LinkBytes(sent, 0), seconds)

    # -- the engine surface ------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._metering(FORWARD):
            return self.ds(*args, **kwargs)

    def set_micro_batches(self, num_micro: int) -> None:
        """Only the count the engine was built with: DeepSpeed fixes its accumulation at
        ``initialize`` (its ZeRO optimizers keep their own copy of the count, and its boundary is
        the running micro-step count modulo it), so a per-step count would misplace the
        boundary (the config refuses max_tokens_per_micro_batch on this backend)."""
        if num_micro != self._micro.per_step:
            raise EngineError(f"backend deepspeed keeps grad_accum_steps={self._micro.per_step} "
                              f"from initialize; set_micro_batches({num_micro}) needs the "
                              "PaRO engine")

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch; DeepSpeed scales the loss by 1/grad_accum_steps."""
        self._micro.check_backward(not self.frozen)
        with self._metering(BACKWARD):
            self.ds.backward(loss)
            self._micro.done += 1
            if self._micro.done < self.grad_accum_steps:
                self.ds.step()  # DeepSpeed counts micro-steps; off the boundary it only counts

    @torch.no_grad()
    def step(self) -> float:
        """DeepSpeed's boundary step; returns the global gradient norm before clipping. A
        non-finite norm skips the update on every rank (DeepSpeed's ZeRO stages do so
        themselves; on stage 0 this adapter holds the optimizer back, as the PaRO engine
        does)."""
        self._micro.check_step(not self.frozen)
        skipped_before = self.ds.skipped_steps
        own_skip = False
        with self._metering(_IN_STEP):
            if self.zero_stage == 0:
                # The gradients are all-reduced by now, the same on every rank.
                norm = float(torch.linalg.vector_norm(torch.stack(
                    [p.grad.float().norm() for p in self.module.parameters()
                     if p.grad is not None])))
                own_skip = not math.isfinite(norm)
            with _no_update(self.ds.optimizer) if own_skip else contextlib.nullcontext():
                self.ds.step()  # its counters advance and the gradients are zeroed
        self._micro.done = 0
        self._own_skips += own_skip
        self._last_skipped = own_skip or self.ds.skipped_steps > skipped_before
        if self.zero_stage != 0:
            norm = self.ds.get_global_grad_norm()
            norm = float("nan") if norm is None else float(norm)
        return norm

    @contextlib.contextmanager
    def gathered(self, phase: str = GATHER) -> Iterator[nn.Module]:
        """Full parameters (ZeRO-3 gathers them; the other stages hold them whole)."""
        with self._metering(phase):
            if self.zero_stage != 3:
                yield self.module
                return
            deepspeed = _import_deepspeed()
            with deepspeed.zero.GatheredParameters(list(self.module.parameters())):
                yield self.module

    def unit_parameters(self, phase: str = GATHER, trainable_only: bool = False
                        ) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter, full (``trainable_only``: the trained ones): DeepSpeed gathers the
        whole model at once (no unit order of its own to follow, nor a gather of the trained
        parameters alone)."""
        with self.gathered(phase) as module:
            yield from ((name, p.detach()) for name, p in module.named_parameters()
                        if p.requires_grad or not trainable_only)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded copies of every entry of ``module.state_dict()``, same keys."""
        return full_state_dict(self)

    # -- offload=params is the PaRO engine's: DeepSpeed offloads with offload_optimizer -------
    @property
    def params_offloaded(self) -> bool:
        return False

    def offload_params(self) -> None:
        self._micro.check_offload("none")

    def onload_params(self) -> None:
        """Nothing is parked: nothing to bring back."""

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds in P, G and OS on the device and on the host (the keys of
        ``ShardedEngine.memory()``), read off DeepSpeed's partitions: P the
        parameters (ZeRO-3: the partition each keeps, plus hpZ's secondary one), G the fp32 gradient partition the
        optimizer accumulates into (the whole gradient below stage 2), OS the optimizer's fp32
        master partition and moments (on the host when offloaded)."""
        params = list(self.module.parameters())
        if self.zero_stage == 3:
            kept = [t for p in params
                    for t in (p.ds_tensor, getattr(p, "ds_secondary_tensor", None))
                    if t is not None]
            p_bytes = sum(t.numel() * t.element_size() for t in kept)
        else:
            p_bytes = sum(p.numel() * p.element_size() for p in params)
        out = no_memory()
        out["params"] = p_bytes
        if self.frozen:
            return out
        masters = self._master_partitions()
        trained = sum(p.numel() for p in params if p.requires_grad)
        g_elems = sum(m.numel() for m in masters) if self.zero_stage >= 2 else trained
        optim = _optimizer_state(self.ds.optimizer)
        o_bytes = sum(t.numel() * t.element_size() for t in optim)
        if self.zero_stage >= 1:
            o_bytes += sum(m.numel() * m.element_size() for m in masters)
        # Offloaded, DeepSpeed keeps the gradient partition, the master and the moments on the
        # host (``memory()``'s host keys, as for the PaRO engine's offload=optimizer).
        where = "host_" if self.offload_optimizer else ""
        out[f"{where}grads"], out[f"{where}optim"] = 4 * g_elems, o_bytes
        return out

    def _master_partitions(self) -> list[torch.Tensor]:
        opt = self.ds.optimizer
        for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
            if hasattr(opt, name):
                return list(getattr(opt, name))
        return []

    # -- checkpoints: DeepSpeed's own format -------------------------------------------------
    def save_checkpoint(self, directory: str | os.PathLike) -> Path:
        """DeepSpeed's checkpoint of this model (every rank calls it) under ``directory``. A
        frozen model's weights are its source's, unchanged: it writes only a marker, and is
        built from its source again on resume."""
        self._micro.check_between_steps("save_checkpoint()")
        directory = Path(directory)
        if self.frozen:
            directory.mkdir(parents=True, exist_ok=True)
            (directory / _FROZEN_MARKER).write_text(f"{self.zero_stage}\n")
            return directory
        with self._metering(CHECKPOINT):
            self.ds.save_checkpoint(str(directory), tag=_TAG)
        return directory

    def load_checkpoint(self, directory: str | os.PathLike) -> None:
        """Load what ``save_checkpoint`` wrote; DeepSpeed needs the same ZeRO stage and
        number of ranks."""
        self._micro.check_between_steps("loading a checkpoint")
        if self.frozen:
            if not (Path(directory) / _FROZEN_MARKER).is_file():
                raise EngineError(f"{directory} holds no checkpoint of a frozen DeepSpeed model")
            return
        with self._metering(CHECKPOINT):
            path, _ = self.ds.load_checkpoint(str(directory), tag=_TAG,
                                              load_optimizer_states=True,
                                              load_lr_scheduler_states=False)
        if path is None:
            raise EngineError(f"no DeepSpeed checkpoint under {directory}")

    @property
    def grad_accum_steps(self) -> int:
        """backward() calls per step()."""
        return self._micro.per_step

    @property
    def lr(self) -> float:
        return 0.0 if self.frozen else float(self.ds.get_lr()[0])

    @property
    def skipped_steps(self) -> int:
        return 0 if self.frozen else int(self.ds.skipped_steps) + self._own_skips

    @property
    def last_step_skipped(self) -> bool:
        return self._last_skipped


@contextlib.contextmanager
def _no_update(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """The optimizer's ``step`` does nothing meanwhile: DeepSpeed's boundary step on stage 0
    then only clips and zeroes the gradients, a skipped step."""
    optimizer.step = lambda *args, **kwargs: None
    try:
        yield
    finally:
        del optimizer.step  # the class's step again


def _optimizer_state(optimizer: Any) -> list[torch.Tensor]:
    """The tensors of the torch optimizer inside DeepSpeed's wrappers (Adam moments)."""
    inner = optimizer
    while hasattr(inner, "optimizer") and not isinstance(inner, torch.optim.Optimizer):
        inner = inner.optimizer
    return [t for state in inner.state.values() for t in state.values()
            if isinstance(t, torch.Tensor) and t.dim() > 0]


class _Recorder:
    """The wrapper around DeepSpeed's communication backend ([Note: metering DeepSpeed])."""

    engine: DeepSpeedEngine | None = None  # the engine whose call is running
    installed_on: Any = None  # the backend object already wrapped


def _install_recorder(deepspeed: Any) -> None:
    backend = deepspeed.comm.comm.cdb
    if _Recorder.installed_on is backend:
        return
    for method in _METERED:
        original = getattr(backend, method, None)
        if original is not None:
            setattr(backend, method, _recording(method, original))
    _Recorder.installed_on = backend


def _recording(method: str, original: Any) -> Any:
    _, counted, names = _METERED[method]

    def call(*args: Any, **kwargs: Any) -> Any:
        engine = _Recorder.engine
        if engine is None:
            return original(*args, **kwargs)
        bound = {**dict(zip(names, args)), **kwargs}
        start = time.perf_counter()
        out = original(*args, **kwargs)
        value = bound.get(counted)
        tensors = [t for t in (value if isinstance(value, (list, tuple)) else [value])
                   if isinstance(t, torch.Tensor)]
        if tensors:
            group = bound.get("group")
            ranks = torch.distributed.get_process_group_ranks(
                group if group is not None else torch.distributed.group.WORLD)
            engine._record(method, sum(t.numel() for t in tensors), tensors[0].element_size(),
                           sorted(ranks), time.perf_counter() - start)
        return out

    return call


def deepspeed_engine(module: nn.Module, topology: Topology, *, zero_stage: int = 3,
                     hpz_partition_size: int = 1, offload_optimizer: bool = False,
                     optim: dict | None = None, max_grad_norm: float | None = None,
                     grad_accum_steps: int = 1, precision: str = "fp32",
                     reduce_dtype: str = "fp32", model_name: str = "model",
                     frozen: bool = False, device: torch.device | str | None = None,
                     extra: dict[str, Any] | None = None) -> DeepSpeedEngine:
    """``module`` on DeepSpeed ZeRO ``zero_stage`` over ``topology``'s process group; the
    counterpart of ``shard(...)`` (same optimizer, clipping and accumulation arguments)."""
    device = torch.device(device) if device is not None else next(module.parameters()).device
    config = ds_config(zero_stage=zero_stage, hpz_partition_size=hpz_partition_size,
                       offload_optimizer=offload_optimizer, optim=optim,
                       max_grad_norm=max_grad_norm, grad_accum_steps=grad_accum_steps,
                       precision=precision, reduce_dtype=reduce_dtype,
                       num_ranks=topology.num_ranks, frozen=frozen, cpu=device.type == "cpu",
                       extra=extra)
    return DeepSpeedEngine(module, topology, config, model_name=model_name, frozen=frozen,
                           device=device)


def from_options(factory: ModelFactory, topology: Topology, options: EngineOptions
                 ) -> DeepSpeedEngine:
    """The DeepSpeed engine of ``options`` (``contract.BACKENDS["deepspeed"]``): DeepSpeed
    partitions a model built whole on every rank."""
    if options.offload != "none":
        raise ValueError(f"offload={options.offload!r} is the PaRO engine's; a DeepSpeed model "
                         "offloads with offload_optimizer; allowed: none")
    return deepspeed_engine(factory.whole(), topology, zero_stage=options.zero_stage,
                            hpz_partition_size=options.hpz_partition_size,
                            offload_optimizer=options.offload_optimizer, optim=options.optim,
                            max_grad_norm=options.max_grad_norm,
                            grad_accum_steps=options.grad_accum_steps,
                            precision=options.precision, reduce_dtype=options.reduce_dtype,
                            model_name=options.model_name, frozen=options.frozen,
                            device=options.device, extra=options.deepspeed_config)
