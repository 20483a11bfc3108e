"""What a worker drives on every backend (docs/design.md, "The engine contract").

``TrainEngine`` is the surface both engines implement, the PaRO engine (``engine.py``) and
DeepSpeed ZeRO (``deepspeed_engine.py``); ``EngineOptions`` is what either is built from;
``BACKENDS`` names the builders, so that a caller picks one by ``<model>.backend`` without
knowing it. What both engines must do alike lives here once: the order of ``backward()`` and
``step()`` calls and its errors (``MicroBatches``), ``memory()``'s keys and ``full_state_dict``.

Nothing here imports torch: the config and the metrics read ``MEMORY_KEYS`` and the backend
names without it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import (TYPE_CHECKING, Any, Callable, ContextManager, Iterator, NamedTuple,
                    Protocol, runtime_checkable)

from rlhf_paro.comm.meter import GATHER
from rlhf_paro.sharding.errors import EngineError

if TYPE_CHECKING:
    import os
    from pathlib import Path

    import torch
    from torch import nn

    from rlhf_paro.comm.meter import CommMeter
    from rlhf_paro.comm.topology import Topology
    from rlhf_paro.sharding._flat import Read
    from rlhf_paro.sharding._host import Transfers

# memory()'s keys, bytes this rank holds between steps: P, G and OS on the device, then in host
# memory (the metrics' m/mem/<key>_bytes).
MEMORY_KEYS = ("params", "grads", "optim", "host_params", "host_grads", "host_optim")


@runtime_checkable
class TrainEngine(Protocol):
    """One model on one rank, sharded by some backend: what the workers call.

    A step is ``grad_accum_steps`` calls of ``backward(loss)`` (each after a forward through
    ``engine(**inputs)``), then one ``step()``; ``set_micro_batches(k)`` between steps makes
    the following steps k calls (the same k on every rank: the backward's collectives run per
    micro-batch); anything else in between raises ``EngineError``
    (``MicroBatches``), as do ``backward()`` and ``step()`` on a frozen model. Checkpoints are
    written and read between steps only. ``offload_params()`` parks the parameters in host
    memory between phases, where the backend keeps them there (``offload='params'``); forward
    and ``gathered()`` refuse while parked.
    """

    module: nn.Module  # the model; its parameters are whatever the backend keeps between calls
    meter: CommMeter  # every collective the engine runs, by phase (reset by the worker)
    transfers: Transfers  # device <-> host copies the engine makes (reset by the worker)

    @property
    def grad_accum_steps(self) -> int: ...  # backward() calls per step()

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

    def set_micro_batches(self, num_micro: int) -> None: ...  # grad_accum_steps from now on

    def backward(self, loss: torch.Tensor) -> None: ...

    def step(self) -> float: ...  # the global gradient norm before clipping

    def gathered(self, phase: str = GATHER) -> ContextManager[nn.Module]: ...

    # Full parameters a unit at a time: (name in module.named_parameters(), tensor), each valid
    # until the next unit's are drawn ([Note: a unit at a time]); ``trainable_only``: the
    # trained parameters alone.
    def unit_parameters(self, phase: str = GATHER, trainable_only: bool = False
                        ) -> Iterator[tuple[str, torch.Tensor]]: ...

    def memory(self) -> dict[str, int]: ...  # MEMORY_KEYS -> bytes

    def full_state_dict(self) -> dict[str, torch.Tensor]: ...

    def save_checkpoint(self, directory: str | os.PathLike) -> Path: ...

    def load_checkpoint(self, directory: str | os.PathLike) -> None: ...

    @property
    def params_offloaded(self) -> bool: ...

    def offload_params(self) -> None: ...

    def onload_params(self) -> None: ...

    @property
    def lr(self) -> float: ...  # the optimizer's learning rate (0.0 when frozen)

    @property
    def skipped_steps(self) -> int: ...  # steps skipped on a non-finite loss or norm, in all

    @property
    def last_step_skipped(self) -> bool: ...


@dataclass(frozen=True)
class EngineOptions:
    """What a backend builds one model's engine from (a worker makes it from the model's config
    section). Each backend reads the shared keys and its own; the other's keep their defaults."""

    backend: str = "paro"  # a key of BACKENDS
    model_name: str = "model"  # names the model in errors and on its comm meter
    frozen: bool = False  # inference only: no gradients, no optimizer
    precision: str = "fp32"  # of the parameters: fp32 or bf16 (with fp32 masters)
    device: torch.device | str | None = None  # of the shards (None: where the parameters are)
    # A trained model's step: AdamW's keyword arguments, the clipping norm (None: no clipping),
    # micro-batches per step, and the precision of gradient reductions between ranks.
    optim: dict[str, Any] | None = None
    max_grad_norm: float | None = None
    grad_accum_steps: int = 1
    reduce_dtype: str = "fp32"
    # paro: the strategy (a triple or preset; one P level when frozen), the algorithm of
    # world-scope collectives, and what lives in host memory (none, optimizer, params).
    strategy: str | None = None
    comm: str = "auto"
    offload: str = "none"
    # deepspeed: the ZeRO stage, hpZ's partition size, the optimizer in host memory, and any
    # other DeepSpeed setting merged over the generated config.
    zero_stage: int = 3
    hpz_partition_size: int = 1
    offload_optimizer: bool = False
    deepspeed_config: dict[str, Any] = field(default_factory=dict)


class ModelFactory(NamedTuple):
    """The two ways to build a model; each backend calls the one it needs. ``with_source()``: the
    module, its parameters possibly on the meta device, and the reader of their values that
    the shards are filled from (None: the parameters' own values), so that no rank holds it
    whole (docs/design.md, "Setup"); ``whole()``: the module built whole on this rank."""

    with_source: Callable[[], tuple[nn.Module, Read | None]]
    whole: Callable[[], nn.Module]

    @classmethod
    def of(cls, module: nn.Module) -> ModelFactory:
        """A module already built whole."""
        return cls(lambda: (module, None), lambda: module)


# Backend name -> the module whose ``from_options(factory, topology, options)`` builds its
# engine; imported when used (DeepSpeed's import is slow and optional).
BACKENDS = {"paro": "rlhf_paro.sharding.engine", "deepspeed": "rlhf_paro.sharding.deepspeed_engine"}


def build_engine(factory: ModelFactory, topology: Topology, options: EngineOptions
                 ) -> TrainEngine:
    """The engine of ``options.backend`` over ``topology``'s process group."""
    if options.backend not in BACKENDS:
        raise ValueError(f"backend={options.backend!r} is unknown; allowed: "
                         f"{', '.join(BACKENDS)}")
    builder = importlib.import_module(BACKENDS[options.backend]).from_options
    return builder(factory, topology, options)


class MicroBatches:
    """The order of calls every backend holds a worker to: ``per_step`` backward() calls, then
    one step(); checkpoints only between steps. The one source of these errors, so a worker
    meets the same ones on every backend."""

    def __init__(self, model_name: str, per_step: int) -> None:
        if per_step < 1:
            raise ValueError(f"grad_accum_steps={per_step} must be a positive integer")
        self.model_name = model_name
        self.per_step = per_step
        self.done = 0  # backward() calls since the last step()

    @property
    def last(self) -> bool:
        """Inside the backward of the step's last micro-batch (``done`` counts it after)."""
        return self.done == self.per_step - 1

    def set_per_step(self, per_step: int) -> None:
        """``per_step`` backward() calls per step from the next step on; between steps only
        (the loss scale and the boundary of a step in progress depend on it)."""
        if per_step < 1:
            raise ValueError(f"grad_accum_steps={per_step} must be a positive integer")
        self.check_between_steps("set_micro_batches()")
        self.per_step = per_step

    def check_backward(self, trained: bool) -> None:
        if not trained:
            raise EngineError(f"model {self.model_name!r} is frozen; it has no backward")
        if self.done >= self.per_step:
            raise EngineError(f"backward() called {self.done + 1} times without step(); "
                              f"grad_accum_steps={self.per_step}")

    def check_step(self, trained: bool) -> None:
        if not trained:
            raise EngineError(f"model {self.model_name!r} has no optimizer; step() is for "
                              "trained models")
        if self.done != self.per_step:
            raise EngineError(f"step() called after {self.done} of grad_accum_steps="
                              f"{self.per_step} backward() calls; call it once at the "
                              "accumulation boundary")

    def check_between_steps(self, what: str) -> None:
        if self.done:
            raise EngineError(f"{what} after {self.done} backward() call(s) without step(): "
                              "accumulated gradients are not part of the state")

    def check_offload(self, offload: str) -> None:
        """``offload_params()`` needs a model built with ``offload='params'``, between steps."""
        if offload != "params":
            raise EngineError(f"model {self.model_name!r} was built with offload={offload!r}; "
                              "offload_params() needs offload='params'")
        if self.done:
            raise EngineError("offload_params() between backward() and step(): the "
                              "parameters are in use")


def no_memory() -> dict[str, int]:
    """``memory()`` of nothing held: every key, 0 bytes."""
    return dict.fromkeys(MEMORY_KEYS, 0)


def full_state_dict(engine: TrainEngine) -> dict[str, torch.Tensor]:
    """Unsharded copies of every entry of ``engine.module.state_dict()``, same keys: every rank
    gathers (phase ``gather``)."""
    with engine.gathered(GATHER):
        return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
