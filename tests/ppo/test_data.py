"""A user's own files: tokenizers, prompt files, mixed-length batches, reward models and
functions, exports, and every bad input as one line naming its key."""

from __future__ import annotations

import json

import pytest
import ray
import torch

from rlhf_paro import models, usercode
from rlhf_paro.compose import load_config
from rlhf_paro.config import ConfigError, ModelConfig
from rlhf_paro.ppo import data, rewards
from rlhf_paro.resolve import resolve
from rlhf_paro.rollout import PromptBatch, join
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


def test_each_rank_s_prompts_are_left_padded_only_to_its_own_longest(assets):
    # 4 ranks, 2 prompts each, sampled twice (rollout.n=2): rank 0's prompts are 1 and 2 tokens
    # long, rank 3's 6 and 3. A rank's slice is as wide as its longest prompt, not the batch's.
    from rlhf_paro import runs

    cfg = config(assets)
    prompts = runs.Prompts(cfg, task=None)
    lengths = [1, 2, 4, 2, 3, 5, 6, 3]
    batch = data.PromptSet([list(range(3, 3 + k)) for k in lengths],
                           [f"p{i}" for i in range(8)], {"start": list(range(8))})
    per_rank, rows = prompts.split(batch, n=2)
    pad = prompts.tokenizer.pad_token_id
    assert [p.input_ids.shape for p in per_rank] == [(4, 2), (4, 4), (4, 5), (4, 6)]
    for r, part in enumerate(per_rank):
        mine = [lengths[i] for i in (2 * r, 2 * r, 2 * r + 1, 2 * r + 1)]
        assert part.attention_mask.sum(-1).tolist() == mine
        assert (part.attention_mask[:, -1] == 1).all()  # left padding: every prompt ends last
        assert (part.attention_mask.any(0)).all()  # and no column is padding in every row
        for row, ids, mask in zip(mine, part.input_ids, part.attention_mask):
            assert ids[mask.bool()].tolist() == list(range(3, 3 + row))
            assert (ids[~mask.bool()] == pad).all()
        assert rows[r]["texts"] == [f"p{i}" for i in (2 * r, 2 * r, 2 * r + 1, 2 * r + 1)]


def test_chat_messages_go_through_the_template(assets):
    cfg = config(assets, f"data.train_files={assets['chat']}", "data.apply_chat_template=true")
    prompts = data.load_prompts(cfg, data.actor_tokenizer(cfg))
    assert prompts.texts[0].startswith("user : count :")
    assert prompts.texts[0].endswith("assistant : ")


def test_files_of_string_prompts_and_chat_prompts_go_together(assets, tmp_path):
    # Each file is its own table: a string column in one and messages in the other is no
    # reason to refuse them (datasets could not join the two tables: a ValueError traceback).
    cfg = config(assets, f"data.train_files={assets['train']},{assets['chat']}",
                 "data.apply_chat_template=true")
    prompts = data.load_prompts(cfg, data.actor_tokenizer(cfg))
    assert len(prompts) == 48 and len(prompts.columns["start"]) == 48
    assert prompts.texts[:24] == prompts.texts[24:]  # the same prompts, as text and as messages
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"prompt": "count : a", "answer": 1}) + "\n")
    cfg = config(assets, f"data.train_files={assets['train']},{other}")
    with pytest.raises(ConfigError, match=r"^data.train_files: '.*other.jsonl' has the columns "
                                          r"prompt, answer and '.*train.jsonl' prompt, start; "
                                          r"allowed: files with the same columns$"):
        data.load_prompts(cfg, data.actor_tokenizer(cfg))


@pytest.mark.parametrize("column", ["prompts", "responses"])
def test_a_column_named_as_a_reward_functions_argument_is_refused_before_the_run(
        assets, tmp_path, column):
    # A column "prompts" made the reward server answer 500; "responses" failed at step 0 with a
    # TypeError blaming the reward function (the argument passed twice).
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "count : a", column: 1}) + "\n")
    cfg = config(assets, f"data.train_files={rows}")
    with pytest.raises(ConfigError, match=rf"^data.train_files: '.*rows.jsonl' has a column "
                                          rf"'{column}', the name of a reward function's own "
                                          r"argument \(name\(prompts, responses, \*\*columns\)\); "
                                          r"allowed: columns named other than prompts, "
                                          r"responses$"):
        data.load_prompts(cfg, data.actor_tokenizer(cfg))


def test_long_prompts_are_skipped_and_counted(assets, capsys):
    cfg = config(assets, "data.max_prompt_length=5")
    tokenizer = data.actor_tokenizer(cfg)
    prompts = data.load_prompts(cfg, tokenizer)
    assert 0 < prompts.num_skipped < 24 and all(len(i) <= 5 for i in prompts.ids)
    assert f"skipped {prompts.num_skipped} of 24" in capsys.readouterr().out
    # A prompt that fills the shortest context of the run's models leaves no room for a
    # response: skipped and counted too, each kind with its first rows named (from 1).
    every = data.load_prompts(config(assets), tokenizer)
    capsys.readouterr()
    lengths = [len(ids) for ids in every.ids]
    over = [n for n, length in enumerate(lengths, 1) if length > 5]
    filling = [n for n, length in enumerate(lengths, 1) if length == 5]
    assert len(over) > 3 and filling
    prompts = data.load_prompts(cfg, tokenizer, context=(5, "actor's max_position_embeddings"))
    assert all(len(i) < 5 for i in prompts.ids)
    assert prompts.num_skipped == len(over) + len(filling)
    where = f"{str(assets['train'])!r} row"
    named = ", ".join(f"{where} {n}" for n in over[:3])
    assert capsys.readouterr().out == (
        f"[data] data.train_files: skipped {prompts.num_skipped} of 24 prompts: {len(over)} longer "
        f"than data.max_prompt_length=5 tokens ({named} and {len(over) - 3} more); "
        f"{len(filling)} of 5 tokens or more (actor's max_position_embeddings: no room for a "
        f"response) ({', '.join(f'{where} {n}' for n in filling[:3])}"
        f"{f' and {len(filling) - 3} more' if len(filling) > 3 else ''})\n")


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


# A chat template as models ship them: an unknown role is refused with raise_exception().
STRICT_TEMPLATE = ("{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant']"
                   " %}{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
                   "{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
                   "{% if add_generation_prompt %}assistant : {% endif %}")
GOOD = json.dumps({"prompt": "count : a b", "start": "0"}).encode() + b"\n"
CHAT = [{"role": "user", "content": "count : a"}]

# (the bad row, extra keys, the key named, what the line says after naming the row). Before,
# these were a UnicodeDecodeError or jinja2 TemplateError traceback, or "'prompt' holds chat
# messages" for a null or numeric prompt, with a TypeError when that advice was followed.
BAD_ROWS = {
    "not_utf8": (b'{"prompt": "count : \xff\xfe b", "start": "1"}\n', [], "data.train_files",
                 " is not UTF-8 text; allowed: UTF-8 files"),
    "not_utf8_column": (b'{"prompt": "count : b", "start": "\xff"}\n', [], "data.train_files",
                        " is not UTF-8 text; allowed: UTF-8 files"),
    "unknown_role": (json.dumps({"prompt": [{"role": "wizard", "content": "count : a"}],
                                 "start": "1"}).encode() + b"\n",
                     ["data.apply_chat_template=true"], "data.apply_chat_template",
                     ": the chat template refuses its messages (TemplateError: unknown role "
                     "wizard)"),
    "null": (b'{"prompt": null, "start": "1"}\n', [], "data.prompt_key",
             ": 'prompt' is null; allowed: a string, or chat messages with "
             "data.apply_chat_template=true"),
    "null_with_template": (b'{"prompt": null, "start": "1"}\n', ["data.apply_chat_template=true"],
                           "data.prompt_key", ": 'prompt' is null; allowed: a string or a list "
                                              "of chat messages"),
    "number": (b'{"prompt": 7, "start": "1"}\n', [], "data.prompt_key",
               ": 'prompt' is an int (7); allowed: a string"),
    "messages_not_dicts": (b'{"prompt": ["count", "a"], "start": "1"}\n',
                           ["data.apply_chat_template=true"], "data.prompt_key",
                           ": 'prompt' is a list (['count', 'a']); allowed: a string or a list of "
                           "chat messages"),
}


@pytest.mark.parametrize("case", list(BAD_ROWS))
def test_a_bad_prompt_row_is_one_line_naming_the_file_and_the_row(assets, tmp_path, case):
    from rlhf_paro import train

    rows, extra, key, said = BAD_ROWS[case]
    llama = tmp_path / "llama"
    if case == "unknown_role":
        tokenizer = hf_assets.word_tokenizer()
        tokenizer.chat_template = STRICT_TEMPLATE
        hf_assets.save_llama(llama, tokenizer)
        # Chat messages of known roles pass the same template.
        ok = tmp_path / "ok.jsonl"
        ok.write_text(json.dumps({"prompt": CHAT, "start": "0"}) + "\n")
        cfg = load_config([f"actor.path={llama}", f"data.train_files={ok}", *extra])
        assert data.load_prompts(cfg, data.actor_tokenizer(cfg)).texts == [
            "user : count : a assistant : "]
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    good.write_bytes(GOOD * 3)
    bad.write_bytes(GOOD + rows + GOOD)
    argv = [f"actor.path={llama if llama.exists() else assets['llama']}",
            f"reward.function={assets['fns']}:length",
            f"data.train_files={good},{bad}", *extra]
    # Rows are counted from 1 in each file: the bad one is the second row of the second file.
    for split, files in (("train", []), ("val", [f"data.val_files={bad}"])):
        cfg = load_config([*argv, *files])
        if split == "val":
            cfg.data.train_files = str(good)
            key = key.replace("train_files", "val_files")
        with pytest.raises(ConfigError) as info:
            train.prepare(cfg, "ppo_tiny")  # the entry point's checks, before Ray starts
        line = str(info.value)
        assert line.startswith(f"{key}: {str(bad)!r} row 2{said}") and "\n" not in line, line
    assert not ray.is_initialized()


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
        rewards.call_function(usercode.load_function(spec), spec, 7, *args)
    spec = f"{assets['fns']}:short"
    with pytest.raises(rewards.RewardFunctionError, match="at step 3 returned 1 values for 2"):
        rewards.call_function(usercode.load_function(spec), spec, 3, *args)
    spec = f"{assets['fns']}:length"
    out = rewards.call_function(usercode.load_function(spec), spec, 1, *args)
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
    ids, prompt_mask = data.left_pad(prompts, tokenizer.pad_token_id)
    rollout = join(PromptBatch(ids, prompt_mask), responses, tokenizer.eos_token_id)
    seq, attn, mask = rollout.sequences, rollout.attention_mask, rollout.action_mask
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
