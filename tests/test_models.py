"""Model building: tensor outputs, seeded init, padding, frozen roles, meta counts, paths, LoRA."""

import dataclasses

import pytest
import torch

from rlhf_paro.config import ConfigError, ModelConfig
from rlhf_paro.models import (
    build_model, count_parameters, hf_config, hf_name, hf_state_dict, hf_weights,
    save_value_model,
)
from rlhf_paro.sharding.layout import unit_sizes
from tests.confs import INLINE, load

VOCAB = 19


@pytest.fixture(scope="module")
def cfg():
    return load(INLINE)


def batch(seed=0, batch_size=3, length=10):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch_size, length), generator=gen)


def test_actor_and_ref_from_the_same_seed_are_identical(cfg):
    ids = batch()
    mask = torch.ones_like(ids)
    actor = build_model("actor", cfg.actor, VOCAB, seed=5)
    ref = build_model("ref", cfg.ref, VOCAB, seed=5)
    other = build_model("actor", cfg.actor, VOCAB, seed=6)
    torch.testing.assert_close(actor(ids, mask, response_len=4), ref(ids, mask, response_len=4))
    assert not torch.allclose(actor(ids, mask, response_len=4), other(ids, mask, response_len=4))
    assert all(p.requires_grad for p in actor.parameters())
    assert not any(p.requires_grad for p in ref.parameters())


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_response_log_probs_match_full_log_softmax(cfg, temperature):
    ids = batch()
    mask = torch.ones_like(ids)
    actor = build_model("actor", cfg.actor, VOCAB)
    logp = actor(ids, mask, response_len=4, temperature=temperature)
    logits = actor(ids, mask)  # (B, T, V): position t predicts token t + 1
    assert logits.shape == (3, 10, VOCAB)
    full = (logits / temperature).log_softmax(-1)[:, -5:-1]
    torch.testing.assert_close(logp, full.gather(-1, ids[:, -4:, None]).squeeze(-1))


def test_left_padding_does_not_change_log_probs_or_values(cfg):
    # Positions count valid tokens only, so a left-padded row sees what the unpadded row sees.
    ids = batch(length=8)
    padded = torch.cat([torch.zeros(3, 2, dtype=torch.long), ids], dim=1)
    padded_mask = torch.cat([torch.zeros(3, 2, dtype=torch.long), torch.ones_like(ids)], dim=1)
    actor = build_model("actor", cfg.actor, VOCAB)
    critic = build_model("critic", cfg.critic, VOCAB)
    torch.testing.assert_close(actor(padded, padded_mask, response_len=3),
                               actor(ids, torch.ones_like(ids), response_len=3))
    torch.testing.assert_close(critic(padded, padded_mask, response_len=3),
                               critic(ids, torch.ones_like(ids), response_len=3))


def test_critic_values_per_token_and_reward_at_last_valid_token(cfg):
    ids = batch()
    mask = torch.ones_like(ids)
    critic = build_model("critic", cfg.critic, VOCAB)
    all_values = critic(ids, mask)
    assert all_values.shape == (3, 10)
    # The value of response token k is read at the position before it.
    torch.testing.assert_close(critic(ids, mask, response_len=4), all_values[:, -5:-1])

    reward = build_model("reward", cfg.reward, VOCAB)
    right_padded = torch.cat([ids[:, :7], torch.zeros(3, 3, dtype=torch.long)], dim=1)
    right_mask = torch.cat([torch.ones(3, 7, dtype=torch.long),
                            torch.zeros(3, 3, dtype=torch.long)], dim=1)
    scores = reward(right_padded, right_mask)
    assert scores.shape == (3,)
    torch.testing.assert_close(scores, reward(ids[:, :7], mask[:, :7]))
    assert not any(p.requires_grad for p in reward.parameters())


def test_meta_models_give_engine_units_and_llama2_7b_counts():
    llama = load(["conf=ppo_llama7b"])
    # Llama-2-7B: 32 x (4*4096^2 + 3*4096*11008 + 2*4096) + 2*32000*4096 + 4096.
    assert count_parameters("ref", llama.ref, VOCAB) == (6_738_415_616, 0)
    assert count_parameters("actor", llama.actor, VOCAB) == (6_738_415_616, 6_738_415_616)
    # The critic drops the LM head (32000*4096) and adds a value head (4096 + 1).
    assert count_parameters("critic", llama.critic, VOCAB)[0] == 6_738_415_616 - 32000 * 4096 + 4097
    units = unit_sizes(build_model("actor", llama.actor, VOCAB, meta=True))
    assert len(units) == 1 + 32  # the root unit and one per LlamaDecoderLayer
    assert units[1].trainable == 4 * 4096 ** 2 + 3 * 4096 * 11008 + 2 * 4096


def test_lora_trains_adapters_only_and_starts_as_the_base(cfg):
    ids = batch()
    mask = torch.ones_like(ids)
    lora_cfg = dataclasses.replace(cfg.actor,
                                   lora=dataclasses.replace(cfg.actor.lora, enabled=True))
    base = build_model("actor", cfg.actor, VOCAB, seed=1)
    lora = build_model("actor", lora_cfg, VOCAB, seed=1)
    torch.testing.assert_close(lora(ids, mask, response_len=4), base(ids, mask, response_len=4))
    total, trainable = count_parameters("actor", lora_cfg, VOCAB)
    # r=8 adapters on q, k, v, o of 2 layers: 2 * 4 * (64*8 + 8*64) trainable elements.
    assert trainable == 2 * 4 * (64 * 8 + 8 * 64)
    assert total == count_parameters("actor", cfg.actor, VOCAB)[0] + trainable
    units = unit_sizes(build_model("actor", lora_cfg, VOCAB, meta=True))
    assert units[0].trainable == 0 and units[1].frozen > 0 and units[1].trainable > 0


def test_models_load_from_a_local_directory(cfg, tmp_path):
    ids = batch()
    mask = torch.ones_like(ids)
    actor = build_model("actor", cfg.actor, VOCAB, seed=2)
    actor.lm.save_pretrained(tmp_path / "actor")
    loaded = build_model("actor", ModelConfig(path=str(tmp_path / "actor")), VOCAB)
    torch.testing.assert_close(loaded(ids, mask, response_len=4), actor(ids, mask, response_len=4))

    reward = build_model("reward", cfg.reward, VOCAB, seed=3)
    save_value_model(reward, tmp_path / "reward")
    again = build_model("reward", ModelConfig(path=str(tmp_path / "reward")), VOCAB)
    torch.testing.assert_close(again(ids, mask), reward(ids, mask))
    # A causal LM directory has no value head: fine for a critic, not for a reward model.
    build_model("critic", ModelConfig(path=str(tmp_path / "actor")), VOCAB)
    with pytest.raises(ConfigError, match="reward.path: .*no score head"):
        build_model("reward", ModelConfig(path=str(tmp_path / "actor")), VOCAB)
    # A directory whose weights are gone (what a worker finds, not the config check): one line.
    (tmp_path / "actor" / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="ref.path: cannot load the weights in .*OSError") as info:
        build_model("ref", ModelConfig(path=str(tmp_path / "actor")), VOCAB)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("inline, key, allowed", [
    ({"hiden_size": 64}, "actor.config.hiden_size", "did you mean hidden_size"),
    ({"model_type": "lama"}, "actor.config.model_type", "did you mean llama"),
    ({"vocab_size": 10}, "actor.config.vocab_size", "at least 19"),
])
def test_bad_inline_configs_name_the_key(inline, key, allowed):
    with pytest.raises(ConfigError) as info:
        hf_config("actor", ModelConfig(config=inline), VOCAB)
    assert str(info.value).startswith(f"{key}: ") and allowed in str(info.value)


@pytest.mark.parametrize("lora", [False, True])
def test_hf_names_are_the_hugging_face_models_own(cfg, lora):
    # Every key of an actor's state is its wrapped model's own key (a PEFT model's under LoRA),
    # with the same tensor; a value model's are its backbone's, and its head has none.
    actor_cfg = dataclasses.replace(cfg.actor, lora=dataclasses.replace(cfg.actor.lora,
                                                                        enabled=lora))
    actor = build_model("actor", actor_cfg, VOCAB, seed=1)
    state = actor.state_dict()
    named = hf_state_dict(actor, state)
    assert named.keys() == actor.lm.state_dict().keys() and len(named) == len(state)
    assert all(named[hf_name(actor, k)] is v for k, v in state.items())
    critic = build_model("critic", cfg.critic, VOCAB, seed=1)
    state = critic.state_dict()
    assert hf_state_dict(critic, state).keys() == critic.backbone.state_dict().keys()
    head = [k for k in state if hf_name(critic, k) is None]
    assert head and all(k.startswith("value_head.") for k in head)
    with pytest.raises(TypeError, match="no Hugging Face names"):
        hf_name(torch.nn.Linear(2, 2), "weight")


@pytest.mark.parametrize("lora", [False, True])
def test_hf_weights_are_what_the_plain_model_loads(cfg, lora):
    # What a rollout engine's sync loads: the plain Hugging Face causal LM's own parameters. Under
    # LoRA each adapted linear is merged, W + alpha / r * B A, as PEFT's merge_and_unload does
    # (B is set non-zero first: it starts at zero, which would make any merge look right).
    actor_cfg = dataclasses.replace(cfg.actor, lora=dataclasses.replace(cfg.actor.lora,
                                                                        enabled=lora))
    actor = build_model("actor", actor_cfg, VOCAB, seed=1)
    with torch.no_grad():
        for name, p in actor.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    lora_cfg = actor_cfg.lora
    got = dict(hf_weights(actor, actor.named_parameters(), lora_cfg.alpha / lora_cfg.r))
    plain = actor.lm.merge_and_unload() if lora else actor.lm
    want = dict(plain.named_parameters())
    assert got.keys() == want.keys()
    for name, value in want.items():
        # One fp32 product B A of a rank-8 adapter, added once: a few ulps apart at most.
        torch.testing.assert_close(got[name], value, rtol=1e-6, atol=1e-7, msg=name)


# GPT-2 keeps its dropout of 0.1 (resid, embd, attn, summary_first) unless told otherwise.
GPT2 = {"model_type": "gpt2", "n_embd": 32, "n_layer": 1, "n_head": 2, "n_positions": 32,
        "bos_token_id": 1, "eos_token_id": 2}
GPT2_DROPOUT = {"resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1,
                "summary_first_dropout": 0.1}


def _dropouts(model: torch.nn.Module) -> set[float]:
    return {m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)}


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_dropout_is_off_unless_kept_and_an_export_writes_the_config_as_given(role, tmp_path):
    import json

    from rlhf_paro.models import export_hf

    model = build_model(role, ModelConfig(config=GPT2), VOCAB)
    inner = model.lm if role == "actor" else model.backbone
    assert _dropouts(model) == {0.0}
    assert {k: getattr(inner.config, k) for k in GPT2_DROPOUT} == dict.fromkeys(GPT2_DROPOUT, 0.0)
    # In train mode the forward is the eval forward, bit for bit.
    ids = batch(length=6)
    args = (ids, torch.ones_like(ids)) + ((3,) if role == "actor" else ())
    expected = model.eval()(*args)
    assert torch.equal(model.train()(*args), expected)
    # The export writes the config as the user gave it; the model trains on without dropout.
    export_hf(model, model.state_dict(), tmp_path / "out")
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert {k: saved[k] for k in GPT2_DROPOUT} == GPT2_DROPOUT
    assert inner.config.resid_pdrop == 0.0

    kept = build_model(role, ModelConfig(config=GPT2, disable_dropout=False), VOCAB)
    assert _dropouts(kept) == {0.1}
    assert not torch.equal(kept.train()(*args), expected)


@pytest.mark.filterwarnings("ignore:fan_in_fan_out")  # PEFT on GPT-2's Conv1D: said and done
def test_lora_keeps_its_own_dropout():
    lora = dataclasses.replace(ModelConfig().lora, enabled=True, dropout=0.25,
                               target_modules=["c_attn"])
    model = build_model("actor", ModelConfig(config=GPT2, lora=lora), VOCAB)
    adapters = {m.p for name, m in model.named_modules()
                if "lora_dropout" in name and isinstance(m, torch.nn.Dropout)}
    assert adapters == {0.25} and _dropouts(model) == {0.0, 0.25}
