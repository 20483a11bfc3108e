"""Run a function on a few gloo processes on loopback and collect what each rank returns.

The ranks fork from one server process per test session that has imported torch, transformers
and the engine once (``multiprocessing``'s forkserver; a fork after torch is imported is what
torch's own DataLoader workers do on Linux): four ranks that import the engine took 6.3-7.0 s
to start spawned on two cores and 0.7 s forked. Each rank still starts from a process that has
only imported (no process group, no random number drawn), with the caller's environment and
working directory of the moment, as a spawned one did, not the server's of when it started.
"""

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


# What every rank imports before its function runs, imported once in the server.
_PRELOAD = ["torch", "torch.distributed", "transformers", "rlhf_paro.models",
            "rlhf_paro.sharding.engine", "rlhf_paro.comm.collectives"]


def _context(fresh: bool) -> Any:
    if fresh:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # read once, when the server starts
    return ctx


def _entry(fn: Callable, rank: int, world_size: int, port: int, results: Any, args: tuple,
           env: dict[str, str], cwd: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
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


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 600,
                    fresh: bool = False) -> list:
    """Start ``world_size`` gloo ranks, run ``fn(rank, world_size, *args)`` on each, return the
    per-rank results in rank order. A failure on any rank raises with that rank's traceback.
    ``fresh``: each rank a new interpreter (spawned), for what is read only when a process
    starts, such as the C library's allocator settings in the environment."""
    ctx = _context(fresh)
    results = ctx.Queue()
    port = free_port()
    env, cwd = dict(os.environ), os.getcwd()
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, results, args, env, cwd),
                         daemon=True) for r in range(world_size)]
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
