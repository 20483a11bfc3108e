"""A new user's run on real Ray: their Hugging Face models, tokenizers, prompt files and reward.

One Ray session for PPO runs of 2 steps on 2 CPU devices, each model with its own strategy: a
Llama with chat-message prompts, a reward function and evaluation; a GPT-2 (byte-level BPE, no
pad token) scored by a Llama sequence classifier of another tokenizer, exported every step; and
a reward function that raises, which stops the run in one line.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
import torch

from rlhf_paro.actors.group import init_ray
from rlhf_paro.metrics import read_jsonl
from tests.confs import load
from tests import hf_assets

pytestmark = [pytest.mark.ray, pytest.mark.slow]

N = 2
COMMON = [f"cluster.num_devices={N}", "cluster.group_size=1", "ppo.rollout_batch_size=8",
          "ppo.mini_batch_size=4", "actor.micro_batch_size=2", "critic.micro_batch_size=2",
          "trainer.steps=2", "logger.wandb.mode=disabled", "logger.progress=false"]


def run(argv):
    from rlhf_paro.trainer import PPOTrainer

    cfg = load(argv)
    trainer = PPOTrainer(cfg)
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    return cfg, read_jsonl(f"{cfg.trainer.output_dir}/metrics.jsonl")


def stopped(argv):
    """The one line a run that stops early ends with."""
    from rlhf_paro.trainer import PPOTrainer, RunError

    trainer = PPOTrainer(load(argv))
    try:
        trainer.fit()
    except RunError as err:
        return str(err)
    finally:
        trainer.shutdown()
    return None


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("own")
    word, bpe = hf_assets.word_tokenizer(), hf_assets.bpe_tokenizer()
    llama = hf_assets.save_llama(root / "llama", word)
    gpt2 = hf_assets.save_gpt2(root / "gpt2", bpe)
    rm = hf_assets.save_reward(root / "rm", word)
    chat = hf_assets.write_prompts(root / "chat.jsonl", 32, chat=True)
    val = hf_assets.write_prompts(root / "val.jsonl", 6, chat=True, seed=1)
    plain = hf_assets.write_prompts(root / "train.jsonl", 32)
    fns = hf_assets.write_reward_functions(root / "fns.py")
    init_ray(None, num_cpus=N, num_devices=N)
    out = {}
    out["llama"] = run([
        *COMMON, f"actor.path={llama}", f"reward.function={fns}:length",
        f"data.train_files={chat}", f"data.val_files={val}", "data.apply_chat_template=true",
        "trainer.eval_every=1", "actor.strategy=IGG", "critic.strategy=III", "ref.strategy=G",
        f"trainer.output_dir={root / 'run_llama'}"])
    out["gpt2"] = run([
        *COMMON, f"actor.path={gpt2}", f"critic.path={gpt2}", f"reward.path={rm}",
        f"data.train_files={plain}", "trainer.export_every=1", "actor.strategy=GGG",
        "critic.strategy=NNG", "ref.strategy=I", "reward.strategy=G",
        f"trainer.output_dir={root / 'run_gpt2'}"])
    out["broken"] = stopped([
        *COMMON, f"actor.path={llama}", f"reward.function={fns}:broken",
        f"data.train_files={plain}", f"trainer.output_dir={root / 'run_broken'}"])
    yield out
    ray.shutdown()


def test_llama_with_chat_prompts_a_reward_function_and_evaluation(runs):
    cfg, rows = runs["llama"]
    assert len(rows) == 2
    for row in rows:
        # The reward is the response length / 8 in words: in [0, 1]. No score function: no task
        # score (it was logged as one, the reward again).
        assert 0.0 <= row["ppo/reward_mean"] <= 1.0
        assert "ppo/task_score" not in row
        assert 0.0 <= row["eval/reward_mean"] <= 1.0 and "eval/score_mean" in row
    assert abs(rows[0]["ppo/kl"]) < 1e-4  # ref is the actor's path: the first KL is zero
    assert Path(cfg.trainer.output_dir, "hf", "actor", "model.safetensors").is_file()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(cfg.trainer.output_dir + "/hf/actor")
    AutoTokenizer.from_pretrained(cfg.trainer.output_dir + "/hf/actor")


def test_gpt2_scored_by_a_classifier_of_another_tokenizer_and_exported_every_step(runs):

    from transformers import AutoModelForCausalLM

    cfg, rows = runs["gpt2"]
    assert len(rows) == 2 and all(torch.isfinite(torch.tensor(r["ppo/reward_mean"]))
                                  for r in rows)
    out = Path(cfg.trainer.output_dir) / "hf"
    for step in (1, 2):
        assert (out / f"step_{step}" / "actor" / "model.safetensors").is_file()
    assert (out / "critic" / "value_head.safetensors").is_file()
    final = AutoModelForCausalLM.from_pretrained(out / "actor")
    last = AutoModelForCausalLM.from_pretrained(out / "step_2" / "actor")
    for a, b in zip(final.state_dict().values(), last.state_dict().values()):
        torch.testing.assert_close(a, b)
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # no partial export


def test_a_reward_function_that_raises_stops_the_run_in_one_line_naming_it_and_the_step(runs):
    message = runs["broken"]
    assert message is not None and "\n" not in message
    assert "reward function " in message and "fns.py:broken at step 0 raised ValueError" in message
