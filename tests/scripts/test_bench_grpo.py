"""scripts/bench_grpo.py --episodes: the two contenders run the same episodes. Given the same
actions, TRL's side (``trl_rollout``, its ``rollout_func``) builds every episode's prompt,
actions, observations, action mask and score exactly as rlhf_paro's ``episodes.run`` does, so a
timing compares the same work; and the environment is the deterministic game the docstring says."""

from __future__ import annotations

import contextlib
import importlib.util
from pathlib import Path

import pytest
import torch

from rlhf_paro.envs import EnvRunner, Observations
from rlhf_paro.ppo import demo
from rlhf_paro.ppo.task import CountingTask, SymbolTokenizer
from rlhf_paro.rollout import episodes
from rlhf_paro.rollout.base import Sampling
from rlhf_paro.rollout.batch import PromptBatch, join

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_grpo", ROOT / "scripts" / "bench_grpo.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

NEW_TOKENS = 7
EOS, PAD = SymbolTokenizer.eos_token_id, SymbolTokenizer.pad_token_id


def policy(context: list[int]) -> list[int]:
    """A scripted policy, a pure function of the context's ids: 1 to 5 symbols then <eos>, or
    NEW_TOKENS symbols cut by the budget (no <eos>). A side that feeds a turn anything else
    than the exact ids of the episode so far gets other actions, and the episodes differ."""
    seed = sum((k + 1) * t for k, t in enumerate(context))
    if seed % 4 == 0:
        n, end = NEW_TOKENS, []
    else:
        n, end = 1 + seed % 5, [EOS]
    return [SymbolTokenizer.num_special + (seed * 7 + 3 * k) % bench.SYMBOLS
            for k in range(n)] + end


class Scripted:
    """A rollout engine that answers each left-padded context with ``policy``'s action."""

    eos_token_id = EOS

    def turns(self):
        return contextlib.nullcontext()

    def generate(self, prompts: PromptBatch, sampling: Sampling):
        actions = [policy(ids[mask.bool()].tolist())
                   for ids, mask in zip(prompts.input_ids, prompts.attention_mask)]
        responses = torch.full((len(actions), max(map(len, actions))), PAD)
        for row, action in enumerate(actions):
            responses[row, :len(action)] = torch.tensor(action)
        return join(prompts, responses, EOS, torch.full(responses.shape, -1.0))


@pytest.fixture(scope="module")
def tokenizer():
    return demo.make_tokenizer(CountingTask(num_symbols=bench.SYMBOLS))


PROMPTS = ["a b c d e f", "q r s t u v", "A B C D E F", "x y z E F G", "f e d c b a"]


def test_trl_rollout_builds_rlhf_paros_episodes_token_for_token(tokenizer):
    turns = 3
    actions: list[list[int]] = []

    def generate(contexts):
        actions.extend(policy(c) for c in contexts)
        return actions[-len(contexts):]

    trl = bench.trl_rollout(PROMPTS, generate, tokenizer, turns)
    runner = EnvRunner(bench.Recall, "Recall", num_workers=2, timeout_s=60.0)
    try:
        ours, stats = episodes.run(
            Scripted(), PromptBatch.left_padded([tokenizer(p)["input_ids"] for p in PROMPTS],
                                                PAD),
            [{"prompt": p, "turns": turns} for p in PROMPTS], [0] * len(PROMPTS), runner,
            Observations(tokenizer, chat=False),
            lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
            Sampling(NEW_TOKENS), episodes.Budget(turns, 10_000), PAD, lambda i: f"sample {i}")
    finally:
        runner.close()
    assert stats.total["turns"] == turns * len(PROMPTS)
    for i in range(len(PROMPTS)):
        prompt = ours.prompts[i][ours.attention_mask[i, :ours.prompts.shape[1]].bool()]
        real = ours.response_attention[i].bool()
        assert prompt.tolist() == trl["prompt_ids"][i]
        assert ours.responses[i][real].tolist() == trl["completion_ids"][i]
        assert ours.action_mask[i][real].long().tolist() == trl["env_mask"][i]
        # The same rewards summed in the same order (ours held in float32).
        assert float(ours.scores[i]) == pytest.approx(trl["episode_score"][i], abs=1e-7)
    # Observations, actions ended by <eos> and actions cut by the budget all occur.
    assert 0 in [m for row in trl["env_mask"] for m in row]
    assert {EOS in a for a in actions} == {True, False}


def test_recall_rewards_lowercase_and_answers_with_the_prompts_missed_symbols():
    env = bench.Recall(prompt="a b c D E F", turns=2)
    assert env.reset() is None
    # 2 of the 4 symbols are lowercase: 2/4 of the turn's 1/2.
    assert env.step("a X b Y") == ("c D E", 0.25, False)
    # 1 of 4 lowercase; all the prompt's symbols said: the answer is its first three again.
    assert env.step("c D E F") == ("a b c", 0.125, True)
    assert bench.Recall(prompt="a b", turns=3).step("")[1] == 0.0  # an empty action scores 0
