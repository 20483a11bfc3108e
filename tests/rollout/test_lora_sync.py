"""A LoRA actor's sync into rollout engines with weights of their own (``actor.lora.sync``): the
base weights once, then the adapters alone (``models.BASE``, ``models.ADAPTERS``), against the
whole model merged (``models.MERGED``).

    parts      what the actor sends: the adapters are its trained parameters and nothing else
    hf         a replica's hf engine merges them into the base it keeps: the merged weights to
               the bit, sync after sync
    vllm       vLLM's own LoRA layers, on this machine's build: the merged engine's tokens, and
               its log-probs within the fp32 bound, on attention and MLP projections
    refused    a target the engines cannot take (an embedding, the output head): one line
    fallback   an engine without LoRA kernels on the device: merged, said in one line
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from rlhf_paro import models, rollout
from rlhf_paro.config import ConfigError
from rlhf_paro.rollout import vllm as vllm_engine
from rlhf_paro.rollout.hf import HFReplica, LocalWeights
from tests.confs import INLINE, load

VOCAB = 19
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


def _actor(cfg, seed: int) -> models.CausalLM:
    """A LoRA actor whose B factors are not zero (they start at zero, which would make any
    merge, or none, look right)."""
    actor = models.build_model("actor", cfg.actor, VOCAB, seed=1)
    _perturb(actor, seed)
    return actor


@torch.no_grad()
def _perturb(actor: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, p in actor.named_parameters():
        if "lora_" in name:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)


def _lora_cfg(*args: str):
    return load([*INLINE, "actor.lora.enabled=true", *args])


def test_the_adapters_are_the_trained_parameters_alone():
    # What each sync sends after the first: every trained parameter (each adapted linear's A
    # and B) and no other; the base is the plain model's every weight, none of them adapted.
    cfg = _lora_cfg()
    actor = _actor(cfg, seed=0)
    scale = cfg.actor.lora.alpha / cfg.actor.lora.r
    trained = [(n, p) for n, p in actor.named_parameters() if p.requires_grad]
    adapters = dict(models.hf_weights(actor, trained, scale, models.ADAPTERS))
    assert adapters == dict(models.hf_weights(actor, actor.named_parameters(), scale,
                                              models.ADAPTERS))
    assert len(adapters) == len(trained) == 2 * 4 * 2  # A and B, 4 projections, 2 layers
    assert sum(t.numel() for t in adapters.values()) == sum(p.numel() for _, p in trained)
    base = dict(models.hf_weights(actor, actor.named_parameters(), scale, models.BASE))
    merged = dict(models.hf_weights(actor, actor.named_parameters(), scale, models.MERGED))
    assert base.keys() == merged.keys()
    assert not any("lora" in name for name in base)


def test_a_replicas_hf_engine_merges_the_adapters_into_the_merged_weights_to_the_bit():
    # The replica keeps each adapted linear's base and merges every sync's adapters into it with
    # the actor's own expression (models.lora_merged): the weights of a merged sync, bit for
    # bit, at the first sync and at the next (where merging into the last merged weights
    # instead of the base would add the old adapter in twice).
    cfg = _lora_cfg(f"actor.lora.target_modules=[{','.join(ATTENTION + MLP)}]")
    lora = cfg.actor.lora
    scale = lora.alpha / lora.r
    actor = _actor(cfg, seed=0)
    plain = dataclasses.replace(cfg.actor, lora=dataclasses.replace(lora, enabled=False))
    module = models.build_model("actor", plain, VOCAB, seed=2)
    replica = HFReplica(LocalWeights(module), 0, 2, torch.device("cpu"), lora_scale=scale)
    replica.sync(models.hf_weights(actor, actor.named_parameters(), scale, models.BASE))
    for seed in (0, 1):
        _perturb(actor, seed)
        trained = [(n, p) for n, p in actor.named_parameters() if p.requires_grad]
        replica.sync_adapters(models.hf_weights(actor, trained, scale, models.ADAPTERS))
        merged = dict(models.hf_weights(actor, actor.named_parameters(), scale))
        got = dict(module.lm.named_parameters())
        assert got.keys() == merged.keys()
        for name, value in merged.items():
            assert torch.equal(got[name], value), (seed, name)


def test_a_target_the_engines_cannot_take_is_one_line_naming_it():
    # An embedding's adapter has no place among the linears a sync carries: refused when the
    # config is resolved, naming the key, the module and the linears allowed.
    with pytest.raises(ConfigError) as info:
        _lora_cfg("actor.lora.target_modules=[q_proj,embed_tokens]", "rollout.num_devices=1")
    line = str(info.value)
    assert line.startswith("actor.lora.target_modules: a rollout engine with weights of its own "
                           "(rollout.num_devices>0) cannot take an adapter on embed_tokens "
                           "(Embedding, not a linear layer); allowed: the model's linear layers "
                           "("), line
    assert "down_proj" in line and "q_proj" in line and "lm_head" not in line
    with pytest.raises(ConfigError, match=r"an adapter on lm_head \(the output head\)"):
        _lora_cfg("actor.lora.target_modules=[lm_head]", "rollout.num_devices=1")
    # The hf engine on the actor's own parameters syncs nothing: any target PEFT takes.
    _lora_cfg("actor.lora.target_modules=[q_proj,embed_tokens]")


@pytest.mark.slow
def test_through_the_command_line_the_refusal_is_one_line_and_exit_2_before_ray(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "rlhf_paro.train", *INLINE,
                           "actor.lora.enabled=true", "actor.lora.target_modules=[embed_tokens]",
                           "rollout.num_devices=1", f"trainer.output_dir={out}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "error: actor.lora.target_modules: a rollout engine with weights of its own "
        "(rollout.num_devices>0) cannot take an adapter on embed_tokens (Embedding, not a "
        "linear layer); allowed: the model's linear layers ("), proc.stderr
    assert not out.exists()  # nothing started: no run folder, no Ray


def test_an_engine_without_lora_kernels_on_the_device_syncs_merged_and_says_so(monkeypatch):
    cfg = _lora_cfg("rollout.num_devices=1")
    assert rollout.lora_sync(cfg) == (models.ADAPTERS, None)
    vllm_cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, engine="vllm"))
    monkeypatch.setitem(rollout.base.ADAPTERS, "vllm", lambda cfg: "no kernels")
    part, line = rollout.lora_sync(vllm_cfg)
    assert part == models.MERGED
    assert line == ("actor.lora.sync=adapters: rollout.engine=vllm cannot take adapters on cpu "
                    "(no kernels); each sync sends the whole model, the adapters merged in")
    # Asked for merged weights, or with no copy to sync, there is nothing to say.
    merged = dataclasses.replace(vllm_cfg, actor=dataclasses.replace(
        cfg.actor, lora=dataclasses.replace(cfg.actor.lora, sync="merged")))
    assert rollout.lora_sync(merged) == (models.MERGED, None)


# Head size 32: the smallest vLLM's CPU attention takes (tests/rollout/test_vllm.py).
VLLM_MODEL = ("{model_type: llama, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2,"
              " num_attention_heads: 2, num_key_value_heads: 2, max_position_embeddings: 64}")


def _gap(actor: models.CausalLM, batch) -> float:
    """The largest |difference| over the actions between the engine's log-probs of a sampled
    batch and the actor's own (its PEFT forward, fp32)."""
    with torch.no_grad():
        logp = actor(batch.sequences, batch.attention_mask, response_len=batch.response_len)
    return float((logp - batch.logprobs)[batch.action_mask.bool()].abs().max())


@pytest.mark.slow
@pytest.mark.skipif(not vllm_engine.installed(),
                    reason='needs the vllm extra: pip install -e ".[vllm]"')
def test_vllms_lora_layers_sample_with_the_actors_log_probs_sync_after_sync():
    # The installed build's LoRA on this device, for real: the base weights once, then the
    # adapters on attention and MLP projections, twice (the second replaces the first in
    # place). The bound: fp32 throughout; a logit of this model is a chain of 2 blocks' dot
    # products of at most 128 terms, each within 128 u (u = 2^-24) of its terms' magnitudes,
    # and vLLM's unmerged x W + s (x A) B differs from the actor's PEFT forward in order of
    # summation only: about 1e-5 on logits of order 1, so a log-prob (a logit less a
    # log-sum-exp) stays within the 1e-4 of rollout/logprob_diff (tests/rollout/test_vllm.py).
    cfg = load([f"actor.config={VLLM_MODEL}", "reward.path=null", "data.train_files=null",
                "rollout.engine=vllm", "actor.lora.enabled=true",
                f"actor.lora.target_modules=[{','.join(ATTENTION + MLP)}]",
                "ppo.max_new_tokens=8"])
    assert rollout.lora_sync(cfg) == (models.ADAPTERS, None)
    lora = cfg.actor.lora
    scale = lora.alpha / lora.r
    actor = models.build_model("actor", cfg.actor, VOCAB, seed=1).eval()
    hf_config = models.hf_config("actor", cfg.actor, VOCAB)
    engine = vllm_engine.VLLMRollout(cfg, hf_config, 2, 0, torch.device("cpu"), seed=3)
    engine.sync(models.hf_weights(actor, actor.named_parameters(), scale, models.BASE))
    gen = torch.Generator().manual_seed(0)
    ids = torch.cat([torch.ones(16, 1, dtype=torch.long),
                     torch.randint(3, VOCAB, (16, 4), generator=gen)], dim=1)
    prompts = rollout.PromptBatch(ids, torch.ones_like(ids))
    sampling = rollout.Sampling(max_new_tokens=8, temperature=1.0)
    before = None
    for seed in (0, 1):
        _perturb(actor, seed)
        trained = [(n, p) for n, p in actor.named_parameters() if p.requires_grad]
        engine.sync_adapters(models.hf_weights(actor, trained, scale, models.ADAPTERS))
        batch = engine.generate(prompts, sampling)
        assert _gap(actor, batch) <= 1e-4, seed
        if before is not None:
            # The first adapter, still loaded, would sample these far from the second's.
            assert _gap(actor, before) > 1e-2
        before = batch
