"""A short PPO job on real Ray with models on both backends: the actor and the ref on DeepSpeed
ZeRO-3, the critic on PaRO NIG and the reward on PaRO I, colocated on 4 CPU
devices (2 groups x 2, gloo). One job; every test reads it."""

from __future__ import annotations

import json

import pytest
import ray
import torch

from rlhf_paro.actors.group import init_ray
from rlhf_paro.metrics import read_jsonl
from tests.confs import load
from tests.conftest import demo_cache

pytestmark = [pytest.mark.ray, pytest.mark.slow]

N, M = 4, 2
STEPS = 2


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("ppo_ds")
    cfg = load([
        f"cluster.num_devices={N}", f"cluster.group_size={M}",
        "actor.backend=deepspeed", "actor.deepspeed.zero_stage=3",
        "ref.backend=deepspeed", "ref.deepspeed.zero_stage=3",
        # DeepSpeed keeps parameters under 1e5 elements whole; this model's all are.
        "ref.deepspeed.config={zero_optimization: {stage3_param_persistence_threshold: 0}}",
        "critic.strategy=NIG", "reward.strategy=I",
        "task.model.hidden_size=32", "task.model.intermediate_size=64", "task.sft_steps=10",
        "task.train_prompts=64", "task.val_prompts=8",
        "actor.micro_batch_size=1", "critic.micro_batch_size=1",
        "reward.micro_batch_size=2", "ref.micro_batch_size=1",
        "ppo.rollout_batch_size=8", "ppo.mini_batch_size=8", "ppo.ppo_epochs=1",
        f"task.cache_dir={demo_cache()}", f"trainer.output_dir={out / 'run'}",
        f"trainer.steps={STEPS}", f"trainer.save_every={STEPS}",
        "logger.wandb.mode=disabled", "logger.progress=false",
    ])
    init_ray(None, num_cpus=N, num_devices=N)
    from rlhf_paro.trainer import PPOTrainer

    trainer = PPOTrainer(cfg)
    trainer.fit()
    trainer.shutdown()
    yield cfg, out / "run", read_jsonl(str(out / "run" / "metrics.jsonl"))
    ray.shutdown()


def test_both_backends_train_and_are_metered(job):
    cfg, _, rows = job
    assert len(rows) == STEPS
    assert cfg.actor.strategy == "GGG" and cfg.ref.strategy == "G"  # the stages' equivalents
    for row in rows:
        for role in ("actor", "critic"):
            assert row[f"{role}/grad_norm"] > 0 and row[f"{role}/lr"] > 0
            # Both send on both kinds of link in a step (ZeRO-3 and NIG cross groups).
            assert row[f"{role}/comm/intra_bytes"] > 0 and row[f"{role}/comm/inter_bytes"] > 0
        # DeepSpeed's ZeRO-3: parameters gathered in forward and backward, gradients
        # reduce-scattered in backward, and the full model gathered for generation.
        for phase in ("forward", "backward", "generate"):
            assert row[f"actor/comm/{phase}/intra_bytes"] > 0, phase
        # The frozen ref on ZeRO-3 gathers on the world ring (its .config reached DeepSpeed).
        assert row["ref/comm/intra_bytes"] > 0 and row["ref/comm/inter_bytes"] > 0
    # DeepSpeed's ZeRO-3 keeps 1/N of the parameters and 1/N of the fp32 master + moments.
    row = rows[-1]
    assert row["actor/mem/optim_bytes"] == pytest.approx(3 * row["actor/mem/params_bytes"],
                                                         rel=0.01)
    assert row["critic/mem/params_bytes"] == M * row["critic/mem/grads_bytes"]  # PaRO NIG


def test_deepspeed_checkpoint_and_export(job):
    _, run, _ = job
    saved = run / "checkpoints" / f"step_{STEPS}"
    assert (saved / "actor" / "latest").read_text().strip() == "deepspeed"
    assert any((saved / "actor" / "deepspeed").iterdir())
    assert json.loads((saved / "manifest.json").read_text())  # listed like any model's files
    # The trained policy comes out whole, from ZeRO-3's partitions.
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(run / "hf" / "actor")
    assert all(torch.isfinite(p).all() for p in policy.parameters())
