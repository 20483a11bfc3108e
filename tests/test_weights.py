"""A model read from files and sharded unit by unit (``models.build_for_setup`` and the engine's
``source``) holds the same weights as the model built whole and then sharded, bit for bit, and
trains the same: on 4 gloo ranks as 2 groups x 2, a Llama (untied, and saved in bf16) and a GPT-2
(tied), causal LMs, value models and a sequence-classifier reward, LoRA, gradient checkpointing,
fp32 and bf16, under strategies of every P level. Each rank reads only the elements it keeps.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import pytest
import torch

from rlhf_paro import models, weights
from rlhf_paro.config import ConfigError, ModelConfig
from tests import hf_assets
from tests.dist_utils import run_distributed

WORLD, GROUP = 4, 2
SEED = 3


@dataclass(frozen=True)
class Case:
    role: str
    asset: str
    strategy: str
    precision: str = "fp32"
    lora: bool = False
    ckpt: bool = False  # gradient checkpointing (the step runs in train mode: Llama has no dropout)

    @property
    def key(self) -> str:
        return (f"{self.role}-{self.asset}-{self.strategy}-{self.precision}"
                + ("-lora" if self.lora else "") + ("-ckpt" if self.ckpt else ""))

    def model_cfg(self, assets: dict) -> ModelConfig:
        cfg = ModelConfig(path=str(assets[self.asset]), precision=self.precision,
                          gradient_checkpointing=self.ckpt)
        if self.lora:
            cfg.lora.enabled = True
            cfg.lora.target_modules = ["c_attn"] if self.asset == "gpt2" else ["q_proj", "v_proj"]
        return cfg


CASES = [
    Case("actor", "llama", "GGG"), Case("actor", "llama", "IGG", "bf16"),
    Case("actor", "llama", "NIG", "bf16"), Case("ref", "llama", "I"),
    Case("critic", "llama", "IIG"), Case("actor", "gpt2", "GGG", "bf16"),
    Case("actor", "gpt2", "NNG"), Case("ref", "gpt2", "G", "bf16"),
    Case("critic", "gpt2", "GIG", "bf16"), Case("actor", "llama", "GGG", lora=True),
    Case("actor", "gpt2", "IGG", "bf16", lora=True), Case("reward", "rm", "G"),
    Case("critic", "rm", "NGG", "bf16"), Case("actor", "llama_bf16", "IGG"),
    Case("actor", "llama_bf16", "GGG", "bf16"), Case("critic", "llama", "GGG", ckpt=True),
]


def save_assets(directory) -> dict:
    words = hf_assets.word_tokenizer()
    assets = {"llama": hf_assets.save_llama(directory / "llama", words),
              "gpt2": hf_assets.save_gpt2(directory / "gpt2", hf_assets.bpe_tokenizer()),
              "rm": hf_assets.save_reward(directory / "rm", words)}
    from transformers import LlamaForCausalLM

    torch.manual_seed(1)
    bf16 = LlamaForCausalLM(hf_assets.llama_config(len(words))).to(torch.bfloat16)
    bf16.save_pretrained(directory / "llama_bf16")  # weights stored as bf16 in the file
    assets["llama_bf16"] = directory / "llama_bf16"
    return assets


def _expected_reads(engine) -> int:
    """Elements this rank keeps: its P shard of every buffer, and a bf16 model's fp32 master
    at the OS level (padding is never read)."""
    total = 0
    for unit in engine.units:
        for buf in unit.buffers:
            spans = [buf.level_slice(engine.strategy.params)]
            if buf is unit.trainable and engine.precision == "bf16":
                spans.append(buf.level_slice(engine.strategy.optim))
            total += sum(max(0, min(s.stop, buf.numel) - s.start) for s in spans)
    return total


def both_paths(rank: int, world_size: int, assets: dict, cases: list[Case]) -> dict:
    """Each case built whole and from files on this rank; what the parent compares."""
    from rlhf_paro.sharding import Strategy, Topology, shard

    topo = Topology.from_process_group(group_size=GROUP)
    out = {}
    for case in cases:
        cfg = case.model_cfg(assets)
        strategy = Strategy.parse(case.strategy, frozen=case.role in ("ref", "reward"))
        options = dict(precision=case.precision, device="cpu", optim={"lr": 1e-3})
        whole = shard(models.build_model(case.role, cfg, 0, seed=SEED), strategy, topo,
                      **options)
        model, source = models.build_for_setup(case.role, cfg, 0, seed=SEED)
        on_meta = all(p.is_meta for p in model.parameters())
        real_buffers = not any(b.is_meta for b in model.buffers())
        read = [0]

        def counted(name: str, start: int, stop: int, source=source, read=read) -> torch.Tensor:
            read[0] += stop - start
            return source(name, start, stop)

        lazy = shard(model, strategy, topo, source=counted, **options)
        pieces = [engine.state_dict()["tensors"] for engine in (whole, lazy)]
        states = [engine.full_state_dict() for engine in (whole, lazy)]
        buffers = [dict(engine.module.named_buffers()) for engine in (whole, lazy)]
        ids = torch.randint(3, 20, (2, 9), generator=torch.Generator().manual_seed(rank))
        mask = torch.ones_like(ids)
        kwargs = {} if case.role == "reward" else {"response_len": 4}
        with torch.no_grad():
            outputs = [engine(input_ids=ids, attention_mask=mask, **kwargs)
                       for engine in (whole, lazy)]
        trained = [None, None]
        if not strategy.frozen:  # one optimizer step each: a backward re-gathers every unit
            for k, engine in enumerate((whole, lazy)):
                engine.module.train(case.ckpt)
                engine.backward(engine(input_ids=ids, attention_mask=mask, **kwargs).mean())
                trained[k] = (engine.step(), engine.state_dict()["tensors"])
        out[case.key] = {
            "on_meta": on_meta, "real_buffers": real_buffers,
            "read": read[0], "expected_read": _expected_reads(lazy),
            "kinds": sorted({k.split("/")[0] for k in pieces[0]}),
            "pieces_equal": pieces[0].keys() == pieces[1].keys() and all(
                torch.equal(v, pieces[1][k]) for k, v in pieces[0].items()),
            "states_equal": states[0].keys() == states[1].keys() and all(
                torch.equal(v, states[1][k]) and v.dtype == states[1][k].dtype
                for k, v in states[0].items()),
            "buffers_equal": buffers[0].keys() == buffers[1].keys() and all(
                torch.equal(v, buffers[1][k]) for k, v in buffers[0].items()),
            "outputs_equal": torch.equal(outputs[0], outputs[1]),
            "trained_equal": trained[0] is None or trained[0][0] == trained[1][0] and all(
                torch.equal(v, trained[1][1][k]) for k, v in trained[0][1].items()),
        }
    return out


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return save_assets(tmp_path_factory.mktemp("weights"))


@pytest.fixture(scope="module")
def grid(assets) -> list[dict]:
    return run_distributed(functools.partial(both_paths), WORLD, assets, CASES)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.key)
def test_setup_from_files_equals_the_whole_build_and_reads_only_what_a_rank_keeps(grid, case):
    for rank, results in enumerate(grid):
        got = results[case.key]
        assert got["on_meta"] and got["real_buffers"], rank
        # P shards, bf16 masters (and Adam moments, zero on both) of this rank's chunk; then
        # every parameter gathered, the buffers, and a forward: bit for bit.
        assert got["pieces_equal"] and got["states_equal"], rank
        assert got["buffers_equal"] and got["outputs_equal"] and got["trained_equal"], rank
        assert got["read"] == got["expected_read"] > 0, rank
    trained = case.role in ("actor", "critic")
    kinds = ["exp_avg", "exp_avg_sq", "params"] if trained else ["params"]
    if trained and case.precision == "bf16":
        kinds = ["exp_avg", "exp_avg_sq", "master", "params"]
    assert grid[0][case.key]["kinds"] == kinds


# -- one process ---------------------------------------------------------------------------------

def test_fresh_parameters_depend_on_seed_and_name_only():
    name = "lm.base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
    a = weights.fresh(name, (2, 64), seed=1)
    assert torch.equal(a, weights.fresh(name, (2, 64), seed=1))
    assert not torch.equal(a, weights.fresh(name, (2, 64), seed=2))
    assert not torch.equal(a, weights.fresh(name.replace("q_proj", "v_proj"), (2, 64), seed=1))
    assert a.abs().max() <= 1 / 8 and a.std() > 0.05  # uniform in +-1/sqrt(fan_in = 64)
    assert not weights.fresh(name.replace("lora_A", "lora_B"), (64, 2), seed=1).any()
    head = weights.fresh("value_head.weight", (1, 4095), seed=1)
    assert 2e-4 < float(head.std()) < 3e-4  # std 1 / (hidden + 1) = 2.44e-4
    assert not weights.fresh("value_head.bias", (1,), seed=1).any()
    assert weights.fresh("lm.model.embed_tokens.weight", (8, 4), seed=1) is None


def test_a_path_model_comes_on_the_meta_device_an_inline_one_whole(assets):
    model, source = models.build_for_setup("critic", ModelConfig(path=str(assets["gpt2"])), 0)
    assert source is not None and all(p.is_meta for p in model.parameters())
    # A fresh value head: the same values on the whole path.
    whole = models.build_model("critic", ModelConfig(path=str(assets["gpt2"])), 0)
    head = whole.value_head.weight.detach()
    assert torch.equal(source("value_head.weight", 0, head.numel()), head.reshape(-1))
    assert torch.equal(head, weights.fresh("value_head.weight", head.shape, 0))
    inline = ModelConfig(config={"hidden_size": 8, "intermediate_size": 16,
                                 "num_hidden_layers": 1, "num_attention_heads": 2})
    model, source = models.build_for_setup("actor", inline, 19)
    assert source is None and not any(p.is_meta for p in model.parameters())


def test_files_that_miss_a_weight_build_whole_with_a_warning_and_bad_files_fail_in_one_line(
        assets, tmp_path):
    from safetensors.torch import load_file, save_file
    import shutil

    directory = tmp_path / "llama"
    shutil.copytree(assets["llama"], directory)
    tensors = load_file(str(directory / "model.safetensors"))
    del tensors["model.norm.weight"]  # what transformers starts fresh, or renames on load
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model, source = models.build_for_setup("actor", ModelConfig(path=str(directory)), 0)
    assert source is None and not any(p.is_meta for p in model.parameters())
    assert any("actor.path: 'lm.model.norm.weight' is in none of the files; the model is "
               "built whole on every rank" in str(w.message) for w in seen)
    (directory / "model.safetensors").write_bytes(b"\x08" + bytes(7) + b"not json")
    with pytest.raises(ConfigError, match="ref.path: cannot load the weights in .* is not a "
                                          "readable safetensors file") as info:
        models.build_for_setup("ref", ModelConfig(path=str(directory)), 0)
    assert "\n" not in str(info.value)
