"""The multi-turn demo's game (``conf/grpo_agent_tiny.yaml``): guess a hidden symbol of an
ordered alphabet, told ``higher`` or ``lower`` after each wrong guess.

The alphabet is the counting task's first ``num_symbols`` symbols in order (a < b < ... < p for
16). An action is one symbol (the model's turn decoded: the symbol, then <eos>). A right guess
ends the episode with reward 1; a wrong one is answered ``higher`` (the hidden symbol comes later
in the alphabet) or ``lower``, reward 0; anything but one symbol of the alphabet forfeits the
game (reward 0, done). ``env.max_turns`` ends an episode that has not won. The hidden symbol is a
column of the prompt's row (``secret``), so a row's episodes are fully determined by its actions.

Feedback is worth using: bisection wins every game of 16 symbols within 5 guesses, a guesser
that ignores the feedback wins 1 - (15/16)^5 = 28% of them, and one that guesses at random
among the symbols the feedback leaves wins about 78% (``demonstration``'s three skills).
"""

from __future__ import annotations

import random
import string

HIGHER, LOWER = "higher", "lower"  # the observations: where the hidden symbol lies
PROMPT = "guess"  # the prompt of every row: the game starts at once
SKILLS = ("random", "consistent", "bisect")  # the demonstrations' guessers, worst first


def alphabet(num_symbols: int) -> list[str]:
    """The game's symbols in order: the counting task's (``ppo/task.py``, ``SymbolTokenizer``)."""
    letters = string.ascii_lowercase + string.ascii_uppercase
    return [letters[k] if k < len(letters) else f"s{k}" for k in range(num_symbols)]


class GuessEnv:
    """One game: ``GuessEnv(**row)`` from a row ``{"prompt", "secret", "num_symbols"}``."""

    def __init__(self, prompt: str, secret: str, num_symbols: int) -> None:
        self.symbols = alphabet(num_symbols)
        if secret not in self.symbols:
            raise ValueError(f"secret {secret!r} is not one of the {num_symbols} symbols "
                             f"{self.symbols[0]}..{self.symbols[-1]}")
        self.secret = self.symbols.index(secret)
        self.guesses = 0

    def reset(self) -> None:
        return None  # the prompt alone starts the game

    def step(self, action: str) -> tuple[str | None, float, bool]:
        self.guesses += 1
        guess = action.strip()
        if guess not in self.symbols:
            return None, 0.0, True
        index = self.symbols.index(guess)
        if index == self.secret:
            return None, 1.0, True
        return (HIGHER if index < self.secret else LOWER), 0.0, False


def demonstration(secret: str, num_symbols: int, max_turns: int, skill: str,
                  rng: random.Random) -> tuple[list[tuple[str, str | None]], float]:
    """(turns as (action, observation), score) of one game played by a scripted guesser against
    ``GuessEnv``: ``random`` ignores the feedback, ``consistent`` guesses uniformly among the
    symbols the feedback leaves, ``bisect`` guesses the middle of them. The observation of the
    last turn is None (the game is over, or ``max_turns`` is)."""
    if skill not in SKILLS:
        raise ValueError(f"skill {skill!r}; allowed: {', '.join(SKILLS)}")
    env = GuessEnv(PROMPT, secret, num_symbols)
    low, high = 0, num_symbols - 1  # the symbols the feedback leaves
    turns: list[tuple[str, str | None]] = []
    score = 0.0
    for turn in range(max_turns):
        if skill == "random":
            index = rng.randrange(num_symbols)
        elif skill == "consistent":
            index = rng.randint(low, high)
        else:
            index = (low + high) // 2
        observation, reward, done = env.step(env.symbols[index])
        score += reward
        last = done or turn == max_turns - 1
        turns.append((env.symbols[index], None if last else observation))
        if last:
            break
        if observation == HIGHER:
            low = max(low, index + 1)
        else:
            high = min(high, index - 1)
    return turns, score
