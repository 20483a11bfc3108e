"""Pure checks of every algorithm's schedule on topologies too large to spawn.

A symbolic executor plays all N ranks' steps together: every send must be matched by a receive
of the same range in the same step on the peer, a rank may only send what it holds, an
all-gather must leave every rank with every chunk (each range received once), and a
reduce-scatter must leave each rank's chunk holding every rank's contribution exactly once.
The bytes the steps send must equal the closed forms of ``link_bytes``.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import pytest

from rlhf_paro.comm.topology import Topology
from rlhf_paro.comm import rings
from rlhf_paro.comm.meter import ALGORITHM_NAMES, LinkBytes
from rlhf_paro.comm.rings import ALGORITHMS, predicted_world_bytes

SHAPES = [(1, 1), (1, 4), (4, 1), (2, 2), (2, 3), (3, 2), (3, 4), (4, 3), (5, 2), (16, 8)]


def _all_steps(algo: rings.Algorithm, op: str, g: int, m: int, c: int) -> list[list[rings.Step]]:
    topo = Topology(g * m, m)
    return [algo.steps(op, topo.with_rank(r), c) for r in range(g * m)]


def _check_matching(steps: list[list[rings.Step]]) -> int:
    """Every rank runs the same number of steps and, step by step, the messages a sends to b are
    exactly the ones b expects from a, in the same order. Returns the number of steps."""
    n = len(steps)
    num_steps = {len(s) for s in steps}
    assert len(num_steps) == 1, f"ranks disagree on the number of steps: {num_steps}"
    for k in range(num_steps.pop()):
        sent: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
        expected: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
        for r in range(n):
            for t in steps[r][k].sends:
                sent[(r, t.peer)].append((t.lo, t.hi))
            for t in steps[r][k].recvs:
                expected[(t.peer, r)].append((t.lo, t.hi))
        assert sent == expected, f"step {k}: sends and receives do not match"
    return len(steps[0])


def _sent_bytes(steps: list[rings.Step], topo: Topology, elem: int) -> LinkBytes:
    per_step = [rings.step_bytes(s, topo.rank, topo.group_size, elem) for s in steps]
    return LinkBytes(sum(b.intra for b in per_step), sum(b.inter for b in per_step))


@pytest.mark.parametrize("name", list(ALGORITHMS))
@pytest.mark.parametrize("g,m", SHAPES)
def test_all_gather_schedule_delivers_every_chunk_once(name: str, g: int, m: int) -> None:
    n, c = g * m, 5  # c=5 makes the pipelined pieces uneven (and some empty for 8 pieces)
    topo = Topology(n, m)
    steps = _all_steps(ALGORITHMS[name], "all_gather", g, m, c)
    num_steps = _check_matching(steps)
    held = [set(range(topo.chunk_index(r) * c, (topo.chunk_index(r) + 1) * c)) for r in range(n)]
    received = [Counter() for _ in range(n)]
    for k in range(num_steps):
        incoming = []
        for r in range(n):
            for t in steps[r][k].sends:
                assert set(range(t.lo, t.hi)) <= held[r], f"rank {r} sends what it lacks"
            for t in steps[r][k].recvs:
                incoming.append((r, range(t.lo, t.hi)))
        for r, elems in incoming:  # lock step: what arrives is usable from the next step on
            held[r].update(elems)
            received[r].update(elems)
    for r in range(n):
        assert held[r] == set(range(n * c)), f"rank {r} misses elements"
        assert max(received[r].values(), default=1) == 1, f"rank {r} received a range twice"


@pytest.mark.parametrize("name", list(ALGORITHMS))
@pytest.mark.parametrize("g,m", SHAPES)
def test_reduce_scatter_schedule_sums_each_contribution_once(name: str, g: int, m: int) -> None:
    n, c = g * m, 3
    topo = Topology(n, m)
    steps = _all_steps(ALGORITHMS[name], "reduce_scatter", g, m, c)
    num_steps = _check_matching(steps)
    # parts[r][e]: ranks whose contribution to element e rank r's working buffer holds.
    parts = [[frozenset([r]) for _ in range(n * c)] for r in range(n)]
    for k in range(num_steps):
        # Messages carry the sender's partial sums as they were at the start of the step.
        outbox = {(r, t.peer, t.lo): [parts[r][e] for e in range(t.lo, t.hi)]
                  for r in range(n) for t in steps[r][k].sends}
        for r in range(n):
            for t in steps[r][k].recvs:
                for e, got in zip(range(t.lo, t.hi), outbox[(t.peer, r, t.lo)]):
                    assert not parts[r][e] & got, f"rank {r} adds a contribution twice"
                    parts[r][e] = parts[r][e] | got
    everyone = frozenset(range(n))
    for r in range(n):
        k = topo.chunk_index(r)
        assert all(parts[r][e] == everyone for e in range(k * c, (k + 1) * c)), \
            f"rank {r}'s chunk misses contributions"


@pytest.mark.parametrize("name", list(ALGORITHMS))
@pytest.mark.parametrize("op", rings.OPS)
@pytest.mark.parametrize("g,m", SHAPES)
def test_schedule_bytes_equal_closed_form(name: str, op: str, g: int, m: int) -> None:
    n, c, elem = g * m, 7, 2
    algo = ALGORITHMS[name]
    for r in range(n):
        topo = Topology(n, m, r)
        sent = _sent_bytes(algo.steps(op, topo, c), topo, elem)
        # Any numel whose padded chunk is c: here the smallest, n*(c-1)+1.
        assert sent == algo.link_bytes(op, n * (c - 1) + 1, elem, topo)
        assert sent == predicted_world_bytes(name, op, n * c, elem, topo)


@pytest.mark.parametrize("g,m", SHAPES)
def test_two_level_bytes_match_the_issue_formula(g: int, m: int) -> None:
    # Per rank, H-Ring and HO-Ring send (g-1)*S/N across groups and g(M-1)*S/N inside.
    n, numel = g * m, 96 * g * m
    for name in ("hring", "horing", "horing_pipelined"):
        for r in range(n):
            sent = ALGORITHMS[name].link_bytes("all_gather", numel, 4, Topology(n, m, r))
            assert sent == LinkBytes(g * (m - 1) * numel * 4 // n, (g - 1) * numel * 4 // n)


def test_native_prediction_follows_the_rank_order_ring() -> None:
    # 2 groups of 3, 12 fp32 elements: chunks of 2 elements, 5 steps -> 40 bytes per rank,
    # sent across groups by the last rank of each group only.
    for r in range(6):
        sent = predicted_world_bytes("native", "reduce_scatter", 12, 4, Topology(6, 3, r))
        assert sent == (LinkBytes(0, 40) if r % 3 == 2 else LinkBytes(40, 0))
    assert predicted_world_bytes("native", "all_gather", 12, 4, Topology(6, 6, 5)) == (40, 0)


def test_pipelined_overlaps_the_final_intra_ring() -> None:
    # HO-Ring runs max(g-1, M-1) + (M-1) batches; the pipelined one fills the intra ring while
    # the inter ring still runs: with 1 piece it needs (g-1) + (M-1) slots, not 2 phases.
    topo = Topology(12, 4, 0)  # g=3, M=4
    assert len(ALGORITHMS["horing"].steps("all_gather", topo, 8)) == max(2, 3) + 3
    assert len(rings.pipelined(1).steps("all_gather", topo, 8)) == 2 + 3
    with pytest.raises(ValueError, match="num_pieces"):
        rings.pipelined(0)


def test_unknown_op_and_algorithm_are_named() -> None:
    with pytest.raises(ValueError, match="all_reduce"):
        ALGORITHMS["ring"].link_bytes("all_reduce", 8, 4, Topology(4, 2))
    with pytest.raises(ValueError, match="comm.algorithm='tree'"):
        predicted_world_bytes("tree", "all_gather", 8, 4, Topology(4, 2))


def test_every_named_algorithm_has_a_schedule() -> None:
    # comm.algorithm is checked against ALGORITHM_NAMES (torch-free); each name needs its schedule.
    assert ("native", *ALGORITHMS) == ALGORITHM_NAMES
