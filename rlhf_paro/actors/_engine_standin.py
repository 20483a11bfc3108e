"""TEMPORARY stand-in for the engine's checkpoint and skipped-step surface, until the engine has
its own; it adds to ``ShardedEngine`` only what the engine lacks, and goes away at that merge.

    engine.save_checkpoint(directory)   every rank writes rank_<r>.pt: its shards, its optimizer
                                        state, its fp32 masters (bf16), the skipped-step count
    engine.load_checkpoint(directory)   reads this rank's file back; the same strategy, N, M and
                                        unit sizes only, anything else is one ValueError line
    engine.skipped_steps                optimizer steps skipped because the gradient norm was
                                        not finite (a NaN loss anywhere makes it NaN everywhere)

The engine's own version is layout-independent (keyed by parameter name and offset, loads under
any strategy); this one is not, which is why the trainer's test of a resume under other
strategies is skipped while it is in place.
"""

from __future__ import annotations

import math
import os

import torch

from rlhf_paro.sharding import engine as _engine
from rlhf_paro.sharding._step import BoundaryStep
from rlhf_paro.sharding.schedule import run


class _GuardedBoundaryStep(BoundaryStep):
    """BoundaryStep that skips the update when the global gradient norm is not finite."""

    skipped = 0  # optimizer steps skipped so far

    @torch.no_grad()
    def __call__(self) -> float:
        grads = [self._reduce_to_os(u) for u in self.units]
        sq = torch.zeros(1, dtype=torch.float32, device=grads[0].device if grads else None)
        for g in grads:
            sq += g.pow(2).sum()
        run(self._norm, sq, self.comm)
        norm = sq.sqrt()
        for unit in self.units:  # the gradients were copied out; used or not, they are spent
            unit.grad_acc.zero_()
        if not math.isfinite(float(norm)):
            # The norm is all-reduced, so every rank skips the same step.
            self.skipped += 1
            return float(norm)
        if self.max_grad_norm is not None:  # from here on BoundaryStep's arithmetic, unchanged
            coef = torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0)
            for g in grads:
                g.mul_(coef)
        for master, g in zip(self.masters, grads):
            master.grad = g
        if self.optimizer is not None:
            self.optimizer.step()
        for unit, master in zip(self.units, self.masters):
            master.grad = None
            self._refresh(unit, master)
        return float(norm)


def _meta(engine: _engine.ShardedEngine) -> dict:
    topo = engine.topo
    return {"strategy": engine.strategy.name, "num_ranks": topo.num_ranks,
            "group_size": topo.group_size, "rank": topo.rank,
            "sizes": [[buf.size for buf in unit.buffers] for unit in engine.units]}


def save_checkpoint(self: _engine.ShardedEngine, directory: str) -> None:
    boundary = self._boundary
    state = {"meta": _meta(self),
             "shards": [[buf.shard.clone() for buf in unit.buffers] for unit in self.units],
             "skipped_steps": self.skipped_steps}
    if boundary is not None and boundary.optimizer is not None:
        state["optim"] = boundary.optimizer.state_dict()
        state["masters"] = [m.detach().clone() for m in boundary.masters]
    os.makedirs(directory, exist_ok=True)
    torch.save(state, os.path.join(directory, f"rank_{self.topo.rank:05d}.pt"))


@torch.no_grad()
def load_checkpoint(self: _engine.ShardedEngine, directory: str) -> None:
    path = os.path.join(directory, f"rank_{self.topo.rank:05d}.pt")
    if not os.path.isfile(path):
        raise ValueError(f"{directory} has no file for rank {self.topo.rank} (the stand-in "
                         "engine checkpoint loads only under the same number of devices)")
    state = torch.load(path, map_location=self.units[0].buffers[0].device, weights_only=True)
    if state["meta"] != _meta(self):
        saved = state["meta"]
        raise ValueError(f"{directory} was written under strategy {saved['strategy']} on "
                         f"N={saved['num_ranks']}, M={saved['group_size']}; the stand-in engine "
                         f"checkpoint loads only the same (here {self.strategy.name}, "
                         f"N={self.topo.num_ranks}, M={self.topo.group_size})")
    for unit, shards in zip(self.units, state["shards"]):
        for buf, shard in zip(unit.buffers, shards):
            buf.shard.copy_(shard)
    boundary = self._boundary
    if boundary is not None and boundary.optimizer is not None:
        for master, saved in zip(boundary.masters, state["masters"]):
            master.copy_(saved)
        boundary.optimizer.load_state_dict(state["optim"])
        boundary.skipped = state["skipped_steps"]


def _skipped_steps(self: _engine.ShardedEngine) -> int:
    return 0 if self._boundary is None else self._boundary.skipped


if not hasattr(_engine.ShardedEngine, "save_checkpoint"):
    _engine.BoundaryStep = _GuardedBoundaryStep
    _engine.ShardedEngine.save_checkpoint = save_checkpoint
    _engine.ShardedEngine.load_checkpoint = load_checkpoint
    _engine.ShardedEngine.skipped_steps = property(_skipped_steps)
