"""The README's example environment, gymnasium's Blackjack, through the episode runner on the hf
engine: its descriptions are the observations (attended, never actions), its rewards the
episodes' scores."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("gymnasium")

from rlhf_paro import models  # noqa: E402
from rlhf_paro.config import ModelConfig  # noqa: E402
from rlhf_paro.envs import EnvRunner, Observations  # noqa: E402
from rlhf_paro import usercode  # noqa: E402
from rlhf_paro.rollout import PromptBatch, Sampling, episodes  # noqa: E402
from tests.envs.test_envs import _Engine  # noqa: E402
from tests.hf_assets import bpe_tokenizer  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "blackjack_env.py"


def test_blackjack_games_run_as_episodes_of_described_turns():
    tok = bpe_tokenizer()
    model = models.build_model("actor", ModelConfig(config={
        "model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
        "max_position_embeddings": 512}), len(tok), seed=0)
    factory = usercode.load_function(f"{EXAMPLE}:Blackjack", "env.function")
    prompts = [tok("Play blackjack.")["input_ids"]] * 8
    torch.manual_seed(0)
    engine = _Engine(model)
    engine.hf.pad_token_id = engine.hf.eos_token_id = tok.eos_token_id
    batch, stats = episodes.run(
        engine, PromptBatch.left_padded(prompts, tok.eos_token_id), [{"prompt": "p"}] * 8,
        list(range(8)), EnvRunner(factory, "Blackjack", 4, 30.0), Observations(tok, chat=False),
        lambda ids: tok.decode(ids, skip_special_tokens=True), Sampling(max_new_tokens=4),
        episodes.Budget(max_turns=6, max_total_tokens=480), tok.eos_token_id, str)
    # The reset's description joins the prompt; a game's score is its win (+1), loss (-1) or
    # draw (0); a random policy's "hit" or "stick" ends each game within its 6 turns, most of
    # them: a hand busts after a few hits.
    prompt_text = [tok.decode(row[mask.bool()]) for row, mask in
                   zip(batch.prompts, batch.attention_mask[:, :batch.prompts.shape[1]])]
    assert all(t.startswith("Play blackjack.You hold ") and t.endswith("Hit or stick?")
               for t in prompt_text), prompt_text
    assert set(batch.scores.tolist()) <= {-1.0, 0.0, 1.0}
    assert stats.total["episodes"] == 8 and 8 <= stats.total["turns"] <= 48
    # Observations between turns are the game's words, never actions.
    observed = batch.response_attention.bool() & ~batch.action_mask.bool()
    for row in range(8):
        text = tok.decode(batch.responses[row][observed[row]])
        assert text == "" or "the dealer shows" in text, text
