"""A user's own files: tokenizers, prompt files, mixed-length batches, reward models and
functions, exports, and every bad input as one line naming its key."""

from __future__ import annotations

import json

import pytest
import torch

from rlhf_paro import models
from rlhf_paro.compose import load_config
from rlhf_paro.config import ConfigError, ModelConfig
from rlhf_paro.ppo import data, rewards
from rlhf_paro.ppo.task import join, response_mask
from rlhf_paro.resolve import resolve
from tests import dist_utils, hf_assets
from tests.confs import load


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("assets")
    word, bpe = hf_assets.word_tokenizer(), hf_assets.bpe_tokenizer()
    return {
        "llama": hf_assets.save_llama(root / "llama", word),
        "gpt2": hf_assets.save_gpt2(root / "gpt2", bpe),
        "rm": hf_assets.save_reward(root / "rm", word),
        "train": hf_assets.write_prompts(root / "train.jsonl", 24),
        "chat": hf_assets.write_prompts(root / "chat.jsonl", 24, chat=True),
        "fns": hf_assets.write_reward_functions(root / "fns.py"),
        "root": root,
    }


def config(assets, *extra):
    return load([f"actor.path={assets['llama']}", f"data.train_files={assets['train']}",
                 *extra])


def test_prompts_are_tokenized_with_their_columns_and_epochs_are_seeded(assets):
    cfg = config(assets)
    tokenizer = data.actor_tokenizer(cfg)
    prompts = data.load_prompts(cfg, tokenizer)
    assert len(prompts) == 24 and set(prompts.columns) == {"start"}
    assert len({len(ids) for ids in prompts.ids}) > 1  # mixed lengths
    first = data.PromptStream(prompts, seed=3, shuffle=True)
    again = data.PromptStream(prompts, seed=3, shuffle=True)
    batches = [first.next(10).texts for _ in range(5)]  # runs over two epochs
    assert batches == [again.next(10).texts for _ in range(5)]
    # Each epoch is a permutation: the first 24 prompts drawn are all of them once.
    assert sorted(sum(batches, [])[:24]) == sorted(prompts.texts)
    ids, mask = data.left_pad(prompts.ids[:4], tokenizer.pad_token_id)
    assert (mask.sum(-1) == torch.tensor([len(i) for i in prompts.ids[:4]])).all()
    assert (mask[:, -1] == 1).all()  # left padding: every prompt ends in the last column


def test_chat_messages_go_through_the_template(assets):
    cfg = config(assets, f"data.train_files={assets['chat']}", "data.apply_chat_template=true")
    prompts = data.load_prompts(cfg, data.actor_tokenizer(cfg))
    assert prompts.texts[0].startswith("user : count :")
    assert prompts.texts[0].endswith("assistant : ")


def test_long_prompts_are_skipped_and_counted(assets, capsys):
    cfg = config(assets, "data.max_prompt_length=5")
    prompts = data.load_prompts(cfg, data.actor_tokenizer(cfg))
    assert 0 < prompts.num_skipped < 24 and all(len(i) <= 5 for i in prompts.ids)
    assert f"skipped {prompts.num_skipped} of 24" in capsys.readouterr().out


@pytest.mark.parametrize("mistake, key", [
    ("missing_key", "data.prompt_key"),
    ("no_template", "data.apply_chat_template"),
    ("messages_without_template", "data.prompt_key"),
    ("empty_file", "data.train_files"),
    ("no_such_file", "data.train_files"),
    ("not_a_model", "actor.path"),
    ("not_a_classifier", "reward.path"),
    ("bad_function", "reward.function"),
    ("file_and_function", "reward.function"),
    ("files_without_tokenizer", "data.train_files"),
])
def test_bad_input_is_one_line_naming_the_key(assets, tmp_path, mistake, key):
    from rlhf_paro import runs

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    not_model = tmp_path / "not_model"
    not_model.mkdir()
    (not_model / "config.json").write_text(json.dumps({"hello": 1}))
    argv = {
        "missing_key": ["data.prompt_key=question"],
        "no_template": [f"actor.path={assets['gpt2']}", "data.apply_chat_template=true"],
        "messages_without_template": [f"data.train_files={assets['chat']}"],
        "empty_file": [f"data.train_files={empty}"],
        "no_such_file": [f"data.train_files={tmp_path / 'nope.jsonl'}"],
        "not_a_model": [f"actor.path={not_model}"],
        "not_a_classifier": [f"reward.path={assets['llama']}"],
        "bad_function": [f"reward.function={assets['fns']}:nope"],
        "file_and_function": [f"reward.function={assets['fns']}:length",
                              f"reward.path={assets['rm']}"],
        "files_without_tokenizer": ["actor.path=null", "actor.config={hidden_size: 32}"],
    }[mistake]
    with pytest.raises(ConfigError) as info:
        cfg = config(assets, *argv)
        models.check_model_configs(cfg, runs.check_inputs(cfg))
    message = str(info.value)
    assert message.startswith(key) and "\n" not in message, message


def test_command_line_keys_replace_the_confs_competing_keys(assets, tmp_path):
    conf = tmp_path / "mine.yaml"
    conf.write_text(f"defaults: [ppo_tiny]\nreward:\n  function: {assets['fns']}:length\n"
                    f"data:\n  train_files: {assets['train']}\n  val_files: {assets['train']}\n")
    cfg = load_config([f"conf={conf}", f"actor.path={assets['llama']}",
                              f"reward.path={assets['rm']}", f"data.train_files={assets['chat']}"])
    assert cfg.actor.config is None and cfg.reward.function is None and cfg.data.val_files is None
    # Composing leaves ref and the critic without a source; resolving gives ref the actor's and
    # the critic (PPO's) the reward model's, whose score head starts the value head.
    assert cfg.ref.path is None and cfg.critic.path is None
    assert (resolve(cfg).ref.path, resolve(cfg).critic.path) == (str(assets["llama"]),
                                                                  str(assets["rm"]))
    # A reward model of another tokenizer than the actor's: the critic starts from the actor.
    cfg = load_config([f"conf={conf}", f"actor.path={assets['gpt2']}",
                              f"reward.path={assets['rm']}"])
    assert resolve(cfg).critic.path == str(assets["gpt2"])
    cfg = load_config([f"conf={conf}", f"actor.path={assets['llama']}"])
    assert cfg.reward.function.endswith(":length")
    assert resolve(cfg).critic.path == str(assets["llama"])
    cfg = load_config([f"actor.path={assets['llama']}",
                              f"data.train_files={assets['train']},{assets['chat']}"])
    assert data.data_files(cfg.data.train_files) == [str(assets["train"]), str(assets["chat"])]


def test_reward_function_failures_name_the_function_and_the_step(assets):
    spec = f"{assets['fns']}:broken"
    args = (["p"] * 2, ["r"] * 2, {"start": [1, 2]})
    with pytest.raises(rewards.RewardFunctionError, match=r"fns.py:broken at step 7 raised "
                                                          r"ValueError: no score for you"):
        rewards.call_function(rewards.load_function(spec), spec, 7, *args)
    spec = f"{assets['fns']}:short"
    with pytest.raises(rewards.RewardFunctionError, match="at step 3 returned 1 values for 2"):
        rewards.call_function(rewards.load_function(spec), spec, 3, *args)
    spec = f"{assets['fns']}:length"
    out = rewards.call_function(rewards.load_function(spec), spec, 1, *args)
    assert out.scores == [1 / 8, 1 / 8] and out.extras == {}


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_mixed_length_batch_log_probs_values_and_scores_equal_each_sequence_alone(assets, name):
    # Left-padded prompts, right-padded responses: every model's forward on the batch equals its
    # forward on each sequence alone, up to fp32 reduction order (the padded keys get zero
    # attention weight exactly; only the length of the sums differs).
    tokenizer = data.load_tokenizer(str(assets[name]))
    vocab = len(tokenizer)
    actor = models.build_model("actor", ModelConfig(path=str(assets[name])), vocab)
    critic = models.build_model("critic", ModelConfig(path=str(assets[name])), vocab)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (2, 7, 4)]
    responses = torch.randint(3, vocab, (3, 5), generator=gen)
    responses[0, 3] = tokenizer.eos_token_id  # an early end: right padding after it
    mask = response_mask(responses, tokenizer.eos_token_id)
    ids, prompt_mask = data.left_pad(prompts, tokenizer.pad_token_id)
    seq, attn = join(ids, responses, mask, prompt_mask)
    batch_logp = actor(seq, attn, response_len=5)
    batch_values = critic(seq, attn, response_len=5)
    for i, prompt in enumerate(prompts):
        alone = torch.cat([torch.tensor(prompt), responses[i]])[None]
        alone_mask = torch.cat([torch.ones(len(prompt), dtype=torch.long), mask[i].long()])[None]
        keep = mask[i].bool()
        torch.testing.assert_close(batch_logp[i][keep],
                                   actor(alone, alone_mask, response_len=5)[0][keep],
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(batch_values[i][keep],
                                   critic(alone, alone_mask, response_len=5)[0][keep],
                                   rtol=1e-5, atol=1e-5)


def test_sequence_classifier_reward_scores_as_transformers_does(assets):
    from transformers import AutoModelForSequenceClassification

    tokenizer = data.load_tokenizer(str(assets["rm"]))
    ours = models.build_model("reward", ModelConfig(path=str(assets["rm"])), len(tokenizer))
    theirs = AutoModelForSequenceClassification.from_pretrained(str(assets["rm"]))
    tokenizer.padding_side = "right"
    enc = tokenizer(["count : a b c", "count : d"], padding=True, return_tensors="pt")
    torch.testing.assert_close(ours(enc["input_ids"], enc["attention_mask"]),
                               theirs(**enc).logits[:, 0], rtol=1e-5, atol=1e-5)


def _train_and_export(rank: int, world_size: int, path: str, out: str, lora: bool) -> dict:
    from rlhf_paro.sharding import Topology, shard

    cfg = ModelConfig(path=path)
    if lora:
        cfg.lora.enabled, cfg.lora.merge_on_export = True, True
    model = models.build_model("actor", cfg, 0, seed=0)
    engine = shard(model, "IGG" if not lora else "GGG", Topology.from_process_group(group_size=1),
                   optim={"lr": 1e-2}, max_grad_norm=1.0)
    ids = torch.randint(3, 20, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    engine.backward(-engine(input_ids=ids, attention_mask=mask, response_len=4).mean())
    engine.step()
    state = engine.full_state_dict()
    if rank == 0:
        models.export_hf(engine.module, state, out, data.load_tokenizer(path), merge_lora=lora)
    torch.distributed.barrier()
    with torch.no_grad():
        return {"ids": ids, "logp": engine(input_ids=ids, attention_mask=mask, response_len=4)}


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True])
def test_export_loads_with_from_pretrained_and_matches_the_sharded_model(assets, tmp_path, lora):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "hf" / "actor"
    result = dist_utils.run_distributed(_train_and_export, 2, str(assets["llama"]), str(out),
                                        lora)[0]
    loaded = AutoModelForCausalLM.from_pretrained(str(out / "merged" if lora else out))
    assert (out / ("adapter_model.safetensors" if lora else "model.safetensors")).is_file()
    assert (out / "tokenizer.json").is_file() and not list(tmp_path.glob("hf/.*"))
    logp = models.CausalLM(loaded)(result["ids"], torch.ones_like(result["ids"]), response_len=4)
    torch.testing.assert_close(logp, result["logp"], rtol=1e-5, atol=1e-5)
