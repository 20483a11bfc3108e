"""rollout.n: the samples of a prompt form a group that lands whole on one rank, and the actor's
baseline for a sample uses exactly the other samples of its group."""

from __future__ import annotations

import torch

from rlhf_paro import runs
from rlhf_paro.actors.actor import ActorWorker
from rlhf_paro.ppo.task import task_from_config
from rlhf_paro.rollout import RolloutBatch
from tests.confs import INLINE, load

GRPO = [*INLINE, "algorithm.adv_estimator=grpo", "algorithm.kl_coef=0", "rollout.n=4",
        "ppo.rollout_batch_size=8", "ppo.mini_batch_size=32", "actor.micro_batch_size=4",
        "cluster.num_devices=2", "cluster.group_size=1"]


def test_each_rank_gets_whole_groups_of_one_prompt():
    cfg = load(GRPO)
    prompts = runs.Prompts(cfg, task_from_config(cfg))
    per_rank, rows = prompts.next(8, n=4)
    assert rows is None and [len(p) for p in per_rank] == [16, 16]
    seen = []
    for part in per_rank:
        groups = part.input_ids.view(4, 4, -1)  # 4 groups of 4 samples on this rank
        assert all(torch.equal(g[0], g[k]) for g in groups for k in range(4))
        seen += [tuple(g[0].tolist()) for g in groups]
    # The prompts of the step are those an n=1 stream draws, each once.
    again = runs.Prompts(cfg, task_from_config(cfg))
    plain = torch.cat([p.input_ids for p in again.next(8, n=1)[0]])
    assert seen == [tuple(row.tolist()) for row in plain]


def test_the_actors_group_baseline_uses_exactly_its_group():
    cfg = load(GRPO)
    actor = ActorWorker(cfg, "actor", 0, 2)
    # 3 groups of 4 samples on this rank, responses of different lengths.
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]] * 3, dtype=torch.float32)
    score = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, 2.0, 4.0, 0.0, 0.0, 0.0, 0.0, 1.0])
    rollout = RolloutBatch(torch.zeros(12, 5, dtype=torch.long),
                           torch.cat([torch.ones(12, 2), mask], 1).long(), mask)
    old_logp = torch.zeros_like(mask)
    given = actor.make_experience(0, rollout, score, kl_coef=0.0, old_logp=old_logp)
    advantages = given["experience"].advantages
    for g in range(3):
        rows = slice(4 * g, 4 * g + 4)
        s = score[rows]
        # GRPO: (score - group mean) / (group's unbiased std + eps), on every valid token.
        expected = (s - s.mean()) / (s.std() + 1e-6)
        got = (advantages[rows] * mask[rows]).sum(1) / mask[rows].sum(1)
        torch.testing.assert_close(got, expected)
    # Moving one sample's score changes its own group's advantages only.
    score[0] = 3.0
    moved = actor.make_experience(0, rollout, score, kl_coef=0.0,
                                  old_logp=old_logp)["experience"].advantages
    assert not torch.allclose(moved[:4], advantages[:4])
    assert torch.equal(moved[4:], advantages[4:])
    assert given["exp_sums"].total["count"] == 12.0
