"""Ranks with different numbers of micro-batches (docs/design.md, "Batching"): on 2 gloo ranks
under GGG (every forward all-gathers, every backward reduce-scatters), the ranks agree on the
largest count, set it with ``set_micro_batches``, and the rank with fewer runs fillers
(``batching.fill_to``: a real forward and backward with its loss times 0). Each micro-batch's
loss is divided by ``batching.micro_divisor``. Two optimizer steps give the parameters of the
unsharded model trained on the mean loss of all real micro-batches, as the padded path does.

    step 0: rank 0 holds 3 micro-batches, rank 1 holds 1 (and runs 2 fillers): 3 agreed
    step 1: rank 0 holds 1 (1 filler), rank 1 holds 2: 2 agreed
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.sharding.parity import BATCH, MAX_NORM, OPTIM, SEQ, build_model, micro_loss

pytestmark = [pytest.mark.dist, pytest.mark.slow]

WORLD = 2
# Real micro-batches of each rank at each step.
COUNTS = [(3, 1), (1, 2)]


def _batches() -> list[list[torch.Tensor]]:
    """Token ids per step and rank: (count, BATCH, SEQ)."""
    gen = torch.Generator().manual_seed(3)
    return [[torch.randint(0, 32, (n, BATCH, SEQ), generator=gen) for n in step]
            for step in COUNTS]


def _sharded(rank: int, world_size: int) -> dict:
    from rlhf_paro import batching
    from rlhf_paro.sharding import Topology, shard

    engine = shard(build_model("base"), "GGG", Topology.from_process_group(group_size=world_size),
                   optim=OPTIM, max_grad_norm=MAX_NORM, grad_accum_steps=1)
    norms = []
    for step, per_rank in enumerate(_batches()):
        mine = per_rank[rank]
        agreed = max(COUNTS[step])  # what the worker's all-reduce MAX gives
        # Each micro-batch's loss is a token mean: the global count is the number of real
        # micro-batches, so the step's loss is their mean.
        divisor = batching.micro_divisor(float(sum(COUNTS[step])), world_size, agreed)
        # Rows of this rank's micro-batches as indices of ``mine``; all of equal length here.
        micros = [torch.tensor([k]) for k in range(len(mine))]
        engine.set_micro_batches(agreed)
        for micro in batching.fill_to(micros, agreed, torch.full((len(mine),), SEQ)):
            loss = micro_loss(engine, mine[micro.rows[0]]) / divisor
            engine.backward(loss * micro.weight if micro.weight != 1.0 else loss)
        norms.append(engine.step())
    return {"norms": norms, "state": engine.full_state_dict()}


def _reference() -> dict:
    model = build_model("base")
    opt = torch.optim.AdamW(model.parameters(), **OPTIM)
    norms = []
    for per_rank in _batches():
        real = torch.cat(per_rank)
        for ids in real:
            (micro_loss(model, ids) / len(real)).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"norms": norms, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def test_fillers_keep_uneven_ranks_on_the_unsharded_update():
    got = run_distributed(_sharded, WORLD)
    ref = _reference()
    # The norms before clipping see a wrong divisor, which AdamW's updates (scale-free up to
    # eps) would hide; the parameters see a filler that adds to the gradient.
    for rank in range(WORLD):
        assert got[rank]["norms"] == pytest.approx(ref["norms"], rel=1e-6)
    state = got[0]["state"]
    # Per tensor, as tests/sharding/test_engine_parity.py: fp32 sums of 4 and 3 micro-batch
    # gradients in another order, through 2 AdamW steps.
    for key, value in ref["state"].items():
        diff = (state[key].double() - value.double()).norm() / value.double().norm()
        assert diff <= 1e-6, f"{key}: relative difference {diff:.2e} > 1e-6"
