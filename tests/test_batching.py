"""The packed layout (``rlhf_paro/batching.py``): exact bookkeeping, and every model's packed
forward equal to its padded one per sequence.

Tolerance: the packed and padded forwards run the same fp32 arithmetic per sequence, but on
differently shaped products (one row of L tokens against B rows of T), so sums may be taken in
another order. Each value is a sum of a few hundred products of O(1) terms through 2 blocks,
so the difference is a few float32 ulps of values of order 1-10: 1e-5 bounds it with room.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from rlhf_paro import batching
from rlhf_paro.models import CausalLM, ValueModel

VOCAB = 40


def _rollout(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A rollout of mixed prompt and response lengths: (sequences, attention_mask, action_mask)
    with prompts left-padded to 5 and responses right-padded to 6."""
    gen = torch.Generator().manual_seed(seed)
    prompt_lens, response_lens = [5, 1, 3, 2, 4], [6, 1, 3, 0, 5]
    ids = torch.randint(3, VOCAB, (5, 11), generator=gen)
    prompt = torch.tensor([[0] * (5 - p) + [1] * p for p in prompt_lens])
    response = torch.tensor([[1] * r + [0] * (6 - r) for r in response_lens])
    ids = ids * torch.cat([prompt, response], 1)  # 0 (the pad id) at padding
    return ids, torch.cat([prompt, response], 1), response.float()


def test_pack_places_whole_sequences_longest_first_and_unpack_puts_every_token_back():
    ids, mask, _ = _rollout()
    lengths = mask.sum(1).tolist()  # [11, 2, 6, 2, 9]
    packed = batching.pack(ids, mask)
    # Rows as wide as the longest sequence (11); first fit, longest first: [11], [9, 2], [6, 2].
    assert batching.first_fit_decreasing(lengths, 11) == [[0], [4, 1], [2, 3]]
    assert packed.input_ids.shape == (3, 11)
    assert packed.input_ids[1, :9].tolist() == ids[4][mask[4].bool()].tolist()
    assert packed.input_ids[1, 9:].tolist() == ids[1][mask[1].bool()].tolist()
    # Positions restart at 0 for every sequence, and for a row's unused tail.
    assert packed.position_ids[1].tolist() == [*range(9), 0, 1]
    assert packed.position_ids[2].tolist() == [*range(6), 0, 1, 0, 1, 2]
    assert torch.equal(batching.unpack(packed.input_ids, packed), ids)
    # The last real token of each row, numbered in row-major order: cumulative lengths - 1.
    assert batching.last_tokens(packed).tolist() == (mask.sum(1).cumsum(0) - 1).tolist()
    # A wider row takes more sequences.
    assert batching.first_fit_decreasing(lengths, 20) == [[0, 4], [2, 1, 3]]


def test_response_predictors_list_exactly_the_valid_response_tokens():
    ids, mask, action = _rollout()
    packed = batching.pack(ids, mask)
    index, row, col = batching.response_predictors(packed, response_len=6)
    got = torch.zeros(5, 6)
    got[row, col] = 1.0
    assert torch.equal(got, action)
    # Each predictor is followed, in its packed row, by the token it predicts.
    flat = packed.input_ids.reshape(-1)
    assert torch.equal(packed.slots[index + 1], packed.slots[index] + 1)
    assert torch.equal(flat[packed.slots[index + 1]], ids[row, 5 + col])


def _tiny(model_type: str) -> transformers.PreTrainedModel:
    config = transformers.AutoConfig.for_model(
        model_type, vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("model_type", batching.PACKED_MODEL_TYPES)
def test_every_packed_architecture_gives_its_padded_log_probs(model_type):
    ids, mask, action = _rollout()
    model = CausalLM(_tiny(model_type))
    padded = model(ids, mask, response_len=6, temperature=0.7)
    packed = model(ids, mask, response_len=6, temperature=0.7, packed=True)
    torch.testing.assert_close(packed * action, padded * action, rtol=0, atol=1e-5)
    assert torch.all(packed[action == 0] == 0)


def test_packed_values_and_scores_equal_the_padded_ones_and_so_do_their_gradients():
    ids, mask, action = _rollout(1)
    lm = _tiny("llama")
    torch.manual_seed(1)
    critic = ValueModel(lm.model, 32, per_token=True)
    reward = ValueModel(lm.model, 32, per_token=False)
    torch.testing.assert_close(critic(ids, mask, 6, packed=True) * action,
                               critic(ids, mask, 6) * action, rtol=0, atol=1e-5)
    torch.testing.assert_close(reward(ids, mask, packed=True), reward(ids, mask), rtol=0,
                               atol=1e-5)
    # The gradient of a masked loss: the same up to the same rounding.
    grads = []
    for packed in (False, True):
        critic.zero_grad()
        (critic(ids, mask, 6, packed=packed) * action).sum().backward()
        grads.append(critic.value_head.weight.grad.clone())
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-5)
