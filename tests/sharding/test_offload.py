"""Offload on 4 gloo ranks as 2 groups x 2 (docs/design.md, "Offload").

One process group serves every case (spawning and importing deepspeed are the slow parts):

- offload=optimizer against no offload, in fp32 under NNN, NIG, GGG and IIG (OS at N and G, P at
  N, I and G) and in bf16 under IGG. Two comparisons per case. The *shadow*: before every step a
  no-offload engine loads the offload engine's state (all ranks' state dicts), so both take the
  step from the same parameters, masters and moments: the losses are bit-identical and the
  parameters after the step differ only by the optimizers' arithmetic, held to the bound of
  ``step_bound`` element by element (measured: at most 0.12 of it). The *trajectories*: an
  offload run and a no-offload run from the same start, every loss of every rank and the final
  parameters (per tensor) to 1e-6 relative, the fp32 budget of ``test_engine_parity.py``. That
  budget is the parity test's, not derived here: the per-step bound allows 16u ~ 1e-6 of an
  element per step in the worst case, but the roundings of thousands of elements do not align,
  and a tensor moves far less (measured: at most 3.4e-7 after 3 steps); the derived check is
  the shadow's.
- the bytes held on the device and in host memory equal ``cost.offload_memory`` exactly, and the
  host copies are counted exactly: per step and trained unit, the OS gradient out and the
  master back, each the OS shard's fp32 bytes.
- checkpoints cross: a checkpoint saved with offload=optimizer loads without it and the other
  way round, under another strategy, with the step count that sets Adam's bias correction.
- offload=params: parking and bringing back P changes nothing (bit-identical forward, training
  and state), moves exactly the P shards' bytes once each way, and a forward while parked is an
  ``EngineError``; a parked model loads a state dict into its host copies.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.sharding.parity import (MAX_NORM, MICRO, OPTIM, STEPS, U_BF16, U32, build_model,
                                   make_batches, micro_loss)

pytestmark = [pytest.mark.dist, pytest.mark.slow]

WORLD, GROUP = 4, 2
OPTIMIZER_CASES = [("NNN", "base"), ("NIG", "base"), ("GGG", "base"), ("IIG", "base"),
                   ("IGG", "bf16")]


def step_bound(t: int, master: torch.Tensor) -> torch.Tensor:
    """Largest difference between DeepSpeedCPUAdam's and torch.optim.AdamW's step ``t`` from
    the same master, moments and gradient, element by element (fp64).

    Both evaluate AdamW in fp32; they differ in the order of operations and in how they form
    the coefficients. Terms, with u = 2^-24:
      - each side rounds its element-wise update (moments, sqrt, division, weight decay, the
        final add) a few times: 16u(|master| + lr C_t), the rounding term of parity.py's
        [Note: bf16 error bound], C_t bounding |m_hat / sqrt(v_hat)| by Cauchy-Schwarz;
      - DeepSpeed takes 1 - fl(beta) where torch takes fl(1 - beta): the EMA weights differ by
        u/(1 - beta) relative (beta2's under the square root);
      - DeepSpeed forms beta^t by t - 1 fp32 products and 1 - beta^t in fp32 where torch works
        in fp64: the bias corrections differ by t u / (1 - beta^t) relative.
    The last two move the update lr * m_hat / (sqrt(v_hat) + eps), at most lr C_t, relatively.
    """
    lr = OPTIM["lr"]
    b1, b2 = OPTIM["betas"]
    w1 = [(1 - b1) * b1 ** (t - k) / (1 - b1 ** t) for k in range(1, t + 1)]
    w2 = [(1 - b2) * b2 ** (t - k) / (1 - b2 ** t) for k in range(1, t + 1)]
    c_t = math.sqrt(sum(x * x / y for x, y in zip(w1, w2)))
    coefficients = (2 / (1 - b1) + 1 / (1 - b2) + 2 * t / (1 - b1 ** t) + t / (1 - b2 ** t))
    return 16 * U32 * (master.double().abs() + lr * c_t) + lr * c_t * coefficients * U32


def _engine(strategy: str, variant: str, topo, offload: str = "none", seed: int = 0):
    from rlhf_paro.sharding import Strategy, shard

    frozen = len(strategy) == 1
    return shard(build_model(variant, seed=seed), Strategy.parse(strategy, frozen=frozen), topo,
                 optim=None if frozen else OPTIM, max_grad_norm=None if frozen else MAX_NORM,
                 grad_accum_steps=MICRO, precision="bf16" if variant == "bf16" else "fp32",
                 offload=offload)


def _all_states(engine) -> list[dict]:
    """Every rank's state dict: what ``load_state_dict`` needs for any strategy."""
    import torch.distributed as dist

    states: list = [None] * dist.get_world_size()
    dist.all_gather_object(states, engine.state_dict())
    return states


def _train_step(engines: dict, ids: torch.Tensor) -> dict[str, list[float]]:
    """One optimizer step of every engine on the same micro-batches; their losses."""
    losses: dict[str, list[float]] = {name: [] for name in engines}
    for k in range(MICRO):
        for name, engine in engines.items():
            loss = micro_loss(engine, ids[k])
            losses[name].append(loss.item())
            engine.backward(loss)
    for engine in engines.values():
        engine.step()
    return losses


def optimizer_case(rank: int, topo, strategy: str, variant: str, directory: str) -> dict:
    from rlhf_paro.sharding import cost
    from rlhf_paro.sharding.layout import unit_sizes
    from rlhf_paro.sharding.strategy import Strategy

    batches = make_batches(variant, topo.num_ranks)[:, rank]
    offload = _engine(strategy, variant, topo, "optimizer")
    plain = _engine(strategy, variant, topo)
    shadow = _engine(strategy, variant, topo)
    losses = {"offload": [], "plain": [], "shadow": []}
    shadow_steps = []  # per step: the shadow's state after it, the offload engine's after it
    for step in range(STEPS):
        shadow.load_state_dict(_all_states(offload))
        for name, values in _train_step({"offload": offload, "plain": plain, "shadow": shadow},
                                        batches[step]).items():
            losses[name].append(values)
        shadow_steps.append((shadow.state_dict(), offload.state_dict()))
    sizes = unit_sizes(build_model(variant))
    out = {
        "losses": losses,
        "shadow_steps": shadow_steps,
        "state": offload.full_state_dict(),
        "plain_state": plain.full_state_dict(),
        "memory": offload.memory(),
        "expected_memory": cost.offload_memory(Strategy.parse(strategy), sizes, WORLD, GROUP,
                                               offload.precision, "optimizer"),
        "transfers": offload.transfers.totals(),
        "num_units": len(offload.units),
        "masters_on_host": all(m.device.type == "cpu" for m in offload._boundary.masters),
    }
    if strategy == "IIG" and variant == "base":
        out["checkpoints"] = crossed_checkpoints(rank, topo, offload, plain, batches, directory)
    return out


def crossed_checkpoints(rank: int, topo, offload, plain, batches, directory: str) -> dict:
    """Save both runs of IIG, load the offload run's into a GGG engine without offload and the
    plain run's into an NIG engine with it; each loaded engine and its source then take one
    more step on the same micro-batches."""
    import torch.distributed as dist

    offload.save_checkpoint(f"{directory}/offload")
    plain.save_checkpoint(f"{directory}/plain")
    dist.barrier()  # every file written before any rank reads
    into_plain = _engine("GGG", "base", topo, seed=7)
    into_plain.load_checkpoint(f"{directory}/offload")
    into_offload = _engine("NIG", "base", topo, "optimizer", seed=7)
    into_offload.load_checkpoint(f"{directory}/plain")
    loaded = {"into_plain": (into_plain.state_dict(), offload.state_dict()),
              "into_offload": (into_offload.state_dict(), plain.state_dict())}
    ids = make_batches("base", topo.num_ranks, seed=5, steps=1)[0, rank]
    losses = _train_step({"offload": offload, "into_plain": into_plain, "plain": plain,
                          "into_offload": into_offload}, ids)
    return {"loaded": loaded, "losses": losses,
            "states": {name: engine.full_state_dict() for name, engine in
                       (("offload", offload), ("into_plain", into_plain), ("plain", plain),
                        ("into_offload", into_offload))}}


def params_case(rank: int, topo, strategy: str) -> dict:
    """offload=params on a frozen (``G``, ``N``) or trained (``IGG``) model."""
    from rlhf_paro.sharding import EngineError, cost
    from rlhf_paro.sharding.layout import unit_sizes
    from rlhf_paro.sharding.strategy import Strategy

    batches = make_batches("base", topo.num_ranks)[:, rank]
    engine = _engine(strategy, "base", topo, "params")
    plain = _engine(strategy, "base", topo)
    out: dict = {"p_bytes": engine.memory()["params"],
                 "num_buffers": sum(len(u.buffers) for u in engine.units)}
    if engine.strategy.frozen:
        with torch.no_grad():
            before = engine(input_ids=batches[0, 0]).logits
            state = engine.state_dict()
            engine.offload_params()
            out["parked_memory"] = engine.memory()
            out["parked_transfers"] = engine.transfers.totals()
            try:
                engine(input_ids=batches[0, 0])
                out["parked_forward"] = "no error"
            except EngineError as err:
                out["parked_forward"] = str(err)
            parked_state = engine.state_dict()
            engine.onload_params()
            out["same_forward"] = torch.equal(engine(input_ids=batches[0, 0]).logits, before)
            out["same_state"] = all(torch.equal(parked_state["tensors"][k], v)
                                    for k, v in state["tensors"].items())
            # A parked model loads into its host copies (the workers load checkpoints parked).
            other = _engine(strategy, "base", topo, seed=7)
            expected = other(input_ids=batches[0, 0]).logits
            states = _all_states(other)
            engine.offload_params()
            engine.load_state_dict(states)
            engine.onload_params()
            out["loaded_forward"] = torch.equal(engine(input_ids=batches[0, 0]).logits, expected)
    else:
        losses = {"params": [], "plain": []}
        for step in range(STEPS):
            engine.onload_params()
            for name, values in _train_step({"params": engine, "plain": plain},
                                            batches[step]).items():
                losses[name].append(values)
            engine.offload_params()
            out.setdefault("parked_memory", engine.memory())
        engine.onload_params()
        out["losses"] = losses
        out["same_state"] = all(torch.equal(a, b) for a, b in zip(
            engine.full_state_dict().values(), plain.full_state_dict().values()))
    out["transfers"] = engine.transfers.totals()
    out["expected_parked"] = cost.offload_memory(
        Strategy.parse(strategy, frozen=engine.strategy.frozen),
        unit_sizes(build_model("base")), WORLD, GROUP, "fp32", "params")
    return out


def offload_worker(rank: int, world_size: int, group_size: int, directory: str) -> dict:
    from rlhf_paro.sharding import Topology

    topo = Topology.from_process_group(group_size=group_size)
    results = {f"{s}-{v}": optimizer_case(rank, topo, s, v, directory)
               for s, v in OPTIMIZER_CASES}
    results.update({f"params-{s}": params_case(rank, topo, s) for s in ("G", "N", "IGG")})
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    return run_distributed(offload_worker, WORLD, GROUP, str(tmp_path_factory.mktemp("ckpt")))


@pytest.mark.parametrize("case", [f"{s}-{v}" for s, v in OPTIMIZER_CASES])
def test_offload_optimizer_step_equals_adamw_within_the_rounding_bound(runs, case) -> None:
    for rank in range(WORLD):
        got = runs[rank][case]
        # The same parameters before every step: the same losses, bit for bit.
        assert got["losses"]["shadow"] == got["losses"]["offload"], f"rank {rank}"
        for t, (shadow, offload) in enumerate(got["shadow_steps"], start=1):
            shadow, offload = shadow["tensors"], offload["tensors"]
            assert shadow.keys() == offload.keys()
            # fp32 parameters are their own masters; a bf16 model's are saved apart.
            kind = "master/" if case.endswith("bf16") else "params/"
            masters = [k for k in shadow if k.startswith(kind)]
            assert masters
            for key in masters:
                diff = (offload[key].double() - shadow[key].double()).abs()
                worst = float((diff / step_bound(t, shadow[key])).max())
                assert worst <= 1.0, f"rank {rank} step {t} {key}: {worst:.2f} x the bound"
            if case.endswith("bf16"):  # each bf16 weight is its master rounded (2^-8 relative)
                for key in (k for k in shadow if k.startswith("params/")):
                    master = shadow[key.replace("params/", "master/")].double()
                    bound = step_bound(t, master)
                    bound = bound + U_BF16 * (2 * master.abs() + bound)
                    diff = (offload[key].double() - shadow[key].double()).abs()
                    assert bool((diff <= bound).all()), f"rank {rank} step {t} {key}"


@pytest.mark.parametrize("case", [f"{s}-base" for s, _ in OPTIMIZER_CASES[:4]])
def test_offload_optimizer_trains_like_no_offload_fp32(runs, case) -> None:
    for rank in range(WORLD):
        got = runs[rank][case]
        torch.testing.assert_close(torch.tensor(got["losses"]["offload"]),
                                   torch.tensor(got["losses"]["plain"]), rtol=1e-6, atol=0.0,
                                   msg=lambda m: f"rank {rank} losses: {m}")
    state, plain = runs[0][case]["state"], runs[0][case]["plain_state"]
    initial = build_model("base").state_dict()
    for key, value in plain.items():
        diff = (state[key].double() - value.double()).norm() / value.double().norm()
        assert diff <= 1e-6, f"{key}: relative difference {diff:.2e} > 1e-6"
        assert not torch.equal(value, initial[key]), f"{key} never moved: a vacuous comparison"


@pytest.mark.parametrize("case", [f"{s}-{v}" for s, v in OPTIMIZER_CASES])
def test_offload_optimizer_holds_the_state_on_the_host_and_counts_its_copies(runs, case) -> None:
    for rank in range(WORLD):
        got = runs[rank][case]
        mem = got["memory"]
        assert mem == got["expected_memory"], f"rank {rank}"
        assert mem["optim"] == 0 and mem["host_optim"] > 0 and got["masters_on_host"]
        # Per step and unit: the OS gradient out, the master back, the OS shard's fp32 bytes each.
        os_bytes = mem["host_grads"]
        assert got["transfers"] == {"d2h_bytes": STEPS * os_bytes, "h2d_bytes": STEPS * os_bytes,
                                    "transfers": STEPS * 2 * got["num_units"]}, f"rank {rank}"


def test_checkpoints_cross_between_offload_and_no_offload(runs) -> None:
    for rank in range(WORLD):
        got = runs[rank]["IIG-base"]["checkpoints"]
        for name, (loaded, saved) in got["loaded"].items():
            # The G-chunk pieces are the same under any strategy on N = 4: equal, element for
            # element, with the same step count.
            assert loaded["meta"]["step"] == saved["meta"]["step"] == STEPS
            assert loaded["tensors"].keys() == saved["tensors"].keys(), name
            for key, value in saved["tensors"].items():
                assert torch.equal(loaded["tensors"][key], value), f"{name} rank {rank} {key}"
        # The same parameters: the same losses. A loaded engine that lost the step count (Adam's
        # bias correction) or kept stale masters would step elsewhere by far more than 1e-6.
        assert got["losses"]["into_plain"] == got["losses"]["offload"]
        assert got["losses"]["into_offload"] == got["losses"]["plain"]
    states = runs[0]["IIG-base"]["checkpoints"]["states"]
    for loaded, source in (("into_plain", "offload"), ("into_offload", "plain")):
        for key, value in states[source].items():
            diff = (states[loaded][key].double() - value.double()).norm() / value.double().norm()
            assert diff <= 1e-6, f"{loaded} {key}: relative difference {diff:.2e}"


@pytest.mark.parametrize("strategy", ["G", "N"])
def test_offload_params_parks_a_frozen_model_without_changing_it(runs, strategy) -> None:
    for rank in range(WORLD):
        got = runs[rank][f"params-{strategy}"]
        assert got["parked_memory"] == got["expected_parked"], f"rank {rank}"
        assert got["parked_memory"]["params"] == 0
        assert got["parked_memory"]["host_params"] == got["p_bytes"] > 0
        # One copy out per flat buffer, the P shard's bytes; nothing in yet.
        assert got["parked_transfers"] == {"d2h_bytes": got["p_bytes"], "h2d_bytes": 0,
                                           "transfers": got["num_buffers"]}
        assert "while its parameters are offloaded to host memory; call onload_params()" in \
            got["parked_forward"]
        assert got["same_forward"] and got["same_state"] and got["loaded_forward"]
        # Parked twice, brought back twice.
        assert got["transfers"] == {"d2h_bytes": 2 * got["p_bytes"],
                                    "h2d_bytes": 2 * got["p_bytes"],
                                    "transfers": 4 * got["num_buffers"]}


def test_offload_params_between_steps_trains_bit_identically(runs) -> None:
    for rank in range(WORLD):
        got = runs[rank]["params-IGG"]
        assert got["losses"]["params"] == got["losses"]["plain"]
        assert got["same_state"]
        assert got["parked_memory"] == got["expected_parked"]
        # Brought back STEPS + 1 times, parked STEPS times (the first onload moves nothing).
        assert got["transfers"] == {"d2h_bytes": STEPS * got["p_bytes"],
                                    "h2d_bytes": STEPS * got["p_bytes"],
                                    "transfers": 2 * STEPS * got["num_buffers"]}
