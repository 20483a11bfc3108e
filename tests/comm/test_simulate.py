"""The alpha-beta model: its fit to the paper, its orderings, and the command line."""

from __future__ import annotations

import itertools
import random

import pytest

from rlhf_paro.comm import simulate
from rlhf_paro.comm.simulate import FITTED, PAPER, Links, collective_time, lower_bounds

PAPER_SHAPE = (PAPER["size"], PAPER["nodes"], PAPER["gpus_per_node"])


def test_fit_reproduces_the_two_fitted_paper_numbers() -> None:
    for name in ("ring", "hring"):
        t = collective_time(name, "all_gather", *PAPER_SHAPE, FITTED)
        assert t == pytest.approx(PAPER[name], rel=1e-12)
    # The stated defaults, to the digits the module docstring gives.
    assert FITTED.inter_bw / 1e9 == pytest.approx(3.460, abs=5e-4)
    assert FITTED.intra_bw / 1e9 == pytest.approx(5.874, abs=5e-4)


def test_fit_of_made_up_links_recovers_them() -> None:
    links = Links(intra_bw=20e9, inter_bw=4e9, intra_lat=3e-6, inter_lat=8e-6)
    ring = collective_time("ring", "all_gather", 256e6, 4, 4, links)
    hring = collective_time("hring", "all_gather", 256e6, 4, 4, links)
    got = simulate.fit(ring, hring, 256e6, 4, 4, intra_lat=3e-6, inter_lat=8e-6)
    assert got.intra_bw == pytest.approx(20e9, rel=1e-9)
    assert got.inter_bw == pytest.approx(4e9, rel=1e-9)


@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter", "all_reduce"])
@pytest.mark.parametrize("scope", ["intra", "inter", "world"])
def test_fit_port_recovers_equal_ports_from_two_sizes(op: str, scope: str) -> None:
    # Times made by scope_seconds on equal ports (2 nodes x 2) give those ports back, and the
    # fit then times a third size as they do: the seconds are affine in (latency, 1 / bw).
    truth = Links(intra_bw=3e8, inter_bw=3e8, intra_lat=1.5e-3, inter_lat=1.5e-3)
    small, large, other = 1e3, 1.6e7, 4e6
    got = simulate.fit_port(op, scope, 2, 2, *[
        (s, simulate.scope_seconds(op, scope, s, 2, 2, truth)) for s in (small, large)])
    assert got.intra_lat == pytest.approx(1.5e-3, rel=1e-9)
    assert got.intra_bw == pytest.approx(3e8, rel=1e-9) and got.inter_bw == got.intra_bw
    assert simulate.scope_seconds(op, scope, other, 2, 2, got) == pytest.approx(
        simulate.scope_seconds(op, scope, other, 2, 2, truth), rel=1e-9)


def test_fit_port_keeps_the_latency_at_least_zero() -> None:
    # A small run faster than the large one's bandwidth allows: no negative latency.
    got = simulate.fit_port("all_gather", "world", 2, 2, (1e3, 1e-9), (1e6, 1e-3))
    assert got.intra_lat == 0.0 and got.intra_bw > 0
    with pytest.raises(ValueError, match="cannot fit"):
        simulate.fit_port("all_gather", "world", 2, 2, (1e6, 1e-3), (1e6, 1e-3))


def test_fit_rejects_impossible_times() -> None:
    with pytest.raises(ValueError, match="intra ring"):
        simulate.fit(0.288, 0.03, *PAPER_SHAPE)  # H-Ring faster than its own inter ring


def _random_cases(count: int) -> list[tuple[str, float, int, int, Links]]:
    rng = random.Random(7)
    shapes = [(g, m) for g, m in itertools.product((1, 2, 3, 5), (1, 2, 4)) if g * m > 1]
    return [(rng.choice(("all_gather", "reduce_scatter")), rng.uniform(1e5, 1e9),
             *rng.choice(shapes),
             Links(rng.uniform(1e9, 300e9), rng.uniform(1e9, 100e9), rng.uniform(0, 2e-5),
                   rng.uniform(0, 5e-5)))
            for _ in range(count)]


@pytest.mark.parametrize("op,size,g,m,links", _random_cases(40))
def test_orderings_hold_for_any_links(op: str, size: float, g: int, m: int,
                                      links: Links) -> None:
    t = {name: collective_time(name, op, size, g, m, links) for name in simulate.NAMES}
    bounds = lower_bounds(size, g, m, links)
    slack = 1 + 1e-12
    assert t["native-ring"] == t["ring"]
    # HO-Ring moves H-Ring's first M-1 intra chunks under the inter ring; it pays for that with
    # M-1 more intra messages, so it can only lose where latency dominates, by their latency.
    assert t["horing"] <= (t["hring"] + (m - 1) * links.intra_lat) * slack
    bandwidth_only = Links(links.intra_bw, links.inter_bw, 0.0, 0.0)
    assert collective_time("horing", op, size, g, m, bandwidth_only) <= \
        collective_time("hring", op, size, g, m, bandwidth_only) * slack
    for name in simulate.NAMES:
        assert t[name] * slack >= bounds.any_algorithm
    for name in ("hring", "horing", "horing_pipelined"):
        assert t[name] * slack >= bounds.two_level
    assert bounds.two_level * slack >= bounds.any_algorithm


def test_paper_shape_predictions() -> None:
    # Recorded in the note; here only what the model must get right by construction:
    # HO-Ring lands between the bound and H-Ring, the pipelined variant close to the bound.
    t = {name: collective_time(name, "all_gather", *PAPER_SHAPE, FITTED)
         for name in ("hring", "horing", "horing_pipelined")}
    bound = lower_bounds(*PAPER_SHAPE, FITTED).two_level
    assert bound < t["horing_pipelined"] < t["horing"] < t["hring"]
    assert t["horing_pipelined"] <= 1.10 * bound


def test_parse_size_units() -> None:
    assert simulate.parse_size("1GB") == 1e9
    assert simulate.parse_size("64MiB") == 64 * 2**20
    assert simulate.parse_size("4096") == 4096
    with pytest.raises(ValueError, match="--size"):
        simulate.parse_size("lots")


def test_command_line_prints_every_algorithm_and_the_paper(capsys: pytest.CaptureFixture) -> None:
    assert simulate.main([]) == 0
    out = capsys.readouterr().out
    for name in (*simulate.NAMES, "bound, two-level", "bound, any", "paper (section 4.4)"):
        assert name in out
    assert "ring 288 ms (model +0.0%)" in out


def test_command_line_rejects_bad_shapes(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        simulate.main(["--nodes", "2", "--gpus-per-node", "0"])
    assert exc.value.code == 2
    assert "group_size" in capsys.readouterr().err


# scope_seconds on hand-computed cases: 2 groups of 2, a 4 MB buffer, intra 10 GB/s + 1 us,
# inter 1 GB/s + 10 us. Per step an intra chunk costs 1 us + 1 MB / 10 GB/s = 101 us and an
# inter one 10 us + 1 MB / 1 GB/s = 1010 us.
HAND = Links(intra_bw=10e9, inter_bw=1e9, intra_lat=1e-6, inter_lat=10e-6)
INTRA_CHUNK, INTER_CHUNK = 101e-6, 1010e-6


@pytest.mark.parametrize("op,scope,expected", [
    # A ring on the scope's 2 ranks: 1 step of half the buffer (2 MB), 2 for an all-reduce.
    ("all_gather", "intra", 1e-6 + 2e6 / 10e9),
    ("reduce_scatter", "inter", 10e-6 + 2e6 / 1e9),
    ("all_reduce", "intra", 2 * (1e-6 + 2e6 / 10e9)),
    # The world ring in rank order: 3 steps of 1 MB, each waiting for the one inter hop of
    # each group (ranks 1 -> 2 and 3 -> 0): per-NIC concentration.
    ("all_gather", "world", 3 * INTER_CHUNK),
    ("all_reduce", "world", 6 * INTER_CHUNK),
    # A reduce: a pipelined chain, n-1 step latencies and the whole 4 MB once through its
    # slowest link (on the world, the inter hop at the inter step latency).
    ("reduce", "intra", 1e-6 + 4e6 / 10e9),
    ("reduce", "inter", 10e-6 + 4e6 / 1e9),
    ("reduce", "world", 3 * 10e-6 + 4e6 / 1e9),
])
def test_scope_seconds_of_native_rings_by_hand(op: str, scope: str, expected: float) -> None:
    assert simulate.scope_seconds(op, scope, 4e6, 2, 2, HAND) == pytest.approx(expected,
                                                                                rel=1e-12)


def test_scope_seconds_of_horing_by_hand() -> None:
    # Step 1: the inter ring (1 chunk on the NIC) beside the intra ring (1 chunk): the NIC
    # decides, 1010 us. Step 2: one intra step passing the other group's chunk, 101 us.
    got = simulate.scope_seconds("reduce_scatter", "world", 4e6, 2, 2, HAND, "horing")
    assert got == pytest.approx(INTER_CHUNK + INTRA_CHUNK, rel=1e-12)


def test_scope_seconds_agree_with_the_simulated_schedules() -> None:
    # 48 MB on 12 ranks: whole chunks and pieces, so the integer chunks of step_times agree.
    for name in ("native", "hring", "horing", "horing_pipelined"):
        for op in ("all_gather", "reduce_scatter"):
            schedule = "ring" if name == "native" else name
            assert simulate.scope_seconds(op, "world", 48e6, 3, 4, FITTED, name) == \
                pytest.approx(collective_time(schedule, op, 48e6, 3, 4, FITTED), rel=1e-12)


def test_scope_seconds_of_nothing_is_zero() -> None:
    assert simulate.scope_seconds("all_gather", "inter", 4e6, 1, 8, HAND) == 0.0
    assert simulate.scope_seconds("all_reduce", "world", 0, 2, 2, HAND) == 0.0
    with pytest.raises(ValueError, match="unknown collective"):
        simulate.scope_seconds("broadcast", "world", 1.0, 2, 2, HAND)
