"""Run a function on a few gloo processes on loopback and collect what each rank returns."""

from __future__ import annotations

import io
import os
import queue
import socket
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn: Callable, rank: int, world_size: int, port: int, results: Any, args: tuple) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)  # N ranks share two cores
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        out = fn(rank, world_size, *args)
        # Bytes, not tensors: a tensor sent through a queue is shared by file descriptor, which
        # dies with this process before the parent reads it.
        data = io.BytesIO()
        torch.save(out, data)
        results.put((rank, True, data.getvalue()))
    except BaseException:  # noqa: BLE001 - the parent re-raises with this traceback
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 600) -> list:
    """Spawn ``world_size`` gloo ranks, run ``fn(rank, world_size, *args)`` on each, return the
    per-rank results in rank order. A failure on any rank raises with that rank's traceback."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, results, args), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    try:
        while len(out) < world_size:
            try:
                rank, ok, payload = results.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"ranks {sorted(set(range(world_size)) - set(out))} gave no "
                                   f"result within {timeout}s") from None
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            import torch

            out[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=5 if len(out) == world_size else 0.1)
            if p.is_alive():
                p.terminate()
    return [out[r] for r in range(world_size)]
