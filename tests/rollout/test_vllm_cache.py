"""The vllm engine's pure parts (no vLLM needed): the key/value cache a CPU engine is given."""

import math
from types import SimpleNamespace

import pytest
import torch

from rlhf_paro.rollout.vllm import BLOCK_TOKENS, kv_cache_bytes

# 2 blocks, 4 key/value heads of 32: a token's key and value take 2 x 2 x 4 x 32 x 4 bytes in fp32.
CONFIG = SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                         hidden_size=128)
TOKEN_BYTES = 2 * 2 * 4 * 32 * 4


@pytest.mark.parametrize("longest, num_seqs", [(1, 1), (31, 1), (32, 1), (33, 1), (33, 16),
                                               (272, 64)])
def test_the_cpu_cache_holds_every_sequence_in_whole_blocks_besides_the_null_block(longest,
                                                                                  num_seqs):
    blocks = kv_cache_bytes(CONFIG, torch.float32, longest, num_seqs) // (TOKEN_BYTES
                                                                         * BLOCK_TOKENS)
    # vLLM keeps one block back (its null block); each sequence takes whole blocks of the rest,
    # ceil(longest / block) of them, and so a cache of longest x num_seqs tokens falls short
    # whenever longest is not a multiple of the block (33 tokens need two blocks of 32).
    needed = num_seqs * math.ceil(longest / BLOCK_TOKENS)
    assert needed <= blocks - 1 <= needed + num_seqs  # room for all, at most a block spare each


def test_a_cuda_engine_sleeps_and_takes_the_resolved_share_a_cpu_one_a_sized_cache():
    """Defect caught: a CUDA engine built without sleep mode (its sleep() and wake_up() then
    fail), one not given the planner's share, or a bf16 actor's engine in another dtype."""
    from rlhf_paro.plan import resolve_auto
    from rlhf_paro.rollout.vllm import engine_kwargs
    from tests.confs import INLINE, load

    argv = [*INLINE, "rollout.engine=vllm", "actor.precision=bf16"]
    hf = SimpleNamespace(**vars(CONFIG), max_position_embeddings=64)
    cuda = resolve_auto(load([*argv, "cluster.device=cuda", "cluster.memory_gb=1"],
                             engine_check=False))
    share = cuda.rollout.gpu_memory_utilization
    assert share != "auto" and 0 < share <= 0.9
    kwargs = engine_kwargs(cuda, hf, "cuda", seed=1)
    assert kwargs["enable_sleep_mode"] is True and kwargs["gpu_memory_utilization"] == share
    assert kwargs["dtype"] == "bfloat16" and "kv_cache_memory_bytes" not in kwargs
    cpu = engine_kwargs(load(argv, engine_check=False), hf, "cpu", seed=1)
    assert "enable_sleep_mode" not in cpu and "gpu_memory_utilization" not in cpu
    assert cpu["kv_cache_memory_bytes"] > 0 and cpu["dtype"] == "bfloat16"
