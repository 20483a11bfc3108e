"""The schedule table: its two scope rules, what it resolves to for the 14 strategies, and the
design document's copy of that resolution."""

from pathlib import Path

import pytest

from rlhf_paro.sharding.schedule import SCHEDULE, Collective, plan, transition_scope
from rlhf_paro.sharding.strategy import Level, Strategy, all_strategies

DESIGN = Path(__file__).resolve().parents[2] / "docs" / "design.md"


def test_level_changes_run_on_the_scope_that_separates_the_levels() -> None:
    assert transition_scope(Level.N, Level.I) == transition_scope(Level.I, Level.N) == "intra"
    assert transition_scope(Level.I, Level.G) == "inter"
    assert transition_scope(Level.G, Level.N) == "world"
    assert all(transition_scope(x, x) is None for x in Level)


# The G -> OS and OS -> P tables of the paper's section 3 (and our design), written out by hand,
# independently of the two rules: (op, scope) in order.
G_TO_OS = {
    ("N", "N"): [("all_reduce", "world")],
    ("N", "I"): [("reduce_scatter", "intra"), ("all_reduce", "inter")],
    ("N", "G"): [("reduce_scatter", "world")],
    ("I", "I"): [("all_reduce", "inter")],
    ("I", "G"): [("reduce_scatter", "inter")],  # the two-step reduce-scatter of eq. (1)
    ("G", "G"): [],
}
OS_TO_P = {("N", "N"): [], ("I", "I"): [], ("G", "G"): [], ("I", "N"): [("all_gather", "intra")],
           ("G", "I"): [("all_gather", "inter")], ("G", "N"): [("all_gather", "world")]}
GATHER = {"N": [], "I": [("all_gather", "intra")], "G": [("all_gather", "world")]}
GRAD_RS = {"N": [], "I": [("reduce_scatter", "intra")], "G": [("reduce_scatter", "world")]}
NORM = {"N": [], "I": [("all_reduce", "intra")], "G": [("all_reduce", "world")]}


def _ops(collectives: list[Collective]) -> list[tuple[str, str]]:
    return [(c.op, c.scope) for c in collectives]


@pytest.mark.parametrize("name", [s.name for s in all_strategies()])
def test_plan_matches_the_hand_written_tables(name: str) -> None:
    p, g, os = name
    got = plan(Strategy.parse(name))

    def phase(ph: str, what: tuple[str, ...]) -> list[tuple[str, str]]:
        return _ops([c for c in got if c.phase == ph and c.what in what])

    assert phase("forward", ("params",)) == GATHER[p]
    assert phase("backward", ("params",)) == GATHER[p]
    assert phase("backward", ("grads",)) == GRAD_RS[g]
    assert phase("boundary", ("grads",)) == G_TO_OS[(g, os)]
    assert phase("boundary", ("norm",)) == NORM[os]
    assert phase("update", ("trained",)) == OS_TO_P[(os, p)]


def test_frozen_models_only_gather_for_forward() -> None:
    for level in "NIG":
        got = plan(Strategy.parse(level, frozen=True))
        assert _ops(got) == GATHER[level] and all(c.phase == "forward" for c in got)


def test_every_row_names_levels_the_strategy_has() -> None:
    for row in SCHEDULE:
        assert {row.src, row.dst} <= {"P", "G", "OS", "N"}
        assert (row.op == "all_reduce") == bool(row.over)


def _table() -> str:
    short = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR"}

    def cell(collectives: tuple[Collective, ...], phase: str) -> str:
        return ", ".join(f"{short[c.op]}{'(norm)' if c.what == 'norm' else ''} {c.scope}"
                         for c in collectives if c.phase == phase) or "—"

    lines = ["| strategy | forward (per micro-batch) | backward (per micro-batch) | "
             "boundary (per step) | update (per step) |", "|---|---|---|---|---|"]
    for s in all_strategies():
        got = plan(s)
        lines.append(f"| {s.name} | " + " | ".join(
            cell(got, ph) for ph in ("forward", "backward", "boundary", "update")) + " |")
    return "\n".join(lines)


def test_the_design_documents_table_is_what_plan_resolves_to() -> None:
    text = DESIGN.read_text()
    block = text.split("<!-- schedule-table -->\n")[1].split("\n<!-- /schedule-table -->")[0]
    assert block == _table()


def test_buckets_send_large_units_alone_and_group_small_ones_in_finishing_order() -> None:
    from rlhf_paro.sharding.schedule import buckets

    # 5 and 3 fill a bucket of 6 together; 10 goes alone although a bucket is open; the empty
    # unit (a frozen root) is in none; 2 and 2 never reach 6 and go at the end of backward.
    assert buckets([5, 3, 0, 10, 2, 2], 6) == [[0, 1], [3], [4, 5]]
    assert buckets([2, 10, 2, 2], 6) == [[1], [0, 2, 3]]
    assert buckets([7, 7], 1) == [[0], [1]]  # 1: every unit alone
    assert buckets([], 6) == [] and buckets([0, 0], 6) == []
    # Every trained unit is in exactly one bucket, in its finishing order inside the bucket.
    sizes = [3, 0, 9, 1, 1, 6, 2, 8, 5]
    got = buckets(sizes, 6)
    flat = [k for b in got for k in b]
    assert sorted(flat) == [k for k, n in enumerate(sizes) if n]
    assert all(b == sorted(b) for b in got)
    assert all(sum(sizes[k] for k in b) >= 6 for b in got[:-1] if len(b) > 1)
