"""The rollout's batches: rows selected and joined keep every row's tokens and masks."""

import dataclasses
import pickle

import torch

from rlhf_paro.rollout import PromptBatch, RolloutBatch, join, response_mask

EOS, PAD = 2, 0


def test_response_mask_covers_tokens_through_the_first_eos():
    responses = torch.tensor([[5, 2, 0, 0], [5, 6, 7, 8], [2, 5, 2, 0]])
    expected = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]).float()
    torch.testing.assert_close(response_mask(responses, EOS), expected)


def _batch(prompt_lens, responses):
    """Left-padded prompts of ``prompt_lens`` real tokens (ids 10+), joined to ``responses``."""
    width = max(prompt_lens)
    ids = torch.tensor([[PAD] * (width - n) + [10 + k for k in range(n)] for n in prompt_lens])
    mask = (ids != PAD).long()
    return join(PromptBatch(ids, mask), torch.tensor(responses), EOS)


def test_join_marks_real_prompt_tokens_and_responses_through_eos():
    b = _batch([2, 3], [[5, 2, 0], [5, 6, 7]])
    assert b.sequences.tolist() == [[0, 10, 11, 5, 2, 0], [10, 11, 12, 5, 6, 7]]
    assert b.attention_mask.tolist() == [[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]]
    assert b.response_len == 3 and b.prompts.shape == (2, 3)
    assert b.num_tokens().tolist() == [4, 6]


def test_concat_pads_prompts_left_and_responses_right_and_select_gives_rows_back():
    a = _batch([2, 1], [[5, 2], [6, 2]])  # prompt width 2, responses 2
    b = _batch([3], [[5, 6, 7, 2]])  # prompt width 3, response 4
    both = RolloutBatch.concat([a, b], PAD)
    assert both.sequences.shape == (3, 7) and both.response_len == 4
    # Each row's real tokens, in order, are unchanged; only padding was added.
    for row, (src, i) in enumerate([(a, 0), (a, 1), (b, 0)]):
        keep = both.attention_mask[row].bool()
        assert both.sequences[row][keep].tolist() == \
            src.sequences[i][src.attention_mask[i].bool()].tolist()
        assert both.action_mask[row].sum() == src.action_mask[i].sum()
    assert both.sequences[0].tolist() == [PAD, 10, 11, 5, 2, PAD, PAD]
    part = both.select(torch.tensor([2, 0]))
    assert torch.equal(part.sequences, both.sequences[[2, 0]])
    assert torch.equal(part.action_mask, both.action_mask[[2, 0]])
    assert len(part) == 2


def test_a_batch_travels_pickled_and_moves_whole():
    b = _batch([2, 3], [[5, 2, 0], [5, 6, 7]])
    back = pickle.loads(pickle.dumps(b))
    assert all(torch.equal(getattr(b, k), getattr(back, k))
               for k in ("sequences", "attention_mask", "action_mask"))
    moved = b.to("meta")
    assert moved.sequences.device.type == "meta" and moved.action_mask.device.type == "meta"


def test_trimmed_drops_only_the_columns_that_are_padding_in_every_row():
    b = RolloutBatch.concat([_batch([1], [[5, 2]]), _batch([3], [[6, 7, 8, 9]])], PAD)
    rows = b.select(torch.tensor([0]))  # prompt of 1 token, response of 2 in a 3 + 4 layout
    short = rows.trimmed()
    assert short.sequences.tolist() == [[10, 5, 2]]
    assert short.attention_mask.tolist() == [[1, 1, 1]]
    assert short.action_mask.tolist() == [[1.0, 1.0]]
    assert torch.equal(b.trimmed().sequences, b.sequences)  # nothing to drop


def test_logprobs_stay_aligned_through_select_concat_and_trimmed():
    # Each real response token's log-prob is -(its id) / 4 (exact in float), so any misalignment shows.
    def with_logp(prompt_lens, responses):
        ids = torch.tensor(responses)
        b = _batch(prompt_lens, responses)
        return join(PromptBatch(b.prompts, b.attention_mask[:, :b.prompts.shape[1]]), ids, EOS,
                    -ids.float() / 4)

    a = with_logp([2, 1], [[5, 2, 9], [6, 7, 2]])  # row 0 ends at its eos: 9 is past the end
    assert a.logprobs.tolist() == [[-1.25, -0.5, 0.0], [-1.5, -1.75, -0.5]]
    b = with_logp([3], [[5, 2, 0, 0, 0]])
    both = RolloutBatch.concat([a, b], PAD)
    expected = torch.where(both.action_mask.bool(), -both.responses.float() / 4, 0.0)
    assert torch.equal(both.logprobs, expected) and both.logprobs.shape == (3, 5)
    part = both.select(torch.tensor([2, 0]))
    assert torch.equal(part.logprobs, expected[[2, 0]])
    short = part.trimmed()  # responses of 2 real tokens: 3 columns fewer
    assert short.response_len == 2
    assert torch.equal(short.logprobs, -short.responses.float() / 4)
    assert both.to("meta").logprobs.device.type == "meta"
    # A batch without them (a greedy one) makes a concatenation without them.
    assert RolloutBatch.concat([a, _batch([1], [[5, 2]])], PAD).logprobs is None
    assert _batch([1], [[5, 2]]).select(slice(0, 1)).trimmed().logprobs is None


def test_prompts_are_left_padded_to_the_longest_and_select_gives_rows_back():
    # A prompt padded on the wrong side, a mask off its tokens, or an empty prompt given a real
    # token would shift every position the models compute.
    prompts = PromptBatch.left_padded([[5, 6, 7], [8], []], pad_token_id=0)
    assert prompts.input_ids.tolist() == [[5, 6, 7], [0, 0, 8], [0, 0, 0]]
    assert prompts.attention_mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 0, 0]]
    assert len(prompts) == 3
    picked = prompts.select(torch.tensor([2, 0]))
    assert isinstance(picked, PromptBatch) and len(picked) == 2
    assert picked.input_ids.tolist() == [[0, 0, 0], [5, 6, 7]]
    assert picked.attention_mask.tolist() == [[0, 0, 0], [1, 1, 1]]


def test_concat_keeps_the_environments_scores_in_row_order_only_when_every_batch_has_them():
    # Episodes' scores dropped, or kept from some batches only, would train on other rows'.
    a = dataclasses.replace(_batch([2, 1], [[5, 2], [6, 2]]), scores=torch.tensor([0.5, 1.0]))
    b = dataclasses.replace(_batch([3], [[5, 6, 7, 2]]), scores=torch.tensor([2.0]))
    assert RolloutBatch.concat([a, b], PAD).scores.tolist() == [0.5, 1.0, 2.0]
    plain = _batch([3], [[5, 6, 7, 2]])
    assert RolloutBatch.concat([a, plain], PAD).scores is None


def test_concat_of_one_batch_is_that_batch():
    # One rank's rollout is concatenated alone (sources.Colocated.balance with one training rank).
    a = dataclasses.replace(_batch([2, 1], [[5, 2], [6, 2]]), scores=torch.tensor([0.5, 1.0]))
    alone = RolloutBatch.concat([a], PAD)
    assert all(torch.equal(getattr(alone, f.name), getattr(a, f.name))
               for f in dataclasses.fields(a) if getattr(a, f.name) is not None)
