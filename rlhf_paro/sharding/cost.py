"""Closed forms of the paper's Table 2 (memory) and Table 3 (traffic) for all 14 strategies.

Everything is per rank and exact for the engine: a unit's trainable and frozen flat buffers are
each padded to a multiple of N, bytes per element are 4 (fp32) or 2 (bf16) for P, 4 for G (the
engine accumulates gradients in fp32 whatever the parameter precision, where Table 2 counts 2 in
mixed precision; see the engine's [Note: gradient precision]), and the optimizer state is K bytes
per trainable element, K = 8 in fp32 (Adam moments; the fp32 parameters themselves are the master
copy) and K = 12 in bf16 (fp32 master + moments), the K of Table 2 for mixed precision. Gradient
reductions send ``reduce_dtype`` elements (fp32 by default; bf16 is Table 3's setting).

Traffic is not a second copy of the schedule: ``traffic`` runs the engine's own table
(``schedule.py``) for one optimizer step of s micro-batches on a ``DryRunCommunicator``, which
counts what each collective would send and moves nothing. ``tests/sharding/test_cost.py`` holds
the result to closed forms written independently from the paper's Table 3.

A sync into a rollout engine that holds its own copy of the weights (``engine.unit_parameters``,
[Note: a unit at a time]) gathers every unit's flat buffers at the P scope as a forward does,
metered under ``sync``: ``traffic`` counts it by running the forward's gather row again under that
phase, once per sync.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from rlhf_paro.comm.collectives import DryRunCommunicator
from rlhf_paro.comm.meter import BOUNDARY, FORWARD, SYNC, CommMeter, LinkBytes
from rlhf_paro.comm.topology import Topology
from rlhf_paro.sharding._flat import DTYPES
from rlhf_paro.sharding._host import OFFLOAD_MODES
from rlhf_paro.sharding.layout import UnitSizes, padded
from rlhf_paro.sharding.schedule import (BUCKET_NUMEL, TRAINING_PHASES, buckets, plan, run, select,
                                         ways)
from rlhf_paro.sharding.strategy import Strategy

__all__ = ["UnitSizes", "bytes_per_element", "memory", "offload_memory",
           "optimizer_bytes_per_element", "setup_memory", "traffic"]

GRAD_BYTES = 4  # the fp32 gradient accumulator
HOST_OPTIM_BYTES = 12  # offload=optimizer: an fp32 master of its own and two fp32 moments
DEVICE_KEYS = ("params", "grads", "optim")  # offload_memory's keys on the device
TRAFFIC_PHASES = (*TRAINING_PHASES, SYNC)  # traffic's keys


def bytes_per_element(precision: str) -> int:
    """Bytes of one P or G element."""
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"precision={precision!r} is unknown; allowed: fp32, bf16")
    return 4 if precision == "fp32" else 2


def optimizer_bytes_per_element(precision: str) -> int:
    """K of Table 2: optimizer-state bytes per trainable element."""
    return 8 if bytes_per_element(precision) == 4 else 12


def memory(strategy: Strategy, units: Sequence[UnitSizes], num_ranks: int, group_size: int,
           precision: str = "fp32", grad_bytes: int = GRAD_BYTES) -> dict[str, int]:
    """Bytes held per rank in P, G and OS (Table 2), padding included. ``grad_bytes`` is the
    engine's fp32 accumulator; 2 models a half-precision one (DeepSpeed's, in the paper)."""
    topo = Topology(num_ranks, group_size)  # validates M | N
    b = bytes_per_element(precision)
    trainable = sum(padded(u.trainable, num_ranks) for u in units)
    everything = trainable + sum(padded(u.frozen, num_ranks) for u in units)
    params = everything * b // ways(strategy.params, topo)
    if strategy.frozen:
        return {"params": params, "grads": 0, "optim": 0}
    grads = trainable * grad_bytes // ways(strategy.grads, topo)
    optim = (trainable * optimizer_bytes_per_element(precision)
             // ways(strategy.optim, topo))
    return {"params": params, "grads": grads, "optim": optim}


def offload_memory(strategy: Strategy, units: Sequence[UnitSizes], num_ranks: int,
                   group_size: int, precision: str = "fp32", offload: str = "none"
                   ) -> dict[str, int]:
    """``memory()`` placed by an offload mode (_host.py, [Note: offload modes]), as
    ``engine.memory()`` reports it between the model's phases: ``params``, ``grads``, ``optim`` on
    the device, ``host_params``, ``host_grads``, ``host_optim`` in host memory.

    offload=optimizer moves the OS level to the host with an fp32 master of its own even for
    fp32 parameters (12 bytes per trainable element, the K of bf16) and a 4-byte copy of the OS
    gradient; offload=params moves P there (parked: the model brings it back for its phases).
    """
    if offload not in OFFLOAD_MODES:
        raise ValueError(f"offload={offload!r} is unknown; allowed: {', '.join(OFFLOAD_MODES)}")
    if offload == "optimizer" and strategy.frozen:
        raise ValueError(f"offload='optimizer' needs a trained model; strategy {strategy.name} "
                         "is frozen (allowed: none, params)")
    held = memory(strategy, units, num_ranks, group_size, precision)
    out = {**held, "host_params": 0, "host_grads": 0, "host_optim": 0}
    if offload == "params":
        out["params"], out["host_params"] = 0, held["params"]
    elif offload == "optimizer":
        topo = Topology(num_ranks, group_size)
        trainable = sum(padded(u.trainable, num_ranks) for u in units)
        os_elements = trainable // ways(strategy.optim, topo)
        out["optim"] = 0
        out["host_optim"] = os_elements * HOST_OPTIM_BYTES
        out["host_grads"] = os_elements * GRAD_BYTES
    return out


def setup_memory(strategy: Strategy, units: Sequence[UnitSizes], num_ranks: int,
                 group_size: int, precision: str = "fp32", offload: str = "none") -> int:
    """Device bytes a rank holds at most while the engine sets the model up: what it keeps
    (``memory``) plus the largest unit gathered (engine.py, [Note: setup memory]).
    offload=optimizer reads and makes the OS level in host memory; offload=params fills P on
    the device first (the caller parks it afterwards)."""
    placed = offload_memory(strategy, units, num_ranks, group_size, precision,
                            "optimizer" if offload == "optimizer" else "none")
    held = sum(placed[k] for k in DEVICE_KEYS)
    gathered = max((padded(u.trainable, num_ranks) + padded(u.frozen, num_ranks)
                    for u in units), default=0)
    return held + gathered * bytes_per_element(precision)


def _rank_traffic(strategy: Strategy, units: Sequence[UnitSizes], topo: Topology, s: int,
                  precision: str, algorithm: str, reduce_dtype: str, bucket_numel: int,
                  syncs: int) -> dict[str, LinkBytes]:
    """Dry-run the engine's schedule for one optimizer step, and ``syncs`` syncs, on a
    communicator that only counts, on meta tensors of the sizes the engine would hand it."""
    elem = {"params": DTYPES[precision], "trained": DTYPES[precision],
            "grads": DTYPES[reduce_dtype], "norm": torch.float32}
    meter = CommMeter()
    comm = DryRunCommunicator(topo, meter, algorithm)
    collectives = plan(strategy)
    # A sync is the forward's gather of the P level once more, metered under its own phase.
    synced = [dataclasses.replace(c, phase=SYNC) for c in select(collectives, FORWARD, "params")]
    n = topo.num_ranks
    for u in units:
        sizes = {"params": [padded(x, n) for x in (u.trainable, u.frozen) if x],
                 "trained": [padded(u.trainable, n)] if u.trainable else []}
        sizes["grads"] = sizes["trained"]
        for c in [*collectives, *synced]:
            if c.what == "norm" or c.what == "grads" and c.per == "micro":
                continue
            for size in sizes[c.what]:
                tensor = torch.empty(size // ways(c.src, topo), dtype=elem[c.what],
                                     device="meta")
                for _ in range(syncs if c.phase == SYNC else s if c.per == "micro" else 1):
                    run([c], tensor, comm)
    # The backward reduce-scatters, unit by unit as backward finishes them (the blocks in
    # reverse, the root last), small ones together (schedule.py, [Note: gradient buckets]).
    finishing = [padded(u.trainable, n) for u in [*reversed(units[1:]), *units[:1]]]
    for c in [c for c in collectives if c.what == "grads" and c.per == "micro"]:
        for bucket in buckets(finishing, bucket_numel):
            tensor = torch.empty(sum(finishing[k] for k in bucket) // ways(c.src, topo),
                                 dtype=elem["grads"], device="meta")
            for _ in range(s):
                run([c], tensor, comm)
    if any(u.trainable for u in units):
        run(select(collectives, BOUNDARY, "norm"),
            torch.empty(1, dtype=elem["norm"], device="meta"), comm)
    totals = {phase: meter.totals(phase) for phase in TRAFFIC_PHASES}
    return {phase: LinkBytes(t["intra_bytes"], t["inter_bytes"]) for phase, t in totals.items()}


def traffic(strategy: Strategy, units: Sequence[UnitSizes], num_ranks: int, group_size: int,
            grad_accum_steps: int = 1, precision: str = "fp32", algorithm: str = "native",
            rank: int | None = None, reduce_dtype: str = "fp32",
            bucket_numel: int = BUCKET_NUMEL, syncs: int = 0) -> dict[str, LinkBytes]:
    """Bytes one rank sends per optimizer step, by phase (``TRAFFIC_PHASES``), on intra and
    inter links.

    For a frozen (inference-only) strategy the step is ``grad_accum_steps`` forward passes.
    With ``rank=None`` the result is the average over all ranks (Table 3's total divided by N);
    the ranks differ only in which of them cross groups on the world ring. ``bucket_numel`` is
    the engine's (schedule.py, [Note: gradient buckets]). ``syncs``: syncs into a rollout
    engine with a copy of its own (phase ``sync``), each one gather of every unit at P.
    """
    topo = Topology(num_ranks, group_size)
    if rank is not None:
        return _rank_traffic(strategy, units, topo.with_rank(rank), grad_accum_steps, precision,
                             algorithm, reduce_dtype, bucket_numel, syncs)
    # Every group is laid out alike, so a rank's traffic depends only on its local index j:
    # the mean over the M ranks of one group is the mean over all N.
    per_rank = [_rank_traffic(strategy, units, topo.with_rank(j), grad_accum_steps, precision,
                              algorithm, reduce_dtype, bucket_numel, syncs)
                for j in range(group_size)]
    return {phase: LinkBytes(sum(p[phase].intra for p in per_rank) / group_size,
                             sum(p[phase].inter for p in per_rank) / group_size)
            for phase in TRAFFIC_PHASES}
