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
