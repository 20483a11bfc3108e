"""OpenEnv environments (``rlhf_paro/envs/openenv.py``, the openenv extra) for real: the shipped
example's echo environment served by OpenEnv on 127.0.0.1, reached by OpenEnv's client, driving
episodes of the hf engine through the runner (``episodes.run``) and a two-step run of
``python -m rlhf_paro.train``. Without the extra these skip, but for the one line that names it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from rlhf_paro import envs, models, usercode
from rlhf_paro.config import ConfigError, ModelConfig
from rlhf_paro.rollout import PromptBatch, Sampling
from rlhf_paro.rollout import episodes
from rlhf_paro.rollout.hf import HFRollout
from tests import hf_assets
from tests.rollout.test_hf import TINY, Gathered

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = f"{ROOT / 'examples' / 'openenv_echo_env.py'}:EchoEnv"
ROWS, NEW_TOKENS = 6, 5


def backwards(text: str) -> str:
    return " ".join(reversed(text.split()))


def test_without_the_extra_the_example_fails_in_one_line_naming_it(monkeypatch):
    # As if not installed: the package and any of its modules an earlier import left in memory
    # (a module found there is returned without its package being looked at).
    for name in ["openenv", *(n for n in sys.modules if n.startswith("openenv."))]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.delitem(sys.modules, "rlhf_paro.envs.openenv", raising=False)
    with pytest.raises(ConfigError) as info:
        usercode.load_function(EXAMPLE, "env.function")
    assert str(info.value) == (
        f"env.function: {EXAMPLE.rpartition(':')[0]} fails on import: ModuleNotFoundError: "
        "OpenEnv environments need the openenv extra: pip install -e '.[openenv]'")


@pytest.fixture(scope="module")
def echo():
    """The example's wrapper, serving a subclass of its environment that records each session
    (the seed and row its reset got, the messages its steps got, whether it was closed) and
    echoes each message's words backwards: observations the model's own text cannot pass for."""
    pytest.importorskip("openenv.core", reason='needs the openenv extra: pip install -e '
                                               '".[openenv]"')
    wrapper = usercode.load_function(EXAMPLE, "env.function")
    example = sys.modules[wrapper.__module__]

    class Recorded(example.EchoEnvironment):
        sessions: list[Recorded] = []

        def __init__(self):
            super().__init__()
            self.reset_args, self.messages, self.closed = None, [], False
            Recorded.sessions.append(self)

        def reset(self, seed=None, episode_id=None, **kwargs):
            self.reset_args = {"seed": seed, **kwargs}
            return super().reset(seed, episode_id)

        def step(self, action, timeout_s=None, **kwargs):
            self.messages.append(action.message)
            observation = super().step(action, timeout_s)
            observation.echoed = backwards(observation.echoed)
            return observation

        def close(self):
            self.closed = True

    class Echo(wrapper):
        url = None
        served = (Recorded, example.EchoAction, example.EchoObservation)

    return Echo, Recorded, example


@pytest.mark.slow
def test_episodes_of_a_served_openenv_environment_carry_its_observations_and_rewards(echo):
    Echo, Recorded, _ = echo
    tokenizer = hf_assets.word_tokenizer(chat=False)
    model = models.build_model("actor", ModelConfig(config=TINY), len(tokenizer), seed=3)
    engine = HFRollout(Gathered(model), tokenizer.pad_token_id, tokenizer.eos_token_id,
                       torch.device("cpu"))
    texts = ["count : " + " ".join(hf_assets.SYMBOLS[i:i + 1 + i % 3]) for i in range(ROWS)]
    rows = [{"prompt": text, "start": i} for i, text in enumerate(texts)]
    prompts = PromptBatch.left_padded([tokenizer(t)["input_ids"] for t in texts],
                                      tokenizer.pad_token_id)
    seeds = [envs.sample_seed(7, 0, i) for i in range(ROWS)]
    runner = envs.EnvRunner(Echo, "Echo", num_workers=4, timeout_s=60)
    torch.manual_seed(0)
    try:
        batch, stats = episodes.run(
            engine, prompts, rows, seeds, runner, envs.Observations(tokenizer, chat=False),
            lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
            Sampling(NEW_TOKENS, temperature=1.0), episodes.Budget(4, 64),
            tokenizer.pad_token_id, lambda i: f"at step 0, sample {i}")
    finally:
        runner.close()

    # One session per sample, each reset with its sample's seed and row, each closed.
    assert len(Recorded.sessions) == ROWS
    session = {s.reset_args["start"]: s for s in Recorded.sessions}
    assert sorted(session) == list(range(ROWS))
    for i in range(ROWS):
        assert session[i].reset_args == {"seed": seeds[i], **rows[i]}
        assert session[i].closed
    # The environment ends each episode at its third message (done), before env.max_turns=4.
    assert stats.total["turns"] == stats.total["steps"] == 3 * ROWS
    assert stats.total["truncated_max_turns"] == stats.total["truncated_max_total_tokens"] == 0

    real = batch.response_attention.bool()
    actions = batch.action_mask.bool()
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    scores, observed, reversals = [], 0, 0
    for row in range(ROWS):
        sent = session[row].messages  # what the server received, three messages
        assert len(sent) == 3
        tokens = batch.responses[row]
        # The model's action tokens are what the server received...
        said = tokenizer.decode(tokens[real[row] & actions[row]], skip_special_tokens=True)
        assert said.split() == " ".join(sent).split()
        # ...and the tokens between them, attended and never actions, are the server's echoes of
        # the first two (the third ended the episode; an empty echo adds no tokens), in order.
        echoes = [encode(backwards(m)) for m in sent[:2]]
        reversals += sum(e != encode(m) for e, m in zip(echoes, sent))
        holes, run = [], []
        for token, is_real, is_action in zip(tokens.tolist(), real[row], actions[row]):
            if is_real and not is_action:
                run.append(token)
            elif run:
                holes, run = holes + [run], []
        assert not run  # every episode ends with an action
        assert holes == [e for e in echoes if e]
        observed += sum(map(len, echoes))
        scores.append(sum(0.1 * len(m.split()) for m in sent))
    assert stats.total["observation_tokens"] == observed
    assert reversals > 0  # some echoes are not the message itself: the holes came from the server
    # The scores are the sums of the server's rewards (0.1 a word): at most 1.5, so float32
    # holds them within 1e-7; 1e-6 is far below the 0.1 a word more or less would move them.
    torch.testing.assert_close(batch.scores, torch.tensor(scores), atol=1e-6, rtol=0)


@pytest.mark.slow
def test_an_environment_that_raises_on_the_server_stops_the_step_in_one_line(echo):
    Echo, _, example = echo

    class Raising(example.EchoEnvironment):
        def step(self, action, timeout_s=None, **kwargs):
            raise ValueError(f"no echo for {action.message!r}\ntoday")

    class Broken(Echo):
        served = (Raising, *Echo.served[1:])

    runner = envs.EnvRunner(Broken, "Broken", num_workers=2, timeout_s=60)
    try:
        opened, _ = runner.start([{"prompt": "count : a"}], [0], lambda i: f"at step 4, sample {i}")
        with pytest.raises(envs.EnvError) as info:
            runner.step(opened, ["a b"], lambda i: f"at step 4, sample {i} (turn 0)")
        runner.end(opened, lambda i: f"at step 4, sample {i}")
    finally:
        runner.close()
    assert str(info.value) == ("Broken.step raised at step 4, sample 0 (turn 0) (RuntimeError: "
                               "Server error: no echo for 'a b')")


@pytest.mark.slow
def test_the_example_reaches_a_server_started_apart_by_its_address(echo):
    # The example's own app under uvicorn, as a user serves it; the wrapper with its url set.
    server = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "--app-dir", str(ROOT / "examples"),
         "openenv_echo_env:app", "--host", "127.0.0.1", "--port", "0"],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, stderr=subprocess.PIPE, text=True)
    try:
        for line in server.stderr:  # uvicorn says where it listens once it does
            if "Uvicorn running on " in line:
                url = line.split("Uvicorn running on ")[1].split()[0]
                break
        else:
            pytest.fail(f"the server ended with {server.wait()} before it listened")
        Wrapper = usercode.load_function(EXAMPLE, "env.function")
        env = type("Apart", (Wrapper,), {"url": url, "served": None})(prompt="count : a")
        assert env.reset(seed=3) is None  # the reset's empty echo
        assert env.step("a b") == ("a b", pytest.approx(0.2), False)
        assert env.step("") == (None, 0.0, False)
        assert env.step("c") == ("c", pytest.approx(0.1), True)
        env.close()
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_a_wrapper_without_action_or_observation_is_refused_naming_what_each_does():
    pytest.importorskip("openenv.core", reason='needs the openenv extra: pip install -e '
                                               '".[openenv]"')
    from rlhf_paro.envs.openenv import OpenEnv

    base = {"url": "http://127.0.0.1:1"}
    no_action = type("NoAction", (OpenEnv,), {**base, "observation": lambda self, o: o})
    no_observation = type("NoObservation", (OpenEnv,), {**base, "action": lambda self, t: t})
    with pytest.raises(ValueError) as info:
        no_action(prompt="a")
    assert str(info.value) == ("NoAction defines no action(): the model's turn as the action "
                               "its client's step takes")
    with pytest.raises(ValueError) as info:
        no_observation(prompt="a")
    assert str(info.value) == ("NoObservation defines no observation(): OpenEnv's observation "
                               "as text, chat messages or None")


@pytest.mark.slow
def test_a_reset_s_observation_a_missing_reward_and_a_clean_close(echo, capfd):
    Echo, Recorded, example = echo

    class Greeting(Recorded):
        """Greets at its reset; its steps echo without a reward (OpenEnv's None)."""

        def reset(self, seed=None, episode_id=None, **kwargs):
            super().reset(seed, episode_id, **kwargs)
            return example.EchoObservation(echoed="hello there")

        def step(self, action, timeout_s=None, **kwargs):
            self.messages.append(action.message)
            return example.EchoObservation(echoed=action.message, reward=None, done=False)

    class Greeter(Echo):
        served = (Greeting, *Echo.served[1:])

    env = Greeter(prompt="count : a")
    assert env.reset(seed=1) == "hello there"  # the reset's observation reaches the episode
    assert env.step("a b") == ("a b", 0.0, False)  # no reward is 0
    session = Recorded.sessions[-1]
    env.close()
    # The server ends the session as asked: the environment closed and nothing on the server's
    # log (uvicorn's, on this process's stderr). A connection dropped without the close message
    # left a traceback there for every episode.
    deadline = time.monotonic() + 10
    while not session.closed and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    assert session.closed
    assert "Traceback" not in capfd.readouterr().err
    # The sessions' event loop runs in a daemon thread: it never holds a finished process open.
    assert [t.daemon for t in threading.enumerate() if t.name == "openenv"] == [True]


@pytest.mark.ray
@pytest.mark.slow
def test_a_run_of_train_with_the_example_reaches_its_server_every_step(echo, tmp_path):
    model = hf_assets.save_llama(tmp_path / "model", hf_assets.word_tokenizer(chat=False))
    prompts = hf_assets.write_prompts(tmp_path / "prompts.jsonl", 16)
    out = tmp_path / "run"
    args = [f"actor.path={model}", f"data.train_files={prompts}", f"env.function={EXAMPLE}",
            "env.reward=env", "env.max_turns=4", "reward.path=null", "cluster.num_devices=1",
            "cluster.group_size=1", "actor.strategy=NNN", "rollout.n=2",
            "algorithm.adv_estimator=grpo", "algorithm.kl_coef=0", "ppo.rollout_batch_size=4",
            "ppo.mini_batch_size=8", f"ppo.max_new_tokens={NEW_TOKENS}",
            "data.max_prompt_length=12", "trainer.steps=2", f"trainer.output_dir={out}",
            "logger.wandb.mode=disabled", "logger.progress=false"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    env.pop("ECHO_ENV_URL", None)  # each actor serves the environment itself
    proc = subprocess.run([sys.executable, "-m", "rlhf_paro.train", *args], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [0, 1]
    for s in steps:
        # Every episode ran until the environment's done, after its third message.
        assert s["env/turns_mean"] == 3.0 and s["env/truncated_fraction"] == 0.0
        # Scores are 0.1 a word of the three messages, at most 5 tokens each.
        assert 0.0 < s["ppo/reward_mean"] <= 1.5
        assert s["env/observation_tokens"] > 0
