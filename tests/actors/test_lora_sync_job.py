"""A LoRA actor's replica through the command line (``actor.lora.sync``): GRPO with adapters of
rank 8 on q, k, v and o, a replica of its own one step off (``rollout.num_devices=1
rollout.max_staleness=1``), 10 steps, on each engine.

    merged     actor.lora.sync=merged: the whole model, adapters merged in, at every sync
    adapters   the default: the base weights with the first sync, the adapters alone after
    resumed    (hf) adapters' step-5 checkpoint resumed: the base goes again, the same rows
"""

from __future__ import annotations

import pytest

from rlhf_paro import models
from rlhf_paro.actors import checkpoint
from rlhf_paro.ppo.data import vocab_sizes
from rlhf_paro.rollout import vllm
from tests.actors.test_async_job import GRPO
from tests.confs import load
from tests.conftest import SMALL, compared, demo_cache, train

pytestmark = [pytest.mark.ray, pytest.mark.slow]

STEPS = 10
RESUME_AT = 5  # the hf run resumes from its checkpoint of this step
LORA = ["actor.lora.enabled=true", "actor.lora.r=8",
        "actor.lora.target_modules=[q_proj,k_proj,v_proj,o_proj]", "rollout.num_devices=1",
        "rollout.max_staleness=1", f"trainer.steps={STEPS}"]
# vLLM's CPU attention takes heads of 32 and more (tests/actors/test_vllm_job.py).
ENGINES = {"hf": [], "vllm": ["task.model.hidden_size=64", "task.model.intermediate_size=64",
                              "rollout.engine=vllm"]}


@pytest.mark.parametrize("engine", [
    "hf", pytest.param("vllm", marks=pytest.mark.skipif(
        not vllm.installed(), reason='needs the vllm extra: pip install -e ".[vllm]"'))])
def test_after_the_first_sync_only_the_adapters_travel_and_the_rows_are_the_merged_ones(
        tmp_path, engine):
    args = [*GRPO, *LORA, *ENGINES[engine]]
    cache = demo_cache()
    merged = train(tmp_path / "merged", *args, "actor.lora.sync=merged", cache=cache)
    adapters = train(tmp_path / "adapters", *args, f"trainer.save_every={RESUME_AT}",
                     cache=cache)
    assert merged.returncode == 0, merged.stderr
    assert adapters.returncode == 0, adapters.stderr
    cfg = load([*SMALL, f"task.cache_dir={cache}", *args])  # the config train() runs
    whole, trained = models.count_parameters("actor", cfg.actor, vocab_sizes(cfg)["actor"])
    model_bytes, adapter_bytes = 4 * whole - 4 * trained, 4 * trained  # fp32
    sent = [r.get("actor/comm/transfer/intra_bytes", 0) for r in adapters.rows]
    base = [r.get("actor/comm/base_transfer/intra_bytes", 0) for r in adapters.rows]
    # The base weights once, in the first step's row, under their own phase; then each sync
    # sends the adapters alone, one for each policy the replica generates with (steps 0 and 1
    # both sample the first policy, one step off): at most two in a row (the first step's
    # also holds the sync of the rollout launched ahead of the second).
    assert base == [model_bytes] + [0] * (STEPS - 1)
    assert all(s <= 2 * adapter_bytes for s in sent), (sent, adapter_bytes)
    assert sum(sent) == (STEPS - 1) * adapter_bytes
    # The merged sync sends the whole model each time.
    assert sum(r.get("actor/comm/transfer/intra_bytes", 0)
               for r in merged.rows) == (STEPS - 1) * model_bytes
    assert [r["step"] for r in adapters.rows] == list(range(STEPS))
    for want, got in zip(merged.rows, adapters.rows):
        # The same tokens from the same per-step random streams: the trainer's arithmetic in
        # the same order, tests/test_trainer.py's fp32 bound (1e-6 relative).
        assert compared(got) == pytest.approx(compared(want), rel=1e-6, abs=0), got["step"]
        # The engine's log-probs against the trainer's: a rollout one update old after step 0,
        # so the distance is mostly the update's, the same in both runs. The hf replica merges
        # the adapters with the actor's own expression (models.lora_merged): the same engine
        # weights, the same distance to the bit. vLLM's LoRA layers compute x W + s (x A) B
        # unmerged, in another order than the merged weights: each engine's log-probs are
        # within rollout/logprob_diff's fp32 bound of the policy's (1e-4,
        # tests/rollout/test_lora_sync.py derives it), so the two distances within twice it.
        diff, merged_diff = got["rollout/logprob_diff_max"], want["rollout/logprob_diff_max"]
        if engine == "hf":
            assert diff == merged_diff, got["step"]
        assert abs(diff - merged_diff) <= 2e-4, got["step"]
    assert adapters.rows[0]["rollout/logprob_diff_max"] <= 1e-4  # the policy that sampled it
    if engine == "hf":  # one engine is enough for what a resume adds: the base goes again
        step = checkpoint.checkpoint_dir(adapters.out, RESUME_AT)
        resumed = train(tmp_path / "resumed", *args, f"trainer.resume={step}", cache=cache)
        assert resumed.returncode == 0, resumed.stderr
        # New processes: the replica's engine has no weights until the base comes again.
        assert resumed.rows[0]["actor/comm/base_transfer/intra_bytes"] == model_bytes
        for want, got in zip(adapters.rows[RESUME_AT:], resumed.rows, strict=True):
            assert got["step"] == want["step"]
            assert compared(got) == pytest.approx(compared(want), rel=1e-6, abs=0), got["step"]
