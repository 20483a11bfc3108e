"""Micro-batches by tokens end to end: the small GRPO run of test_grpo_job.py, once with
``actor.micro_batch_size=4`` (2 micro-batches of 4 sequences per rank and step) and once with
``actor.max_tokens_per_micro_batch=16`` (as many sequences as fit in 16 real tokens: counts
that differ between the 2 ranks, fillers on the rank with fewer). The update is the same
aggregate (docs/design.md, "Batching"), so the runs agree."""

from __future__ import annotations

import pytest

from tests.actors.test_grpo_job import SMALL
from tests.conftest import demo_cache, train

pytestmark = [pytest.mark.ray, pytest.mark.slow]

# Prompts of at most 8 tokens (the demo's are shorter) + 8 new tokens: 16 holds any sequence.
SHORT = [*SMALL, "cluster.num_devices=2", "data.max_prompt_length=8", "trainer.steps=2",
         "trainer.save_every=0"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("budget")
    by_rows = train(root / "rows", *SHORT, cache=demo_cache())
    by_tokens = train(root / "tokens", *SHORT, "actor.max_tokens_per_micro_batch=16",
                      cache=demo_cache())
    for run in (by_rows, by_tokens):
        assert run.returncode == 0, run.stderr
    return by_rows.rows, by_tokens.rows


def test_token_budget_micro_batches_take_the_same_update(runs):
    by_rows, by_tokens = runs
    assert [r["step"] for r in by_rows] == [r["step"] for r in by_tokens] == [0, 1]
    # Step 1 trains on the same rollout: the gradient (its norm) is the same sum of fp32 terms
    # in another order (relative error a few float32 ulps times the number of micro-batches).
    first_rows, first_tokens = by_rows[0], by_tokens[0]
    assert first_tokens["ppo/reward_mean"] == first_rows["ppo/reward_mean"]
    assert first_tokens["actor/grad_norm"] == pytest.approx(first_rows["actor/grad_norm"],
                                                            rel=1e-5)
    # Step 2 samples from the updated actor with the same generators: the same parameters up to
    # rounding give the same samples.
    for key in ("ppo/reward_mean", "ppo/response_length"):
        assert by_tokens[1][key] == by_rows[1][key]
    assert by_tokens[1]["actor/grad_norm"] == pytest.approx(by_rows[1]["actor/grad_norm"],
                                                            rel=1e-4)
