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


# --- micro-batches by tokens ----------------------------------------------------------------------

def test_split_by_tokens_fills_each_micro_batch_up_to_the_budget_in_order():
    num_tokens = torch.tensor([5, 3, 4, 2, 6, 1])
    rows = torch.tensor([4, 0, 1, 3, 2, 5])  # a shuffled mini-batch: 6, 5, 3, 2, 4, 1 tokens
    micros = batching.split_by_tokens(rows, num_tokens, max_tokens=8)
    # 6 (+5 would be 11) | 5 + 3 = 8 | 2 + 4 + 1 = 7: a new micro-batch only when the next
    # row would go over the budget, rows kept in the mini-batch's order.
    assert [m.tolist() for m in micros] == [[4], [0, 1], [3, 2, 5]]
    assert all(int(num_tokens[m].sum()) <= 8 for m in micros)
    # The budget of the longest sequence (6 | 5 | 3 + 2 | 4 + 1), and one that holds all.
    assert [m.tolist() for m in batching.split_by_tokens(rows, num_tokens, 6)] == [
        [4], [0], [1, 3], [2, 5]]
    assert [m.tolist() for m in batching.split_by_tokens(rows, num_tokens, 21)] == [rows.tolist()]
    # No rows (a rank's empty share) are no micro-batch, not an empty one.
    assert batching.split_by_tokens(rows[:0], num_tokens, 8) == []


def test_split_by_tokens_names_the_longest_sequence_when_it_does_not_fit():
    with pytest.raises(ValueError) as err:
        batching.split_by_tokens(torch.tensor([0, 1]), torch.tensor([5, 9]), max_tokens=7)
    assert str(err.value) == ("max_tokens_per_micro_batch=7 is smaller than the longest "
                              "sequence of the mini-batch, 9 tokens; allowed: at least 9")


def test_fill_to_pads_with_the_shortest_row_at_weight_zero():
    num_tokens = torch.tensor([5, 3, 4, 2, 6, 1])
    micros = [torch.tensor([4]), torch.tensor([0, 1])]
    filled = batching.fill_to(micros, 4, num_tokens)
    assert [(m.rows.tolist(), m.weight) for m in filled] == [
        ([4], 1.0), ([0, 1], 1.0), ([1], 0.0), ([1], 0.0)]  # row 1 (3 tokens) is the shortest
    assert [(m.rows.tolist(), m.weight) for m in batching.fill_to(micros, 2, num_tokens)] == [
        ([4], 1.0), ([0, 1], 1.0)]
    with pytest.raises(ValueError, match="3 micro-batches exceed the agreed count 2"):
        batching.fill_to(micros + micros[:1], 2, num_tokens)


# --- balanced ranks ------------------------------------------------------------------------------

def test_balanced_parts_deal_the_heaviest_first_to_the_lightest_part_with_room():
    weights = torch.tensor([9, 8, 7, 6, 5, 4, 3, 2])
    parts = batching.balanced_parts(weights, 2)
    # 9 -> A, 8 -> B, 7 -> B (8 < 9), 6 -> A, 5 -> A (15 = 15: the lower part), 4 -> B, 3 -> B
    # (19 < 20, B now full), 2 -> A: 22 and 22 tokens, where the halves in order hold 30 and 14.
    assert [p.tolist() for p in parts] == [[0, 3, 4, 7], [1, 2, 5, 6]]
    assert [int(weights[p].sum()) for p in parts] == [22, 22]
    with pytest.raises(ValueError, match="8 items do not split into 3 parts of equal size"):
        batching.balanced_parts(weights, 3)


def test_balance_groups_keeps_groups_whole_and_evens_the_ranks_tokens():
    gen = torch.Generator().manual_seed(0)
    group_size, num_ranks, num_minis = 4, 2, 2
    # 8 groups of 4 samples: short ones first, long ones last (a skewed rollout).
    num_tokens = torch.cat([torch.randint(5, 10, (16,), generator=gen),
                            torch.randint(40, 60, (16,), generator=gen)])
    plan = batching.balance_groups(num_tokens, group_size, num_ranks, num_minis)
    rows = torch.cat([m for rank in plan for m in rank])
    assert sorted(rows.tolist()) == list(range(32))  # every row once
    for rank in plan:
        assert [len(m) for m in rank] == [8, 8]  # as many sequences per rank and mini-batch
        for mini in rank:  # whole groups: each group's 4 rows together
            groups = mini.div(group_size, rounding_mode="floor")
            assert all((groups == g).sum() == group_size for g in groups.unique())
    per_rank = [int(num_tokens[torch.cat(rank)].sum()) for rank in plan]
    contiguous = [int(part.sum()) for part in num_tokens.chunk(num_ranks)]
    group_max = int(num_tokens.reshape(-1, group_size).sum(-1).max())
    # Greedy over 8 groups: the ranks differ by less than one group; in order they differ by
    # the short half against the long half.
    assert max(per_rank) - min(per_rank) < group_max
    assert max(per_rank) - min(per_rank) < (max(contiguous) - min(contiguous)) / 4
    # A pure function of the lengths: every rank computes the same plan.
    again = batching.balance_groups(num_tokens.clone(), group_size, num_ranks, num_minis)
    assert all(torch.equal(a, b) for r, s in zip(plan, again) for a, b in zip(r, s))
    with pytest.raises(ValueError, match="30 rows are not whole groups of 4"):
        batching.balance_groups(num_tokens[:30], group_size, num_ranks, num_minis)


def test_rank_order_evens_a_skewed_rollout_and_its_mini_batches_are_consecutive_slices():
    gen = torch.Generator().manual_seed(1)
    group_size, num_ranks, mini_size = 2, 2, 4
    # 16 rows in rank order as generated: rank 0 got the long responses, rank 1 the short.
    num_tokens = torch.cat([torch.randint(40, 60, (8,), generator=gen),
                            torch.randint(5, 10, (8,), generator=gen)])
    order = batching.rank_order(num_tokens, group_size, num_ranks, mini_size)
    assert sorted(torch.cat(order).tolist()) == list(range(16))  # every row once
    assert [len(rows) for rows in order] == [8, 8]
    group_max = int(num_tokens.reshape(-1, group_size).sum(-1).max())
    before = [int(part.sum()) for part in num_tokens.chunk(num_ranks)]
    after = [int(num_tokens[rows].sum()) for rows in order]
    assert max(before) - min(before) > 3 * group_max  # skewed: rank 0 holds most tokens
    assert max(after) - min(after) < group_max
    for rows in order:
        # Groups whole and in a row (the actor's group ids are row // rollout.n).
        pairs = rows.reshape(-1, group_size)
        assert torch.equal(pairs // group_size, (pairs[:, :1] // group_size).expand_as(pairs))
        assert torch.equal(pairs[:, 1], pairs[:, 0] + 1)
        # Its mini-batches are consecutive slices of mini_size rows, as even as the greedy gets.
        minis = [int(num_tokens[m].sum()) for m in rows.split(mini_size)]
        assert max(minis) - min(minis) < group_max
    again = batching.rank_order(num_tokens.clone(), group_size, num_ranks, mini_size)
    assert all(torch.equal(a, b) for a, b in zip(order, again))  # deterministic


@pytest.mark.parametrize("num_tokens", [
    [50, 50, 50, 50, 40, 40, 40, 40, 5, 5, 5, 5, 9, 9, 9, 9],
    # Each rank's lighter group first: dealt to mini-batches by tokens, it would go second.
    [5, 5, 5, 5, 9, 9, 9, 9, 50, 50, 50, 50, 40, 40, 40, 40]])
def test_rank_order_with_groups_larger_than_a_mini_batch_balances_the_ranks_only(num_tokens):
    # Groups of 4 and mini-batches of 2 rows: a group cannot sit in one mini-batch, so each
    # rank's groups stay in order and only the ranks are evened out.
    order = batching.rank_order(torch.tensor(num_tokens), 4, 2, 2)
    assert [rows.tolist() for rows in order] == [[0, 1, 2, 3, 8, 9, 10, 11],
                                                 [4, 5, 6, 7, 12, 13, 14, 15]]


def test_split_by_rows_cuts_consecutive_micro_batches_the_last_one_short():
    rows = torch.tensor([7, 3, 9, 1, 4])
    assert [m.tolist() for m in batching.split_by_rows(rows, 2)] == [[7, 3], [9, 1], [4]]
    assert [m.tolist() for m in batching.split_by_rows(rows, 5)] == [[7, 3, 9, 1, 4]]


def test_micro_divisor_makes_the_engines_mean_the_global_aggregate():
    # 3 ranks x 2 agreed micro-batches, 30 tokens in the global mini-batch: the engine averages
    # 6 micro-batch losses, each a sum divided by 5, so their mean is the global sum / 30.
    divisor = batching.micro_divisor(30.0, 3, 2)
    assert divisor == 5.0
    sums = torch.arange(6, dtype=torch.float64)  # any micro-batches' loss sums
    assert torch.isclose((sums / divisor).mean(), sums.sum() / 30.0)
