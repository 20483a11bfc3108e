"""The hf engine keeps each episode's keys and values across its turns ([Note: keys and values
across turns]): the episodes are today's (each turn recomputing its whole context), their
log-probs the trainer's, and the prefill computes only what each turn adds."""

import contextlib

import pytest
import torch

from rlhf_paro import models
from rlhf_paro.config import ModelConfig
from rlhf_paro.envs import EnvRunner, Observations
from rlhf_paro.ppo.demo import make_tokenizer
from rlhf_paro.ppo.task import CountingTask
from rlhf_paro.rollout import PromptBatch, Sampling, episodes
from rlhf_paro.rollout.hf import HFRollout
from tests.rollout.test_hf import TINY, Gathered

TURNS, ACTION = 4, 5
# fp32, the same weights: the kept entries were computed in another batch layout, the trainer's
# over the whole sequence, so they differ by summation order only (test_hf's bound).
TOL = 1e-5


class Echo:
    """Answers action k with ``1 + (seed + k) % 3`` symbols; ends after ``2 + seed % 3`` actions,
    so the episodes of one call run different numbers of turns with different contexts."""

    def __init__(self, seed: int) -> None:
        self.seed, self.turns = seed, 0

    def reset(self) -> None:
        return None

    def step(self, action: str) -> tuple[str, float, bool]:
        self.turns += 1
        text = " ".join("abcdefgh"[(self.seed + self.turns + j) % 8]
                        for j in range(1 + (self.seed + self.turns) % 3))
        return text, float(len(action)), self.turns == 2 + self.seed % 3


class Recomputing:
    """The engine as it was: the weights gathered across turns, nothing else kept."""

    def __init__(self, engine: HFRollout) -> None:
        self.engine = engine
        self.eos_token_id = engine.eos_token_id

    def generate(self, prompts, sampling):
        return self.engine.generate(prompts, sampling)

    def turns(self):
        return contextlib.nullcontext()


@pytest.fixture(scope="module")
def setup():
    tokenizer = make_tokenizer(CountingTask(8))
    vocab = len(tokenizer.get_vocab())
    model = models.build_model("actor", ModelConfig(config=TINY), vocab, seed=3).eval()
    gen = torch.Generator().manual_seed(0)
    prompts = PromptBatch.left_padded(
        [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (3, 6, 4, 5, 2, 6)], 0)
    return tokenizer, model, prompts


def run(engine, setup, sampling):
    """The episodes, and the tokens the model was fed (the prefill's and every step's)."""
    tokenizer, model, prompts = setup
    fed = []
    handle = model.lm.register_forward_pre_hook(
        lambda mod, args, kwargs: fed.append(kwargs["input_ids"].numel()), with_kwargs=True)
    runner = EnvRunner(lambda seed: Echo(seed), "Echo", 2, 60.0)
    try:
        batch, stats = episodes.run(
            engine, prompts, [{"seed": i} for i in range(len(prompts))], [0] * len(prompts),
            runner, Observations(tokenizer, chat=False), tokenizer.decode, sampling,
            episodes.Budget(TURNS, 60), 0, str)
    finally:
        runner.close()
        handle.remove()
    return batch, stats, sum(fed)


@pytest.mark.parametrize("size", [None, 4])  # one call for all episodes; chunks of 4
def test_kept_keys_and_values_give_today_s_episodes_and_the_trainer_s_logprobs(setup, size):
    """Defect caught: entries kept at the wrong columns or positions (another context: the greedy
    episodes or the log-probs change), the last sampled token taken as kept (its entry was never
    computed), a turn recomputing its whole context (the tokens fed do not drop)."""
    _, model, _ = setup
    hf = HFRollout(Gathered(model), 0, 1, torch.device("cpu"), size)
    greedy = Sampling(ACTION, greedy=True)
    kept, stats, fed_kept = run(hf, setup, greedy)
    today, _, fed_today = run(Recomputing(hf), setup, greedy)
    assert stats.total["turns"] > len(kept.sequences) + 2  # several turns, not all alike
    for name in ("sequences", "attention_mask", "action_mask", "scores"):
        assert torch.equal(getattr(kept, name), getattr(today, name)), name
    # Each turn after the first feeds its new observation and the last action token only.
    assert fed_kept < 0.6 * fed_today, (fed_kept, fed_today)
    sampling = Sampling(ACTION, temperature=1.0)
    torch.manual_seed(7)
    kept, _, _ = run(hf, setup, sampling)
    torch.manual_seed(7)
    today, _, _ = run(Recomputing(hf), setup, sampling)
    assert torch.equal(kept.sequences, today.sequences)
    torch.testing.assert_close(kept.logprobs, today.logprobs, atol=TOL, rtol=0)
    with torch.no_grad():
        trainer = model(kept.sequences, kept.attention_mask, kept.response_len)
    torch.testing.assert_close(trainer * kept.action_mask, kept.logprobs, atol=TOL, rtol=0)
