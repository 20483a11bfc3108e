"""``comm.algorithm=auto`` as a pure rule ([Note: choosing an algorithm] in ``comm/auto.py``):
what it picks on a grid of topologies and sizes, the edges of its measured thresholds, and that
the cost model and the simulator resolve it as the communicator does."""

from __future__ import annotations

import pytest

from rlhf_paro.comm.auto import (CROSSOVERS, HORING_GATHER_FROM, NATIVE_GATHER_BELOW,
                                 PIPELINED_GATHER_FROM, PIPELINED_SCATTER_FROM, choose, resolve)
from rlhf_paro.comm.collectives import predicted_bytes
from rlhf_paro.comm.meter import ALGORITHM_CHOICES, ALGORITHM_NAMES, AUTO
from rlhf_paro.comm.rings import OPS
from rlhf_paro.comm.simulate import FITTED, scope_seconds
from rlhf_paro.comm.topology import Topology

SHAPES = [(g, m) for g in (1, 2, 3, 4, 16) for m in (1, 2, 3, 8) if g * m > 1]
KiB, MiB = 1 << 10, 1 << 20
ELEM_SIZES = (1, 2, 4)


def _numel(chunk_bytes: int, topo: Topology, elem_size: int) -> int:
    """A full buffer whose chunk is ``chunk_bytes`` (a multiple of ``elem_size``)."""
    return chunk_bytes // elem_size * topo.num_ranks


def _expected(op: str, chunk: int) -> str:
    # The thresholds of comm/auto.py, written out: across groups, by chunk bytes.
    if op == "all_gather":
        if chunk < NATIVE_GATHER_BELOW:
            return "native"
        if chunk < HORING_GATHER_FROM:
            return "hring"
        return "horing" if chunk < PIPELINED_GATHER_FROM else "horing_pipelined"
    return "hring" if chunk < PIPELINED_SCATTER_FROM else "horing_pipelined"


CHUNKS = sorted({0, 4, 1 * KiB, 64 * KiB, 32 * MiB}
                | {t + d for t in (NATIVE_GATHER_BELOW, HORING_GATHER_FROM,
                                   PIPELINED_GATHER_FROM, PIPELINED_SCATTER_FROM)
                   for d in (-4, 0, 4)})


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_auto_picks_by_scope_shape_and_chunk_size(shape: tuple[int, int]) -> None:
    g, m = shape
    for rank in {0, g * m - 1}:  # the choice is the same on every rank
        topo = Topology(g * m, m, rank)
        for elem in ELEM_SIZES:
            for chunk in CHUNKS:
                numel = _numel(chunk, topo, elem)
                for op in OPS:
                    for scope in ("intra", "inter"):
                        assert choose(op, scope, numel, elem, topo) == "native"
                    want = "native" if g == 1 or m == 1 else _expected(op, chunk // elem * elem)
                    assert choose(op, "world", numel, elem, topo) == want, (op, chunk, elem)
                assert choose("all_reduce", "world", numel, elem, topo) == "native"


def test_thresholds_bite_at_their_exact_chunk_size() -> None:
    # 2 x 2, bf16: one element below each threshold against the threshold itself.
    topo, e = Topology(4, 2), 2
    edges = [("all_gather", NATIVE_GATHER_BELOW, "native", "hring"),
             ("all_gather", HORING_GATHER_FROM, "hring", "horing"),
             ("all_gather", PIPELINED_GATHER_FROM, "horing", "horing_pipelined"),
             ("reduce_scatter", PIPELINED_SCATTER_FROM, "hring", "horing_pipelined")]
    for op, threshold, below, at in edges:
        assert choose(op, "world", 4 * (threshold // e - 1), e, topo) == below
        assert choose(op, "world", 4 * (threshold // e), e, topo) == at
        # A buffer short of its padded tail has the padded chunk: ceil(numel / N).
        assert choose(op, "world", 4 * (threshold // e - 1) + 1, e, topo) == at


def test_crossovers_ascend_from_zero_and_name_algorithms() -> None:
    assert set(CROSSOVERS) == set(OPS)
    for rows in CROSSOVERS.values():
        starts = [start for start, _ in rows]
        assert starts[0] == 0 and starts == sorted(set(starts))
        assert all(name in ALGORITHM_NAMES for _, name in rows)


def test_resolve_keeps_concrete_names_and_native_off_world() -> None:
    topo = Topology(8, 4)
    for name in ALGORITHM_NAMES:
        assert resolve(name, "all_gather", "world", 1 << 30, 2, topo) == name
        assert resolve(name, "reduce_scatter", "intra", 1 << 30, 2, topo) == "native"
        assert resolve(name, "all_reduce", "world", 1 << 30, 2, topo) == "native"
    assert resolve(AUTO, "all_gather", "world", 8 * MiB, 2, topo) == \
        choose("all_gather", "world", 8 * MiB, 2, topo)
    assert ALGORITHM_CHOICES == (AUTO, *ALGORITHM_NAMES)
    with pytest.raises(ValueError, match="comm.algorithm='tree' is unknown; allowed: auto, "):
        resolve("tree", "all_gather", "world", 8, 4, topo)


@pytest.mark.parametrize("shape", [(2, 2), (4, 8), (1, 8), (8, 1)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_cost_model_and_simulator_resolve_auto_like_the_communicator(
        shape: tuple[int, int]) -> None:
    g, m = shape
    for chunk in CHUNKS:
        for rank in range(g * m):
            topo = Topology(g * m, m, rank)
            numel = _numel(chunk, topo, 2)
            for op in OPS:
                name = choose(op, "world", numel, 2, topo)
                assert predicted_bytes(AUTO, op, numel, 2, "world", topo) == \
                    predicted_bytes(name, op, numel, 2, "world", topo)
        if chunk:
            size = float(chunk * g * m)
            for op in OPS:
                name = choose(op, "world", chunk * g * m, 1, Topology(g * m, m))
                assert scope_seconds(op, "world", size, g, m, FITTED, AUTO) == \
                    scope_seconds(op, "world", size, g, m, FITTED, name)
