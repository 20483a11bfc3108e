"""World-scope all-gather and reduce-scatter built on point-to-point operations.

Every algorithm here is a *schedule*: a list of lock-step steps, each a set of sends and receives
of element ranges of the nested-order buffer (``rlhf_paro.comm.topology``). One executor runs
any schedule with ``batch_isend_irecv``, so our own code decides which link every byte crosses,
and it counts the bytes where the sends are issued. Schedules are pure functions of the topology,
which lets ``comm/simulate.py`` time exactly the steps that run here. A collective may be posted
asynchronously; the ring collectives of a process group run one at a time, in the order they
were posted, on the group's lane ([Note: one lane per group]).

Algorithms (c = S/N elements per chunk, chunk (i, j) = nested chunk ``j*g + i``):

- ``ring``: one ring over the N ranks in rank order, N-1 steps of one chunk.
- ``hring``: inter ring (g-1 steps of one chunk), then intra ring (M-1 steps of g chunks).
- ``horing``: the paper's HO-Ring (section 3.4, Figure 4), see [Note: HO-Ring all-gather].
- ``horing_pipelined``: HO-Ring whose final intra ring starts on each piece of a chunk as soon
  as the inter ring delivers it, see [Note: pipelined HO-Ring].

[Note: reduce-scatter is the transposed all-gather]
An all-gather schedule moves every chunk from its owner along a tree that reaches every rank,
each rank receiving each range exactly once and forwarding it only in a later step. Running the
steps backwards with sends and receives swapped, and adding instead of copying what arrives,
turns each broadcast tree into a reduction tree towards the owner: a rank sends a range only
after every partial sum it will ever receive for that range has been added. So one schedule
gives both collectives, with the same bytes on the same kind of link. The reduce-scatter uses
the all-gather schedule of the rings running in the opposite direction, so that its rings run
forward again (for ``ring`` this puts its inter-group sends on the same ranks as native's).
Each range is summed in the order of its reduction tree: exact for integer-valued data, equal to
native up to the summation order otherwise.
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist

from rlhf_paro.comm.meter import ALGORITHM_NAMES, LinkBytes, native_bytes, sends_across_groups
from rlhf_paro.comm.topology import Topology


OPS = ("all_gather", "reduce_scatter")
PIPELINE_PIECES = 4  # pieces per chunk of the registered pipelined HO-Ring
# The tag of every message the executor posts: other point-to-point traffic on the group (tag 0
# unless it says otherwise) can never take one of ours on gloo ([Note: one lane per group]).
RING_TAG = 0x52494E47


class Transfer(NamedTuple):
    """One message: elements [lo, hi) of the nested-order buffer, to or from world rank ``peer``."""

    peer: int
    lo: int
    hi: int


class Step(NamedTuple):
    """Transfers issued together in one batch; the next step starts when all of them are done."""

    sends: tuple[Transfer, ...]
    recvs: tuple[Transfer, ...]


# (topology with this rank, chunk numel, direction of every ring: +1 or -1) -> all-gather steps
Schedule = Callable[["Topology", int, int], list[Step]]

Range = tuple[int, int]


# -- building blocks of schedules ------------------------------------------------------------------
def _ring_step(members: list[int], pos: int, blocks: list[list[Range]], step: int,
               direction: int) -> Step:
    """Step ``step`` of a ring all-gather among ``members`` (world ranks), seen from position
    ``pos``: ``blocks[q]`` are the ranges first held by position q. Each step a rank forwards to
    its successor the block it received in the step before (its own block at step 0)."""
    n = len(members)
    nxt, prev = members[(pos + direction) % n], members[(pos - direction) % n]
    send = blocks[(pos - direction * step) % n]
    recv = blocks[(pos - direction * (step + 1)) % n]
    return Step(tuple(Transfer(nxt, lo, hi) for lo, hi in send),
                tuple(Transfer(prev, lo, hi) for lo, hi in recv))


def _coalesce(transfers: list[Transfer]) -> tuple[Transfer, ...]:
    """Merge adjacent ranges to the same peer into one message and drop empty ones. Both ends of
    a message see the same set of ranges, so both merge them the same way and, sorted by (peer,
    lo), post them in the same order: that order is what matches sends to receives."""
    merged: list[Transfer] = []
    for t in sorted(t for t in transfers if t.hi > t.lo):
        last = merged[-1] if merged else None
        if last is not None and last.peer == t.peer and last.hi == t.lo:
            merged[-1] = Transfer(t.peer, last.lo, t.hi)
        else:
            merged.append(t)
    return tuple(merged)


def _merge(*steps: Step) -> Step:
    """Several rings' steps issued in one batch, so that they use their links at the same time."""
    return Step(_coalesce([t for s in steps for t in s.sends]),
                _coalesce([t for s in steps for t in s.recvs]))


class _Rings:
    """The members and blocks of the rings a rank (i, j) takes part in."""

    def __init__(self, topo: Topology, c: int) -> None:
        g, m, i, j = topo.num_groups, topo.group_size, topo.group_index, topo.local_index
        self.g, self.m, self.i, self.j, self.c = g, m, i, j, c
        self.inter = [ii * m + j for ii in range(g)]  # ranks (., j) in group order
        self.intra = [i * m + jj for jj in range(m)]  # ranks (i, .) in local order

    def chunk(self, i: int, j: int, piece: int = 0, num_pieces: int = 1) -> Range:
        """Piece ``piece`` of ``num_pieces`` of chunk (i, j); pieces differ by at most one."""
        base = (j * self.g + i) * self.c
        return base + piece * self.c // num_pieces, base + (piece + 1) * self.c // num_pieces


# -- the algorithms ----------------------------------------------------------------------------------
def _ring_schedule(topo: Topology, c: int, direction: int) -> list[Step]:
    n = topo.num_ranks
    blocks = [[(topo.chunk_index(r) * c, (topo.chunk_index(r) + 1) * c)] for r in range(n)]
    return [_merge(_ring_step(list(range(n)), topo.rank, blocks, s, direction))
            for s in range(n - 1)]


def _hring_schedule(topo: Topology, c: int, direction: int) -> list[Step]:
    r = _Rings(topo, c)
    inter_blocks = [[r.chunk(ii, r.j)] for ii in range(r.g)]
    # After the inter ring, rank (i, j) holds block j: chunks (0..g-1, j), contiguous.
    intra_blocks = [[(jj * r.g * c, (jj + 1) * r.g * c)] for jj in range(r.m)]
    return ([_merge(_ring_step(r.inter, r.i, inter_blocks, s, direction)) for s in range(r.g - 1)]
            + [_merge(_ring_step(r.intra, r.j, intra_blocks, s, direction))
               for s in range(r.m - 1)])


def _horing_schedule(topo: Topology, c: int, direction: int) -> list[Step]:
    """[Note: HO-Ring all-gather]
    Step 1, max(g-1, M-1) batches: in the same batch as inter-ring step s (rank (i, j) gathers
    c(., j), its I-block) goes intra-ring step s of the own chunks (rank (i, j) gathers c(i, .)).
    The two rings use disjoint links, so both are busy at once; neither waits for the other
    because each only forwards what it received itself.
    Step 2, M-1 batches: an intra ring passes each rank's g-1 other chunks of its block, received
    in step 1 from the other groups, so that every rank holds all N chunks. Those chunks are the
    block minus chunk i: two contiguous ranges, sent as two messages at most."""
    r = _Rings(topo, c)
    inter_blocks = [[r.chunk(ii, r.j)] for ii in range(r.g)]
    own_blocks = [[r.chunk(r.i, jj)] for jj in range(r.m)]
    rest_blocks = [[r.chunk(ii, jj) for ii in range(r.g) if ii != r.i] for jj in range(r.m)]
    step1 = []
    for s in range(max(r.g - 1, r.m - 1)):
        lanes = []
        if s < r.g - 1:
            lanes.append(_ring_step(r.inter, r.i, inter_blocks, s, direction))
        if s < r.m - 1:
            lanes.append(_ring_step(r.intra, r.j, own_blocks, s, direction))
        step1.append(_merge(*lanes))
    step2 = [_merge(_ring_step(r.intra, r.j, rest_blocks, s, direction)) for s in range(r.m - 1)]
    return step1 + step2


def _horing_pipelined_schedule(topo: Topology, c: int, direction: int,
                               num_pieces: int = PIPELINE_PIECES) -> list[Step]:
    """[Note: pipelined HO-Ring]
    Each chunk is cut into P = ``num_pieces`` pieces and time into slots. The inter ring sends
    one piece per slot: piece p of its step s in slot s*P + p, so it never idles. "Layer" d of
    group i is the chunks c(i - d, .) (d = 0: the group's own chunks); rank (i, j) holds c(i-d, j)
    once its inter ring delivered it, which for piece p is the end of slot (d-1)*P + p. The intra
    ring of (layer d, piece p) starts in the next slot and runs M-1 slots, one per slot, so the
    final intra ring of HO-Ring overlaps the inter ring instead of following it. Layer 0 is there
    from the start; its pieces start one per slot, to spread its load like the others'.
    Every rank of group i receives layer d's pieces in the same slot (the inter rings of the M
    rails run in step), so each intra ring only forwards what its sender already holds.
    Per slot the intra link carries at most 2(M-1) pieces and the inter link one, so with P
    large enough the total time approaches what the busier link needs for its bytes alone."""
    r = _Rings(topo, c)
    num_slots = (r.g - 1) * num_pieces + r.m - 1 if r.g > 1 else num_pieces + r.m - 2
    slots: list[list[Step]] = [[] for _ in range(max(num_slots, 0))]
    for s in range(r.g - 1):
        for p in range(num_pieces):
            blocks = [[r.chunk(ii, r.j, p, num_pieces)] for ii in range(r.g)]
            slots[s * num_pieces + p].append(_ring_step(r.inter, r.i, blocks, s, direction))
    for d in range(r.g):
        # The inter ring's step d-1 delivers block (i - direction*d): that is layer d here.
        src = (r.i - direction * d) % r.g
        for p in range(num_pieces):
            blocks = [[r.chunk(src, jj, p, num_pieces)] for jj in range(r.m)]
            start = p if d == 0 else (d - 1) * num_pieces + p + 1
            for u in range(r.m - 1):
                slots[start + u].append(_ring_step(r.intra, r.j, blocks, u, direction))
    return [_merge(*lanes) for lanes in slots]


# -- execution ----------------------------------------------------------------------------------------
def _transpose(steps: list[Step]) -> list[Step]:
    """See [Note: reduce-scatter is the transposed all-gather]."""
    return [Step(s.recvs, s.sends) for s in reversed(steps)]


def step_bytes(step: Step, rank: int, group_size: int, elem_size: int) -> LinkBytes:
    """Bytes ``rank`` sends in ``step`` to ranks of its own group (intra) and of others."""
    intra = inter = 0
    for t in step.sends:
        if t.peer // group_size == rank // group_size:
            intra += (t.hi - t.lo) * elem_size
        else:
            inter += (t.hi - t.lo) * elem_size
    return LinkBytes(intra, inter)


class Posted(NamedTuple):
    """A point-to-point operation as the executor posts it (see [Note: posting order])."""

    kind: str  # "send" or "recv"
    step: int  # the schedule step it belongs to
    transfer: Transfer
    batch: int  # operations of one batch are posted together, as one group of the library
    after: tuple[int, ...]  # positions of operations that must complete before it is posted


def post_order(steps: list[Step], grouped: bool) -> list[Posted]:
    """The operations a rank posts to run ``steps``, in order.

    [Note: posting order]
    NCCL runs the point-to-point operations between a pair of ranks in the order they were
    posted, on one stream: a receive posted before a send to the same peer waits for that peer's
    send, and if the peer did the same, both wait forever — every ring of two members would.
    Operations inside one group (``batch_isend_irecv``) do not block each other. So on NCCL
    (``grouped``) each step is one group, posted once the previous step's group has completed:
    lock-step, deadlock-free because every send of step t meets its receive in the peer's group
    of step t. gloo matches messages by tag and pair whatever the order, so there the dataflow
    order keeps more in flight: every receive is posted at once, and each send as soon as the
    receives it forwards have landed (see [Note: dataflow execution]).
    ``tests/comm/test_posting_order.py`` runs both orders through a simulator of NCCL's rule.
    """
    out: list[Posted] = []
    if grouped:
        previous: tuple[int, ...] = ()
        for index, step in enumerate(steps):
            first = len(out)
            out += [Posted("send", index, t, index, previous) for t in step.sends]
            out += [Posted("recv", index, t, index, previous) for t in step.recvs]
            previous = tuple(range(first, len(out)))
        return out
    for index, step in enumerate(steps):
        out += [Posted("recv", index, t, len(out) + k, ()) for k, t in enumerate(step.recvs)]
    recvs = list(enumerate(out))
    for index, step in enumerate(steps):
        for t in step.sends:
            waits = tuple(k for k, r in recvs if r.step < index
                          and r.transfer.lo < t.hi and t.lo < r.transfer.hi)
            out.append(Posted("send", index, t, len(out), waits))
    return out


def _execute(buf: torch.Tensor, steps: list[Step], topo: Topology, reduce: bool) -> LinkBytes:
    """Run ``steps`` on the flat nested-order ``buf``; received ranges are copied in (all-gather)
    or added in (reduce-scatter). Returns the bytes this rank sent, by kind of link.

    [Note: dataflow execution]
    The steps say what may overlap; they are not barriers. On gloo every receive is posted at
    once, and each send is posted, in step order, as soon as the receives it forwards have
    landed: a send of range R in step t waits only for the receives of step < t that overlap R
    (for a reduce-scatter, all the partial sums of R it will ever get, see the transpose note).
    So a rank whose inter ring has delivered piece p forwards it at once, whatever the other
    lanes of that step are still doing. Both ends post the messages between two ranks in the same
    order (step, then (peer, lo)), which is what pairs sends with receives. On NCCL the steps run
    in lock-step instead, one group each: [Note: posting order].
    """
    posted = post_order(steps, grouped=dist.get_backend(topo.world) == "nccl")
    works: list[object] = [None] * len(posted)
    landing: list[torch.Tensor | None] = [None] * len(posted)
    done = [False] * len(posted)

    def complete(k: int) -> None:
        if not done[k]:
            works[k].wait()
            if reduce and posted[k].kind == "recv":
                buf[posted[k].transfer.lo:posted[k].transfer.hi].add_(landing[k])
            done[k] = True

    position = 0
    while position < len(posted):
        end = position + 1
        while end < len(posted) and posted[end].batch == posted[position].batch:
            end += 1
        batch = range(position, end)
        for k in batch:
            for dep in posted[k].after:
                complete(dep)
        ops = []
        for k in batch:
            t = posted[k].transfer
            if posted[k].kind == "send":
                ops.append(dist.P2POp(dist.isend, buf[t.lo:t.hi], group=topo.world,
                                      tag=RING_TAG, group_peer=t.peer))
            else:
                # Reduce-scatter: a range may arrive from two peers in one step (HO-Ring's last
                # step adds the inter and the intra partial sums), so each gets its own buffer.
                landing[k] = buf.new_empty(t.hi - t.lo) if reduce else buf[t.lo:t.hi]
                ops.append(dist.P2POp(dist.irecv, landing[k], group=topo.world,
                                      tag=RING_TAG, group_peer=t.peer))
        if len(ops) == 1:
            op = ops[0]
            peer = {"group_dst" if op.op is dist.isend else "group_src": op.group_peer}
            batch_works = [op.op(op.tensor, group=op.group, tag=op.tag, **peer)]
        else:
            batch_works = dist.batch_isend_irecv(ops)
        for k, work in zip(batch, batch_works):
            works[k] = work
        position = end
    for k in range(len(posted)):
        complete(k)
    intra = inter = 0
    for step in steps:
        sent = step_bytes(step, topo.rank, topo.group_size, buf.element_size())
        intra, inter = intra + sent.intra, inter + sent.inter
    return LinkBytes(intra, inter)


class Running:
    """A ring collective handed to its group's lane. ``wait()`` returns once it is done, with
    the result in the caller's ``out``, and gives the bytes this rank sent."""

    def __init__(self, sent: LinkBytes | None = None) -> None:
        self._sent = sent  # set when the collective is done
        self._error: BaseException | None = None  # what stopped it, raised again by wait()
        self._thread: threading.Thread | None = None  # gloo: the thread that runs it
        self._ready: Callable[[], None] | None = None  # NCCL: the caller's stream waits for it

    def _start(self, run: Callable[[], LinkBytes], before: Running | None) -> None:
        def target() -> None:
            try:
                if before is not None:
                    before._join()
                    if before._error is not None:
                        raise RuntimeError("not run: the ring collective posted before it on "
                                           "this process group failed") from before._error
                with torch.no_grad():  # grad mode is per thread
                    self._sent = run()
            except BaseException as err:  # noqa: BLE001 - raised again by wait()
                self._error = err

        self._thread = threading.Thread(target=target, name="ring-lane", daemon=True)
        self._thread.start()

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def wait(self) -> LinkBytes:
        self._join()
        if self._error is not None:
            raise self._error
        if self._ready is not None:
            self._ready()
        assert self._sent is not None
        return self._sent


class _Lane:
    """The ring collectives of one process group, run one at a time in the order they were
    posted.

    [Note: one lane per group]
    Each ring collective on a process group, of any communicator, synchronous or not, goes
    through the group's lane, which runs them one at a time in the order the caller posted
    them. On gloo a collective's later sends wait for its earlier receives, so something on the
    host must post them as the data lands: an asynchronous one runs on a thread of its own that
    first joins the thread of the one posted before it; a synchronous one runs on the caller's
    thread once the lane is idle. Why every message still meets its own:
      - gloo pairs a point-to-point message with a receive by (pair, tag), in the order the two
        ends post them. Every rank posts the same ring collectives on a group in the same order
        (the engine's schedule), the lane runs them in that order and never two at once, and
        within one collective both ends of a pair post its messages in the same order
        ([Note: dataflow execution]); so on every pair our messages form the same sequence at
        both ends, collective after collective.
      - They carry ``RING_TAG``: other point-to-point traffic on the group cannot take ours.
      - gloo matches a native collective in a slot of its own kind and sequence number, drawn
        when the caller issues it; a point-to-point slot is its bare tag and draws no number.
        The lane's threads issue no collective, so the callers' collectives, on any group,
        keep one order on every rank whatever a lane does meanwhile, and they never match
        our messages.
      - The lane waits for nothing its caller does: the input is copied into the working
        buffer before ``post``, and only the lane touches that buffer and ``out`` until
        ``wait()``. A rank blocked in a native collective, or in ``wait()`` on a later ring
        collective, cannot hold back the one in flight, so no cycle of waits forms.
    NCCL posts without blocking the host but runs a communicator's operations in the order
    they were enqueued, and two threads enqueuing on one communicator would give each rank an
    order of its own. There every ring collective is posted by the caller's thread, in program
    order; an asynchronous one on the lane's own stream, which first waits for the caller's,
    and ``wait()`` makes the caller's stream wait for the lane's.
    """

    def __init__(self) -> None:
        self.last: Running | None = None  # gloo: the collective posted last; the next joins it
        self.stream: Any = None  # NCCL: the stream of asynchronous ring collectives

    def post(self, run: Callable[[], LinkBytes], work: torch.Tensor, group: Any,
             async_op: bool) -> Running:
        if dist.get_backend(group) == "nccl":
            return self._post_on_stream(run, work, async_op)
        if not async_op:
            if self.last is not None:
                self.last.wait()  # raises if it failed: the pairs' message order is lost
                self.last = None
            return Running(run())
        running = Running()
        running._start(run, self.last)
        self.last = running
        return running

    def _post_on_stream(self, run: Callable[[], LinkBytes], work: torch.Tensor,
                        async_op: bool) -> Running:
        if not async_op:
            return Running(run())
        caller = torch.cuda.current_stream(work.device)
        if self.stream is None:
            self.stream = torch.cuda.Stream(work.device)
        self.stream.wait_stream(caller)  # the input copied into ``work`` is there
        with torch.cuda.stream(self.stream):
            running = Running(run())
        work.record_stream(self.stream)  # not reused by the caller's stream before it is done
        event, device = self.stream.record_event(), work.device
        running._ready = lambda: torch.cuda.current_stream(device).wait_event(event)
        return running


_LANES: weakref.WeakKeyDictionary[Any, _Lane] = weakref.WeakKeyDictionary()
_LANES_LOCK = threading.Lock()


def _lane(group: Any) -> _Lane:
    """The lane of a process group: one per group and process, shared by every communicator
    of that group, since the point-to-point messages it orders are the group's."""
    with _LANES_LOCK:
        if group not in _LANES:
            _LANES[group] = _Lane()
        return _LANES[group]


def _chunk_numel(total: int, n: int) -> int:
    return -(-total // n)


class Algorithm:
    """A world-scope all-gather / reduce-scatter defined by its all-gather schedule."""

    def __init__(self, name: str, schedule: Schedule,
                 link_bytes: Callable[[int, Topology], LinkBytes]) -> None:
        self.name = name
        self.schedule = schedule  # pure: the simulator times it, the tests check it
        self._link_bytes = link_bytes  # (chunk bytes, topology) -> what this rank sends

    def steps(self, op: str, topo: Topology, c: int) -> list[Step]:
        """The steps this rank runs for ``op`` on chunks of ``c`` elements."""
        if op == "all_gather":
            return self.schedule(topo, c, 1)
        if op == "reduce_scatter":
            return _transpose(self.schedule(topo, c, -1))
        raise ValueError(f"unknown collective {op!r}; allowed: {', '.join(OPS)}")

    @torch.no_grad()
    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, topo: Topology,
                   async_op: bool = False) -> Running:
        """Fill ``out`` with the N chunks in nested order; ``shard`` is chunk
        ``topo.chunk_index()``. ``out`` may be shorter than N chunks by less than one chunk per
        rank (a size not divisible by N): the tail of the padded result is dropped.
        ``shard`` is copied before this returns; with ``async_op``, ``out`` holds the result
        once ``wait()`` on what this returns has returned."""
        c, n = shard.numel(), topo.num_ranks
        if _chunk_numel(out.numel(), n) != c:
            raise ValueError(f"all_gather: out has {out.numel()} elements, expected "
                             f"{n} chunks of {c} (the last rank's chunk may be padded)")
        exact = out.numel() == n * c and out.is_contiguous()
        work = out.view(-1) if exact else out.new_empty(n * c)
        k = topo.chunk_index()
        work[k * c:(k + 1) * c].copy_(shard.reshape(-1))

        def run() -> LinkBytes:
            sent = _execute(work, self.steps("all_gather", topo, c), topo, reduce=False)
            if not exact:
                out.copy_(work[:out.numel()].view_as(out))
            return sent

        return _lane(topo.world).post(run, work, topo.world, async_op)

    @torch.no_grad()
    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, topo: Topology,
                       async_op: bool = False, overwrite: bool = False) -> Running:
        """Sum ``full`` (N chunks in nested order, possibly short of a padded tail) over all
        ranks and write this rank's chunk ``topo.chunk_index()`` to ``out``. ``full`` is left
        as it was, and copied before this returns: the partial sums live in a working copy;
        with ``overwrite`` (a scratch buffer nobody reads again) and a ``full`` of exactly N
        chunks they live in ``full`` itself, which saves a buffer's allocation, zeroing and
        copy. With ``async_op``, ``out`` holds the result once ``wait()`` has returned."""
        c, n = out.numel(), topo.num_ranks
        if _chunk_numel(full.numel(), n) != c:
            raise ValueError(f"reduce_scatter: full has {full.numel()} elements, expected "
                             f"{n} chunks of {c} (the last rank's chunk may be padded)")
        if overwrite and full.numel() == n * c and full.is_contiguous():
            work = full.view(-1)
        else:
            work = full.new_zeros(n * c)
            work[:full.numel()].copy_(full.reshape(-1))
        k = topo.chunk_index()

        def run() -> LinkBytes:
            sent = _execute(work, self.steps("reduce_scatter", topo, c), topo, reduce=True)
            out.copy_(work[k * c:(k + 1) * c].view_as(out))
            return sent

        return _lane(topo.world).post(run, work, topo.world, async_op)

    def link_bytes(self, op: str, numel: int, elem_size: int, topo: Topology) -> LinkBytes:
        """Closed form of the bytes this rank sends (intra, inter) for ``op`` on a buffer of
        ``numel`` elements, padded to N chunks of ceil(numel / N)."""
        if op not in OPS:
            raise ValueError(f"unknown collective {op!r}; allowed: {', '.join(OPS)}")
        return self._link_bytes(_chunk_numel(numel, topo.num_ranks) * elem_size, topo)


def _ring_link_bytes(chunk: int, topo: Topology) -> LinkBytes:
    # The ring's only cross-group hop leaves the last rank of each group (both directions of
    # the ring are used: see the reduce-scatter note), N-1 chunks in all.
    sent = (topo.num_ranks - 1) * chunk
    return LinkBytes(0, sent) if sends_across_groups(topo) else LinkBytes(sent, 0)


def _two_level_link_bytes(chunk: int, topo: Topology) -> LinkBytes:
    # H-Ring and both HO-Rings: the inter ring sends g-1 chunks, the intra rings g(M-1) chunks.
    g, m = topo.num_groups, topo.group_size
    return LinkBytes(g * (m - 1) * chunk, (g - 1) * chunk)


ALGORITHMS: dict[str, Algorithm] = {
    "ring": Algorithm("ring", _ring_schedule, _ring_link_bytes),
    "hring": Algorithm("hring", _hring_schedule, _two_level_link_bytes),
    "horing": Algorithm("horing", _horing_schedule, _two_level_link_bytes),
    "horing_pipelined": Algorithm("horing_pipelined", _horing_pipelined_schedule,
                                  _two_level_link_bytes),
}


assert tuple(ALGORITHMS) == ALGORITHM_NAMES[1:], "comm.meter.ALGORITHM_NAMES lists these"


def pipelined(num_pieces: int) -> Algorithm:
    """Pipelined HO-Ring with chunks cut into ``num_pieces`` pieces."""
    if num_pieces < 1:
        raise ValueError(f"num_pieces={num_pieces} must be at least 1")
    return Algorithm("horing_pipelined",
                     functools.partial(_horing_pipelined_schedule, num_pieces=num_pieces),
                     _two_level_link_bytes)


def predicted_world_bytes(algorithm: str, op: str, numel: int, elem_size: int,
                          topo: Topology) -> LinkBytes:
    """Bytes this rank sends for a world-scope ``op`` under ``algorithm``, native included
    (native is attributed by the ring model of ``comm.meter``)."""
    if op not in OPS:
        raise ValueError(f"unknown collective {op!r}; allowed: {', '.join(OPS)}")
    if algorithm == "native":
        return native_bytes(op, numel, elem_size, "world", topo)
    if algorithm not in ALGORITHMS:
        raise ValueError(f"comm.algorithm={algorithm!r} is unknown; allowed: "
                         f"{', '.join(ALGORITHM_NAMES)}")
    return ALGORITHMS[algorithm].link_bytes(op, numel, elem_size, topo)
