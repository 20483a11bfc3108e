"""The engine contract (sharding/contract.py): the same tiny model through every backend of
``BACKENDS``, built by ``build_engine`` from ``EngineOptions``, on 2 gloo ranks, and held to
what a worker relies on: the call order's errors (same type, same message), a step's loss and
norm, ``memory()``'s keys, ``full_state_dict``, ``gathered()`` and a checkpoint round trip.

Both backends shard for real: the PaRO engine under GGG, DeepSpeed under ZeRO-3 with every
parameter partitioned (its persistence threshold at 0), so ``gathered()`` has work to do.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from rlhf_paro.sharding.contract import BACKENDS, MEMORY_KEYS
from tests.dist_utils import run_distributed
from tests.sharding.parity import MAX_NORM, MICRO, OPTIM, build_model, make_batches, micro_loss

pytestmark = [pytest.mark.dist, pytest.mark.slow]

WORLD = 2
TRAIN_STEPS = 2  # of make_batches' 3: the third is the step after the checkpoint
# Every backend's own options; the shared ones come from _options.
OWN = {"paro": {"strategy": "GGG"},
       "deepspeed": {"zero_stage": 3, "deepspeed_config": {
           "zero_optimization": {"stage3_param_persistence_threshold": 0}}}}

# The errors of calls out of order, word for word, on every backend (model_name "model",
# grad_accum_steps = MICRO = 2).
EXPECTED_ERRORS = {
    "step before any backward": ("EngineError", "step() called after 0 of grad_accum_steps=2 "
                                 "backward() calls; call it once at the accumulation boundary"),
    "step after one of two backwards": ("EngineError", "step() called after 1 of "
                                        "grad_accum_steps=2 backward() calls; call it once at "
                                        "the accumulation boundary"),
    "save between backward and step": ("EngineError", "save_checkpoint() after 1 backward() "
                                       "call(s) without step(): accumulated gradients are not "
                                       "part of the state"),
    "offload_params without offload=params": ("EngineError", "model 'model' was built with "
                                              "offload='none'; offload_params() needs "
                                              "offload='params'"),
    "a third backward of two": ("EngineError", "backward() called 3 times without step(); "
                                "grad_accum_steps=2"),
    "backward of a frozen model": ("EngineError", "model 'model' is frozen; it has no backward"),
    "step of a frozen model": ("EngineError", "model 'model' has no optimizer; step() is for "
                               "trained models"),
    "no micro-batches per step": ("ValueError", "grad_accum_steps=0 must be a positive integer"),
}


def _options(backend: str, **shared):
    from rlhf_paro.sharding.contract import EngineOptions

    return EngineOptions(**{"backend": backend, "optim": OPTIM, "max_grad_norm": MAX_NORM,
                            "grad_accum_steps": MICRO, **OWN[backend], **shared})


def _caught(call) -> tuple[str, str] | None:
    try:
        call()
    except Exception as err:  # noqa: BLE001 - the type is what is compared
        return type(err).__name__, str(err)
    return None


def contract_run(rank: int, world_size: int, backend: str, directory: str) -> dict:
    import torch.distributed as dist

    from rlhf_paro.sharding import Topology
    from rlhf_paro.sharding.contract import ModelFactory, TrainEngine, build_engine

    topo = Topology.from_process_group(group_size=world_size)

    def engine(**shared):
        return build_engine(ModelFactory.of(build_model("base")), topo,
                            _options(backend, **shared))

    batches = make_batches("base", world_size)[:, rank]
    dummy = torch.zeros((), requires_grad=True)  # refused before it is used
    trained = engine()
    errors = {"step before any backward": _caught(trained.step)}

    def step(index: int) -> tuple[list[float], float]:
        losses = []
        for k in range(MICRO):
            loss = micro_loss(trained, batches[index, k])
            losses.append(loss.item())
            trained.backward(loss)
            if index == 0 and k == 0:  # between the step's backwards
                errors["step after one of two backwards"] = _caught(trained.step)
                errors["save between backward and step"] = _caught(
                    lambda: trained.save_checkpoint(Path(directory) / "never"))
                errors["offload_params without offload=params"] = _caught(
                    trained.offload_params)
        if index == 0:
            errors["a third backward of two"] = _caught(lambda: trained.backward(dummy))
        return losses, trained.step()

    steps = [step(index) for index in range(TRAIN_STEPS)]
    with trained.gathered() as module:
        gathered = {name: p.detach().clone() for name, p in module.named_parameters()}
    state = trained.full_state_dict()
    trained.save_checkpoint(Path(directory) / backend)
    dist.barrier()  # every rank's files are written before any is read
    straight = step(TRAIN_STEPS)
    trained.load_checkpoint(Path(directory) / backend)
    restored = trained.full_state_dict()
    resumed = step(TRAIN_STEPS)

    frozen = engine(frozen=True, optim=None, max_grad_norm=None, grad_accum_steps=1)
    errors["backward of a frozen model"] = _caught(lambda: frozen.backward(dummy))
    errors["step of a frozen model"] = _caught(frozen.step)
    errors["no micro-batches per step"] = _caught(lambda: engine(grad_accum_steps=0))
    return {"is_train_engine": isinstance(trained, TrainEngine) and
                               isinstance(frozen, TrainEngine),
            "errors": errors, "steps": steps, "lr": trained.lr,
            "skipped": trained.skipped_steps, "offloaded": trained.params_offloaded,
            "memory": trained.memory(), "frozen_memory": frozen.memory(),
            "frozen_lr": frozen.lr, "gathered": gathered, "state": state,
            "restored": restored, "straight": straight, "resumed": resumed}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """backend -> the ranks' results; each backend runs once, when a test first asks."""
    done: dict[str, list[dict]] = {}

    def get(backend: str) -> list[dict]:
        if backend not in done:
            done[backend] = run_distributed(contract_run, WORLD, backend,
                                            str(tmp_path_factory.mktemp(backend)))
        return done[backend]

    return get


@pytest.mark.parametrize("backend", BACKENDS)
def test_calls_out_of_order_raise_the_contracts_errors(runs, backend: str) -> None:
    for rank, got in enumerate(runs(backend)):
        assert got["is_train_engine"]
        assert got["errors"] == EXPECTED_ERRORS, f"rank {rank}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_steps_give_finite_losses_and_a_norm_and_move_the_model(runs, backend: str) -> None:
    initial = build_model("base").state_dict()
    for rank, got in enumerate(runs(backend)):
        for losses, norm in got["steps"]:
            assert all(math.isfinite(x) for x in losses) and len(losses) == MICRO
            assert math.isfinite(norm) and norm > 0
        assert got["lr"] == OPTIM["lr"] and got["skipped"] == 0 and not got["offloaded"]
        assert got["frozen_lr"] == 0.0
        assert any(not torch.equal(initial[k], v) for k, v in got["state"].items()), \
            f"rank {rank}: no parameter moved"
    # The norm is global: the same on every rank.
    assert [n for _, n in runs(backend)[0]["steps"]] == [n for _, n in runs(backend)[1]["steps"]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_memory_has_the_contracts_keys(runs, backend: str) -> None:
    for got in runs(backend):
        for memory in (got["memory"], got["frozen_memory"]):
            assert tuple(memory) == MEMORY_KEYS
            assert all(isinstance(v, int) and v >= 0 for v in memory.values())
            assert memory["params"] > 0
        assert got["memory"]["optim"] > 0 and got["memory"]["grads"] > 0
        assert got["frozen_memory"]["optim"] == got["frozen_memory"]["grads"] == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_full_state_dict_and_gathered_give_the_whole_model(runs, backend: str) -> None:
    whole = build_model("base")
    shapes = {k: v.shape for k, v in whole.state_dict().items()}
    for rank, got in enumerate(runs(backend)):
        assert {k: v.shape for k, v in got["state"].items()} == shapes, f"rank {rank}"
        assert {k: v.shape for k, v in got["gathered"].items()} == \
            {k: p.shape for k, p in whole.named_parameters()}
        for name, value in got["gathered"].items():
            assert torch.equal(value, got["state"][name]), f"rank {rank}: {name}"
    first, second = runs(backend)
    assert all(torch.equal(first["state"][k], second["state"][k]) for k in shapes)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_checkpoint_restores_the_parameters_and_the_optimizer(runs, backend: str) -> None:
    for rank, got in enumerate(runs(backend)):
        assert got["restored"].keys() == got["state"].keys()
        for name, value in got["state"].items():
            assert torch.equal(got["restored"][name], value), f"rank {rank}: {name}"
        # The same step from the restored state: the same losses and norm, so the optimizer's
        # moments and step count came back too.
        assert got["resumed"] == got["straight"], f"rank {rank}"


def test_both_backends_train_the_same_model_alike(runs) -> None:
    # Same arithmetic, other summation orders: 1e-6 relative, the bound derived in
    # tests/sharding/test_deepspeed.py's docstring (fewer terms here: N*s = 4).
    paro, deepspeed = runs("paro"), runs("deepspeed")
    for rank in range(WORLD):
        for (p_losses, p_norm), (d_losses, d_norm) in zip(paro[rank]["steps"],
                                                          deepspeed[rank]["steps"]):
            assert d_losses == pytest.approx(p_losses, rel=1e-6)
            assert d_norm == pytest.approx(p_norm, rel=1e-6)
