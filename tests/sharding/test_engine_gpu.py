"""The engine on CUDA: buffers on the device, same numbers as the unsharded model there."""

import contextlib
import gc
from typing import Iterator

import pytest
import torch

from rlhf_paro.sharding import Topology, shard
from tests.sharding.parity import MAX_NORM, OPTIM, build_model, make_batches, micro_loss

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@contextlib.contextmanager
def _no_collection() -> Iterator[None]:
    """Torch's allocation counters read with no garbage collection in between: earlier tests'
    engines in reference cycles, collected in the middle of a build, made its allocation negative
    (-124 KiB seen on an H200). They are collected first, then the collector is off."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.mark.parametrize("strategy", ["NNN", "IGG", "GGG"])
def test_single_gpu_engine_matches_unsharded_reference(strategy: str) -> None:
    ids = make_batches("base", 1)[:, 0].cuda()
    model = build_model("base").cuda()
    ref = build_model("base").cuda()
    engine = shard(model, strategy, Topology(1, 1), optim=OPTIM, max_grad_norm=MAX_NORM,
                   grad_accum_steps=ids.shape[1])
    opt = torch.optim.AdamW(ref.parameters(), **OPTIM)
    for step in range(ids.shape[0]):
        for k in range(ids.shape[1]):
            loss = micro_loss(engine, ids[step, k])
            ref_loss = micro_loss(ref, ids[step, k])
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
            engine.backward(loss)
            (ref_loss / ids.shape[1]).backward()
        engine.step()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
    assert all(b.shard.is_cuda for u in engine.units for b in u.buffers)
    state = engine.full_state_dict()
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-6)


def test_single_gpu_skips_a_nan_step_and_reloads_a_checkpoint_under_another_strategy(
        tmp_path) -> None:
    ids = make_batches("base", 1)[:, 0].cuda()
    engine = shard(build_model("base").cuda(), "IGG", Topology(1, 1), optim=OPTIM,
                   max_grad_norm=MAX_NORM, grad_accum_steps=ids.shape[1])
    for step in range(2):
        for k in range(ids.shape[1]):
            loss = micro_loss(engine, ids[step, k])
            engine.backward(loss + float("nan") if step == 0 and k == 0 else loss)
        engine.step()
        assert engine.last_step_skipped == (step == 0)
    engine.save_checkpoint(tmp_path)
    loaded = shard(build_model("base", seed=7).cuda(), "GGG", Topology(1, 1), optim=OPTIM)
    loaded.load_checkpoint(tmp_path)
    assert loaded.skipped_steps == 1
    got, saved = loaded.state_dict(), engine.state_dict()
    assert got["meta"]["step"] == 1 and got["tensors"].keys() == saved["tensors"].keys()
    assert all(torch.equal(got["tensors"][k], v) for k, v in saved["tensors"].items())


def test_single_gpu_offload_moves_the_state_off_the_device_and_measures_the_copies() -> None:
    """offload=optimizer: the device holds P + G only (torch's allocation counters), the steps
    equal no offload to 1e-6; offload=params: parking frees the P shard's device bytes and
    bringing it back allocates them again; the copies' bandwidth is printed (pytest -s)."""
    import time

    from rlhf_paro.sharding import cost
    from rlhf_paro.sharding.layout import unit_sizes

    ids = make_batches("base", 1)[:, 0].cuda()
    sizes = unit_sizes(build_model("base"))
    engines, allocated = {}, {}
    with _no_collection():
        for offload in ("none", "optimizer"):
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            engines[offload] = shard(build_model("base"), "IGG", Topology(1, 1), optim=OPTIM,
                                     max_grad_norm=MAX_NORM, grad_accum_steps=ids.shape[1],
                                     device="cuda", offload=offload)
            allocated[offload] = torch.cuda.memory_allocated() - before
    held = cost.offload_memory(engines["optimizer"].strategy, sizes, 1, 1, "fp32", "optimizer")
    assert engines["optimizer"].memory() == held
    assert all(m.is_pinned() for m in engines["optimizer"]._boundary.masters)
    # The moments (OS) left the device: the difference is at least their bytes (the caching
    # allocator rounds each block up to 512 bytes, which only adds to both sides alike).
    assert allocated["none"] - allocated["optimizer"] >= held["host_optim"] * 8 // 12
    for step in range(ids.shape[0]):
        for k in range(ids.shape[1]):
            for engine in engines.values():
                engine.backward(micro_loss(engine, ids[step, k]))
        for engine in engines.values():
            engine.step()
    plain, offloaded = (e.full_state_dict() for e in engines.values())
    for key, value in plain.items():
        diff = (offloaded[key].double() - value.double()).norm() / value.double().norm()
        assert diff <= 1e-6, f"{key}: relative difference {diff:.2e}"

    big = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(8)]).cuda()
    engine = shard(big, "GGG", Topology(1, 1), optim=OPTIM, offload="params")
    p_bytes = engine.memory()["params"]
    with _no_collection():
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        start = time.perf_counter()
        engine.offload_params()
        torch.cuda.synchronize()
        out_s = time.perf_counter() - start
        freed = before - torch.cuda.memory_allocated()
        start = time.perf_counter()
        engine.onload_params()
        torch.cuda.synchronize()
        in_s = time.perf_counter() - start
    assert p_bytes <= freed <= p_bytes + 512 * len(engine.units)
    assert torch.cuda.memory_allocated() == before
    print(f"offload=params: {p_bytes / 2**20:.0f} MiB to host in {out_s * 1e3:.1f} ms "
          f"({p_bytes / out_s / 1e9:.1f} GB/s), back in {in_s * 1e3:.1f} ms "
          f"({p_bytes / in_s / 1e9:.1f} GB/s)")
