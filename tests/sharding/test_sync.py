"""The sync into a rollout engine (``engine.unit_parameters``, [Note: a unit at a time]) on 4 gloo
ranks as 2 groups x 2: P at N, I and G, on native collectives and on HO-Ring. Per rank, the bytes
metered under phase ``sync`` equal the closed form of ``test_cost.sync_bytes`` and
``cost.traffic(..., syncs=1)`` exactly, and the tensors handed out are the model's parameters as
``full_state_dict`` gathers them, after a step has changed them.
"""

from __future__ import annotations

import pytest
import torch

from rlhf_paro.sharding.layout import UnitSizes
from tests.dist_utils import run_distributed
from tests.sharding.parity import OPTIM, build_model, make_batches, micro_loss
from tests.sharding.test_cost import sync_bytes

pytestmark = [pytest.mark.dist, pytest.mark.slow]

WORLD, GROUP = 4, 2
STRATEGIES = ("NGG", "IGG", "GGG")
ALGORITHMS = ("native", "horing")
# odd: unit buffers that N = 4 does not divide (padding); lora: a frozen and a trainable buffer
# in the adapted blocks, each padded on its own.
VARIANTS = ("odd", "lora")
CASES = [(s, a, v) for s in STRATEGIES for a in ALGORITHMS for v in VARIANTS]


def sync_worker(rank: int, world_size: int, group_size: int) -> dict:
    from rlhf_paro.comm.meter import SYNC
    from rlhf_paro.sharding import Topology, cost, shard
    from rlhf_paro.sharding.layout import unit_sizes
    from rlhf_paro.sharding.strategy import Strategy

    topo = Topology.from_process_group(group_size=group_size)
    out = {}
    for strategy, algorithm, variant in CASES:
        model = build_model(variant)
        sizes = unit_sizes(model)
        names = [name for name, _ in model.named_parameters()]
        engine = shard(model, strategy, topo, optim=OPTIM, comm=algorithm)
        # One step first, so that the P shards hold values the model was not built with.
        ids = make_batches(variant, world_size)[0, rank, 0]
        engine.backward(micro_loss(engine, ids))
        engine.step()
        engine.meter.reset()
        # A tensor is valid until the next unit is drawn: keep copies.
        synced = [(name, tensor.clone()) for name, tensor in engine.unit_parameters(SYNC)]
        sent = engine.meter.by_phase()
        # A LoRA actor's adapters alone (trainable_only): each unit's trainable buffer only.
        engine.meter.reset()
        adapters = [(name, tensor.clone())
                    for name, tensor in engine.unit_parameters(SYNC, trainable_only=True)]
        adapters_sent = engine.meter.by_phase()
        full = engine.full_state_dict()  # collective: every rank takes part
        expected = cost.traffic(Strategy.parse(strategy), sizes, world_size, group_size, 1,
                                "fp32", algorithm, rank=rank, syncs=1)["sync"]
        out[strategy, algorithm, variant] = {"names": names, "synced": synced, "full": full,
                                             "sent": sent, "sizes": sizes, "expected": expected,
                                             "adapters": adapters,
                                             "adapters_sent": adapters_sent}
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(sync_worker, WORLD, GROUP)


@pytest.mark.parametrize("case", CASES, ids="-".join)
def test_sync_bytes_per_rank_equal_the_closed_form(results: list[dict], case: tuple) -> None:
    strategy, algorithm, _ = case
    for rank in range(WORLD):
        got = results[rank][case]
        # Nothing but the sync ran, all of it under its phase.
        assert set(got["sent"]) <= {"sync"}
        totals = got["sent"].get("sync", {"intra_bytes": 0, "inter_bytes": 0})
        sent = (totals["intra_bytes"], totals["inter_bytes"])
        closed = sync_bytes(strategy[0], got["sizes"], WORLD, GROUP, 4, algorithm, rank)
        assert sent == closed == tuple(got["expected"]), f"rank {rank}"
        if strategy[0] == "N":
            assert sent == (0, 0)  # every rank holds the full buffers already
        else:
            assert sum(sent) > 0


@pytest.mark.parametrize("case", CASES, ids="-".join)
def test_sync_hands_out_every_parameter_as_full_state_dict_has_it(results: list[dict],
                                                                   case: tuple) -> None:
    for rank in range(WORLD):
        got = results[rank][case]
        # Unit by unit, every parameter once (named_parameters gives a shared one once too).
        assert sorted(name for name, _ in got["synced"]) == sorted(got["names"])
        for name, tensor in got["synced"]:
            assert torch.equal(tensor, got["full"][name]), f"rank {rank} {name}"
    # The step moved the parameters, so stale values would not pass.
    initial = dict(build_model(case[2]).named_parameters())
    trained = [name for name, p in initial.items() if p.requires_grad]
    synced = dict(results[0][case]["synced"])
    assert trained and all(not torch.equal(synced[name], initial[name]) for name in trained)


@pytest.mark.parametrize("case", [c for c in CASES if c[2] == "lora"], ids="-".join)
def test_the_trained_parameters_alone_gather_the_trainable_buffers_only(results: list[dict],
                                                                         case: tuple) -> None:
    # What a LoRA actor's sync sends after the base (unit_parameters(trainable_only=True)):
    # every trained parameter, as full_state_dict has it, and the bytes of gathering the
    # trainable buffers alone, not the frozen ones beside them.
    strategy, algorithm, _ = case
    trained = {name for name, p in build_model("lora").named_parameters() if p.requires_grad}
    for rank in range(WORLD):
        got = results[rank][case]
        assert sorted(name for name, _ in got["adapters"]) == sorted(trained)
        for name, tensor in got["adapters"]:
            assert torch.equal(tensor, got["full"][name]), f"rank {rank} {name}"
        totals = got["adapters_sent"].get("sync", {"intra_bytes": 0, "inter_bytes": 0})
        sent = (totals["intra_bytes"], totals["inter_bytes"])
        only = [UnitSizes(u.trainable, 0) for u in got["sizes"]]
        assert sent == sync_bytes(strategy[0], only, WORLD, GROUP, 4, algorithm, rank)
        if strategy[0] != "N":
            assert 0 < sum(sent) < sum(sync_bytes(strategy[0], got["sizes"], WORLD, GROUP, 4,
                                                  algorithm, rank))
