"""The run's models in this process, without Ray: what a test of the trainer's logic, or of one
step's order, runs on (``LocalGroup``, ``local_groups``).

A ``LocalGroup`` answers the calls a ``ModelGroup`` does (``call``, ``run``, ``rendezvous``,
``put``) with values instead of references: each call runs at once, in the order issued, which
is an order the plan allows (``ppo/step.py``: a call is issued after what it reads). It holds one
rank of its model, on the process group of this process (gloo): a run of one device
(``cluster.num_devices=1``) computes as it does on Ray; a test's N gloo processes each hold rank
r of N of every model and run the same plan, so the models' collectives meet.

[Note: one random stream per worker]
On Ray each worker is a process of its own, with torch's random stream its own: a dropout mask
the critic draws does not move the actor's. Here the workers share a process, so each keeps its
own stream: the process's generator state is set to the worker's before each of its calls and
read back after it, as if each had run alone. A worker starts from the state a fresh process
starts from.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import torch
import torch.distributed as dist

from rlhf_paro.actors.group import Call
from rlhf_paro.config import Config, ConfigError

# The state torch's default generator starts a process with (its documented default seed).
_FRESH_SEED = 67280421310721


def init_process_group() -> None:
    """This process as rank 0 of 1 on gloo, unless it has joined a group already (a test's)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


class LocalGroup:
    """Rank ``rank`` of ``world`` of model ``role`` in this process (``worker_cls(cfg, role,
    rank, world)``; the other ranks, if any, in other processes of this process group)."""

    num_ranks = 1  # the ranks held here: one slice of every per-rank value

    def __init__(self, worker_cls: type, role: str, cfg: Config,
                 issued: list[Call] | None = None, rank: int = 0, world: int = 1) -> None:
        self.role = role
        self.issued = [] if issued is None else issued
        self._states = [torch.Generator().manual_seed(_FRESH_SEED).get_state()]
        self.workers: list[Any] = []
        self.workers.append(self._in_stream(0, lambda: worker_cls(cfg, role, rank, world)))

    def _in_stream(self, rank: int, fn: Any) -> Any:
        """``fn()`` on worker ``rank``'s own random stream ([Note: one random stream per
        worker])."""
        saved = torch.get_rng_state()
        torch.set_rng_state(self._states[rank])
        try:
            return fn()
        finally:
            self._states[rank] = torch.get_rng_state()
            torch.set_rng_state(saved)

    def rendezvous(self) -> list[int]:
        """Build the rank's model on this process's group; this process's id."""
        init_process_group()
        for rank, worker in enumerate(self.workers):
            if getattr(worker, "has_model", True):  # a reward function or server builds none
                self._in_stream(rank, worker.shard_model)
        return [os.getpid()] * self.num_ranks

    def call(self, method: str, *per_rank: Sequence[Any], num_returns: int = 1,
             **common: Any) -> list[Any]:
        """``ModelGroup.call``, run now: each rank's result (a tuple for ``num_returns`` > 1)."""
        out = []
        for rank, worker in enumerate(self.workers):
            self.issued.append(Call(None, self.role, rank, method))
            out.append(self._in_stream(rank, lambda: getattr(worker, method)(
                *(arg[rank] for arg in per_rank), **common)))
        return out

    def run(self, method: str, step: int, returns: tuple[str, ...] = (),
            keeps: tuple[str, ...] = (), takes: tuple[str, ...] = (),
            *after: Sequence[Any], sent: dict[str, Sequence[Any]] | None = None,
            common: dict[str, Any] | None = None) -> list[Any]:
        """``ModelGroup.run``, run now (what it waits for, ``after``, is there)."""
        sent = sent or {}
        self.issued.extend(Call(None, self.role, rank, method) for rank in range(self.num_ranks))
        return [self._in_stream(rank, lambda: worker.run(
                    method, step, returns, keeps, takes,
                    **{name: values[rank] for name, values in sent.items()}, **(common or {})))
                for rank, worker in enumerate(self.workers)]

    @staticmethod
    def put(value: Any) -> Any:
        return value

    def shutdown(self) -> None:
        """Nothing to stop: the workers are this process's objects."""


def check(cfg: Config, world: int = 1, dealt: bool = True) -> None:
    """The runs in-process groups can hold: ``world`` devices (one rank each in as many
    processes), the rollout in the actor's ranks, and, over several with the actor's ranks'
    rollouts (``dealt``), each rank's its own (the driver of one process cannot deal the others'
    rows)."""
    if cfg.cluster.num_devices != world:
        raise ConfigError("cluster.num_devices", f"{cfg.cluster.num_devices} for an in-process "
                                                 f"run of {world} process(es); allowed: {world}")
    if world > 1 and dealt and cfg.deals_rollouts:
        raise ConfigError("ppo.balance_batch", "true for an in-process run of several processes; "
                                               "allowed: false")
    if cfg.rollout.num_devices:
        raise ConfigError("rollout.num_devices", f"{cfg.rollout.num_devices} for an in-process "
                                                 "run; allowed: 0")
