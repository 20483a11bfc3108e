"""Flat buffers a pass asks for again and again, kept for the next one on a CPU device.

[Note: a pool of gradient buffers]  (docs/design.md, "The engine in parts")
Every micro-batch, a unit whose gradients leave the N level takes a flat buffer as large as the
unit to copy its gradients into, and a buffer of 1/n of it for the reduce-scatter's result; both
are dropped once the reduction is added to the accumulator. On CUDA the caching
allocator keeps such blocks for the next request. On a CPU, torch allocates with malloc, which
hands buffers of megabytes back to the kernel when they are freed (mmap, or a trimmed heap), so
every micro-batch pays a page fault for every 4 KiB of every buffer, before the zeroing itself: on
the 2-core machine of the benchmarks, zeroing a block's 4 MB buffer took 22 ms where zeroing
memory already held takes under 1 ms. The pool keeps a freed buffer for the next request of the
same size and dtype instead. It holds no more than the step's peak: a buffer is back in the pool
only when nothing reads it (its reduction waited for), and a pass asks again for what it gave
back, so the pool never holds more buffers of a size than were in use at once. Its bytes are not
in ``memory()`` (state the strategy keeps), as the CUDA allocator's cached blocks are not; off on
CUDA, where that allocator does this already.
"""

from __future__ import annotations

import torch


class BufferPool:
    """Flat buffers by (number of elements, dtype), reused on a CPU device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.enabled = device.type == "cpu"
        self._free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat buffer of ``numel`` elements, contents undefined."""
        kept = self._free.get((numel, dtype))
        if kept:
            return kept.pop()
        return torch.empty(numel, dtype=dtype, device=self.device)

    def give(self, *buffers: torch.Tensor) -> None:
        """Buffers no one reads any more (taken from this pool or not), for the next request."""
        if not self.enabled:
            return
        for buf in buffers:
            if buf.is_contiguous() and buf.dim() == 1 and buf.storage_offset() == 0 and \
                    buf.untyped_storage().nbytes() == buf.numel() * buf.element_size():
                self._free.setdefault((buf.numel(), buf.dtype), []).append(buf)

    def clear(self) -> None:
        self._free.clear()
