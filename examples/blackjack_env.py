"""Gymnasium's Blackjack as a multi-turn episode (README, "Multi-turn agents"):

    pip install gymnasium
    python -m rlhf_paro.train actor.path=my/policy data.train_files=prompts.jsonl \
        env.function=examples/blackjack_env.py:Blackjack env.max_turns=6

Each prompt row builds one game; the agent answers "hit" or "stick", the table is described in
words after every move, and the game's reward (+1 win, -1 loss, 0 draw) is the episode's score.
"""

import gymnasium as gym


class Blackjack:
    def __init__(self, **row):
        self.game = gym.make("Blackjack-v1")

    def reset(self, seed=None):
        hand, _ = self.game.reset(seed=seed)
        return self.describe(hand)

    def step(self, action):
        hand, reward, ended, cut, _ = self.game.step(1 if "hit" in action.lower() else 0)
        return None if ended or cut else self.describe(hand), float(reward), ended or cut

    def describe(self, hand):
        total, dealer, ace = hand
        ace = " with a usable ace" if ace else ""
        return f"You hold {total}{ace}; the dealer shows {dealer}. Hit or stick?"
