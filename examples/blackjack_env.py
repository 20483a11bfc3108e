"""Gymnasium's Blackjack as a multi-turn episode (README, "Multi-turn agents"):

    pip install gymnasium
    python -m rlhf_paro.train actor.path=my/policy data.train_files=prompts.jsonl \
        env.function=examples/blackjack_env.py:Blackjack env.reward=env env.max_turns=6 \
        trainer.output_dir=outputs/blackjack

Each prompt row builds one game (a row such as {"prompt": "You play blackjack against the
dealer. Answer hit or stick."}; its columns are the constructor's keywords); the agent answers
"hit" or "stick", so the policy needs a tokenizer that writes those words; the table is described
in words after every move, and the game's reward (+1 win, -1 loss, 0 draw) is the episode's score
(env.reward=env, in place of the conf's reward model). `conf=grpo_blackjack_tiny` plays it with a
tiny Llama of the demo's, fine-tuned to answer hit or stick at random.
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
