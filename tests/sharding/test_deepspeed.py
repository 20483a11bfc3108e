"""The DeepSpeed backend (sharding/deepspeed_engine.py) on 4 gloo ranks as 2 groups x 2, held
to the same unsharded reference as the PaRO engine (tests/sharding/parity.py).

Tolerance: the fp32 reference, 1e-6 relative, as for the PaRO engine. DeepSpeed runs the same
arithmetic (torch's AdamW on fp32 partitions, clipping by max_norm / (norm + 1e-6)); what
differs is the order in which the N*s micro-batch gradients are added and DeepSpeed's division
by N before or after its reductions. Each of those changes a summed gradient element by a few
fp32 ulps (the sum bound of parity.py's [Note: bf16 error bound], step 2, with n = 8 terms:
2 * gamma(7) * sum|g| ~ 8e-7 relative to sum|g|), and parity.py's eps = 1e-6 keeps Adam from
magnifying noise on cancelling gradients, so the steps, losses and norms agree to 1e-6.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.sharding.parity import (MAX_NORM, MICRO, OPTIM, STEPS, build_model, make_batches,
                                   micro_loss, reference_run)

pytestmark = [pytest.mark.dist, pytest.mark.slow]

WORLD, GROUP = 4, 2
# (zero stage, hpZ partition size, offload the optimizer)
CASES = [(0, 1, False), (1, 1, False), (2, 1, False), (3, 1, False), (3, 2, False),
         (2, 1, True)]
# DeepSpeed keeps parameters under 1e5 elements whole on every rank by default; this model's
# are all smaller, so ZeRO-3 partitions them only with the threshold at 0.
EXTRA = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}


def key(case: tuple[int, int, bool]) -> str:
    stage, hpz, offload = case
    return f"zero{stage}" + (f"-hpz{hpz}" if hpz > 1 else "") + ("-offload" if offload else "")


def deepspeed_run(rank: int, topo, case: tuple[int, int, bool]) -> dict:
    from rlhf_paro.sharding.deepspeed_engine import _import_deepspeed, deepspeed_engine

    deepspeed = _import_deepspeed()

    stage, hpz, offload = case
    engine = deepspeed_engine(build_model("base"), topo, zero_stage=stage,
                              hpz_partition_size=hpz, offload_optimizer=offload, optim=OPTIM,
                              max_grad_norm=MAX_NORM, grad_accum_steps=MICRO, extra=EXTRA)
    batches = make_batches("base", topo.num_ranks)[:, rank]
    losses = torch.zeros(STEPS, MICRO, dtype=torch.float64)
    norms, traffic, recorded = [], [], 0
    # DeepSpeed's comms logger counts its collectives by name ([Note: metering DeepSpeed]).
    deepspeed.comm.configure(enabled=True, prof_all=True, verbose=False)
    deepspeed.comm.reset_log()
    for step in range(STEPS):
        engine.meter.reset()
        for k in range(MICRO):
            loss = micro_loss(engine, batches[step, k])
            losses[step, k] = loss.item()
            engine.backward(loss)
        norms.append(engine.step())
        traffic.append(engine.meter.by_phase())
        recorded += len(engine.meter.records)
    logged = {name: sum(record[0] for record in sizes.values())
              for name, sizes in deepspeed.comm.comm.comms_logger.comms_dict.items()}
    deepspeed.comm.configure(enabled=False)
    deepspeed.comm.reset_log()
    return {"losses": losses, "norms": norms, "traffic": traffic, "memory": engine.memory(),
            "logged": logged, "recorded": recorded,
            "state": engine.full_state_dict()}


def resumed_run(rank: int, topo, stage: int, directory: str) -> dict:
    """Train a step, save, train the last steps; then a fresh engine loads the save and trains
    the same steps: the losses of both, step by step."""
    from rlhf_paro.sharding.deepspeed_engine import deepspeed_engine

    def engine():
        return deepspeed_engine(build_model("base", seed=7), topo, zero_stage=stage,
                                optim=OPTIM, max_grad_norm=MAX_NORM, grad_accum_steps=MICRO,
                                extra=EXTRA)

    batches = make_batches("base", topo.num_ranks)[:, rank]

    def train(e, steps):
        out = []
        for step in steps:
            for k in range(MICRO):
                loss = micro_loss(e, batches[step, k])
                out.append(loss.item())
                e.backward(loss)
            e.step()
        return out

    first = engine()
    train(first, [0])
    first.save_checkpoint(f"{directory}/zero{stage}")
    straight = train(first, range(1, STEPS))
    second = engine()
    second.load_checkpoint(f"{directory}/zero{stage}")
    return {"straight": straight, "resumed": train(second, range(1, STEPS))}


def skipped_run(rank: int, topo, stage: int) -> dict:
    """A step whose loss is NaN on rank 1 only, then a clean step."""
    from rlhf_paro.sharding.deepspeed_engine import deepspeed_engine

    engine = deepspeed_engine(build_model("base"), topo, zero_stage=stage, optim=OPTIM,
                              max_grad_norm=MAX_NORM, grad_accum_steps=MICRO, extra=EXTRA)
    batches = make_batches("base", topo.num_ranks)[:, rank]
    states, out = [engine.full_state_dict()], []
    for step, poisoned in enumerate((rank == 1, False)):
        for k in range(MICRO):
            loss = micro_loss(engine, batches[step, k])
            engine.backward(loss * float("nan") if poisoned else loss)
        engine.step()
        out.append((engine.last_step_skipped, engine.skipped_steps))
        states.append(engine.full_state_dict())
    same = [all(torch.equal(a[k], b[k]) for k in a) for a, b in zip(states, states[1:])]
    return {"steps": out, "unchanged": same}


def worker(rank: int, world_size: int, group_size: int, directory: str) -> dict:
    from rlhf_paro.sharding import Topology

    topo = Topology.from_process_group(group_size=group_size)
    out = {key(case): deepspeed_run(rank, topo, case) for case in CASES}
    out["resumed"] = {stage: resumed_run(rank, topo, stage, directory) for stage in (1, 3)}
    out["skipped"] = {stage: skipped_run(rank, topo, stage) for stage in (0, 2, 3)}
    return out


@pytest.fixture(scope="module")
def grid(tmp_path_factory) -> list[dict]:
    return run_distributed(worker, WORLD, GROUP, str(tmp_path_factory.mktemp("ds_ckpt")))


@functools.cache
def reference() -> dict:
    return reference_run("base", WORLD)


@pytest.mark.parametrize("case", CASES, ids=key)
def test_deepspeed_zero_matches_the_unsharded_reference(grid: list[dict], case) -> None:
    ref = reference()
    for rank in range(WORLD):
        got = grid[rank][key(case)]
        torch.testing.assert_close(got["losses"], ref["losses"][:, rank], rtol=1e-6, atol=0.0,
                                   msg=lambda m: f"rank {rank} losses: {m}")
        assert got["norms"] == pytest.approx(ref["norms"], rel=1e-6)
    assert max(ref["norms"]) > MAX_NORM, "clipping must bite in this test"
    state = grid[0][key(case)]["state"]
    initial = build_model("base").state_dict()
    for name, value in ref["state"].items():
        diff = (state[name].double() - value.double()).norm() / value.double().norm()
        assert diff <= 1e-6, f"{name}: relative difference {diff:.2e} > 1e-6"
        assert not torch.equal(initial[name], state[name]), f"{name} never moved"


@pytest.mark.parametrize("case", CASES, ids=key)
def test_every_collective_deepspeed_logs_is_metered(grid: list[dict], case) -> None:
    """Our wrapper sees each call DeepSpeed's own comms logger counts (barriers move no data)."""
    for rank in range(WORLD):
        got = grid[rank][key(case)]
        logged = sum(n for name, n in got["logged"].items() if "barrier" not in name)
        assert got["recorded"] == logged, f"rank {rank}: {got['logged']}"
        assert got["recorded"] > 0


def test_bytes_split_by_the_groups_they_ran_on(grid: list[dict]) -> None:
    phases = lambda case, rank: grid[rank][key(case)]["traffic"][-1]  # noqa: E731
    for rank in range(WORLD):
        # ZeRO-3's world all-gathers and reduce-scatters: on the world ring only the last rank
        # of a group sends to another group ([Note: metering DeepSpeed]).
        last_of_group = rank % GROUP == GROUP - 1
        for phase in ("forward", "backward"):
            sent = phases((3, 1, False), rank)[phase]
            assert (sent["inter_bytes"] > 0, sent["intra_bytes"] > 0) == (
                last_of_group, not last_of_group), f"rank {rank} {phase}: {sent}"
        # ZeRO-1/2 gather the updated parameters at the step.
        assert sum(phases((1, 1, False), rank)["update"][k] for k in ("intra_bytes",
                                                                       "inter_bytes")) > 0
    # hpZ: after the first micro-batch, forward gathers from the secondary copy inside the
    # group, so every rank sends on intra links in forward, the last ones of a group too.
    for rank in range(WORLD):
        assert phases((3, 2, False), rank)["forward"]["intra_bytes"] > 0
        if rank % GROUP == GROUP - 1:
            hpz, zero3 = (phases(case, rank)["forward"]["inter_bytes"]
                          for case in ((3, 2, False), (3, 1, False)))
            assert 0 < hpz < zero3


def test_memory_read_off_deepspeed_partitions(grid: list[dict]) -> None:
    total = sum(p.numel() for p in build_model("base").parameters())
    memory = {case: grid[0][key(case)]["memory"] for case in CASES}
    assert memory[(0, 1, False)]["params"] == 4 * total
    assert memory[(3, 1, False)]["params"] < 4 * total / WORLD + 4 * 64  # one partition each
    # hpZ's secondary partition lives from a step's first forward to its optimizer step, which
    # drops it (it is stale then): between steps hpZ holds what ZeRO-3 holds.
    assert memory[(3, 2, False)]["params"] == memory[(3, 1, False)]["params"]
    assert memory[(2, 1, False)]["grads"] < memory[(1, 1, False)]["grads"] == 4 * total
    # ZeRO-1 and up keep 1/N of the fp32 master and both moments: 12 bytes an element.
    assert memory[(1, 1, False)]["optim"] <= 12 * total / WORLD + 12 * 64
    assert memory[(0, 1, False)]["optim"] == 8 * total


@pytest.mark.parametrize("stage", (1, 3))
def test_a_loaded_checkpoint_trains_on_exactly_as_the_saved_run(grid: list[dict],
                                                                 stage: int) -> None:
    # Seed 7, not the parity model: a load that did nothing would train another model.
    for rank in range(WORLD):
        got = grid[rank]["resumed"][stage]
        assert got["resumed"] == got["straight"], f"rank {rank}"


@pytest.mark.parametrize("stage", (0, 2, 3))
def test_a_nan_loss_on_one_rank_skips_the_step_on_every_rank(grid: list[dict],
                                                             stage: int) -> None:
    for rank in range(WORLD):
        got = grid[rank]["skipped"][stage]
        assert got["steps"] == [(True, 1), (False, 1)], f"rank {rank}"
        assert got["unchanged"] == [True, False], "skipped: no update; the clean step updates"
