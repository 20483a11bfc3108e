"""The hf engine: chunked generation gives the rows unchunked generation gives, trimmed to the
longest response; its rows are Hugging Face generate's (greedy, and sampled while no row has
ended), each row leaving the batch when it ends."""

import contextlib

import pytest
import torch

from rlhf_paro import models, rollout
from rlhf_paro.config import ModelConfig
from rlhf_paro.rollout import PromptBatch, Sampling
from rlhf_paro.rollout.hf import HFRollout

PAD, VOCAB, MAX_NEW = 0, 32, 10
TINY = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
        "max_position_embeddings": 64}


class Gathered:
    """The part of the engine contract generation reads: ``gathered`` yields the full model."""

    def __init__(self, model):
        self.model = model

    @contextlib.contextmanager
    def gathered(self, phase=None):
        yield self.model


@pytest.fixture(scope="module")
def model():
    return models.build_model("actor", ModelConfig(config=TINY), VOCAB, seed=3)


def _prompts():
    """7 prompts of 1 to 4 tokens, left-padded."""
    gen = torch.Generator().manual_seed(0)
    lens = [4, 1, 3, 2, 4, 2, 3]
    ids = torch.full((len(lens), 4), PAD)
    for i, n in enumerate(lens):
        ids[i, 4 - n:] = torch.randint(3, VOCAB, (n,), generator=gen)
    return PromptBatch(ids, (ids != PAD).long())


def _eos(model, prompts):
    """An eos id that ends some greedy responses early and not others: the token that the first
    prompt's greedy response emits second."""
    out = HFRollout(Gathered(model), PAD, -1, torch.device("cpu")).generate(
        prompts, Sampling(MAX_NEW, greedy=True))
    return int(out.responses[0, 1])


@pytest.mark.parametrize("size", [3, 16])  # one that does not divide 7 prompts, one above
def test_chunked_greedy_rows_equal_unchunked_and_are_trimmed_to_the_longest(model, size):
    prompts = _prompts()
    eos = _eos(model, prompts)
    greedy = Sampling(MAX_NEW, greedy=True)
    whole = HFRollout(Gathered(model), PAD, eos, torch.device("cpu")).generate(prompts, greedy)
    chunked = HFRollout(Gathered(model), PAD, eos, torch.device("cpu"), size).generate(prompts,
                                                                                       greedy)
    lengths = whole.action_mask.sum(-1)
    assert lengths.min() < lengths.max()  # some responses end early, so trimming shows
    # As wide as the longest response, never wider.
    assert chunked.response_len == whole.response_len == int(lengths.max())
    for name in ("sequences", "attention_mask", "action_mask"):
        assert torch.equal(getattr(chunked, name), getattr(whole, name)), name
    # A chunk alone is as wide as its own longest response.
    first = HFRollout(Gathered(model), PAD, eos, torch.device("cpu")).generate(
        prompts.select(slice(0, 1)), greedy)
    assert first.response_len == int(lengths[0]) == 2


def test_sampling_is_generate_s_own_draws_while_no_row_has_ended(model):
    # No row ends (the eos id is none of the vocabulary's), so every step draws over all rows,
    # as generate does ([Note: rows leave the batch as they end]).
    prompts = _prompts()
    sampling = Sampling(MAX_NEW, temperature=0.7, top_k=5)
    torch.manual_seed(11)
    ours = HFRollout(Gathered(model), PAD, -1, torch.device("cpu")).generate(prompts, sampling)
    torch.manual_seed(11)
    out = model.generate(prompts.input_ids, prompts.attention_mask, max_new_tokens=MAX_NEW,
                         pad_token_id=PAD, eos_token_id=None, do_sample=True, temperature=0.7,
                         top_k=5)
    assert torch.equal(ours.sequences, out)


def test_greedy_rows_are_generate_s_and_each_row_leaves_the_batch_when_it_ends(model):
    prompts = _prompts()
    eos = _eos(model, prompts)
    fed = []
    handle = model.lm.register_forward_pre_hook(
        lambda mod, args, kwargs: fed.append(kwargs["input_ids"].shape[0]), with_kwargs=True)
    try:
        ours = HFRollout(Gathered(model), PAD, eos, torch.device("cpu")).generate(
            prompts, Sampling(MAX_NEW, greedy=True))
    finally:
        handle.remove()
    out = model.generate(prompts.input_ids, prompts.attention_mask, max_new_tokens=MAX_NEW,
                         pad_token_id=PAD, eos_token_id=eos, do_sample=False)
    assert torch.equal(ours.sequences, out)
    lengths = ours.action_mask.sum(-1)
    assert lengths.min() < lengths.max()
    # The prefill feeds every row; step k (k >= 1) the rows whose response is longer than k, and
    # ended rows only while they are fewer than a quarter of those fed (then they are dropped).
    running = [int((lengths > k).sum()) for k in range(1, ours.response_len)]
    assert fed[0] == len(prompts) and len(fed) == ours.response_len
    for count, live in zip(fed[1:], running):
        assert live <= count and (count - live) * 4 < count, (fed, running)
    assert fed[-1] < len(prompts)


def test_the_registry_builds_hf_and_names_the_engines_it_knows():
    assert "hf" in rollout.ENGINES
    with pytest.raises(ValueError, match="allowed: hf"):
        rollout.build("nosuch", None)


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_sampled_logprobs_equal_the_trainer_s_padded_and_packed(model, temperature):
    # top_k=5 samples from the 5 likeliest tokens, but the log-probs are those of
    # softmax(logits / temperature) over all of them, the trainer's definition; the eos id ends
    # some responses early, so the padding after an end shows too.
    prompts = _prompts()
    eos = _eos(model, prompts)
    torch.manual_seed(5)
    batch = HFRollout(Gathered(model), PAD, eos, torch.device("cpu"), 3).generate(
        prompts, Sampling(MAX_NEW, temperature=temperature, top_k=5))
    mask = batch.action_mask
    assert mask.sum(-1).min() < mask.sum(-1).max()
    assert batch.logprobs.dtype == torch.float32 and batch.logprobs.shape == mask.shape
    assert torch.all(batch.logprobs[mask == 0] == 0) and torch.all(batch.logprobs[mask == 1] < 0)
    # In fp32 the two differ by summation order only (the cached forward of one token against
    # the whole sequence's): a few ulps of logits of size ~1, far below 1e-5.
    with torch.no_grad():
        for packed in (False, True):
            trainer = model(batch.sequences, batch.attention_mask, batch.response_len,
                            temperature=temperature, packed=packed)
            torch.testing.assert_close(trainer * mask, batch.logprobs, atol=1e-5, rtol=0)


def test_greedy_rollouts_carry_no_logprobs(model):
    out = HFRollout(Gathered(model), PAD, 2, torch.device("cpu")).generate(
        _prompts(), Sampling(MAX_NEW, greedy=True))
    assert out.logprobs is None


def test_seeded_draws_follow_softmax_within_five_standard_errors():
    # 20000 rows, one seed each, the same logits: each token's share of the draws is within 5
    # standard errors (sqrt(p (1 - p) / n), at most 0.0035) of softmax(logits / 0.7) renormalised
    # over the top 4; the two tokens outside the top 4 are never drawn.
    from rlhf_paro.rollout.hf import seeded_tokens

    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]]).expand(20000, 6)
    sampling = Sampling(1, temperature=0.7, top_k=4)
    drawn = seeded_tokens(logits, sampling, torch.arange(20000), torch.zeros(20000,
                                                                             dtype=torch.long))
    probs = torch.softmax(logits[0, :4] / 0.7, -1).double()
    shares = torch.bincount(drawn, minlength=6).double() / 20000
    assert shares[4:].sum() == 0
    bound = 5 * (probs * (1 - probs) / 20000).sqrt()
    assert bool(((shares[:4] - probs).abs() <= bound).all()), (shares, probs)
    # A row's draw is a function of its seed and counter: the next counter draws anew.
    again = seeded_tokens(logits, sampling, torch.arange(20000), torch.zeros(20000,
                                                                             dtype=torch.long))
    moved = seeded_tokens(logits, sampling, torch.arange(20000), torch.ones(20000,
                                                                            dtype=torch.long))
    assert torch.equal(again, drawn) and not torch.equal(moved, drawn)


def test_a_seeded_row_draws_the_same_tokens_alone_as_among_others(model):
    # Each row samples from a stream of its own: alone, or beside six others that end at other
    # steps (rows leaving the batch), the same tokens. The batches' logits may differ in float32
    # rounding, which moves a draw only where two candidates' noisy scores tie that closely:
    # none of these 7 rows.
    prompts = _prompts()
    eos = _eos(model, prompts)
    sampling = Sampling(MAX_NEW, temperature=1.0)
    seeds = [11 * k + 5 for k in range(len(prompts))]
    hf = HFRollout(Gathered(model), PAD, eos, torch.device("cpu"))
    together = hf.generate(prompts, sampling, seeds)
    lengths = together.action_mask.sum(-1)
    assert lengths.min() < lengths.max()
    for k in range(len(prompts)):
        alone = hf.generate(prompts.select(slice(k, k + 1)), sampling, seeds[k:k + 1])
        width = int(lengths[k])
        assert together.responses[k, :width].tolist() == alone.responses[0, :width].tolist()
        assert alone.response_len == width
    # The same seeds draw the same rollout; other seeds another.
    assert not torch.equal(hf.generate(prompts, sampling, [s + 1 for s in seeds]).sequences,
                           together.sequences)
    assert torch.equal(hf.generate(prompts, sampling, seeds).sequences, together.sequences)
