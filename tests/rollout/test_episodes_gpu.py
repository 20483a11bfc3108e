"""Multi-turn episodes on a CUDA device with the hf engine (docs/design.md, "Multi-turn
episodes"): the engine's log-probs of its sampled actions are the trainer's on the same device,
and observations are attended and never actions; the episodes' tokens per second are printed
(pytest -s)."""

from __future__ import annotations

import time

import pytest
import torch

from rlhf_paro.envs import EnvRunner, Observations
from rlhf_paro.rollout import PromptBatch, Sampling, episodes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


class Relay:
    """Answers each action with four symbols; done after the fourth action."""

    def __init__(self, **row):
        self.turn = 0

    def reset(self):
        return None

    def step(self, action):
        self.turn += 1
        return " ".join("abcd"[(self.turn + k) % 4] for k in range(4)), 1.0, self.turn == 4


def test_hf_episodes_on_cuda_give_the_trainers_log_probs():
    from rlhf_paro import models
    from rlhf_paro.config import ModelConfig
    from rlhf_paro.ppo.demo import make_tokenizer
    from rlhf_paro.ppo.task import CountingTask
    from rlhf_paro.rollout.hf import HFRollout
    from rlhf_paro.sharding import Topology, shard

    tok = make_tokenizer(CountingTask(16))
    module = models.build_model("actor", ModelConfig(config={
        "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 8,
        "max_position_embeddings": 512}), len(tok.get_vocab()), seed=0)
    engine = shard(module, "NNN", Topology(1, 1), device="cuda")
    hf = HFRollout(engine, tok.pad_token_id, tok.eos_token_id, torch.device("cuda"))
    gen = torch.Generator().manual_seed(0)
    prompts = PromptBatch.left_padded(
        [[1, *torch.randint(3, 19, (int(n),), generator=gen).tolist()]
         for n in torch.randint(4, 17, (64,), generator=gen)], tok.pad_token_id)
    torch.manual_seed(0)
    torch.cuda.synchronize()
    start = time.perf_counter()
    batch, stats = episodes.run(
        hf, prompts, [{}] * 64, [0] * 64, EnvRunner(Relay, "Relay", 8, 60.0),
        Observations(tok, chat=False), lambda ids: tok.decode(ids, skip_special_tokens=True),
        Sampling(max_new_tokens=64, temperature=0.8), episodes.Budget(4, 512), tok.pad_token_id,
        str)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    actions = batch.action_mask.bool()
    print(f"\nhf on {torch.cuda.get_device_name()}: 64 episodes x {stats.total['turns'] / 64:.2f} "
          f"turns, {int(actions.sum())} action tokens in {elapsed:.2f} s "
          f"({actions.sum().item() / elapsed:.0f} tokens/s)")
    with torch.no_grad():
        engine.module.eval()
        logp = engine.module(batch.sequences.cuda(), batch.attention_mask.cuda(),
                             response_len=batch.response_len, temperature=0.8).cpu()
    diff = (logp - batch.logprobs)[actions].abs()
    # fp32 on one device, the key/value cache turn by turn against one forward of the whole
    # episode: a few float32 ulps of O(1) logits over a 256-wide model (tests/rollout/test_vllm.py);
    # 1e-4 catches an action scored in the wrong context (an observation missing or moved).
    assert diff.max() <= 1e-4, float(diff.max())
    observed = batch.response_attention.bool() & ~actions
    assert int(observed.sum()) == stats.total["observation_tokens"] > 0
    assert stats.total["turns"] == 4 * 64
