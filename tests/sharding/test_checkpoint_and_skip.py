"""Engine state that survives: a checkpoint saved under one layout and loaded under others, an
exact continuation after a reload, refusals that change nothing, and an optimizer step skipped
on a non-finite loss alike on every rank.

Two process groups serve the multi-process tests (spawning is the slow part). Four gloo ranks
train IGG as 2 groups x 2 for two AdamW steps (so the moments are not zero), in fp32 and bf16,
save both, load them as IGG, GGG, NNG, III (2x2) and IIG (4x1 and 1x4), continue training from
the fp32 one, and run the skip scenario under all 14 strategies. Then two ranks load the same
files as IGG 2x1 and NIG 1x2 and continue with twice the micro-batches per rank, which is the
same global batch. The tests in the parent compare what every rank holds with the saved state,
element for element.
"""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import pytest
import torch

from rlhf_paro.sharding import CheckpointError, EngineError, Topology, all_strategies, shard
from tests.dist_utils import run_distributed
from tests.sharding.parity import (MAX_NORM, MICRO, OPTIM, TwoLayer, build_model, make_batches,
                                   micro_loss, reference_run)

SAVED_STEPS, TOTAL_STEPS = 2, 4  # save after two steps; continue to four
# (strategy, M) loaded from the IGG 2x2 checkpoint on 4 ranks, and on 2 ranks.
LAYOUTS_4 = [("IGG", 2), ("GGG", 2), ("NNG", 2), ("III", 2), ("IIG", 1), ("IIG", 4)]
LAYOUTS_2 = [("IGG", 1), ("NIG", 2)]
CONTINUE_4 = [("IGG", 2), ("GGG", 2), ("NII", 4)]
SKIPPED = 1  # the step at which rank 1 sees a NaN loss (skip scenario, 3 steps)


# -- what runs on the ranks --------------------------------------------------------------------
def new_engine(strategy: str, topo, precision: str = "fp32", seed: int = 0,
               grad_accum_steps: int = MICRO):
    model = build_model("bf16" if precision == "bf16" else "base", seed=seed)
    return shard(model, strategy, topo, optim=OPTIM, max_grad_norm=MAX_NORM,
                 grad_accum_steps=grad_accum_steps, precision=precision)


def train(engine, batches: torch.Tensor, steps: range) -> torch.Tensor:
    """Steps ``steps`` on this rank's ``batches`` (steps, micro, BATCH, SEQ); the losses."""
    losses = torch.zeros(len(steps), batches.shape[1], dtype=torch.float64)
    for n, step in enumerate(steps):
        for k in range(batches.shape[1]):
            loss = micro_loss(engine, batches[step, k])
            losses[n, k] = loss.item()
            engine.backward(loss)
        engine.step()
    return losses


def held(engine) -> list[dict]:
    """Everything this rank holds, flat buffer by flat buffer, with where it starts in the
    padded flat buffer: the P shard and, for trained buffers, the AdamW moments on the OS shard
    (and the fp32 master of a bf16 model). Names come from the module, not from the engine."""
    names = {id(p): name for name, p in engine.module.named_parameters()}
    boundary = engine._boundary
    masters = {} if boundary is None else {
        id(u.trainable): m for u, m in zip(boundary.units, boundary.masters)}
    out = []
    for unit in engine.units:
        for buf in unit.buffers:
            entry = {"names": [names[id(p)] for p in buf.params], "numels": buf.numels,
                     "size": buf.size,
                     "params": (buf.level_slice(engine.strategy.params).start, buf.shard.clone())}
            master = masters.get(id(buf))
            if master is not None:
                start = buf.level_slice(engine.strategy.optim).start
                state = boundary.optimizer.state[master]
                for kind in ("exp_avg", "exp_avg_sq"):
                    entry[kind] = (start, state[kind].clone())
                if buf.full.dtype == torch.bfloat16:
                    entry["master"] = (start, master.detach().clone())
            out.append(entry)
    return out


def four_ranks(rank: int, world_size: int, root: str) -> dict:
    import torch.distributed as dist

    topos = {m: Topology.from_process_group(group_size=m) for m in (2, 1, 4)}
    batches = make_batches("base", world_size, steps=TOTAL_STEPS)[:, rank]
    out: dict = {}
    for precision in ("fp32", "bf16"):
        engine = new_engine("IGG", topos[2], precision)
        train(engine, batches, range(SAVED_STEPS))
        engine.save_checkpoint(f"{root}/igg_{precision}")
        out[f"saved/{precision}"] = engine.state_dict()
    dist.barrier()  # every file is written before any rank reads
    for strategy, m in LAYOUTS_4:
        for precision in ("fp32", "bf16"):
            engine = new_engine(strategy, topos[m], precision, seed=7)  # other initial values
            engine.load_checkpoint(f"{root}/igg_{precision}")
            out[f"held/{strategy}/{m}/{precision}"] = held(engine)
            out[f"state/{strategy}/{m}/{precision}"] = engine.state_dict()
    for strategy, m in CONTINUE_4:
        engine = new_engine(strategy, topos[m], seed=7)
        engine.load_checkpoint(f"{root}/igg_fp32")
        losses = train(engine, batches, range(SAVED_STEPS, TOTAL_STEPS))
        state = engine.full_state_dict()
        out[f"continued/{strategy}/{m}"] = {"losses": losses, "state": state if rank == 0 else None}
    out["skip"] = {s.name: skip_scenario(rank, topos[2], s.name) for s in all_strategies()}
    out["skip_nan_grads"] = skip_scenario(rank, topos[2], "NNN", poison_grads=True)
    return out


def skip_scenario(rank: int, topo, strategy: str, poison_grads: bool = False) -> dict:
    """Three steps; at step SKIPPED rank 1's first micro-batch loss is NaN: a constant NaN
    added (its gradients stay finite), or, with ``poison_grads``, the loss times NaN."""
    engine = new_engine(strategy, topo)
    batches = make_batches("base", topo.num_ranks)[:, rank]
    losses = torch.zeros(batches.shape[0], MICRO, dtype=torch.float64)
    norms, skipped, counts, states = [], [], [], []
    for step in range(batches.shape[0]):
        if step == SKIPPED:
            states.append(engine.full_state_dict())
        for k in range(MICRO):
            loss = micro_loss(engine, batches[step, k])
            losses[step, k] = loss.item()
            if step == SKIPPED and rank == 1 and k == 0:
                loss = loss * float("nan") if poison_grads else loss + float("nan")
            engine.backward(loss)
        norms.append(engine.step())
        skipped.append(engine.last_step_skipped)
        counts.append(engine.skipped_steps)
        if step == SKIPPED:
            states.append(engine.full_state_dict())
    final = engine.full_state_dict()
    return {"losses": losses, "norms": norms, "skipped": skipped, "counts": counts,
            "around_skip": states if rank == 0 else None, "state": final if rank == 0 else None}


def two_ranks(rank: int, world_size: int, root: str) -> dict:
    out: dict = {}
    for strategy, m in LAYOUTS_2:
        topo = Topology.from_process_group(group_size=m)
        for precision in ("fp32", "bf16"):
            engine = new_engine(strategy, topo, precision, seed=7)
            engine.load_checkpoint(f"{root}/igg_{precision}")
            out[f"held/{strategy}/{m}/{precision}"] = held(engine)
            out[f"state/{strategy}/{m}/{precision}"] = engine.state_dict()
    # The 4-rank run's global batch on 2 ranks: rank r takes the micro-batches of ranks 2r and
    # 2r+1, so it accumulates 2*MICRO of them; the mean over all N*s micro-batches is the same.
    topo = Topology.from_process_group(group_size=2)
    batches = make_batches("base", 4, steps=TOTAL_STEPS)[:, 2 * rank:2 * rank + 2]
    batches = batches.reshape(TOTAL_STEPS, 2 * MICRO, *batches.shape[3:])
    engine = new_engine("NIG", topo, seed=7, grad_accum_steps=2 * MICRO)
    engine.load_checkpoint(f"{root}/igg_fp32")
    losses = train(engine, batches, range(SAVED_STEPS, TOTAL_STEPS))
    state = engine.full_state_dict()
    out["continued/NIG/2"] = {"losses": losses, "state": state if rank == 0 else None}
    return out


# -- fixtures and helpers in the parent ------------------------------------------------------
@functools.cache
def reference(steps: int, skip: frozenset[int] = frozenset()) -> dict:
    return reference_run("base", 4, steps=steps, skip=skip)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="module")
def four(root: Path) -> list[dict]:
    return run_distributed(four_ranks, 4, str(root))


@pytest.fixture(scope="module")
def two(root: Path, four: list[dict]) -> list[dict]:
    return run_distributed(two_ranks, 2, str(root))  # reads what ``four`` saved


def assemble(states: list[dict]) -> dict[tuple[str, str], torch.Tensor]:
    """The full flattened tensor of every (kind, parameter) from the ranks' state dicts, each
    element of which must come from exactly one rank."""
    meta = states[0]["meta"]
    numel = {name: torch.Size(e["shape"]).numel() for name, e in meta["params"].items()}
    full: dict[tuple[str, str], torch.Tensor] = {}
    seen: dict[tuple[str, str], torch.Tensor] = {}
    for state in states:
        for key, values in state["tensors"].items():
            kind, name = key.split("/", 1)
            start, stop = state["meta"]["pieces"][name]
            if (kind, name) not in full:
                full[kind, name] = torch.zeros(numel[name], dtype=values.dtype)
                seen[kind, name] = torch.zeros(numel[name], dtype=torch.int64)
            full[kind, name][start:stop] = values
            seen[kind, name][start:stop] += 1
    for key, count in seen.items():
        assert bool((count == 1).all()), f"{key}: elements stored {count.unique().tolist()} times"
    return full


def assert_holds(entries: list[dict], full: dict[tuple[str, str], torch.Tensor],
                 where: str) -> None:
    """Every shard in ``entries`` (from ``held``) equals the saved values at its place."""
    for entry in entries:
        for kind in ("params", "master", "exp_avg", "exp_avg_sq"):
            if kind not in entry:
                continue
            start, values = entry[kind]
            flat = torch.zeros(entry["size"], dtype=values.dtype)
            offset = 0
            for name, n in zip(entry["names"], entry["numels"]):
                flat[offset:offset + n] = full[kind, name]
                offset += n
            expected = flat[start:start + values.numel()]
            assert torch.equal(values, expected), f"{where}: {kind} of {entry['names']}"


def assert_close_per_tensor(got: dict, ref: dict, where: str) -> None:
    # As in test_engine_parity: per tensor, since single elements whose gradients cancel to
    # rounding noise are ill-conditioned under any summation order.
    assert got.keys() == ref.keys()
    for key, value in ref.items():
        diff = (got[key].double() - value.double()).norm() / value.double().norm()
        assert diff <= 1e-6, f"{where} {key}: relative difference {diff:.2e} > 1e-6"


# -- reshard ---------------------------------------------------------------------------------
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("layout", LAYOUTS_4 + LAYOUTS_2, ids=lambda lay: f"{lay[0]}-M{lay[1]}")
@pytest.mark.dist
@pytest.mark.slow
def test_igg_2x2_checkpoint_loads_under_other_layouts_element_for_element(
        four: list[dict], two: list[dict], layout: tuple[str, int], precision: str) -> None:
    saved = assemble([r[f"saved/{precision}"] for r in four])
    kinds = {kind for kind, _ in saved}
    assert kinds == ({"params", "exp_avg", "exp_avg_sq"} | ({"master"} if precision == "bf16"
                                                            else set()))
    assert all(saved["exp_avg", name].abs().sum() > 0 for _, name in saved), "moments are zero"
    ranks = four if layout in LAYOUTS_4 else two
    strategy, m = layout
    for rank, result in enumerate(ranks):
        assert_holds(result[f"held/{strategy}/{m}/{precision}"], saved, f"rank {rank}")
    states = [r[f"state/{strategy}/{m}/{precision}"] for r in ranks]
    # Saved again under the new layout (another partition into G-chunks), it is the same state.
    again = assemble(states)
    assert again.keys() == saved.keys()
    assert all(torch.equal(again[key], saved[key]) for key in saved)
    assert {s["meta"]["step"] for s in states} == {SAVED_STEPS}


@pytest.mark.dist
@pytest.mark.slow
def test_checkpoint_files_hold_each_element_once_and_are_safetensors(
        four: list[dict], root: Path) -> None:
    from safetensors.torch import load_file

    files = sorted(p.name for p in (root / "igg_fp32").iterdir())
    assert files == [f"rank_{r:05d}.safetensors" for r in range(4)]
    for rank, result in enumerate(four):
        on_disk = load_file(root / "igg_fp32" / files[rank])
        in_memory = result["saved/fp32"]["tensors"]
        assert on_disk.keys() == in_memory.keys()
        assert all(torch.equal(on_disk[k], in_memory[k]) for k in on_disk)
    # Each element once: the files together are one copy of parameters and moments (padding
    # excluded), whatever IGG replicates.
    numel = sum(p.numel() for p in build_model("base").parameters())
    stored = sum(v.numel() for r in four for v in r["saved/fp32"]["tensors"].values())
    assert stored == 3 * numel


# -- exact continuation ------------------------------------------------------------------------
@pytest.mark.parametrize("layout", CONTINUE_4 + [("NIG", 2)], ids=lambda lay: f"{lay[0]}-M{lay[1]}")
@pytest.mark.dist
@pytest.mark.slow
def test_two_steps_saved_and_reloaded_then_two_more_equal_four_steps_straight(
        four: list[dict], two: list[dict], layout: tuple[str, int]) -> None:
    ref = reference(TOTAL_STEPS)
    strategy, m = layout
    key = f"continued/{strategy}/{m}"
    if layout in CONTINUE_4:
        for rank, result in enumerate(four):
            torch.testing.assert_close(result[key]["losses"], ref["losses"][SAVED_STEPS:, rank],
                                       rtol=1e-6, atol=0.0)
        state = four[0][key]["state"]
    else:  # rank r of 2 ran the micro-batches of ranks 2r and 2r+1 of 4
        for rank, result in enumerate(two):
            expected = ref["losses"][SAVED_STEPS:, 2 * rank:2 * rank + 2].reshape(2, -1)
            torch.testing.assert_close(result[key]["losses"], expected, rtol=1e-6, atol=0.0)
        state = two[0][key]["state"]
    assert_close_per_tensor(state, ref["state"], key)


# -- skipped steps ----------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", [s.name for s in all_strategies()])
@pytest.mark.dist
@pytest.mark.slow
def test_nan_loss_on_one_rank_skips_the_step_on_every_rank(four: list[dict], strategy: str
                                                            ) -> None:
    ref = reference(3, frozenset({SKIPPED}))
    for rank, result in enumerate(four):
        got = result["skip"][strategy]
        assert got["skipped"] == [k == SKIPPED for k in range(3)], f"rank {rank}"
        assert got["counts"] == [0, 1, 1], f"rank {rank}"
        assert got["norms"][SKIPPED] != got["norms"][SKIPPED], "step() returns the NaN norm"
        # Later steps train normally, as the reference that skipped the same step.
        torch.testing.assert_close(got["losses"], ref["losses"][:, rank], rtol=1e-6, atol=0.0)
    before, after = four[0]["skip"][strategy]["around_skip"]
    assert all(torch.equal(before[k], after[k]) for k in before), "the skipped step moved weights"
    assert_close_per_tensor(four[0]["skip"][strategy]["state"], ref["state"], strategy)


@pytest.mark.dist
@pytest.mark.slow
def test_nan_gradients_on_one_rank_skip_the_step_on_every_rank(four: list[dict]) -> None:
    for rank, result in enumerate(four):
        assert result["skip_nan_grads"]["skipped"] == [False, True, False], f"rank {rank}"
    ref = reference(3, frozenset({SKIPPED}))
    assert_close_per_tensor(four[0]["skip_nan_grads"]["state"], ref["state"], "NNN")


# -- refusals, on one process ---------------------------------------------------------------
def snapshot(engine) -> dict:
    """What an engine holds: its state dict's pieces and its full parameters."""
    full = {f"full/{k}": v for k, v in engine.full_state_dict().items()}
    return {**engine.state_dict()["tensors"], **full}


@pytest.mark.dist
@pytest.mark.slow
def test_bad_checkpoints_are_refused_in_one_line_and_change_nothing(
        four: list[dict], root: Path, tmp_path: Path) -> None:
    def refused(match: str, directory: Path | None = None, states: list | None = None,
                engine=None) -> None:
        engine = engine or new_engine("NNN", Topology(1, 1), seed=7)
        before = snapshot(engine)
        with pytest.raises(ValueError, match=match) as info:
            if states is not None:
                engine.load_state_dict(states)
            else:
                engine.load_checkpoint(directory)
        assert isinstance(info.value, CheckpointError) and "\n" not in str(info.value)
        after = snapshot(engine)
        assert all(torch.equal(before[k], after[k]) for k in before), "a refused load wrote"

    def copy(name: str) -> Path:
        return Path(shutil.copytree(root / "igg_fp32", tmp_path / name))

    missing = copy("missing")
    (missing / "rank_00002.safetensors").unlink()
    refused("saved by 4 ranks but lacks rank_00002.safetensors", missing)
    # Three of four ranks' state: the pieces found first are not written either.
    refused(r"no saved rank holds elements \[\d+, \d+\) of params of '",
            states=[r["saved/fp32"] for r in four[:3]])
    mixed = copy("mixed")
    shutil.copy(root / "igg_bf16" / "rank_00001.safetensors", mixed)
    refused(r"are from different checkpoints \(precision: 'bf16' != 'fp32'\)", mixed)
    truncated = copy("truncated")
    data = (truncated / "rank_00003.safetensors").read_bytes()
    (truncated / "rank_00003.safetensors").write_bytes(data[:len(data) // 2])
    refused("rank_00003.safetensors is not a readable engine checkpoint file", truncated)
    refused(r"parameter 'model.embed_tokens.weight' has shape \(32, 8\), the model's is \(37, 6\)",
            root / "igg_fp32", engine=shard(build_model("odd"), "NNN", Topology(1, 1)))
    refused(r"parameter names differ from the model's \(missing: base_model\.model\.",
            root / "igg_fp32", engine=shard(build_model("lora"), "NNN", Topology(1, 1)))
    shard(build_model("base"), "N", Topology(1, 1)).save_checkpoint(tmp_path / "frozen")
    refused("is trained here but was not trained in the checkpoint", tmp_path / "frozen")


@pytest.mark.dist
@pytest.mark.slow
def test_one_rank_loads_four_ranks_files_and_a_frozen_engine_takes_the_fp32_master(
        four: list[dict], root: Path) -> None:
    saved = assemble([r["saved/bf16"] for r in four])
    frozen = shard(build_model("base", seed=7), "N", Topology(1, 1))  # fp32, inference only
    frozen.load_checkpoint(root / "igg_bf16")
    for name, value in frozen.full_state_dict().items():
        assert torch.equal(value.reshape(-1), saved["master", name]), name
    engine = new_engine("GGG", Topology(1, 1), "bf16", seed=7)
    engine.load_checkpoint(root / "igg_bf16")
    assert_holds(held(engine), saved, "one rank")


# -- single process, no fixture --------------------------------------------------------------
def test_state_dict_is_refused_between_backward_and_step() -> None:
    engine = shard(TwoLayer(), "IGG", Topology(1, 1))
    engine.backward(engine(torch.ones(2, 3)))
    with pytest.raises(EngineError, match="after 1 backward\\(\\) call\\(s\\) without step"):
        engine.state_dict()
    with pytest.raises(EngineError, match="without step"):
        engine.load_state_dict(shard(TwoLayer(), "IGG", Topology(1, 1)).state_dict())


def test_one_rank_round_trip_through_files_continues_exactly(tmp_path: Path) -> None:
    torch.manual_seed(0)
    x = torch.randn(5, 3)
    engine = shard(TwoLayer(), "GGG", Topology(1, 1), optim=dict(lr=0.1))
    for _ in range(2):
        engine.backward(engine(x))
        engine.step()
    path = engine.save_checkpoint(tmp_path)
    assert path == tmp_path / "rank_00000.safetensors" and sorted(tmp_path.iterdir()) == [path]
    torch.manual_seed(1)
    loaded = shard(TwoLayer(), "NNN", Topology(1, 1), optim=dict(lr=0.1))
    loaded.load_checkpoint(tmp_path)
    for e in (engine, loaded):
        e.backward(e(x))
        e.step()
    # One process, same arithmetic in the same order: bit for bit.
    got, ref = loaded.full_state_dict(), engine.full_state_dict()
    assert all(torch.equal(got[k], ref[k]) for k in ref)


def test_skipped_step_leaves_weights_and_moments_and_counts_once() -> None:
    torch.manual_seed(0)
    engine = shard(TwoLayer(), "GGG", Topology(1, 1), optim=dict(lr=0.1))
    x = torch.randn(5, 3)
    engine.backward(engine(x))
    engine.step()
    before = engine.state_dict()
    engine.backward(engine(x) + float("inf"))  # the loss is not finite, its gradients are
    norm = engine.step()
    assert norm != norm and engine.last_step_skipped and engine.skipped_steps == 1
    after = engine.state_dict()
    assert after["meta"]["step"] == before["meta"]["step"] == 1
    assert all(torch.equal(after["tensors"][k], v) for k, v in before["tensors"].items())
    assert all(not u.grad_acc.any() for u in engine.units), "the gradients were not dropped"
    engine.backward(engine(x))
    engine.step()
    assert not engine.last_step_skipped and engine.skipped_steps == 1
    assert engine.state_dict()["meta"]["step"] == 2
