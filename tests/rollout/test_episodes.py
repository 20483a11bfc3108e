"""Multi-turn episodes through the actor (``rollout/episodes.py``) on both engines, against a
deterministic environment: the same greedy episodes token for token from ``hf`` and ``vllm``,
observations attended and never actions, and each engine's log-probs of its sampled actions
within 1e-4 of the trainer's (docs/design.md, "Multi-turn episodes"). The hf engine's checks run
without vLLM; each engine is the actor's own, built with its model as a run builds it.

On each engine, each episode its own loop (``episodes.stream``, ``rollout.streaming``) against
the turn by turn loop (``episodes.run``) on the same engine: the same greedy episodes; a sampled
episode's tokens its own, whatever else the engine decodes; an episode that never waits for
another's environment; an environment's failure or deadline one line, the engine left with
nothing in flight."""

from __future__ import annotations

import time

import pytest
import torch

from rlhf_paro.rollout import vllm as vllm_engine
from tests.confs import load
from tests.dist_utils import run_distributed
from tests.hf_assets import SYMBOLS, word_tokenizer, write_prompts

pytestmark = [pytest.mark.dist, pytest.mark.slow]

# Answers each action with the two symbols after its last one (an <unk>-free observation of two
# tokens), rewards the action's length; the episode is done after the third action.
RELAY = f'''
SYMBOLS = {SYMBOLS!r}

class Relay:
    def __init__(self, prompt, start):
        self.turn, self.start = 0, start

    def reset(self):
        return None

    def step(self, action):
        self.turn += 1
        words = [w for w in action.split() if w in SYMBOLS]
        last = SYMBOLS.index(words[-1]) if words else self.start
        observation = " ".join(SYMBOLS[(last + k) % 16] for k in (1, 2))
        return observation, len(action.split()) / 8, self.turn == 3
'''
NEW_TOKENS = 5
ROWS = 12
STREAMED = 8  # the episodes of the streaming checks (vllm)
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


def _model(directory):
    """A random Llama with heads of 32 (vLLM's CPU attention takes none smaller), saved with a
    word-level tokenizer as a user's model is."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = word_tokenizer(chat=False)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
                         eos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def _argv(tmp, engine: str) -> list[str]:
    return [f"actor.path={tmp / 'model'}", f"data.train_files={tmp / 'prompts.jsonl'}",
            f"env.function={tmp / 'relay.py'}:Relay", "env.reward=env", "env.max_turns=4",
            "reward.path=null", "cluster.num_devices=1", "cluster.group_size=1",
            "actor.strategy=NNN", f"rollout.engine={engine}", "rollout.n=1",
            "algorithm.adv_estimator=reinforce_pp", "algorithm.kl_coef=0",
            f"ppo.rollout_batch_size={ROWS}", f"ppo.mini_batch_size={ROWS}",
            f"ppo.max_new_tokens={NEW_TOKENS}", "ppo.temperature=0.8", "data.max_prompt_length=12"]


def _rank(rank: int, world_size: int, tmp, engine: str) -> dict:
    """The actor with the rollout engine ``engine`` (built with its model, as a run builds it):
    greedy episodes, sampled ones, and its log-probs against the trainer's."""
    from rlhf_paro.actors.actor import ActorWorker
    from rlhf_paro.runs import Prompts

    cfg = load(_argv(tmp, engine))
    actor = ActorWorker(cfg, "actor", rank, world_size)
    actor.shard_model()
    prompts = Prompts(cfg, None)
    per_rank, rows = prompts.split(prompts.stream.next(ROWS))
    greedy, stats = actor.generate(per_rank[0], rows[0], greedy=True, step=0)
    sampled, _ = actor.generate(per_rank[0], rows[0], step=1)
    diff = actor.old_logprobs(1, sampled)["mismatch"]
    out = {"greedy": greedy, "stats": stats, "sampled": sampled, "diff": diff}
    out["streaming"] = _streaming(actor, per_rank[0])
    if engine == "vllm":  # on the engine built here (building one costs seconds)
        from rlhf_paro.metrics import TRAIN

        with actor.timed(TRAIN):  # what the rank's update computes on
            out["threads"] = (actor._threads[TRAIN], torch.get_num_threads())
    return out


def _in_flight(engine) -> int:
    """Requests an engine holds: vLLM's unfinished ones; hf's waiting or decoding."""
    if hasattr(engine, "llm"):
        return engine.llm.llm_engine.get_num_unfinished_requests()
    decoding = engine._decoding
    return len(engine._waiting) + (decoding.running if decoding is not None else 0)


def _streaming(actor, prompts) -> dict:
    """Each episode its own loop (``episodes.stream``) on the actor's engine, against the turn
    by turn loop on the same engine; the first ``STREAMED`` prompts."""
    from rlhf_paro.envs import EnvError, EnvRunner, Observations
    from rlhf_paro.rollout import PromptBatch, Sampling, episodes

    engine, tok = actor.generation.engine, actor.generation.tokenizer
    contexts = [ids[mask.bool()].tolist()
                for ids, mask in zip(prompts.input_ids, prompts.attention_mask)][:STREAMED]
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

    everyone = list(range(STREAMED))
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
        out[f"{name}_left"] = _in_flight(engine)
    # And the engine serves the next rollout as before.
    out["after"] = play(episodes.stream, relay_env, everyone, greedy)[0]
    return out


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("episodes")
    _model(tmp / "model")
    write_prompts(tmp / "prompts.jsonl", 32)
    (tmp / "relay.py").write_text(RELAY)
    return tmp


@pytest.fixture(scope="module")
def hf(assets) -> dict:
    return run_distributed(_rank, 1, assets, "hf", timeout=600)[0]


@pytest.fixture(scope="module")
def vllm(assets) -> dict:
    if not vllm_engine.installed():
        pytest.skip('needs the vllm extra: pip install -e ".[vllm]"')
    return run_distributed(_rank, 1, assets, "vllm", timeout=600)[0]


def test_greedy_episodes_take_three_actions_with_observations_between(hf):
    # Every episode ran three actions, two observations of two tokens between them: holes.
    stats, greedy = hf["stats"], hf["greedy"]
    env = stats.env.total
    assert env["turns"] == 3 * ROWS and env["observation_tokens"] == 4 * ROWS
    observed = (greedy.response_attention == 1) & (greedy.action_mask == 0)
    assert observed.sum(-1).tolist() == [4] * ROWS


def test_a_rank_with_a_vllm_engine_trains_on_the_threads_it_is_given(vllm):
    # vLLM's CPU worker makes torch.set_num_threads do nothing once its engine is built: the
    # rank's update ran on the one thread it had then (half speed on two cores).
    wanted, got = vllm["threads"]
    assert got == wanted, (got, wanted)


def test_greedy_episodes_of_hf_and_vllm_are_the_same_tokens(hf, vllm):
    hf, vllm = hf["greedy"], vllm["greedy"]
    assert torch.equal(hf.sequences, vllm.sequences)
    assert torch.equal(hf.attention_mask, vllm.attention_mask)
    assert torch.equal(hf.action_mask, vllm.action_mask)
    assert torch.equal(hf.scores, vllm.scores)


@pytest.mark.parametrize("name", ["hf", "vllm"])
def test_observations_are_attended_and_never_actions(request, name):
    batch = request.getfixturevalue(name)["sampled"]
    real = batch.response_attention.bool()
    actions = batch.action_mask.bool()
    assert bool((actions <= real).all())  # actions are real tokens
    # Each row's real response tokens are contiguous from its first column (attended).
    assert torch.equal(real, real.long().cumprod(-1).bool())
    # The engine's log-probs lie on actions only.
    assert bool((batch.logprobs[~actions] == 0).all())
    assert bool((batch.logprobs[actions] < 0).all())
    # Every episode ends with an action (its last real token).
    last = real.sum(-1) - 1
    assert bool(actions[torch.arange(len(batch)), last].all())


@pytest.mark.parametrize("name", ["hf", "vllm"])
def test_engine_log_probs_of_sampled_actions_are_the_trainers(request, name):
    # fp32 on both sides, log softmax(logits / 0.8) of the same weights by different paths (a
    # key/value cache turn by turn against one packed forward of the whole episode): about 1e-6
    # (tests/rollout/test_vllm.py); 1e-4 is the bound and catches a log-prob taken in
    # the wrong context (an observation's tokens missing or moved: differences of order 0.1).
    episodes = request.getfixturevalue(name)
    diff = episodes["diff"]
    assert diff.total["logprob_diff_count"] == float(episodes["sampled"].action_mask.sum())
    assert diff.most["logprob_diff"] <= 1e-4


# -- each episode its own loop (both engines) -----------------------------------------------

ENGINES = ["hf", "vllm"]

def _real(batch, row):
    return batch.sequences[row][batch.attention_mask[row].bool()].tolist()


@pytest.mark.parametrize("name", ENGINES)
def test_greedy_episodes_streamed_are_the_turn_by_turn_ones(request, name):
    streamed = request.getfixturevalue(name)["streaming"]
    run, stream = streamed["greedy_run"], streamed["greedy_stream"]
    assert torch.equal(run.sequences, stream.sequences)
    assert torch.equal(run.attention_mask, stream.attention_mask)
    assert torch.equal(run.action_mask, stream.action_mask)
    assert torch.equal(run.scores, stream.scores)
    assert torch.equal(streamed["after"].sequences, run.sequences)


@pytest.mark.parametrize("name", ENGINES)
def test_a_sampled_episode_is_the_same_alone_as_among_others(request, name):
    streamed = request.getfixturevalue(name)["streaming"]
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
    assert len({tuple(_real(batch, k)) for k in range(STREAMED)}) == STREAMED


@pytest.mark.parametrize("name", ENGINES)
def test_no_episode_waits_for_another_s_environment(request, name):
    streamed = request.getfixturevalue(name)["streaming"]
    # Episode 0's steps take 1 s each, the others' none. Turn by turn, every episode's second
    # action waits for episode 0's first step: none ends before 1 s. Streamed, the other seven
    # play both turns at once and end well before it.
    run, stream = streamed["paced_run"], streamed["paced_stream"]
    assert run.least["first_sample_s"] >= SLOW_S
    assert stream.least["first_sample_s"] < SLOW_S / 2
    for stats in (run, stream):
        total = stats.total
        assert stats.most["last_sample_s"] >= 2 * SLOW_S
        assert total["turns"] == 2 * STREAMED and total["steps"] == 2 * STREAMED
        # The engine had nothing to decode at least while episode 0's second step ran, alone.
        assert SLOW_S <= total["engine_idle_s"] <= total["rollout_s"]
        latencies = sorted(stats.each["step_latencies_s"])
        assert len(latencies) == 2 * STREAMED
        assert latencies[-2] >= SLOW_S > latencies[-3]


@pytest.mark.parametrize("name", ENGINES)
def test_an_environment_that_fails_or_stalls_is_one_line_and_nothing_is_left_in_flight(
        request, name):
    streamed = request.getfixturevalue(name)["streaming"]
    assert streamed["failing"] == ("Env.step raised at step 7, sample 3 (turn 1) (ValueError: "
                                   "sandbox gone)")
    assert streamed["stuck"] == "Env.step took longer than env.timeout_s=1 at step 7, sample 5 " \
                                "(turn 0)"
    assert streamed["failing_left"] == streamed["stuck_left"] == 0
