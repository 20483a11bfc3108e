"""``gathered()`` runs the plain module: none of the engine's hooks in its forward passes, all of
them back afterwards (one process, N = M = 1)."""

import pytest
import torch

from rlhf_paro.sharding import Topology, shard
from tests.sharding.parity import build_model, make_batches, micro_loss


def counted(engine) -> list[str]:
    """The engine's hook calls, logged by name: the hooks look their methods up on the engine."""
    calls = []
    for name in ("_pre_forward", "_post_forward"):
        method = getattr(engine, name)
        setattr(engine, name, lambda *a, _m=method, _n=name: (calls.append(_n), _m(*a))[1])
    return calls


def test_gathered_runs_no_engine_hook_and_training_after_it_matches_a_run_without_it() -> None:
    """Defect caught: the hooks running in every decoding step of generation (Python per unit and
    token), or not coming back after it (training would then neither gather nor free)."""
    ids = make_batches("plain", 1, steps=2)[:, 0, 0]
    engines = [shard(build_model("plain"), "IGG", Topology(1, 1), optim={"lr": 0.1})
               for _ in range(2)]
    calls = counted(engines[0])
    with engines[0].gathered() as module, torch.no_grad():
        module(input_ids=ids[0])
        with pytest.raises(RuntimeError, match="boom"), engines[0].gathered():
            raise RuntimeError("boom")  # an inner exit restores nothing: the outer one does
        module(input_ids=ids[0])
    assert calls == []
    for engine in engines:  # one step: the gathered engine trains as the other, bit for bit
        engine.backward(micro_loss(engine.module, ids[1]))
        engine.step()
    assert len(calls) == 2 * len(engines[0].units)
    states = [engine.full_state_dict() for engine in engines]
    for name, value in states[0].items():
        torch.testing.assert_close(value, states[1][name], rtol=0, atol=0, msg=name)
