"""User errors of the engine, on one process (N = M = 1 needs no process group)."""

import pytest
import torch

from rlhf_paro.sharding import EngineError, Strategy, StrategyError, Topology, shard
from tests.sharding.parity import TwoLayer


def test_step_before_the_accumulation_boundary_is_an_error() -> None:
    engine = shard(TwoLayer(), Strategy.parse("IGG"), Topology(1, 1), grad_accum_steps=2)
    engine.backward(engine(torch.ones(2, 3)))
    with pytest.raises(EngineError, match="step\\(\\) called after 1 of grad_accum_steps=2"):
        engine.step()
    engine.backward(engine(torch.ones(2, 3)))
    engine.step()  # now at the boundary
    with pytest.raises(EngineError, match="step\\(\\) called after 0"):
        engine.step()


def test_set_micro_batches_sets_the_next_steps_count_and_its_loss_scale() -> None:
    """An engine built for 2 micro-batches per step and set to 3 takes the same step as one
    built for 3 (each loss scaled by 1/3); a count changes only between steps."""
    x = torch.ones(2, 3)

    def trained(grad_accum_steps: int):
        torch.manual_seed(0)
        return shard(TwoLayer(), Strategy.parse("NNN"), Topology(1, 1), grad_accum_steps=
                     grad_accum_steps, optim={"lr": 0.1})

    reference, engine = trained(3), trained(2)
    engine.set_micro_batches(3)
    for k in (1, 2, 3):
        reference.backward(reference(x * k))
        engine.backward(engine(x * k))
        if k == 1:
            with pytest.raises(EngineError, match="set_micro_batches\\(\\) after 1 backward"):
                engine.set_micro_batches(1)
    assert engine.step() == reference.step()  # the gradient norms
    for (name, p), q in zip(engine.module.state_dict().items(),
                            reference.module.state_dict().values()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
    with pytest.raises(ValueError, match="grad_accum_steps=0 must be a positive integer"):
        engine.set_micro_batches(0)


def test_too_many_backward_calls_without_step_is_an_error() -> None:
    engine = shard(TwoLayer(), "NNN", Topology(1, 1), grad_accum_steps=1)
    engine.backward(engine(torch.ones(2, 3)))
    with pytest.raises(EngineError, match="without step"):
        engine.backward(engine(torch.ones(2, 3)))


def test_frozen_model_has_no_backward_and_no_step() -> None:
    engine = shard(TwoLayer(), "G", Topology(1, 1))
    assert engine.strategy.frozen and engine.memory()["optim"] == 0
    with torch.no_grad():
        engine(torch.ones(2, 3))
    with pytest.raises(EngineError, match="frozen"):
        engine.backward(torch.zeros(()))
    with pytest.raises(EngineError, match="no optimizer"):
        engine.step()


def test_bad_strategy_and_bad_option_are_value_errors() -> None:
    with pytest.raises(StrategyError, match="Principle 1"):
        shard(TwoLayer(), "GGN", Topology(1, 1))
    with pytest.raises(ValueError, match="precision='fp16' is unknown; allowed: fp32, bf16"):
        shard(TwoLayer(), "NNN", Topology(1, 1), precision="fp16")
    with pytest.raises(ValueError, match="unknown optimizer key"):
        shard(TwoLayer(), "NNN", Topology(1, 1), optim={"momentum": 0.9})
    with pytest.raises(ValueError, match="comm.algorithm='tree' is unknown"):
        shard(TwoLayer(), "NNN", Topology(1, 1), comm="tree")


def test_plain_module_without_blocks_is_one_root_unit_and_trains() -> None:
    torch.manual_seed(0)
    model = TwoLayer()
    ref = TwoLayer()
    ref.load_state_dict(model.state_dict())
    engine = shard(model, "GGG", Topology(1, 1), optim=dict(lr=0.1), max_grad_norm=None)
    assert len(engine.units) == 1
    opt = torch.optim.AdamW(ref.parameters(), lr=0.1, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.0)
    x = torch.randn(5, 3)
    for _ in range(3):
        engine.backward(engine(x))
        engine.step()
        ref(x).backward()
        opt.step()
        opt.zero_grad()
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(engine.full_state_dict()[key], value, rtol=1e-6, atol=1e-7)


def test_offload_mode_is_checked_and_parking_is_explicit() -> None:
    with pytest.raises(ValueError, match="offload='cpu' is unknown; allowed: none, optimizer, "
                                         "params"):
        shard(TwoLayer(), "NNN", Topology(1, 1), offload="cpu")
    with pytest.raises(ValueError, match="offload='optimizer' needs a trained model"):
        shard(TwoLayer(), "G", Topology(1, 1), offload="optimizer")
    with pytest.raises(EngineError, match="offload='none'; offload_params\\(\\) needs "
                                          "offload='params'"):
        shard(TwoLayer(), "GGG", Topology(1, 1)).offload_params()
    engine = shard(TwoLayer(), "GGG", Topology(1, 1), offload="params")
    engine.backward(engine(torch.ones(2, 3)))
    with pytest.raises(EngineError, match="between backward\\(\\) and step\\(\\)"):
        engine.offload_params()
    engine.step()
    engine.offload_params()
    assert engine.params_offloaded
    for what, call in (("gathered\\(\\)", lambda: engine.gathered().__enter__()),
                       ("forward", lambda: engine(torch.ones(2, 3)))):
        with pytest.raises(EngineError, match=f"{what} on model 'model' while its parameters "
                                              "are offloaded"):
            call()
    engine.onload_params()
    engine.backward(engine(torch.ones(2, 3)))
    engine.step()  # back on the device, it trains
