"""Strategy parsing, Principle 1 and the topology arithmetic (no processes)."""

import itertools

import pytest
import torch

from rlhf_paro.sharding import Level, Strategy, StrategyError, Topology, TopologyError
from rlhf_paro.sharding.strategy import all_strategies


def test_principle_1_keeps_exactly_14_of_27_triples() -> None:
    valid, rejected = [], []
    for triple in itertools.product("NIG", repeat=3):
        name = "".join(triple)
        try:
            valid.append(Strategy.parse(name).name)
        except StrategyError as err:
            rejected.append(name)
            assert "Principle 1" in str(err)
    assert len(valid) == 14 and len(rejected) == 13
    assert sorted(valid) == sorted(s.name for s in all_strategies())


@pytest.mark.parametrize("bad,nearest", [("IGN", "IGG"), ("NIN", "NII"), ("GGI", "GGG"),
                                         ("NGI", "NGG")])
def test_invalid_triple_suggests_nearest_valid_one(bad: str, nearest: str) -> None:
    with pytest.raises(StrategyError, match=f"nearest valid strategy: {nearest}"):
        Strategy.parse(bad)


@pytest.mark.parametrize("preset,triple", [("ddp", "NNN"), ("zero1", "NNG"), ("zero2", "NGG"),
                                           ("zero3", "GGG"), ("mics", "III"),
                                           ("fsdp-hybrid", "III"), ("ZeRO3", "GGG"),
                                           ("igg", "IGG")])
def test_presets_and_case(preset: str, triple: str) -> None:
    assert Strategy.parse(preset).name == triple


def test_frozen_models_take_one_p_level() -> None:
    assert Strategy.parse("I", frozen=True) == Strategy(Level.I)
    assert Strategy.parse("zero3", frozen=True).name == "G"
    with pytest.raises(StrategyError, match="frozen"):
        Strategy.parse("G")  # a trained model needs a triple
    with pytest.raises(StrategyError, match="allowed"):
        Strategy.parse("XYZ")


def test_nested_chunk_order_makes_i_shard_the_union_of_its_column() -> None:
    n, m = 6, 3  # g = 2
    g = n // m
    for rank in range(n):
        topo = Topology(n, m, rank)
        j = topo.local_index
        column = sorted(Topology(n, m, i * m + j).chunk_index() for i in range(g))
        assert column == list(range(j * g, (j + 1) * g))  # block j of M blocks
    assert sorted(Topology(n, m, r).chunk_index() for r in range(n)) == list(range(n))


def test_world_order_permutation_round_trips() -> None:
    topo = Topology(6, 3)
    flat = torch.arange(12.0)  # 6 chunks of 2
    nested = topo.world_to_nested(flat)
    # chunk slot of rank r (= i*M+j) moves to nested slot j*g+i
    for r in range(6):
        c = Topology(6, 3, r).chunk_index()
        assert torch.equal(nested[2 * c:2 * c + 2], flat[2 * r:2 * r + 2])
    assert torch.equal(topo.nested_to_world(nested), flat)


def test_group_size_must_divide_num_ranks() -> None:
    with pytest.raises(TopologyError, match="must divide"):
        Topology(4, 3)
