"""The vllm rollout engine colocated with the actor on one CUDA device (docs/design.md,
"Rollout"): its key/value cache goes back to training while it sleeps, and after each update
its greedy continuations, synced from the shards, are the actor's own."""

from __future__ import annotations

import pytest
import torch

from rlhf_paro.rollout import vllm as vllm_engine
from tests.confs import load
from tests.dist_utils import run_distributed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not vllm_engine.installed(), reason="needs vllm (the vllm-cuda extra)"),
]

MODEL = ("{model_type: llama, hidden_size: 256, intermediate_size: 512, num_hidden_layers: 2, "
         "num_attention_heads: 4, num_key_value_heads: 4, max_position_embeddings: 128}")
ARGV = [f"actor.config={MODEL}", "reward.path=null", "data.train_files=null",
        "cluster.device=cuda", "cluster.num_devices=1", "cluster.group_size=1",
        "actor.strategy=NNN", "rollout.engine=vllm", "rollout.gpu_memory_utilization=0.3",
        "rollout.n=4", "algorithm.adv_estimator=grpo", "algorithm.kl_coef=0",
        "ppo.rollout_batch_size=16", "ppo.mini_batch_size=64", "ppo.max_new_tokens=16",
        "actor.optim.lr=3e-2"]


def _one_device(rank: int, world_size: int) -> dict:
    from rlhf_paro.actors.actor import ActorWorker
    from rlhf_paro.ppo import data
    from rlhf_paro.rollout import PromptBatch, Sampling
    from rlhf_paro.rollout.hf import HFRollout

    cfg = load(ARGV)
    actor = ActorWorker(cfg, "actor", rank, world_size)
    actor.shard_model()  # with its vLLM engine
    reference = HFRollout(actor.engine, actor.tokenizer.pad_token_id,
                          actor.tokenizer.eos_token_id, actor.device)
    vocab = data.vocab_sizes(cfg)["actor"]
    gen = torch.Generator().manual_seed(0)
    prompts = PromptBatch(torch.randint(3, vocab, (64, 6), generator=gen),
                          torch.ones(64, 6, dtype=torch.long))
    evaluation = prompts.select(slice(0, 16))
    out = {"free": [], "equal": [], "diff": []}
    engine = actor.rollout_engine
    for step in range(2):
        engine.wake()
        awake = torch.cuda.mem_get_info()[0]
        engine.sleep()
        out["free"].append((awake, torch.cuda.mem_get_info()[0]))
        actor.generate(prompts)  # wakes, syncs, samples, sleeps
        out["diff"].append(actor.old_logprobs())
        score = (actor._rollout.responses[:, 0] % 3).float()
        actor.make_experience(None, None, score, kl_coef=0.0)
        actor.train(step=step, kl_coef=0.0)
        ours, _ = actor.generate(evaluation, greedy=True)
        theirs = reference.generate(evaluation, Sampling(16, greedy=True))
        out["equal"].append(torch.equal(ours.sequences, theirs.sequences))
    return out


@pytest.fixture(scope="module")
def run() -> dict:
    return run_distributed(_one_device, 1, timeout=600)[0]


def test_sleep_gives_the_key_value_cache_back_to_training(run):
    # Level 1 drops the cache (0.3 of the device, less the engine's weights and activations)
    # and moves the weights to host memory: at least a tenth of the device comes back.
    total = torch.cuda.mem_get_info()[1]
    for awake, asleep in run["free"]:
        assert asleep - awake >= 0.1 * total


def test_greedy_after_each_sync_equals_the_actors_and_log_probs_agree(run):
    assert run["equal"] == [True, True]
    # fp32 on both sides; the bound of tests/rollout/test_vllm.py.
    assert all(d["logprob_diff_max"] <= 1e-4 for d in run["diff"])
