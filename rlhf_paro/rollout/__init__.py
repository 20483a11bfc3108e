"""Rollout engines: what makes a rank's responses, behind one seam (docs/design.md, "Rollout").

An engine lives in the actor's worker process, one per actor rank, and samples that rank's
prompts. The actor knows only the ``Rollout`` protocol and the registry: it builds the engine
``rollout.engine`` names at setup, calls ``generate`` every step, and, once an engine holds its
own copy of the weights, ``sync`` after each update and ``sleep``/``wake`` around training. A new
engine is one module whose factory registers itself (``base.register_engine``), imported here.
"""

from __future__ import annotations

from rlhf_paro.rollout import hf, vllm
from rlhf_paro.rollout.base import ENGINES, EngineContext, Requests, Rollout, Sampling, build, \
    check, generation_seed, keeps_copy, lora_sync, max_len, needs_sync, register_engine, seeded
from rlhf_paro.rollout.batch import PromptBatch, RolloutBatch, join, response_mask

__all__ = ["ENGINES", "EngineContext", "PromptBatch", "Requests", "Rollout", "RolloutBatch",
           "Sampling", "build", "check", "generation_seed", "hf", "join", "keeps_copy", "lora_sync",
           "max_len", "needs_sync",
           "register_engine", "response_mask", "seeded", "vllm"]
