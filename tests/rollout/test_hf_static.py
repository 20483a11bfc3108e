"""The hf engine's static cache (``rollout.hf_cache``): its compiled decoding step gives the
trainer's log-probs after updates in place, compiled once; bad values are one-line errors."""

import subprocess
import sys

import pytest
import torch

from rlhf_paro import models
from rlhf_paro.config import ConfigError, ModelConfig, RolloutConfig
from rlhf_paro.rollout import Sampling
from rlhf_paro.rollout.hf import HFRollout, StaticDecode, decode_cache
from rlhf_paro.sharding import Topology, shard
from tests.rollout.test_hf import PAD, TINY, VOCAB, _prompts

# Log-probs of the engine against the trainer's, in fp32: the same weights, the cached forward of
# one token against the whole sequence's, so they differ by summation order only, a few ulps of
# logits of size ~1 (the bound of test_hf's padded and packed comparison).
TOL = 1e-5


def test_compiled_static_decode_gives_the_trainer_s_logprobs_after_updates_in_place():
    """Defect caught: the static path not taken (nothing compiled), a graph compiled again per
    call (a cache sized per call, a batch size baked in), or one that keeps the weights it was
    compiled with (its log-probs would be the first policy's after the updates).

    The graph is compiled by a backend that counts its compilations and runs the captured graph
    as it is: inductor's code generation takes minutes on a small CPU and is not what is tested
    here; what is, is the capture (the weights read as the graph's inputs) and its reuse."""
    compiled = []

    def counting(graph, inputs, **options):
        compiled.append(graph)
        return graph.forward

    torch.manual_seed(0)
    module = models.build_model("actor", ModelConfig(config=TINY), VOCAB, seed=3)
    engine = shard(module, "IGG", Topology(1, 1), optim={"lr": 0.05})  # gathered anew each call
    static = StaticDecode.for_run(32)
    static.compile_config.backend = counting
    # Chunks of 4 and 3 prompts: two batch sizes through the one graph.
    hf = HFRollout(engine, PAD, -1, torch.device("cpu"), 4, static)
    prompts, sampling = _prompts(), Sampling(8, temperature=1.0)
    previous = None
    for step in range(3):
        batch = hf.generate(prompts, sampling)
        with torch.no_grad():
            trainer = engine.module(batch.sequences, batch.attention_mask, batch.response_len)
        torch.testing.assert_close(trainer * batch.action_mask, batch.logprobs, atol=TOL, rtol=0)
        if previous is not None:  # the update moved these log-probs far beyond the tolerance
            with torch.no_grad():
                now = engine.module(previous.sequences, previous.attention_mask,
                                    previous.response_len)
            assert (now - previous.logprobs).abs().max() > 100 * TOL
        previous = batch
        loss = -engine.module(batch.sequences, batch.attention_mask, batch.response_len).mean()
        engine.backward(loss)
        engine.step()
    assert len(compiled) == 1


def test_auto_is_static_on_cuda_where_the_model_takes_it_for_single_turn_runs():
    from transformers import LlamaForCausalLM

    class Uncompilable(LlamaForCausalLM):
        _can_compile_fullgraph = False

    assert decode_cache("auto", "cuda", LlamaForCausalLM) == "static"
    assert decode_cache("auto", "cpu", LlamaForCausalLM) == "dynamic"
    assert decode_cache("auto", "cuda", Uncompilable) == "dynamic"
    assert decode_cache("dynamic", "cuda", LlamaForCausalLM) == "dynamic"
    # Episodes keep their keys and values across turns on the dynamic cache.
    assert decode_cache("auto", "cuda", LlamaForCausalLM, multi_turn=True) == "dynamic"
    assert decode_cache("static", "cuda", LlamaForCausalLM, multi_turn=True) == "static"
    with pytest.raises(ConfigError, match="rollout.hf_cache: static: the actor's Uncompilable "
                                          "cannot decode .*; allowed: dynamic, auto"):
        decode_cache("static", "cpu", Uncompilable)


@pytest.mark.parametrize("kwargs, message", [
    ({"hf_cache": "compiled"}, "hf_cache: got 'compiled'; allowed: auto, dynamic, static"),
    ({"hf_cache": "static", "engine": "vllm"}, "hf_cache: static is the hf engine's cache"),
])
def test_bad_values_are_errors_naming_the_key(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        RolloutConfig(**kwargs)


def test_the_command_line_says_a_bad_value_in_one_line_and_exits_2():
    done = subprocess.run([sys.executable, "-m", "rlhf_paro.train", "rollout.hf_cache=compiled",
                           "trainer.steps=0"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines() == [
        "error: rollout.hf_cache: got 'compiled'; allowed: auto, dynamic, static"]


def test_a_model_s_own_generation_defaults_do_not_steer_the_static_path():
    """Defect caught: Hugging Face ``generate`` filling the arguments the engine leaves unset
    from the model's own ``generation_config`` (a checkpoint's ``generation_config.json``): its
    draws would come from a distribution the trainer's log-probs do not describe. Greedy rows
    show it exactly: a repetition penalty and a suppressed token (the first greedy token) in the
    model's defaults would change them; the same call on the same graph gives the same rows."""
    module = models.build_model("actor", ModelConfig(config=TINY), VOCAB, seed=3)
    engine = shard(module, "IGG", Topology(1, 1), optim={"lr": 0.05})
    static = StaticDecode.for_run(32)
    static.compile_config.backend = lambda graph, inputs, **options: graph.forward
    hf = HFRollout(engine, PAD, -1, torch.device("cpu"), None, static)
    prompts, greedy = _prompts(), Sampling(8, greedy=True)
    plain = hf.generate(prompts, greedy)
    own = module.lm.generation_config
    own.repetition_penalty, own.suppress_tokens = 1e4, [int(plain.responses[0, 0])]
    assert torch.equal(hf.generate(prompts, greedy).sequences, plain.sequences)
    # The model's own defaults are still its own after the call (an export writes them).
    assert module.lm.generation_config is own and own.repetition_penalty == 1e4
