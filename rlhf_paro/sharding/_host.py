"""Host memory for offload, and the copies between it and the device, counted
(docs/design.md, "Offload").

[Note: offload modes]
  none       every state on the device (P, G, OS), as the paper's Table 2 counts it
  optimizer  the OS level lives in host memory: the fp32 master (a copy of its own even for
             fp32 parameters), both Adam moments and a host copy of the OS gradient, stepped by
             DeepSpeedCPUAdam; at each step the reduced OS gradient goes to the host and the
             updated master comes back into the P shard, then the update all-gather runs
  params     the P shards have a home in host memory; ``offload_params()`` copies them there and
             frees their device storage, ``onload_params()`` brings them back. The caller parks
             a model between its phases (actors/worker.py)
Host buffers are allocated once, when the engine is built, so that ``memory()`` is the steady
state from the start and pinned memory (on CUDA) is not allocated again at every phase. The
copies are blocking: the host reads the gradient and the device reads the parameters right
after them. They are counted here, apart from the comm meter, whose bytes are link traffic
between ranks.
"""

from __future__ import annotations

import os

import torch

OFFLOAD_MODES = ("none", "optimizer", "params")


def host_zeros(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host buffer for state of ``device``: pinned when the device is a GPU, so that the copies
    run at the link's bandwidth (pageable memory is staged through a pinned bounce buffer)."""
    return torch.zeros(numel, dtype=dtype, pin_memory=device.type == "cuda")


class Transfers:
    """Copies between the device and host memory on this rank, and their bytes."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.d2h_bytes = 0  # bytes copied from the device to host memory
        self.h2d_bytes = 0  # bytes copied from host memory to the device
        self.count = 0  # copies of either direction

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)
        self.d2h_bytes += src.numel() * src.element_size()
        self.count += 1

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)
        self.h2d_bytes += src.numel() * src.element_size()
        self.count += 1

    def totals(self) -> dict[str, int]:
        return {"d2h_bytes": self.d2h_bytes, "h2d_bytes": self.h2d_bytes,
                "transfers": self.count}


def cpu_adam(params: list[torch.nn.Parameter], **optim: object) -> torch.optim.Optimizer:
    """``DeepSpeedCPUAdam`` in AdamW mode over host ``params`` (offload=optimizer).

    deepspeed is imported here, on first use: only offload needs it. Without a GPU its
    accelerator probe must be told to use the CPU (it would warn and guess otherwise); the
    variable is only set when nobody set it.
    """
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam(params, adamw_mode=True, bias_correction=True, **optim)
