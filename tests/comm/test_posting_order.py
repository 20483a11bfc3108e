"""The order in which a rank posts its point-to-point operations, under NCCL's rule that the
operations between a pair of ranks run in the order they were posted ([Note: posting order] in
``comm/rings.py``). A small simulator of that rule runs the posting order of every rank; no GPU.
"""

from __future__ import annotations

from collections import defaultdict, deque

import pytest

from rlhf_paro.comm.rings import ALGORITHMS, OPS, PIPELINE_PIECES, Posted, post_order
from rlhf_paro.comm.topology import Topology

# Every shape to 8 x 8, then the largest, 16 x 8, and two of its neighbours: a cycle in the
# posting order shows on small rings already (two members, odd sizes); the check costs the square
# of the ranks, and every shape to 16 x 8 took minutes for what 8 x 8 finds.
SHAPES = ([(g, m) for g in range(1, 9) for m in range(1, 9) if g * m > 1]
          + [(16, 8), (16, 2), (12, 5)])


def stuck_operations(posted: dict[int, list[Posted]]) -> list[tuple[int, int]]:
    """Run every rank's posted operations under NCCL's rules and return those that never
    complete, as (rank, position):
      - a rank posts its operations in order; one with ``after`` is posted once those completed;
      - between a pair of ranks, an operation starts once every operation posted before it in an
        earlier batch has completed, and within its own batch, once the previous one of the same
        kind (send or receive) has (a group does not order its sends against its receives);
      - the k-th send from a to b meets the k-th receive at b from a; the two complete together
        once both have started."""
    match: dict[tuple[int, int], tuple[int, int]] = {}
    queues: dict[tuple[int, int, str], list[tuple[int, int]]] = defaultdict(list)
    for rank, ops in posted.items():
        for k, op in enumerate(ops):
            src, dst = (rank, op.transfer.peer) if op.kind == "send" else (op.transfer.peer, rank)
            queues[(src, dst, op.kind)].append((rank, k))
    for (src, dst, kind), sends in queues.items():
        if kind != "send":
            continue
        recvs = queues[(src, dst, "recv")]
        assert len(sends) == len(recvs), f"{src}->{dst}: {len(sends)} sends, {len(recvs)} receives"
        for a, b in zip(sends, recvs):
            ta, tb = posted[a[0]][a[1]].transfer, posted[b[0]][b[1]].transfer
            assert ta.hi - ta.lo == tb.hi - tb.lo, f"{a} and {b} differ in size"
            match[a], match[b] = b, a
    for (src, dst, kind), recvs in queues.items():
        assert kind == "send" or len(queues[(src, dst, "send")]) == len(recvs)

    # What each operation waits for: the pair rule, and ``after`` for being posted.
    pending: dict[tuple[int, int], int] = {}
    dependents: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
    posting: dict[tuple[int, int], int] = {}  # ``after`` operations not complete yet
    for rank, ops in posted.items():
        last: dict[tuple[int, str], tuple[int, int]] = {}  # (peer, kind) -> latest of that kind
        for k, op in enumerate(ops):
            peer = op.transfer.peer
            preds = {last[(peer, kind)] for kind in ("send", "recv") if (peer, kind) in last
                     and (ops[last[(peer, kind)][1]].batch != op.batch or kind == op.kind)}
            pending[(rank, k)] = len(preds)
            for p in preds:
                dependents[p].append((rank, k))
            # Posting is in order, so waits that the previous operation already had add nothing.
            waits = () if k and op.after == ops[k - 1].after else op.after
            posting[(rank, k)] = len(waits)
            for p in waits:
                dependents[(rank, p)].append((rank, k, "after"))
            last[(peer, op.kind)] = (rank, k)

    next_to_post = {rank: 0 for rank in posted}
    started: set[tuple[int, int]] = set()
    complete: set[tuple[int, int]] = set()
    done: deque[tuple[int, int]] = deque()

    def try_start(op: tuple[int, int]) -> None:
        if op in started or pending[op] or op[1] >= next_to_post[op[0]]:
            return
        started.add(op)
        if match[op] in started:
            for x in (op, match[op]):
                complete.add(x)
                done.append(x)

    def post(rank: int) -> None:
        ops = posted[rank]
        while next_to_post[rank] < len(ops) and not posting[(rank, next_to_post[rank])]:
            next_to_post[rank] += 1
            try_start((rank, next_to_post[rank] - 1))

    for rank in posted:
        post(rank)
    while done:
        op = done.popleft()
        for dep in dependents[op]:
            if len(dep) == 3:  # an ``after`` edge: dep is posted once its waits are over
                posting[dep[:2]] -= 1
                post(dep[0])
            else:
                pending[dep] -= 1
                try_start(dep)
    return sorted(op for op in pending if op not in complete)


def _posted(name: str, op: str, g: int, m: int, grouped: bool) -> dict[int, list[Posted]]:
    c = 2 * PIPELINE_PIECES  # every piece of a pipelined chunk is non-empty
    return {r: post_order(ALGORITHMS[name].steps(op, Topology(g * m, m, r), c), grouped)
            for r in range(g * m)}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(ALGORITHMS))
@pytest.mark.parametrize("op", OPS)
def test_grouped_posting_cannot_deadlock_on_any_shape_to_8_by_8_nor_on_16_by_8(name: str,
                                                                            op: str) -> None:
    for g, m in SHAPES:
        assert stuck_operations(_posted(name, op, g, m, grouped=True)) == [], f"{g} x {m}"


def test_the_dataflow_order_deadlocks_a_two_member_ring_under_nccls_rule() -> None:
    # Every receive is posted before any send: with one peer on each side, both ranks wait on a
    # receive that sits in front of the send the other one waits for. gloo does not mind; NCCL
    # would hang, which is why the NCCL path groups each step.
    assert stuck_operations(_posted("ring", "all_gather", 1, 2, grouped=False))
    assert stuck_operations(_posted("horing", "reduce_scatter", 2, 2, grouped=False))
    # Rings of three or more never send to the rank they receive from: no deadlock, even so.
    assert stuck_operations(_posted("ring", "all_gather", 1, 3, grouped=False)) == []


def test_the_same_operations_posted_one_by_one_deadlock_a_two_member_ring() -> None:
    # The grouped order with every operation in a batch of its own: each rank's first operation
    # towards its only peer waits for that peer's first, which waits behind its own.
    posted = {r: [op._replace(batch=k, after=()) for k, op in enumerate(ops)]
              for r, ops in _posted("ring", "all_gather", 1, 2, grouped=True).items()}
    assert stuck_operations(posted)
