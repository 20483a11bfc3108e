"""The counting task: tokenizer, prompts, ground-truth score, preference pairs."""

import pytest
import torch

from rlhf_paro.ppo.task import CountingTask


@pytest.fixture(scope="module")
def task():
    return CountingTask(num_symbols=16, prompt_len=4, response_len=8)


def ids(task, text):
    return torch.tensor([task.tokenizer.encode(text)])


def test_tokenizer_round_trip(task):
    tok = task.tokenizer
    assert tok.vocab_size == 3 + 16
    assert tok.decode(tok.encode("<bos> a b p <eos>")) == "<bos> a b p <eos>"
    with pytest.raises(ValueError, match="'z'"):
        tok.encode("a z")


def test_prompts_are_seeded_runs_of_consecutive_symbols(task):
    gen = torch.Generator().manual_seed(0)
    prompts = task.sample_prompts(64, gen)
    assert prompts.shape == (64, 4)
    assert (prompts[:, 0] == task.tokenizer.bos_token_id).all()
    # Each symbol is the successor of the one before it, wrapping from p back to a.
    assert (prompts[:, 2:] == task._successor(prompts[:, 1:-1])).all()
    assert torch.equal(prompts, task.sample_prompts(64, torch.Generator().manual_seed(0)))
    assert len({tuple(p.tolist()) for p in prompts}) > 8


def test_score_hand_values(task):
    prompt = ids(task, "<bos> n o p")
    # Perfect continuation wraps p -> a: 8/8.
    assert task.score(prompt, ids(task, "a b c d e f g h")).item() == 1.0
    # A wrong symbol costs its own slot only: k (not c), then l m n o p count on from k: 7/8.
    assert task.score(prompt, ids(task, "a b k l m n o p")).item() == 7 / 8
    # Stopping early: a b c are right, <eos> is not, the padding after it counts for nothing.
    assert task.score(prompt, ids(task, "a b c <eos> <pad> <pad> <pad> <pad>")).item() == 3 / 8
    # Repeating the last symbol is never right.
    assert task.score(prompt, ids(task, "p p p p p p p p")).item() == 0.0


def test_random_policy_scores_low_and_pairs_are_ordered(task):
    gen = torch.Generator().manual_seed(1)
    prompts = task.sample_prompts(4000, gen)
    uniform = torch.randint(3, 19, (4000, 8), generator=gen)
    assert task.score(prompts, uniform).mean().item() == pytest.approx(1 / 16, abs=0.01)
    pairs = task.preference_pairs(500, seed=0)
    assert pairs.chosen.shape == (500, 8)
    margin = task.score(pairs.prompts, pairs.chosen) - task.score(pairs.prompts, pairs.rejected)
    assert (margin > 0).all()
    # Mixed-quality responses cover the whole range the policy will go through.
    scores = task.score(pairs.prompts, pairs.chosen)
    assert scores.min() < 0.2 and scores.max() == 1.0

