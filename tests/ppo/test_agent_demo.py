"""The multi-turn demo's assets (``ppo/demo.py``, ``conf/grpo_agent_tiny.yaml``): a cache entry
of their own, the single-turn demo's left as it was, and an SFT on the very tokens a run's
episodes hold."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import random

import pytest
import torch

from rlhf_paro.config import TaskConfig
from rlhf_paro.envs import EnvRunner, Observations, guess
from rlhf_paro import usercode
from rlhf_paro.ppo import demo
from rlhf_paro.ppo.task import CountingTask
from rlhf_paro.rollout import episodes
from rlhf_paro.rollout.base import Sampling
from rlhf_paro.rollout.batch import PromptBatch, join
from tests.confs import load

# Smaller than the conf's, so the test makes its own agent in seconds.
SMALL = ["conf=grpo_agent_tiny", "task.sft_steps=10", "task.train_prompts=32",
         "task.val_prompts=8", "task.model.hidden_size=32", "task.model.intermediate_size=64"]


def _tokenizer():
    return demo.make_tokenizer(CountingTask(16, 4, 1), demo._AGENT_WORDS)


def test_the_single_turn_demos_cache_key_is_the_one_its_cache_was_made_under():
    # The key of the default run's assets before the multi-turn demo existed: a cache made then
    # is still found, not made again.
    assert demo.cache_key(TaskConfig(), 8) == "78f4c9ddad765f5a"


def test_the_agents_cache_key_follows_what_its_assets_depend_on():
    task = TaskConfig()
    key = demo.agent_cache_key(task, 5)
    assert key != demo.agent_cache_key(task, 4)  # the demonstrations' turns
    for change in ({"num_symbols": 8}, {"sft_steps": 61}, {"sft_lr": 1e-3},
                   {"model": {**task.model, "hidden_size": 32}}, {"train_prompts": 7}):
        assert key != demo.agent_cache_key(dataclasses.replace(task, **change), 5), change
    # The reward model's training, the counting prompts' length and the cache's place are not.
    for change in ({"reward_steps": 1}, {"reward_pairs": 8}, {"prompt_len": 3},
                   {"cache_dir": "elsewhere"}):
        assert key == demo.agent_cache_key(dataclasses.replace(task, **change), 5), change


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    return load([*SMALL, f"task.cache_dir={cache}"]), cache


def test_the_conf_makes_the_agents_assets_alone_and_points_the_users_keys_at_them(made):
    cfg, cache = made
    # One entry, the agent's: the single-turn demo's actor and reward model are not made.
    entries = sorted(p.name for p in cache.iterdir())
    assert len(entries) == 1 and entries[0] == f"agent-{demo.agent_cache_key(cfg.task, 5)}"
    root = cache / entries[0]
    assert cfg.actor.path == cfg.ref.path == str(root / "actor")
    assert (cfg.data.train_files, cfg.data.val_files) == (str(root / "train.jsonl"),
                                                          str(root / "val.jsonl"))
    assert cfg.env.function == demo.GUESS_ENV and cfg.env.max_turns == 5
    # The environment's score is the reward: no model, function or server scores episodes.
    assert cfg.env_scores and cfg.reward.env_score and not cfg.reward.runs_model
    assert cfg.reward.score_function is None  # the environment's score is the reward
    rows = [json.loads(line) for line in open(cfg.data.train_files)]
    assert len(rows) == 32 and {tuple(sorted(r)) for r in rows} == {
        ("num_symbols", "prompt", "secret")}
    assert len({r["secret"] for r in rows}) > 8  # hidden symbols drawn over the alphabet
    game = usercode.load_function(cfg.env.function, "env.function")(**rows[0])
    assert game.step(rows[0]["secret"]) == (None, 1.0, True)
    meta = json.loads((root / "meta.json").read_text())
    assert set(meta) == {"key", "sft_steps", "sft_win_rate"} and 0 <= meta["sft_win_rate"] <= 1


def test_the_tokenizer_holds_the_games_words_as_single_tokens_after_the_counting_ids():
    tok = _tokenizer()
    counting = demo.make_tokenizer(CountingTask(16, 4, 1))
    # The symbols keep their counting-task ids; the words follow, <unk> last.
    assert tok("a p")["input_ids"] == counting("a p")["input_ids"] == [1, 3, 18]
    assert tok(guess.PROMPT)["input_ids"] == [1, 19]
    assert [tok(w, add_special_tokens=False)["input_ids"] for w in (guess.HIGHER, guess.LOWER)
            ] == [[20], [21]]
    assert len(tok) == 23 and tok.convert_ids_to_tokens(22) == "<unk>"


class _Bisector:
    """A rollout engine whose policy is bisection read off each context's tokens: the symbols
    the observations leave, their middle guessed, then <eos> (``guess.demonstration``'s
    ``bisect``)."""

    def __init__(self, tok) -> None:
        self.tok = tok
        self.eos_token_id = tok.eos_token_id
        self.symbols = guess.alphabet(16)

    def guess(self, context: list[int]) -> str:
        words = self.tok.convert_ids_to_tokens(context)
        low, high = 0, 15
        for k, word in enumerate(words):
            if word in (guess.HIGHER, guess.LOWER):
                index = self.symbols.index(words[k - 2])  # the guess, then <eos>, then this
                low, high = (index + 1, high) if word == guess.HIGHER else (low, index - 1)
        return self.symbols[(low + high) // 2]

    def generate(self, prompts: PromptBatch, sampling: Sampling):
        actions = [[*self.tok(self.guess(ids[mask.bool()].tolist()),
                              add_special_tokens=False)["input_ids"], self.tok.eos_token_id]
                   for ids, mask in zip(prompts.input_ids, prompts.attention_mask)]
        return join(prompts, torch.tensor(actions), self.tok.eos_token_id)

    def turns(self):
        return contextlib.nullcontext()


@pytest.mark.parametrize("max_turns", [5, 3])
def test_the_sfts_episodes_are_token_for_token_those_a_run_assembles(max_turns):
    # The same games through the run's episode loop (the engine's actions, the environment's
    # observations as envs.Observations encodes them) and as the SFT writes them: equal ids and
    # equal action masks, for every secret; 3 turns cut some games short.
    tok = _tokenizer()
    secrets = guess.alphabet(16)
    rows = [{"prompt": guess.PROMPT, "secret": s, "num_symbols": 16} for s in secrets]
    prompts = PromptBatch.left_padded([tok(guess.PROMPT)["input_ids"]] * 16, tok.pad_token_id)
    runner = EnvRunner(guess.GuessEnv, "GuessEnv", 2, 60.0)
    try:
        batch, stats = episodes.run(
            _Bisector(tok), prompts, rows, list(range(16)), runner, Observations(tok, False),
            lambda ids: tok.decode(ids, skip_special_tokens=True), Sampling(2, greedy=True),
            episodes.Budget(max_turns, 64), tok.pad_token_id, str)
    finally:
        runner.close()
    game = demo._GameTokens(tok, 16)
    width = batch.response_len
    for row, secret in enumerate(secrets):
        turns, score = guess.demonstration(secret, 16, max_turns, "bisect", random.Random(0))
        ids, actions = game.episode(turns)
        real = batch.attention_mask[row].bool()
        assert batch.sequences[row][real].tolist() == ids, secret
        prompt_len = int(real.sum()) - int(batch.attention_mask[row, -width:].sum())
        got = [0.0] * prompt_len + batch.action_mask[row][batch.attention_mask[row, -width:]
                                                          .bool()].tolist()
        assert got == actions, secret
        assert batch.scores[row].item() == score
    # 1 + 2 + 4 = 7 secrets are found within 3 guesses, all 16 within 5.
    assert stats.total["truncated_max_turns"] == (0 if max_turns == 5 else 9)


class _Scripted(torch.nn.Module):
    """Logits of a fixed policy for ``demo.play``: ``first`` (a token id) as a turn's first
    token, then <eos>."""

    def __init__(self, vocab: int, first: int, eos: int) -> None:
        super().__init__()
        self.vocab, self.first, self.eos = vocab, first, eos

    def forward(self, ids, mask):
        logits = torch.full((*ids.shape, self.vocab), -1e9)
        # After a symbol comes <eos>; anywhere else the policy's first token.
        symbol = (ids >= 3) & (ids < 19)
        logits[..., self.first] = torch.where(symbol, -1e9, 0.0)
        logits[..., self.eos] = logits[..., self.eos].maximum(torch.where(symbol, 0.0, -1e9))
        return logits


def test_play_counts_wins_as_a_run_scores_its_episodes():
    tok = _tokenizer()
    a = tok("a", add_special_tokens=False)["input_ids"][0]
    games, seed = 512, 3
    rng = random.Random(seed)  # play draws the secrets first, from its seed
    secrets = [rng.choice(guess.alphabet(16)) for _ in range(games)]
    # Always "a": it wins exactly the games whose secret is a (on the first turn).
    always_a = _Scripted(len(tok), a, tok.eos_token_id)
    assert demo.play(always_a, tok, 16, 5, games, seed) == secrets.count("a") / games > 0
    # <eos> first: an empty action forfeits every game.
    silent = _Scripted(len(tok), tok.eos_token_id, tok.eos_token_id)
    assert demo.play(silent, tok, 16, 5, games, seed) == 0.0


# -- the Blackjack demo (conf/grpo_blackjack_tiny.yaml) -----------------------------------------

BLACKJACK_SMALL = ["conf=grpo_blackjack_tiny", "task.sft_steps=10", "task.train_prompts=32",
                   "task.val_prompts=8", "task.model.hidden_size=32",
                   "task.model.intermediate_size=64"]


def _blackjack_tokenizer():
    pytest.importorskip("gymnasium")
    return demo.make_tokenizer(CountingTask(16, 4, 1), demo._blackjack_words())


def test_the_blackjack_tokenizer_writes_every_hand_and_answer_without_unknown_words():
    # A word missing from the vocabulary (a total, the ace's wording) would reach the actor as
    # <unk>: every description the game can give, the prompt and the answers are known words.
    tok = _blackjack_tokenizer()
    env = usercode.load_function(demo.BLACKJACK_ENV, "env.function")()
    # A usable ace counts 11: a total of 12 or more.
    texts = [env.describe((total, dealer, ace)) for total in range(4, 22)
             for dealer in range(1, 11) for ace in (False, True) if total >= 12 or not ace]
    for text in [demo.BLACKJACK_PROMPT, *texts]:
        assert tok.unk_token_id not in tok(text)["input_ids"], text
    assert [len(tok(a, add_special_tokens=False)["input_ids"]) for a in demo.BLACKJACK_ANSWERS
            ] == [1, 1]
    # The guessing game's key is the one its caches were made under; Blackjack's is apart.
    task = TaskConfig()
    assert demo.agent_cache_key(task, 6, "blackjack") != demo.agent_cache_key(task, 6)


class _Answering:
    """A rollout engine that answers every hand with ``word`` and <eos>."""

    def __init__(self, tok, word: str) -> None:
        self.action = [*tok(word, add_special_tokens=False)["input_ids"], tok.eos_token_id]
        self.tok = tok
        self.eos_token_id = tok.eos_token_id

    def generate(self, prompts: PromptBatch, sampling: Sampling):
        actions = torch.tensor([self.action] * prompts.input_ids.shape[0])
        return join(prompts, actions, self.tok.eos_token_id)

    def turns(self):
        return contextlib.nullcontext()


@pytest.mark.parametrize("word", ["hit", "stick"])
def test_the_blackjack_sfts_episodes_are_token_for_token_those_a_run_assembles(word):
    # Games dealt from the same seeds, played through the run's episode loop and as the SFT
    # writes them: equal ids, action masks and scores ("hit" plays several turns of hands).
    tok = _blackjack_tokenizer()
    games, max_turns = 16, 6
    prompts = PromptBatch.left_padded([tok(demo.BLACKJACK_PROMPT)["input_ids"]] * games,
                                      tok.pad_token_id)
    factory = usercode.load_function(demo.BLACKJACK_ENV, "env.function")
    runner = EnvRunner(factory, "Blackjack", 2, 60.0)
    try:
        batch, stats = episodes.run(
            _Answering(tok, word), prompts, [{"prompt": demo.BLACKJACK_PROMPT}] * games,
            list(range(games)), runner, Observations(tok, False),
            lambda ids: tok.decode(ids, skip_special_tokens=True), Sampling(2, greedy=True),
            episodes.Budget(max_turns, 128), tok.pad_token_id, str)
    finally:
        runner.close()
    width = batch.response_len
    for row in range(games):
        ids, actions, score = demo._blackjack_episode(factory(), tok, max_turns, row,
                                                      lambda: word)
        real = batch.attention_mask[row].bool()
        assert batch.sequences[row][real].tolist() == ids, row
        responded = batch.attention_mask[row, -width:].bool()
        prompt_len = int(real.sum()) - int(responded.sum())
        assert [0.0] * prompt_len + batch.action_mask[row][responded].tolist() == actions, row
        assert batch.scores[row].item() == score
    assert stats.total["turns"] > games if word == "hit" else stats.total["turns"] == games


def test_the_blackjack_conf_makes_its_own_assets_and_points_the_users_keys_at_them(tmp_path):
    pytest.importorskip("gymnasium")
    cfg = load([*BLACKJACK_SMALL, f"task.cache_dir={tmp_path}"])
    entries = sorted(p.name for p in tmp_path.iterdir())
    assert entries == [f"blackjack-{demo.agent_cache_key(cfg.task, 6, 'blackjack')}"]
    root = tmp_path / entries[0]
    assert cfg.actor.path == cfg.ref.path == str(root / "actor")
    assert cfg.env.function == demo.BLACKJACK_ENV and cfg.env.max_turns == 6
    assert cfg.env_scores and cfg.reward.env_score and not cfg.reward.runs_model
    rows = [json.loads(line) for line in open(cfg.data.train_files)]
    assert rows == [{"prompt": demo.BLACKJACK_PROMPT}] * 32
    meta = json.loads((root / "meta.json").read_text())
    assert set(meta) == {"key", "sft_steps", "sft_hit_prob", "sft_answer_prob", "sft_eos_prob",
                         "random_policy_score"}
    # 256 games of random answers: a score's spread is at most 1, so the mean is within 0.25
    # (4 standard errors of 1/16) of the random policy's -0.40 (20,000 games).
    assert abs(meta["random_policy_score"] + 0.40) < 0.25
