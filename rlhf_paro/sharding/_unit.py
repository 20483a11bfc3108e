"""A unit's runtime state: its flat buffers, its place in one pass (an explicit state machine),
its gradient accumulator and its optimizer shard.

[Note: unit lifecycle in one pass]  (docs/design.md, "The unit lifecycle")
  READY     --pre-forward wraps inputs that need grad-->  ARMED   (a post-backward will fire)
  READY or ARMED  --pre-backward (first hook on its outputs)-->  BACKWARD  (gathered again)
  any but DONE    --post-backward, or the end-of-backward callback-->  DONE  (grads reduced, freed)
  any       --end of backward-->  READY
A unit whose inputs need no gradient (the root, the first block of a LoRA model) is never ARMED;
the end-of-backward callback finishes it. Recomputation under gradient checkpointing runs
pre-forward again; an ARMED unit is not wrapped twice.
"""

from __future__ import annotations

import enum
from typing import Any

import torch
from torch import nn

from rlhf_paro.comm.collectives import Communicator
from rlhf_paro.sharding._flat import FlatBuffer


class UnitState(enum.Enum):
    READY = "ready"  # not used yet in this pass
    ARMED = "armed"  # inputs wrapped in forward: autograd will call its post-backward
    BACKWARD = "backward"  # gathered for its backward
    DONE = "done"  # backward over: gradients reduced to the G level, parameters freed


class Unit:
    """One wrapped module (a block, or the root: the model itself with every other parameter)."""

    def __init__(self, name: str, module: nn.Module, buffers: list[FlatBuffer],
                 trainable: FlatBuffer | None, is_root: bool) -> None:
        self.name = name
        self.module = module
        self.buffers = buffers  # trainable and frozen buffers that are not empty
        self.trainable = trainable  # the trainable buffer, if any
        # The root's pre-forward runs before every block and its post-forward after all of
        # them, so it stays gathered for the whole forward and (re-gathered) backward.
        self.is_root = is_root
        self.state = UnitState.READY
        # fp32 gradient accumulator at the G level (trained units only).
        self.grad_acc: torch.Tensor | None = None

    def gather(self, comm: Communicator, phase: str, async_op: bool = False) -> None:
        for buf in self.buffers:
            buf.start_gather(comm, phase, async_op)

    def wait(self, comm: Communicator, verify: bool) -> None:
        """Finish gathers in flight; with ``verify``, check each against its owners."""
        for buf in self.buffers:
            if buf.finish_gather() and verify:
                buf.verify(comm, self.name)

    def free(self) -> None:
        for buf in self.buffers:
            buf.free()


def tensors_requiring_grad(obj: Any) -> list[torch.Tensor]:
    """Tensors that require grad inside nested tuples, lists and mappings (model outputs)."""
    if isinstance(obj, torch.Tensor):
        return [obj] if obj.requires_grad else []
    if isinstance(obj, dict) or hasattr(obj, "values") and hasattr(obj, "keys"):
        items = obj.values()
    elif isinstance(obj, (list, tuple)):
        items = obj
    else:
        return []
    return [t for item in items for t in tensors_requiring_grad(item)]


class PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs whose backward marks the end of the unit's backward."""

    @staticmethod
    def forward(ctx: Any, hook: Any, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.hook = hook
        return tuple(x.view_as(x) for x in inputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.hook()
        return (None, *grads)
