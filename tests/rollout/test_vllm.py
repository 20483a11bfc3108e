"""The vllm rollout engine against the actor it serves (docs/design.md, "Rollout"), on 4 gloo
ranks in 2 groups of 2, each rank with its own vLLM engine in its own process as a run has it.

For actor strategies with P = N, I and G, each rank runs 3 GRPO steps of the trainer's own plan
(``ppo/step.py``) on its rank of the actor and reward workers (no Ray), the actor generating with
vLLM on the rank's own prompts and the scores fixed by the test; after each update, vLLM's greedy
continuation of 16 prompts (synced from the shards first) equals the sharded actor's own greedy
continuation (Hugging Face generate on the gathered weights), the engine's log-probs of its
sampled tokens are within 1e-4 of the trainer's, and the sync sent exactly the bytes of one
all-gather of every unit at the P scope.
"""

from __future__ import annotations

import pytest
import torch

from rlhf_paro.rollout import vllm as vllm_engine
from tests.confs import load
from tests.dist_utils import run_distributed
from tests.steps import spy

pytestmark = [pytest.mark.dist, pytest.mark.slow,
              pytest.mark.skipif(not vllm_engine.installed(),
                                 reason='needs the vllm extra: pip install -e ".[vllm]"')]

WORLD = 4
STEPS = 3
# Head size 32: the smallest vLLM's CPU attention takes.
MODEL = ("{model_type: llama, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, "
         "num_attention_heads: 2, num_key_value_heads: 2, max_position_embeddings: 64}")
STRATEGIES = ("NGG", "IGG", "GGG")  # the actor's P = N, I, G
NEW_TOKENS = 8


def _argv(strategy: str) -> list[str]:
    # A large learning rate: greedy continuations change from step to step, so that equality
    # after each update needs that step's sync. Temperature 0.8: the engine's log-probs go
    # through its temperature, not only the raw logits.
    return [f"actor.config={MODEL}", "reward.path=null", "data.train_files=null",
            "cluster.num_devices=4", "cluster.group_size=2", f"actor.strategy={strategy}",
            "rollout.engine=vllm", "rollout.n=4", "algorithm.adv_estimator=grpo",
            "algorithm.kl_coef=0", "comm.algorithm=native", "ppo.rollout_batch_size=16",
            "ppo.mini_batch_size=32", "ppo.ppo_epochs=1", f"ppo.max_new_tokens={NEW_TOKENS}",
            "ppo.temperature=0.8", "actor.micro_batch_size=4", "actor.optim.lr=3e-2"]


def _prompts(seed: int, rows: int, vocab: int, repeat: int = 1):
    """``rows`` prompts of <bos> (id 1, as the task's) and 2 to 6 random tokens, left-padded
    with 0; each ``repeat`` times in a row (a group of rollout.n)."""
    from rlhf_paro.rollout import PromptBatch

    gen = torch.Generator().manual_seed(seed)
    prompts = [[1, *torch.randint(3, vocab, (int(n),), generator=gen).tolist()]
               for n in torch.randint(2, 7, (rows // repeat,), generator=gen)]
    prompts = [p for p in prompts for _ in range(repeat)]
    width = max(map(len, prompts))
    return PromptBatch(torch.tensor([[0] * (width - len(p)) + p for p in prompts]),
                       torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts]))


def _sync_bytes(engine) -> tuple[int, int]:
    """What one all-gather of every unit at the P scope sends from this rank (native ring)."""
    from rlhf_paro.comm.meter import native_bytes
    from rlhf_paro.sharding.strategy import Level

    intra = inter = 0
    for unit in engine.units:
        for buf in unit.buffers:
            if buf.p_level == Level.N:
                continue
            scope = "intra" if buf.p_level == Level.I else "world"
            sent = native_bytes("all_gather", buf.size, buf.shard.element_size(), scope,
                                engine.topo)
            intra, inter = intra + sent.intra, inter + sent.inter
    return intra, inter


def _rank(rank: int, world_size: int, output_dir: str) -> dict:
    from rlhf_paro.actors.rollout import Generation
    from rlhf_paro.cluster import LocalCluster
    from rlhf_paro.comm.meter import SYNC
    from rlhf_paro.metrics import Sums
    from rlhf_paro.ppo import data
    from rlhf_paro.rollout import Sampling
    from rlhf_paro.rollout.hf import HFRollout
    from rlhf_paro.trainer import PPOTrainer

    def score(step, rollout, rows=None):
        # Any score that differs within a group: GRPO's advantages are then not all zero.
        scores = (rollout.responses[:, 0] % 3).float()
        return {"scores": scores, "reward_sums": Sums(total={
            "count": float(len(scores)), "task_score": float(scores.sum())})}

    out: dict = {}
    engine = None  # one vLLM engine per rank, serving every strategy's actor in turn
    for strategy in STRATEGIES:
        cfg = load(_argv(strategy))
        vocab = data.vocab_sizes(cfg)["actor"]
        # Rank ``rank`` of every model in this process, training on the rollout it generated
        # (no rank deals another's); built with the hf engine (no vLLM engine of its own), then
        # given the shared one. No checkpoint is read or written.
        local = load([*_argv(strategy), "rollout.engine=hf", "ppo.balance_batch=false",
                      "trainer.resume=none", f"trainer.output_dir={output_dir}"])
        trainer = PPOTrainer(local, cluster=LocalCluster(local, rank, world_size))
        actor = trainer.models["actor"].workers[0]
        trainer.models["reward"].workers[0].score = score
        # The rank's own prompts in place of the driver's draw: one slice, its generator's.
        trainer.draw = lambda step: {"prompts": (
            [_prompts(100 * rank + step, 16, vocab, repeat=4)], None)}
        seen: dict = {}
        spy(actor, "old_logprobs", seen)  # the engine's distance, this rank's alone
        if engine is None:
            engine = vllm_engine.VLLMRollout(cfg, actor.engine.module.lm.config,
                                             actor.tokenizer.eos_token_id,
                                             actor.tokenizer.pad_token_id, actor.device, seed=rank)
        # Fresh weights: the first generate syncs them.
        actor.generation = Generation(cfg, engine, actor.tokenizer, actor.device)
        reference = HFRollout(actor.engine, actor.tokenizer.pad_token_id,
                              actor.tokenizer.eos_token_id, actor.device)
        evaluation = _prompts(1000, 16, vocab)  # the same on every rank
        steps = []
        for step in range(STEPS):
            trainer._trained(trainer.step(step))  # generates with vLLM, then trains on it
            actor.engine.meter.reset()
            ours, _ = actor.generate(evaluation, greedy=True)  # syncs the update first
            sent = actor.engine.meter.totals(SYNC)
            theirs = reference.generate(evaluation, Sampling(NEW_TOKENS, greedy=True))
            steps.append({"ours": ours.sequences, "theirs": theirs.sequences,
                          "diff": seen["old_logprobs"]["mismatch"],
                          "sent": (sent["intra_bytes"], sent["inter_bytes"]),
                          "expected": _sync_bytes(actor.engine)})
        out[strategy] = steps
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    # Nothing is written there: the steps save no checkpoint (trainer.resume=none).
    return run_distributed(_rank, WORLD, str(tmp_path_factory.mktemp("vllm")), timeout=600)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_vllm_greedy_after_each_sync_equals_the_sharded_actors_greedy(runs, strategy):
    for rank, got in enumerate(runs):
        for step, s in enumerate(got[strategy]):
            assert torch.equal(s["ours"], s["theirs"]), f"rank {rank} step {step}"
    # The updates change the greedy continuations: the equality above needs every sync.
    first, last = runs[0][strategy][0]["theirs"], runs[0][strategy][-1]["theirs"]
    assert not torch.equal(first, last)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_vllm_log_probs_of_sampled_tokens_are_the_trainers(runs, strategy):
    # Both sides compute log softmax(logits / 0.8) in fp32 from the same weights by different
    # kernels (a paged key/value cache against one packed forward): each logit carries a few
    # float32 ulps of its O(1) terms' sums over the 64-wide model, so a log-prob differs by
    # about 1e-6 (the default run's largest: 2.4e-6); 1e-4 is the bound for fp32 and
    # catches any log-prob of the wrong temperature (differences of order 0.1) or of stale
    # weights.
    for rank, got in enumerate(runs):
        for step, s in enumerate(got[strategy]):
            assert s["diff"].total["logprob_diff_count"] > 0
            assert s["diff"].most["logprob_diff"] <= 1e-4, f"rank {rank} step {step}"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sync_sends_one_gather_of_every_unit_at_the_p_scope(runs, strategy):
    for rank, got in enumerate(runs):
        for s in got[strategy]:
            assert s["sent"] == s["expected"]
    sent = [s["sent"] for got in runs for s in got[strategy]]
    if strategy[0] == "N":  # the shards are the full weights: nothing to gather
        assert set(sent) == {(0, 0)}
    elif strategy[0] == "I":  # in the group only
        assert all(intra > 0 and inter == 0 for intra, inter in sent)
    else:  # over the world ring: the last rank of each group sends across groups
        assert [runs[r][strategy][0]["sent"][1] > 0 for r in range(WORLD)] == \
            [False, True, False, True]



def _top_k_rank(rank: int, world_size: int) -> dict:
    """One rank sampling 64 responses at temperature 1 from the top 3 tokens."""
    from rlhf_paro.actors.actor import ActorWorker
    from rlhf_paro.ppo import data

    cfg = load([*_argv("NNN"), "cluster.num_devices=1", "cluster.group_size=1",
                "ppo.temperature=1.0", "ppo.top_k=3"])
    actor = ActorWorker(cfg, "actor", rank, world_size)
    actor.shard_model()  # with its vLLM engine
    rollout, _ = actor.generate(_prompts(7, 64, data.vocab_sizes(cfg)["actor"]))
    diff = actor.old_logprobs(0, rollout)["mismatch"]
    with torch.no_grad():  # the trainer's logits at the positions that predict the responses
        logits = actor.engine.module(rollout.sequences, rollout.attention_mask)
    logits = logits[:, -rollout.response_len - 1:-1]
    picked = logits.gather(-1, rollout.responses.unsqueeze(-1))
    above = (logits > picked).sum(-1)  # tokens the trainer ranks above the sampled one
    return {"diff": diff, "above": above[rollout.action_mask.bool()]}


def test_vllm_samples_from_the_top_k_with_the_trainers_log_probs():
    got = run_distributed(_top_k_rank, 1, timeout=600)[0]
    # Each sampled token among the trainer's 3 most likely (ties aside, which random fp32
    # logits do not make); at temperature 1 the engine's raw log-probs are the trainer's
    # definition (before top-k), within the bound of the test above.
    assert len(got["above"]) > 64 and int(got["above"].max()) <= 2
    assert got["diff"].most["logprob_diff"] <= 1e-4
