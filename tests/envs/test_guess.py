"""The multi-turn demo's game (``envs/guess.py``): its rules, and the scripted guessers whose
games the demo's agent is fine-tuned on."""

from __future__ import annotations

import math
import random
from functools import lru_cache

import pytest

from rlhf_paro.envs import check_step
from rlhf_paro.envs.guess import HIGHER, LOWER, PROMPT, GuessEnv, alphabet, demonstration
from rlhf_paro.ppo.task import SymbolTokenizer


def _game(secret: str, num_symbols: int = 16) -> GuessEnv:
    env = GuessEnv(prompt=PROMPT, secret=secret, num_symbols=num_symbols)
    assert env.reset() is None  # the prompt alone starts the game
    return env


def test_a_wrong_guess_says_where_the_secret_lies_and_a_right_one_wins():
    env = _game("f")
    steps = [env.step("c"), env.step("k"), env.step("f")]
    assert steps == [(HIGHER, 0.0, False), (LOWER, 0.0, False), (None, 1.0, True)]
    for value in steps:  # what the runner accepts from any environment
        assert tuple(check_step(value, "GuessEnv", "here")) == value
    assert env.guesses == 3


@pytest.mark.parametrize("action", ["", "f g", "higher", "q", "F", "<eos>"])
def test_anything_but_one_symbol_of_the_alphabet_forfeits(action):
    # q is the 17th symbol: outside an alphabet of 16. The secret is never guessed by these.
    assert _game("f").step(action) == (None, 0.0, True)


def test_an_action_is_read_as_the_model_decodes_it():
    # Decoded turns may carry the tokenizer's spacing around the symbol.
    assert _game("f").step(" f ") == (None, 1.0, True)


def test_the_alphabet_is_the_counting_tasks_in_order_and_the_secret_must_be_in_it():
    assert alphabet(16) == SymbolTokenizer(16).symbols == list("abcdefghijklmnop")
    # Past the 52 letters, named symbols, as the task's tokenizer names them.
    assert alphabet(54) == SymbolTokenizer(54).symbols and alphabet(54)[50:] == [
        "Y", "Z", "s52", "s53"]
    with pytest.raises(ValueError, match="secret 'q' is not one of the 16 symbols a..p"):
        GuessEnv(prompt=PROMPT, secret="q", num_symbols=16)


def test_bisection_wins_every_game_of_16_within_5_guesses_and_not_within_4():
    rng = random.Random(0)  # unused by bisection
    played = {s: demonstration(s, 16, 5, "bisect", rng) for s in alphabet(16)}
    assert all(score == 1.0 for _, score in played.values())
    # 1 + 2 + 4 + 8 = 15 symbols are reached within 4 guesses: exactly one needs a fifth.
    assert sorted(len(turns) for turns, _ in played.values()) == [1, 2, 2, 3, 3, 3, 3,
                                                                   *[4] * 8, 5]
    assert sum(demonstration(s, 16, 4, "bisect", rng)[1] for s in alphabet(16)) == 15


@pytest.mark.parametrize("skill", ["random", "consistent", "bisect"])
def test_a_demonstration_is_a_game_the_environment_plays_back(skill):
    rng = random.Random(1)
    for _ in range(200):
        secret = rng.choice(alphabet(16))
        turns, score = demonstration(secret, 16, 5, skill, rng)
        env, replayed = _game(secret), 0.0
        for k, (action, observation) in enumerate(turns):
            obs, reward, done = env.step(action)
            replayed += reward
            last = k == len(turns) - 1
            # The last turn shows no observation: the game or its turns are over.
            assert observation == (None if last else obs)
            # Only a win ends a game of these guessers; a lost one runs out of turns.
            assert done == (last and score == 1.0)
        assert replayed == score and 1 <= len(turns) <= 5


@lru_cache(maxsize=None)
def _consistent_win(n: int, turns: int) -> float:
    """Probability that uniform guesses among the n symbols the feedback leaves find a secret
    uniform among them within ``turns``: right at once with 1/n, else a guess g < s leaves the
    n - g symbols above g (the secret uniform among them), g > s the g - 1 below."""
    if turns == 0 or n == 0:
        return 0.0
    rest = sum((n - g) * _consistent_win(n - g, turns - 1) + (g - 1) *
               _consistent_win(g - 1, turns - 1) for g in range(1, n + 1))
    return 1 / n + rest / n ** 2


@pytest.mark.parametrize("skill, expected", [("random", 1 - (15 / 16) ** 5),
                                             ("consistent", _consistent_win(16, 5))])
def test_the_skills_win_as_often_as_their_rules_say(skill, expected):
    # 20000 games: the win rate's standard deviation is at most sqrt(0.25 / 20000) = 0.0035;
    # 5 of them is 0.018, so a correct guesser fails this once in about 3.5 million seeds.
    rng = random.Random(2)
    games = 20000
    wins = sum(demonstration(rng.choice(alphabet(16)), 16, 5, skill, rng)[1]
               for _ in range(games))
    assert abs(wins / games - expected) < 5 * math.sqrt(0.25 / games)
    assert 0.27 < expected < 0.79  # the docstring's 28% and about 78%


def test_an_unknown_skill_is_refused():
    with pytest.raises(ValueError, match="skill 'perfect'; allowed: random, consistent, bisect"):
        demonstration("a", 16, 5, "perfect", random.Random(0))
