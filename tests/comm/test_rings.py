"""Ring, H-Ring, HO-Ring and pipelined HO-Ring against the native gloo collectives.

One process group per world size; every (g, M), algorithm, dtype and size runs inside it.
Each rank's data comes from a generator seeded with its rank, so every rank can rebuild all
contributions and hold the reduce-scatter to a float64 reference, not only to native.
"""

from __future__ import annotations

import pytest
import torch

from rlhf_paro.comm.collectives import Communicator
from rlhf_paro.comm.topology import Topology
from rlhf_paro.comm.rings import ALGORITHMS, predicted_world_bytes
from tests.dist_utils import run_distributed

pytestmark = [pytest.mark.dist, pytest.mark.slow]

DTYPES = (torch.float32, torch.bfloat16)


def _contribution(rank: int, numel: int, dtype: torch.dtype, integer: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + rank)
    if integer:
        # |x| <= 8 on at most 6 ranks: every partial sum is an integer below 2**8, exact even in
        # bf16, so any summation order gives the same bits.
        return torch.randint(-8, 9, (numel,), generator=gen).to(dtype)
    return torch.randn(numel, generator=gen).to(dtype)


def _sizes(n: int) -> list[int]:
    # Divisible by N, one element short (last chunk padded by 1), and N*9 + 1 (chunks of 10, the
    # last rank's chunk padded by N-1 elements).
    return [n * 64, n * 64 - 1, n * 9 + 1]


def _check_all(rank: int, world_size: int, shapes: list[tuple[int, int]]) -> list[str]:
    failures: list[str] = []
    n = world_size
    for m in (m for g, m in shapes):
        topo = Topology.from_process_group(group_size=m)
        native = Communicator(topo, algorithm="native")
        k = topo.chunk_index()
        for name in ALGORITHMS:
            comm = Communicator(topo, algorithm=name)
            for dtype in DTYPES:
                for numel in _sizes(n):
                    c = -(-numel // n)
                    case = f"g={n // m} M={m} {name} {dtype} numel={numel} rank={rank}"
                    failures += _check_all_gather(comm, native, topo, dtype, numel, c, k, case)
                    for integer in (True, False) if dtype == torch.float32 else (True,):
                        failures += _check_reduce_scatter(comm, native, topo, dtype, numel, c, k,
                                                          integer, case)
    return failures


def _check_bytes(comm: Communicator, op: str, numel: int, dtype: torch.dtype, topo: Topology,
                 case: str) -> list[str]:
    rec = comm.meter.records[-1]
    elem = torch.empty(0, dtype=dtype).element_size()
    want = ALGORITHMS[comm.algorithm].link_bytes(op, numel, elem, topo)
    got = (rec.intra_bytes, rec.inter_bytes)
    ok = rec.op == op and got == want == predicted_world_bytes(comm.algorithm, op, numel, elem,
                                                               topo)
    return [] if ok else [f"{case} {op}: metered {got}, closed form {want}"]


def _check_all_gather(comm: Communicator, native: Communicator, topo: Topology,
                      dtype: torch.dtype, numel: int, c: int, k: int, case: str) -> list[str]:
    # The padded buffer is what the owners hold; the algorithm may fill a shorter one.
    shard = _contribution(topo.rank, c, dtype, integer=False)
    expected = torch.empty(topo.num_ranks * c, dtype=dtype)
    native.all_gather(expected, shard, "world", "test")
    out = torch.full((numel,), float("nan"), dtype=dtype)
    comm.all_gather(out, shard, "world", "test")
    failures = [] if torch.equal(out, expected[:numel]) else [f"{case} all_gather differs"]
    if not torch.equal(expected[k * c:(k + 1) * c], shard):
        failures.append(f"{case} native all_gather does not put the shard at chunk {k}")
    return failures + _check_bytes(comm, "all_gather", numel, dtype, topo, case)


def _check_reduce_scatter(comm: Communicator, native: Communicator, topo: Topology,
                          dtype: torch.dtype, numel: int, c: int, k: int, integer: bool,
                          case: str) -> list[str]:
    n = topo.num_ranks
    parts = [_contribution(r, numel, dtype, integer) for r in range(n)]
    full = parts[topo.rank]
    before = full.clone()
    padded = torch.zeros(n * c, dtype=dtype)
    padded[:numel] = full
    expected = torch.empty(c, dtype=dtype)
    native.reduce_scatter(expected, padded, "world", "test")
    out = torch.empty(c, dtype=dtype)
    comm.reduce_scatter(out, full, "world", "test")
    case = f"{case} reduce_scatter {'integer' if integer else 'random'} data"
    failures = [] if torch.equal(full, before) else [f"{case} modified its input"]
    if integer:
        if not torch.equal(out, expected):
            failures.append(f"{case}: not bit-equal to native")
    else:
        # Any order of summing n terms lies within (n-1)*u*sum|x| of the exact sum (u = 2**-24
        # in fp32), so ours and native are each that close to the float64 reference.
        stacked = torch.stack([torch.cat([p, p.new_zeros(n * c - numel)]) for p in parts])
        chunk = stacked[:, k * c:(k + 1) * c].double()
        bound = (n - 1) * 2.0 ** -24 * chunk.abs().sum(0)
        exact = chunk.sum(0)
        for label, got in (("ours", out), ("native", expected)):
            err = (got.double() - exact).abs()
            if not bool((err <= bound).all()):
                failures.append(f"{case}: {label} off the exact sum by {err.max().item():.3g}")
    return failures + _check_bytes(comm, "reduce_scatter", numel, dtype, topo, case)


def test_every_algorithm_equals_native_on_4_ranks() -> None:
    results = run_distributed(_check_all, 4, [(2, 2), (4, 1), (1, 4)])
    failures = [f for rank_failures in results for f in rank_failures]
    assert not failures, "\n".join(failures[:20])


def test_every_algorithm_equals_native_on_6_ranks() -> None:
    results = run_distributed(_check_all, 6, [(2, 3), (3, 2)])
    failures = [f for rank_failures in results for f in rank_failures]
    assert not failures, "\n".join(failures[:20])
