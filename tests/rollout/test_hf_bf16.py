"""bf16 generation (``actor.precision=bf16``): the hf engine generates on the gathered bf16
module, and its log-probs stay within the derived bf16 bound of the trainer's."""

import torch

from rlhf_paro import models
from rlhf_paro.config import ModelConfig
from rlhf_paro.rollout import Sampling
from rlhf_paro.rollout.hf import HFRollout
from rlhf_paro.sharding import Topology, shard
from tests.rollout.test_hf import PAD, TINY, VOCAB, _prompts

# [Note: bf16 log-probs of the engine and the trainer]  (docs/design.md, "Rollout")
# Both compute in bf16 with fp32 accumulation, the engine one token at a time on its key/value
# cache, the trainer the whole sequence: the same exact values before each rounding, up to fp32
# summation order, so each intermediate rounded to bf16 (unit roundoff u = 2^-8) lands on the
# same value or on a neighbour, at most 2u apart relative. A Llama block rounds about 16
# intermediates (two norms, q, k, v, the two rotated, attention, o, gate, up, the activation,
# its product, down, two residual sums), and the final norm and the logits one each. To first
# order, each such difference reaches the logits at its own relative size (the gains of the
# layers taken as one: each branch reads a normalised input), so the logits differ by at most
# eps * Z, eps = 2u (16 L + 2), Z = the logits' largest magnitude; and log softmax moves by at
# most twice the largest change of a logit. A factor 2 of safety covers second-order terms and
# gains above one: |engine - trainer| <= 2 * 2 * eps * Z. For the tiny model (L = 2) that is
# about 1.06 Z. It is loose (the two rarely round apart; the measured difference is ~100x less)
# but derived; what it catches is log-probs of another policy or other tokens: a stale policy
# one update back differs by more (asserted below).
U = 2.0 ** -8
ROUNDED_PER_LAYER, ROUNDED_AT_END, SAFETY = 16, 2, 2.0


def bf16_logprob_bound(num_layers: int, logit_scale: float) -> float:
    eps = 2 * U * (ROUNDED_PER_LAYER * num_layers + ROUNDED_AT_END)
    return SAFETY * 2 * eps * logit_scale


def test_bf16_engine_logprobs_are_within_the_derived_bound_of_the_trainer_s():
    """Defect caught: generation on other weights than the bf16 module the trainer runs (a
    stale policy, the wrong precision beyond the bound), or log-probs of other tokens than
    those sampled (off by a position)."""
    torch.manual_seed(0)
    module = models.build_model("actor", ModelConfig(config=TINY, precision="bf16"), VOCAB,
                                seed=3)
    engine = shard(module, "IGG", Topology(1, 1), precision="bf16", optim={"lr": 0.1})
    with engine.gathered() as gathered:  # what generate runs on: the bf16 compute weights
        assert {p.dtype for p in gathered.parameters()} == {torch.bfloat16}
    hf = HFRollout(engine, PAD, -1, torch.device("cpu"))
    prompts, layers = _prompts(), TINY["num_hidden_layers"]
    for _ in range(2):
        batch = hf.generate(prompts, Sampling(8, temperature=1.0))
        with torch.no_grad():
            trainer = engine.module(batch.sequences, batch.attention_mask, batch.response_len)
            logits = engine.module(batch.sequences, batch.attention_mask)
        bound = bf16_logprob_bound(layers, float(logits.float().abs().max()))
        mask = batch.action_mask.bool()
        assert (trainer - batch.logprobs)[mask].abs().max() <= bound
        loss = -engine.module(batch.sequences, batch.attention_mask, batch.response_len).mean()
        engine.backward(loss)
        engine.step()
        with torch.no_grad():  # the same tokens under the updated policy: beyond the bound
            stale = engine.module(batch.sequences, batch.attention_mask, batch.response_len)
        assert (stale - batch.logprobs)[mask].abs().max() > bound
