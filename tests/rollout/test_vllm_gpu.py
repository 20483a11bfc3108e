"""The vllm rollout engine colocated with the actor on one CUDA device (docs/design.md,
"Rollout"): its key/value cache goes back to training while it sleeps, and after each update
its greedy continuations, synced from the shards, are the actor's own. Each step is the
trainer's own plan (``ppo/step.py``) on this process's models (``cluster.LocalCluster``): the
actor generates with the engine and trains on what it generated."""

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


def _one_device(rank: int, world_size: int, output_dir: str) -> dict:
    from rlhf_paro.cluster import LocalCluster
    from rlhf_paro.metrics import Sums
    from rlhf_paro.ppo import data
    from rlhf_paro.rollout import PromptBatch, Sampling
    from rlhf_paro.rollout.hf import HFRollout
    from rlhf_paro.trainer import PPOTrainer

    cfg = load([*ARGV, "trainer.resume=none", f"trainer.output_dir={output_dir}"])
    trainer = PPOTrainer(cfg, cluster=LocalCluster(cfg))  # the actor with its vLLM engine
    actor = trainer.models["actor"].workers[0]

    def score(step, rollout, rows=None):
        # A reward the policy can learn in a step or two: the first response token's residue.
        scores = (rollout.responses[:, 0] % 3).float()
        return {"scores": scores, "reward_sums": Sums(total={
            "count": float(len(scores)), "task_score": float(scores.sum())})}

    trainer.models["reward"].workers[0].score = score
    reference = HFRollout(actor.engine, actor.tokenizer.pad_token_id,
                          actor.tokenizer.eos_token_id, actor.device)
    vocab = data.vocab_sizes(cfg)["actor"]
    gen = torch.Generator().manual_seed(0)
    evaluation = PromptBatch(torch.randint(3, vocab, (16, 6), generator=gen),
                             torch.ones(16, 6, dtype=torch.long))
    out = {"free": [], "equal": [], "diff": []}
    engine = actor.rollout_engine
    for step in range(2):
        engine.wake()
        awake = torch.cuda.mem_get_info()[0]
        engine.sleep()
        out["free"].append((awake, torch.cuda.mem_get_info()[0]))
        # The step generates (wakes, syncs, samples, sleeps), then trains on the rollout.
        result = trainer.step(step)
        trainer._trained(result)
        out["diff"].append(result.row["rollout/logprob_diff_max"])
        ours, _ = actor.generate(evaluation, greedy=True)
        theirs = reference.generate(evaluation, Sampling(16, greedy=True))
        out["equal"].append(torch.equal(ours.sequences, theirs.sequences))
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    # Nothing is written there: the steps save no checkpoint (trainer.resume=none).
    return run_distributed(_one_device, 1, str(tmp_path_factory.mktemp("vllm")), timeout=600)[0]


def test_sleep_gives_the_key_value_cache_back_to_training(run):
    # Level 1 drops the cache (0.3 of the device, less the engine's weights and activations)
    # and moves the weights to host memory: at least a tenth of the device comes back.
    total = torch.cuda.mem_get_info()[1]
    for awake, asleep in run["free"]:
        assert asleep - awake >= 0.1 * total


def test_greedy_after_each_sync_equals_the_actors_and_log_probs_agree(run):
    assert run["equal"] == [True, True]
    # fp32 on both sides; the bound of tests/rollout/test_vllm.py.
    assert all(d <= 1e-4 for d in run["diff"])
