"""Ring collectives posted with ``async_op=True`` against the same ones run synchronously.

Per shape and algorithm (``auto`` included), each rank runs a world all-gather and a
reduce-scatter synchronously, then posts both asynchronously, issues a native all-reduce on the
world and a native asynchronous all-gather inside its group while they are in flight, runs a
synchronous ring collective too, and only then waits, the reduce-scatter first. Results must be
bit-identical (the same schedule sums in the same order) and the meter must hold the same
records; the inputs are overwritten right after posting, so a ring collective that read them
later would differ ([Note: one lane per group] in ``comm/rings.py``).
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from rlhf_paro.comm.auto import HORING_GATHER_FROM, PIPELINED_GATHER_FROM, choose
from rlhf_paro.comm.collectives import Communicator, DryRunCommunicator, predicted_bytes
from rlhf_paro.comm.meter import AUTO
from rlhf_paro.comm.rings import ALGORITHMS
from rlhf_paro.comm.topology import Topology
from tests.dist_utils import run_distributed

pytestmark = [pytest.mark.dist, pytest.mark.slow]

NAMES = (*ALGORITHMS, AUTO)
POSTING_DELAY = 1.0  # seconds rank 0 waits before posting, in the test of returning early


def _data(rank: int, numel: int, salt: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(100 * salt + rank))


def _records(comm: Communicator) -> list[tuple]:
    return [(r.op, r.scope, r.algorithm, r.intra_bytes, r.inter_bytes)
            for r in comm.meter.records]


def _check_shape(topo: Topology, name: str, numel: int) -> list[str]:
    n, rank = topo.num_ranks, topo.rank
    c = -(-numel // n)
    case = f"g={topo.num_groups} M={topo.group_size} {name} numel={numel} rank={rank}"
    sync, post = Communicator(topo, algorithm=name), Communicator(topo, algorithm=name)
    shard, full = _data(rank, c, 1), _data(rank, numel, 2)
    ag_sync, rs_sync = torch.empty(numel), torch.empty(c)
    sync.all_gather(ag_sync, shard, "world", "test")
    sync.reduce_scatter(rs_sync, full, "world", "test")
    extra_sync = torch.empty(c)
    sync.reduce_scatter(extra_sync, full * 2, "world", "test")

    ag, rs = torch.full((numel,), float("nan")), torch.full((c,), float("nan"))
    shard_in, full_in = shard.clone(), full.clone()
    gathering = post.all_gather(ag, shard_in, "world", "test", async_op=True)
    scattering = post.reduce_scatter(rs, full_in, "world", "test", async_op=True)
    if name != AUTO or choose("all_gather", "world", numel, 4, topo) != "native":
        # Ours copied its input before returning (a native collective may still read it).
        shard_in.fill_(float("nan"))
        full_in.fill_(float("nan"))
    # The engine's other traffic while both are in flight: a world all-reduce (the norm), an
    # asynchronous native gather inside the group, and a synchronous ring collective.
    norm = torch.tensor([float(rank + 1)])
    post.all_reduce(norm, "world", "test")
    local = torch.empty(topo.group_size)
    inside = post.all_gather(local, torch.tensor([float(rank)]), "intra", "test", async_op=True)
    extra = torch.empty(c)
    post.reduce_scatter(extra, full * 2, "world", "test")
    scattering.wait()
    gathering.wait()
    inside.wait()

    failures = []
    if not torch.equal(ag, ag_sync):
        failures.append(f"{case}: asynchronous all_gather differs from the synchronous one")
    if not torch.equal(rs, rs_sync):
        failures.append(f"{case}: asynchronous reduce_scatter differs from the synchronous one")
    if not torch.equal(extra, extra_sync):
        failures.append(f"{case}: a synchronous ring collective among them differs")
    if float(norm) != n * (n + 1) / 2:
        failures.append(f"{case}: the all-reduce between post and wait gave {float(norm)}")
    group = [topo.group_index * topo.group_size + j for j in range(topo.group_size)]
    if local.tolist() != [float(r) for r in group]:
        failures.append(f"{case}: the intra all-gather between post and wait gave {local}")
    # The meter: the same records (the async ones in the order they were waited on).
    rings_sync = _records(sync)
    rings_post = [r for r in _records(post) if r[1] == "world" and r[0] != "all_reduce"]
    if sorted(rings_post) != sorted(rings_sync):
        failures.append(f"{case}: metered {rings_post}, synchronously {rings_sync}")
    # auto: the algorithm that ran is the one choose() picks, and the bytes are the cost
    # model's (predicted_bytes and its dry run).
    dry = DryRunCommunicator(topo, algorithm=name)
    dry.all_gather(torch.empty(numel, device="meta"), torch.empty(c, device="meta"), "world",
                   "test")
    dry.reduce_scatter(torch.empty(c, device="meta"), torch.empty(numel, device="meta"),
                       "world", "test")
    for op, record, planned in zip(("all_gather", "reduce_scatter"), _records(sync),
                                   _records(dry)):
        want = name if name != AUTO else choose(op, "world", numel, 4, topo)
        predicted = predicted_bytes(name, op, numel, 4, "world", topo)
        if record[2] != want or record[3:] != tuple(predicted) or record != planned:
            failures.append(f"{case} {op}: metered {record}, expected {want} {predicted}, "
                            f"dry run {planned}")
    return failures


def _check_all(rank: int, world_size: int, shapes: list[tuple[int, int]]) -> list[str]:
    failures: list[str] = []
    for _, m in shapes:
        topo = Topology.from_process_group(group_size=m)
        for name in NAMES:
            sizes = [world_size * 64, world_size * 9 + 1]
            if name == AUTO:  # chunks of 2 and 4 MiB, where auto picks the HO-Rings
                sizes += [world_size * (HORING_GATHER_FROM // 4),
                          world_size * (PIPELINED_GATHER_FROM // 4)]
            for numel in sizes:
                # A buffer short of its padded tail only for ours: native takes whole chunks.
                ours = name != AUTO or choose("all_gather", "world", numel, 4, topo) != "native"
                if numel % world_size == 0 or ours:
                    failures += _check_shape(topo, name, numel)
    return failures


def test_async_ring_collectives_equal_sync_ones_on_4_ranks() -> None:
    results = run_distributed(_check_all, 4, [(2, 2), (1, 4), (4, 1)])
    failures = [f for rank_failures in results for f in rank_failures]
    assert not failures, "\n".join(failures[:20])


def test_async_ring_collectives_equal_sync_ones_on_6_ranks() -> None:
    results = run_distributed(_check_all, 6, [(2, 3), (3, 2)])
    failures = [f for rank_failures in results for f in rank_failures]
    assert not failures, "\n".join(failures[:20])


def _return_before_the_peers_post(rank: int, world_size: int) -> dict[str, float]:
    # Rank 0 posts its part POSTING_DELAY late; every other rank's call must return at once,
    # its collective still in flight, and finish in wait() once rank 0 has joined.
    topo = Topology.from_process_group(group_size=2)
    returned = {}
    for name in ALGORITHMS:
        comm = Communicator(topo, algorithm=name)
        shard, out = torch.full((8,), float(rank)), torch.empty(8 * world_size)
        dist.barrier()
        if rank == 0:
            time.sleep(POSTING_DELAY)
        start = time.perf_counter()
        pending = comm.all_gather(out, shard, "world", "test", async_op=True)
        returned[name] = time.perf_counter() - start
        pending.wait()
        assert out.view(world_size, 8)[:, 0].tolist() == \
            [float(r % 2 * 2 + r // 2) for r in range(world_size)], name
    return returned


def test_async_ring_collectives_return_before_the_collective_is_done() -> None:
    # A synchronous call on ranks 1-3 would block until rank 0 posts, POSTING_DELAY later.
    results = run_distributed(_return_before_the_peers_post, 4)
    for rank, returned in enumerate(results[1:], start=1):
        for name, seconds in returned.items():
            assert seconds < POSTING_DELAY / 2, f"rank {rank} {name}: returned in {seconds:.3f}s"
