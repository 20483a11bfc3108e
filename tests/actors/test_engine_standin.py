"""TEMPORARY: the stand-in engine checkpoint (``actors/_engine_standin.py``) on one process;
goes away with it when the engine's own checkpoint lands."""

import pytest
import torch
from torch import nn

import rlhf_paro.actors  # noqa: F401  (installs the stand-in)
from rlhf_paro.sharding import Topology, shard


class TwoLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x)).sum()


def _engine(strategy: str = "IGG"):
    return shard(TwoLayer(), strategy, Topology(1, 1), optim={"lr": 0.1}, max_grad_norm=1.0)


def _train(engine, steps: int, start: int = 0) -> list[float]:
    losses = []
    for k in range(start, start + steps):
        loss = engine(torch.full((2, 3), float(k + 1)))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def test_save_then_load_continues_exactly(tmp_path) -> None:
    straight = _engine()
    _train(straight, 2)
    straight.save_checkpoint(str(tmp_path))
    expected = _train(straight, 2, start=2)
    resumed = _engine()
    resumed.load_checkpoint(str(tmp_path))
    assert _train(resumed, 2, start=2) == expected  # Adam's moments and step came back too


def test_non_finite_loss_skips_the_step_and_counts_it() -> None:
    engine = _engine()
    before = engine.full_state_dict()
    engine.backward(engine(torch.ones(2, 3)) * float("nan"))
    norm = engine.step()
    assert norm != norm  # NaN: the returned norm says why
    assert engine.skipped_steps == 1
    after = engine.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    _train(engine, 1)
    assert engine.skipped_steps == 1


def test_other_strategy_is_refused_in_one_line(tmp_path) -> None:
    _engine("IGG").save_checkpoint(str(tmp_path))
    with pytest.raises(ValueError, match="strategy IGG") as info:
        _engine("NNN").load_checkpoint(str(tmp_path))
    assert "\n" not in str(info.value)
