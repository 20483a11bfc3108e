"""``comm.algorithm=auto``: the algorithm of each collective, from the topology and its size.

[Note: choosing an algorithm]
Only world-scope all-gathers and reduce-scatters have a choice; every other collective is
native (``resolve``). For those, ``choose`` reads:
  - the shape: with one group, or groups of one rank, the world has a single level and every
    ring of ours is the world ring, which native runs -> native;
  - across groups, the size of one chunk, c = ceil(S / N) elements of the full buffer of S:
    each message of the rings is a chunk or a few (a piece of one in the pipelined HO-Ring), so
    c against a message's fixed cost decides. ``CROSSOVERS`` lists, per collective, the
    algorithm from each chunk size up: H-Ring where latency rules (fewest steps, one message
    each); HO-Ring once its first step's second lane pays for the messages it adds; the
    pipelined HO-Ring once its P pieces per chunk do; native for the smallest all-gathers,
    where gloo's one call beats the messages posted one by one.
Every input is one every rank agrees on (the full buffer's size, the element size, the shape),
so every rank picks the same algorithm for the same collective, as the schedule needs. The
meter records the algorithm that ran, and ``predicted_bytes`` resolves ``auto`` here too, so the
cost model and the engine count the same bytes.
"""

from __future__ import annotations

from rlhf_paro.comm.meter import ALGORITHM_CHOICES, AUTO
from rlhf_paro.comm.rings import OPS
from rlhf_paro.comm.topology import Topology

KiB, MiB = 1 << 10, 1 << 20

# Chunk bytes (the full buffer over N ranks) at which the choice changes. Measured with gloo on
# an emulated 2 x 2 cluster (NICs shaped to 160 MB/s, 1.4-4 GB/s inside a node), nine runs of
#     python scripts/emulate_cluster.py --nodes 2 --gpus-per-node 2 --inter-rate 160MB -- \
#         python scripts/bench_collectives.py --sizes <MiB ...> --repeats 9..31
# over buffers of 1 KiB to 64 MiB (chunks of a quarter of that). Median time over H-Ring's
# (docs/design.md, "Collectives", has the whole table):
#   all-gather, native:             0.92 0.91 0.88 at 1, 4, 16 KiB; 0.97 at 64 KiB; >= 1.25 above
#   all-gather, HO-Ring:            1.00 at 2 MiB, 0.99 at 4 MiB (0.79-1.09 over six runs),
#                                   0.96 at 8 MiB, 0.89 at 12 MiB
#   all-gather, pipelined HO-Ring:  1.28 at 4 MiB, 1.06 at 8 MiB, 0.91-0.92 at 16, 32, 64 MiB
#   reduce-scatter, native:         >= 1.32 at every size; HO-Ring >= 0.91, never the fastest
#   reduce-scatter, pipelined:      1.43 at 6 MiB, 0.83 at 8 MiB, 0.82-0.97 from there to 64 MiB
NATIVE_GATHER_BELOW = 16 * KiB  # all-gathers of smaller chunks run native
HORING_GATHER_FROM = 2 * MiB  # from here all-gathers run HO-Ring
PIPELINED_GATHER_FROM = 4 * MiB  # from here all-gathers run the pipelined HO-Ring
PIPELINED_SCATTER_FROM = 2 * MiB  # from here reduce-scatters run the pipelined HO-Ring

# Per collective across groups: (smallest chunk bytes, algorithm), ascending; a chunk takes the
# last row it reaches.
CROSSOVERS: dict[str, tuple[tuple[int, str], ...]] = {
    "all_gather": ((0, "native"), (NATIVE_GATHER_BELOW, "hring"),
                   (HORING_GATHER_FROM, "horing"), (PIPELINED_GATHER_FROM, "horing_pipelined")),
    "reduce_scatter": ((0, "hring"), (PIPELINED_SCATTER_FROM, "horing_pipelined")),
}


def choose(op: str, scope: str, numel: int, elem_size: int, topo: Topology) -> str:
    """The algorithm ``auto`` runs ``op`` on, for a full buffer of ``numel`` elements of
    ``elem_size`` bytes on ``scope`` ([Note: choosing an algorithm])."""
    if scope != "world" or op not in OPS:
        return "native"
    if topo.num_groups == 1 or topo.group_size == 1:
        return "native"
    chunk = -(-numel // topo.num_ranks) * elem_size
    return [name for start, name in CROSSOVERS[op] if chunk >= start][-1]


def resolve(algorithm: str, op: str, scope: str, numel: int, elem_size: int,
            topo: Topology) -> str:
    """The algorithm that runs ``op`` under ``comm.algorithm=algorithm``: the selected one for
    world all-gathers and reduce-scatters (``auto``: ``choose``'s), native for the rest."""
    if algorithm not in ALGORITHM_CHOICES:
        raise ValueError(f"comm.algorithm={algorithm!r} is unknown; allowed: "
                         f"{', '.join(ALGORITHM_CHOICES)}")
    if scope != "world" or op not in OPS:
        return "native"
    return choose(op, scope, numel, elem_size, topo) if algorithm == AUTO else algorithm
