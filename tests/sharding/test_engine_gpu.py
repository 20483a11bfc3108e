"""The engine on CUDA: buffers on the device, same numbers as the unsharded model there."""

import pytest
import torch

from rlhf_paro.sharding import Topology, shard
from tests.sharding.parity import MAX_NORM, OPTIM, build_model, make_batches, micro_loss

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


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
