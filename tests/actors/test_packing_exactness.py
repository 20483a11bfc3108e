"""Packing and micro-batches by tokens change how a PPO step computes, not what
(docs/design.md, "Batching"): on 4 gloo ranks in 2 groups of 2, each rank runs the trainer's own
plan of a step (``ppo/step.py``) on its rank of the reward, critic and actor workers (no Ray):
they score a fixed rollout of mixed prompt and response lengths, compute its values and old
log-probs, make the experience and train actor and critic for 2 optimizer steps, once padded
with ``micro_batch_size=2`` and once packed with ``max_tokens_per_micro_batch=16``. The packed
run's scores, values and log-probs equal the padded run's per sequence, and its parameters after
the update equal the padded run's.

Under the budget, rank 0 (sequences of 12 to 14 tokens) holds one sequence per micro-batch, 4 per
mini-batch, and rank 1 (3 or 4 tokens) holds its whole mini-batch in one: every rank runs the
agreed 4, rank 1 three of them fillers, while the engines' collectives run in every forward
(P = I or G) or every backward (G = I or G).
"""

from __future__ import annotations

import pytest
import torch

from rlhf_paro.rollout import RolloutBatch
from tests.confs import load
from tests.dist_utils import run_distributed
from tests.steps import spy

pytestmark = [pytest.mark.dist, pytest.mark.slow]

WORLD = 4
BUDGET = 16  # real tokens per micro-batch on the packed path
MODEL = ("{model_type: llama, hidden_size: 16, intermediate_size: 32, num_hidden_layers: 2, "
         "num_attention_heads: 2, num_key_value_heads: 1, max_position_embeddings: 32}")
# (actor, critic, reward) strategies: the default conf's, and one with the actor's parameters
# replicated (P = N) whose gradients and optimizer state are sharded over the world.
CASES = {"IGG-NIG": ("IGG", "NIG", "I"), "NGG-NNI": ("NGG", "NNI", "G")}
# Prompt and response lengths of each rank's 8 sequences (2 mini-batches of 4, one optimizer
# step each): long, short, and two mixed.
LENGTHS = [
    ([6, 5, 6, 4, 6, 5, 6, 5], [8, 8, 7, 8, 6, 8, 7, 8]),
    ([2, 3, 2, 1, 2, 3, 1, 2], [1, 1, 1, 3, 2, 1, 2, 1]),
    ([1, 6, 3, 2, 5, 4, 2, 6], [5, 2, 8, 1, 3, 7, 4, 1]),
    ([4, 2, 6, 3, 1, 5, 2, 3], [2, 6, 1, 4, 8, 3, 5, 2]),
]


def _argv(case: str, packed: bool, output_dir: str) -> list[str]:
    actor, critic, reward = CASES[case]
    split = ([f"{m}.max_tokens_per_micro_batch={BUDGET}" for m in ("actor", "critic")] if packed
             else [f"{m}.packing=false" for m in ("actor", "critic", "reward")])
    return [f"actor.config={MODEL}", "reward.path=null", "data.train_files=null",
            "cluster.num_devices=4", "cluster.group_size=2", f"actor.strategy={actor}",
            f"critic.strategy={critic}", f"reward.strategy={reward}",
            "ppo.rollout_batch_size=32", "ppo.mini_batch_size=16", "ppo.ppo_epochs=1",
            "data.max_prompt_length=6", "ppo.max_new_tokens=8", "actor.micro_batch_size=2",
            "critic.micro_batch_size=2", "actor.optim.lr=1e-4", "critic.optim.lr=1e-4",
            "actor.optim.eps=1e-6", "critic.optim.eps=1e-6", "algorithm.kl_coef=0",
            "trainer.resume=none", f"trainer.output_dir={output_dir}", *split]


def _rollout(rank: int, vocab: int, pad: int):
    """Rank ``rank``'s rollout: prompts left-padded to its longest, responses right-padded to
    its longest (as ``ActorWorker.generate`` leaves them), ``pad`` at every padding."""
    prompt_lens, response_lens = LENGTHS[rank]
    width, resp = max(prompt_lens), max(response_lens)
    prompt = torch.tensor([[0] * (width - p) + [1] * p for p in prompt_lens])
    action = torch.tensor([[1.0] * r + [0.0] * (resp - r) for r in response_lens])
    mask = torch.cat([prompt, action.long()], 1)
    gen = torch.Generator().manual_seed(rank)
    ids = torch.randint(3, vocab, mask.shape, generator=gen)
    return RolloutBatch(torch.where(mask.bool(), ids, pad), mask, action)


def _record_counts(engine, seen: list[int]) -> None:
    """Append every micro-batch count set on ``engine`` to ``seen``."""
    set_count = engine.set_micro_batches

    def recorded(count: int) -> None:
        seen.append(count)
        set_count(count)

    engine.set_micro_batches = recorded


def _rank_trainer(cfg, rank: int, rollout):
    """The trainer of ``cfg`` on rank ``rank`` of this gloo group: every model's worker of that
    rank in this process (``LocalCluster``), the source giving ``rollout`` (``tests/steps.py``).
    Every rank's trainer runs the same plan, so the models' collectives meet."""
    from rlhf_paro.cluster import LocalCluster
    from rlhf_paro.trainer import PPOTrainer
    from tests.steps import FixedSource

    return PPOTrainer(cfg, cluster=LocalCluster(cfg, rank, WORLD, FixedSource(rollout)))


def _train_stats(worker, seen: dict) -> None:
    """Keep the step's training statistics in ``seen`` as the report that resets them reads
    them."""
    report = worker.report

    def reported():
        seen.update({k: list(v) for k, v in worker._train_stats.items()})
        return report()

    worker.report = reported


def _one_path(rank: int, case: str, packed: bool, output_dir: str) -> dict:
    from rlhf_paro.ppo import data

    cfg = load(_argv(case, packed, output_dir))
    rollout = _rollout(rank, data.vocab_sizes(cfg)["actor"],
                       data.rollout_tokenizer(cfg).pad_token_id)  # the actor's pad id
    trainer = _rank_trainer(cfg, rank, rollout)
    reward, critic, actor = (trainer.models[role].workers[0]
                             for role in ("reward", "critic", "actor"))
    for worker in (reward, critic, actor):
        assert worker.packed is packed
    start = {"actor": actor.engine.full_state_dict(), "critic": critic.engine.full_state_dict()}
    seen, stats = {}, {"actor": {}, "critic": {}}
    for worker, method in ((reward, "score"), (critic, "values"), (actor, "old_logprobs")):
        spy(worker, method, seen)
    agreed = {"actor": [], "critic": []}  # micro-batch counts set on the engines
    for role, worker in (("actor", actor), ("critic", critic)):
        _record_counts(worker.engine, agreed[role])
        _train_stats(worker, stats[role])
    trainer.step(0)
    out = {"score": seen["score"]["scores"], "values": seen["values"]["values"],
           "logp": seen["old_logprobs"]["old_logp"], "mask": rollout.action_mask,
           "agreed": agreed,
           # record_train logs a real micro-batch's loss, never a filler's
           "real": {role: len(stats[role]["loss"]) for role in stats},
           "norms": {role: stats[role]["grad_norm"] for role in stats}}
    end = {"actor": actor.engine.full_state_dict(), "critic": critic.engine.full_state_dict()}
    if rank == 0:
        out["start"], out["end"] = start, end
    return out


def _rank(rank: int, world_size: int, output_dir: str) -> dict:
    return {(case, packed): _one_path(rank, case, packed, output_dir) for case in CASES
            for packed in (False, True)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    # Nothing is written there: the steps save no checkpoint (trainer.resume=none).
    return run_distributed(_rank, WORLD, str(tmp_path_factory.mktemp("packing")), timeout=300)


@pytest.mark.parametrize("case", CASES)
def test_packed_scores_values_and_log_probs_equal_the_padded_ones(runs, case):
    # Same fp32 arithmetic per sequence on differently shaped products (tests/test_batching.py):
    # a few float32 ulps of values of order 0.1 to 10.
    for rank, got in enumerate(runs):
        padded, packed = got[(case, False)], got[(case, True)]
        mask = padded["mask"]
        torch.testing.assert_close(packed["score"], padded["score"], rtol=0, atol=1e-5)
        for key in ("values", "logp"):
            torch.testing.assert_close(packed[key] * mask, padded[key] * mask, rtol=0, atol=1e-5,
                                       msg=lambda m, key=key: f"rank {rank} {key}: {m}")


@pytest.mark.parametrize("case", CASES)
def test_token_budget_micro_batches_ran_fillers_on_the_rank_with_fewer(runs, case):
    for role in ("actor", "critic"):
        # Padded: 2 micro-batches of 2 sequences per mini-batch on every rank.
        assert {tuple(r[(case, False)]["agreed"][role]) for r in runs} == {(2, 2)}
        assert [r[(case, False)]["real"][role] for r in runs] == [4] * WORLD
        # Packed: rank 0 needs 4 per mini-batch, so all agree on 4; rank 1 needs 1.
        assert {tuple(r[(case, True)]["agreed"][role]) for r in runs} == {(4, 4)}
        real = [r[(case, True)]["real"][role] for r in runs]
        assert real[:2] == [8, 2] and all(n <= 8 for n in real)


@pytest.mark.parametrize("case", CASES)
def test_packed_token_budget_update_gives_the_padded_parameters(runs, case):
    # Error bound. Both runs sum the same per-token gradient terms in fp32 in another order
    # (other micro-batches, packed rows, fillers adding exact zeros) from experience that agrees
    # to a few float32 ulps (the first test), so each gradient element differs by a few ulps of
    # the sum of its terms' magnitudes. The gradient norm, a sum of squares over all elements,
    # differs by about as much: 1e-5 relative holds with a wide margin, and catches a divisor
    # wrong by any factor, which AdamW's scale-free updates would hide from the parameters.
    # AdamW moves each parameter by lr * m_hat / (sqrt(v_hat) + eps), about lr * sign(g) in its
    # first steps, and a relative gradient error d moves that by at most about 2 * d * lr. d is a
    # few ulps where an element's terms add up, more where they nearly cancel: up to 1e-5 in
    # this rollout (seen at lr = 1e-3, where it shows above the parameters' rounding). Where a
    # gradient element cancels to the size of eps, m_hat / (sqrt(v_hat) + eps) turns its
    # absolute error e into up to e / (4 eps): eps = 1e-6 (as tests/sharding/parity.py), not the
    # default 1e-8, makes that amplification 100 times smaller. At
    # lr = 1e-4 each step then moves a parameter by 2e-9 more or less, below the float32
    # rounding (2^-24 relative) that each run does to its parameters at each step; relative to
    # a tensor's largest parameter (0.04 to 1 here), the runs differ by at most
    # 4 * 2^-24 + 2 * 2e-9 / 0.04 = 3.4e-7 (seen: 1.5e-7; 1.0e-6 with eps = 1e-8 once ranks
    # were balanced). The value head's bias starts at 0, so its error relative to itself is its
    # gradient's d: a sum of per-token residuals that do not cancel (1e-7 seen).
    padded, packed = runs[0][(case, False)], runs[0][(case, True)]
    for role in ("actor", "critic"):
        assert len(padded["norms"][role]) == 2  # two optimizer steps
        assert packed["norms"][role] == pytest.approx(padded["norms"][role], rel=1e-5)
        for name, before in padded["start"][role].items():
            assert torch.equal(packed["start"][role][name], before)  # the same initial weights
            a, b = padded["end"][role][name].double(), packed["end"][role][name].double()
            scale = a.abs().max()
            diff = float((a - b).abs().max() / scale)
            assert diff <= 1e-6, f"{role} {name}: max |a - b| / max |a| = {diff:.2e} > 1e-6"
            # Every tensor moved by 100 times the tolerance or more: the test sees the update.
            moved = float((a - before.double()).abs().max() / scale)
            assert moved >= 1e-4, f"{role} {name} moved by only {moved:.2e}"
