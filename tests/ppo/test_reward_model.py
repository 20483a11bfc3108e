"""The task's reward model: trained on preference pairs, ranks held-out pairs, cached."""

import pytest

from rlhf_paro.config import load_config
from rlhf_paro.models import build_model
from rlhf_paro.ppo import reward_model
from rlhf_paro.ppo.task import task_from_config


@pytest.mark.slow
def test_reward_model_ranks_held_out_pairs_and_is_cached(tmp_path):
    cfg = load_config([f"task.cache_dir={tmp_path}", "task.reward_steps=150",
                       "task.reward_pairs=2048", "task.reward_eval_pairs=256"])
    trained = reward_model.train_reward_model(cfg)
    assert not trained.cached
    assert trained.accuracy >= 0.85
    again = reward_model.train_reward_model(cfg)
    assert again.cached and again.path == trained.path
    assert [p.name for p in tmp_path.iterdir()] == [trained.path.name]  # no scratch left behind

    # The model the trainer builds from the cache is the one that was measured.
    reward_cfg = reward_model.reward_model_config(cfg)
    assert reward_cfg.path == str(trained.path) and reward_cfg.strategy == cfg.reward.strategy
    model = build_model("reward", reward_cfg, task_from_config(cfg).tokenizer.vocab_size)
    held_out = task_from_config(cfg).preference_pairs(256, seed=2)
    assert reward_model.pairwise_accuracy(model, held_out) == trained.accuracy

    # A different task is a different model.
    other = load_config([f"task.cache_dir={tmp_path}", "task.num_symbols=8"])
    assert reward_model.reward_cache_key(other) != reward_model.reward_cache_key(cfg)
