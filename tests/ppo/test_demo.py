"""The default run's assets: made once through the same files a user brings, then cached."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from rlhf_paro.config import ModelConfig
from rlhf_paro.models import build_model
from rlhf_paro import usercode
from rlhf_paro.ppo import data, demo
from rlhf_paro.ppo.task import CountingTask, task_from_config
from tests.confs import load

# Smaller than the conf's, so the test makes its own demo in seconds.
SMALL = ["task.sft_steps=20", "task.reward_steps=150", "task.reward_pairs=2048",
         "task.reward_eval_pairs=256", "task.train_prompts=32", "task.val_prompts=8"]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    cfg = load([f"task.cache_dir={cache}", *SMALL])
    return cfg, cache


def test_the_conf_points_at_the_demo_through_the_users_keys_and_it_is_cached(made):
    cfg, cache = made
    entries = [p for p in cache.iterdir()]
    assert len(entries) == 1 and entries[0].name.startswith("demo-")  # no scratch left behind
    root = entries[0]
    assert cfg.actor.path == str(root / "actor") and cfg.reward.path == str(root / "reward")
    assert cfg.data.train_files == str(root / "train.jsonl")
    assert cfg.data.val_files == str(root / "val.jsonl")
    assert cfg.reward.score_function.endswith("task.py:counting_score")
    # ref is the SFT'd actor; the critic starts from the reward model (same tokenizer).
    assert cfg.ref.path == cfg.actor.path
    assert cfg.critic.path == cfg.reward.path
    stamp = (root / "meta.json").stat().st_mtime_ns
    again = load([f"task.cache_dir={cache}", *SMALL])
    assert again.actor.path == cfg.actor.path and (root / "meta.json").stat().st_mtime_ns == stamp
    # Another task, model or response length is another demo.
    key = demo.cache_key(cfg.task, cfg.ppo.max_new_tokens)
    assert key != demo.cache_key(dataclasses.replace(cfg.task, num_symbols=8), 8)
    assert key != demo.cache_key(cfg.task, cfg.ppo.max_new_tokens + 1)
    assert key == demo.cache_key(dataclasses.replace(cfg.task, cache_dir="elsewhere"),
                                 cfg.ppo.max_new_tokens)


def test_the_tokenizer_speaks_the_tasks_ids(made):
    cfg, _ = made
    tokenizer = data.actor_tokenizer(cfg)
    task = task_from_config(cfg)
    prompts = task.sample_prompts(8, torch.Generator().manual_seed(0))
    for row in prompts:
        # The file holds the symbols; the tokenizer adds <bos> as the task's prompts have it.
        assert tokenizer(task.tokenizer.decode(row[1:]))["input_ids"] == row.tolist()
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id) == (0, 2)
    rows = [json.loads(line) for line in open(cfg.data.train_files)]
    assert len(rows) == 32 and set(rows[0]) == {"prompt", "num_symbols", "response_len"}


def test_counting_score_on_text_equals_the_tasks_score_on_ids():
    task = CountingTask(num_symbols=16, prompt_len=4, response_len=8)
    generator = torch.Generator().manual_seed(4)
    prompts = task.sample_prompts(64, generator)
    responses = task.sample_responses(prompts, generator)  # mixed skill, some end with <eos>
    tok = task.tokenizer
    texts = [tok.decode(p[1:]) for p in prompts]
    decoded = [tok.decode([i for i in r.tolist() if i >= tok.num_special]) for r in responses]
    fn = usercode.load_function(demo.SCORE_FUNCTION)
    got = fn(texts, decoded, num_symbols=[16] * 64, response_len=[8] * 64)
    assert got == task.score(prompts, responses).tolist()
    assert max(got) > 0  # the sample is not degenerate


def test_the_reward_model_is_a_sequence_classifier_that_ranks_held_out_pairs(made):
    cfg, _ = made
    from transformers import AutoModelForSequenceClassification

    meta = json.loads((Path(cfg.reward.path).parent / "meta.json").read_text())
    assert meta["reward_accuracy"] >= 0.85
    task = task_from_config(cfg)
    vocab = data.vocab_sizes(cfg)["reward"]
    ours = build_model("reward", ModelConfig(path=cfg.reward.path), vocab)
    held_out = task.preference_pairs(cfg.task.reward_eval_pairs, seed=2)
    # What the run builds from the directory is what was measured.
    assert demo.pairwise_accuracy(ours, held_out) == meta["reward_accuracy"]
    # transformers reads the same scores (right padding; its score is at the last non-pad).
    hf = AutoModelForSequenceClassification.from_pretrained(cfg.reward.path).eval()
    prompts = held_out.prompts[:16]
    ids = torch.cat([prompts, held_out.chosen[:16]], dim=1)
    mask = (ids != 0).long()
    with torch.no_grad():
        theirs = hf(input_ids=ids, attention_mask=mask).logits[:, 0]
    # Same weights and the same fp32 operations in another order: a few ulps of the O(1) scores
    # after two blocks of 64-wide sums, far inside 1e-5.
    torch.testing.assert_close(ours(ids, mask), theirs, rtol=1e-5, atol=1e-5)


def test_the_sft_actor_counts_some_of_the_time(made):
    cfg, _ = made
    meta = json.loads((Path(cfg.actor.path).parent / "meta.json").read_text())
    # A random policy scores about 1/16; the demonstrations average about 0.5.
    assert 0.15 < meta["sft_sampled_score"] < 0.9
