"""A reward worker scoring through a reward server (``reward.url``), in this process: no model,
no process group, and the extras of the items in its ``reward_sums`` (``score_sums``)."""

from __future__ import annotations

import os

import threading

import pytest
import torch
import torch.distributed as dist

from rlhf_paro.actors.reward import RewardWorker
from rlhf_paro.actors.worker import Worker
from rlhf_paro.config import Config, ConfigError, DataConfig, ModelConfig
from rlhf_paro.metrics import Sums
from rlhf_paro import usercode
from rlhf_paro.ppo import data
from rlhf_paro.ppo.task import task_from_config
from rlhf_paro.rollout import PromptBatch, RolloutBatch, join
from rlhf_paro.reward_server import RewardServer
from tests import hf_assets
from tests.confs import INLINE, load

TOKEN_ENV = "RLHF_PARO_TEST_WORKER_TOKEN"
FUNCTIONS = '''
def words(prompts, responses, start):
    # An extra only where the row's start is even: the other items lack it.
    return [{"score": float(len(r.split())), "start": float(s)} if s % 2 == 0
            else float(len(r.split())) for r, s in zip(responses, start)]

def first_word(prompts, responses, start):
    return [{"score": float(r.split()[0] == "c"), "start": -1.0} for r in responses]
'''
RESPONSES = [["c", "d"], ["e"], ["f", "g", "h"], ["c"]]
STARTS = [2, 3, 4, 5]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("reward")
    fns = root / "fns.py"
    fns.write_text(FUNCTIONS)
    return {"llama": hf_assets.save_llama(root / "llama", hf_assets.word_tokenizer()),
            "train": hf_assets.write_prompts(root / "train.jsonl", 8), "fns": fns}


@pytest.fixture(scope="module")
def server(assets):
    spec = f"{assets['fns']}:words"
    server = RewardServer(("127.0.0.1", 0), usercode.load_function(spec), spec, "tok")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.url
    finally:
        server.shutdown()
        server.server_close()


def config(assets, url: str, **reward) -> Config:
    return Config(actor=ModelConfig(path=str(assets["llama"])),
                  reward=ModelConfig(url=url, token_env=TOKEN_ENV, **reward),
                  data=DataConfig(train_files=str(assets["train"])))


def rollout(assets) -> tuple[RolloutBatch, dict]:
    """Four responses of the words ``RESPONSES``, right-padded, after a two-token prompt."""
    tokenizer = data.load_tokenizer(str(assets["llama"]))
    width = max(map(len, RESPONSES))
    ids = torch.full((len(RESPONSES), width), tokenizer.pad_token_id)
    mask = torch.zeros_like(ids)
    for i, words in enumerate(RESPONSES):
        ids[i, :len(words)] = torch.tensor(tokenizer.convert_tokens_to_ids(words))
        mask[i, :len(words)] = 1
    prompt = torch.full((len(RESPONSES), 2), tokenizer.bos_token_id)
    rows = {"texts": ["count : a b"] * len(RESPONSES), "columns": {"start": STARTS}}
    return RolloutBatch(torch.cat([prompt, ids], 1), torch.cat([torch.ones_like(prompt), mask], 1),
                        mask.float()), rows


def test_a_server_reward_joins_no_group_and_sums_its_extras_for_the_metrics(assets, server,
                                                                           monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "tok")
    monkeypatch.setattr(Worker, "setup", lambda *args: pytest.fail("joined a process group"))
    monkeypatch.setattr(Worker, "serve_rendezvous",
                        lambda *args: pytest.fail("served a rendezvous store"))
    reward = RewardWorker(config(assets, server), "reward", 0, 1)
    host, port = reward.serve_rendezvous()
    assert port == 0  # no store listens for it
    # Its pid, as every worker's, for workers.json.
    assert reward.setup(host, port) == os.getpid()
    assert reward.engine is None and not dist.is_initialized()
    batch, rows = rollout(assets)
    given = reward.score(2, batch, rows)
    torch.testing.assert_close(given["scores"], torch.tensor([2., 1., 3., 1.]))
    # Starts 2 and 4 are even: those two items carry the extra, the sum of which is 6.
    assert given["reward_sums"] == Sums(total={"count": 4.0, "task_score": 7.0,
                                               "reward/start": 6.0},
                                        counts={"reward/start": 2.0})
    report = given["reward_report"]
    assert report.time_s["inference"] > 0
    # A server reads the real tokens, no padding: 2 prompt tokens per response and its words.
    real = 2 * len(RESPONSES) + sum(map(len, RESPONSES))
    assert (report.tokens, report.real_tokens) == (real, real)


def test_a_score_with_its_report_hands_over_that_scoring_s_metering_once(assets, server,
                                                                         monkeypatch):
    # The driver takes a modelless reward's report from its score call: a report call of its
    # own would queue behind the score of a rollout launched ahead. The scoring's time and
    # tokens are in that report, and only there (the next report starts from nothing).
    monkeypatch.setenv(TOKEN_ENV, "tok")
    reward = RewardWorker(config(assets, server), "reward", 0, 1)
    batch, rows = rollout(assets)
    given = reward.score(1, batch, rows)
    report = given["reward_report"]
    torch.testing.assert_close(given["scores"], torch.tensor([2., 1., 3., 1.]))
    assert given["reward_sums"].total["task_score"] == 7.0
    real = 2 * len(RESPONSES) + sum(map(len, RESPONSES))
    assert report.real_tokens == real and report.time_s["inference"] > 0
    after = reward.report()
    assert (after.real_tokens, after.time_s) == (0, {})


def test_the_score_function_gives_task_score_and_its_extras_win_a_shared_name(assets, server,
                                                                              monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "tok")
    cfg = config(assets, server, score_function=f"{assets['fns']}:first_word")
    reward = RewardWorker(cfg, "reward", 0, 1)
    batch, rows = rollout(assets)
    given = reward.score(1, batch, rows)
    torch.testing.assert_close(given["scores"], torch.tensor([2., 1., 3., 1.]))
    # Two responses start with "c"; every item of the score function says start -1.
    assert given["reward_sums"] == Sums(total={"count": 4.0, "task_score": 2.0,
                                               "reward/start": -4.0},
                                        counts={"reward/start": 4.0})


def test_a_token_variable_missing_where_the_worker_runs_is_one_config_error(assets, server,
                                                                           monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "tok")
    cfg = config(assets, server)
    monkeypatch.delenv(TOKEN_ENV)  # set where the run started, not on the worker's node
    with pytest.raises(ConfigError, match=f"^reward.token_env: the environment variable "
                                          f"{TOKEN_ENV} is not set on the reward worker's node"):
        RewardWorker(cfg, "reward", 0, 1)


def test_a_token_read_with_a_trailing_newline_is_sent_without_it(assets, server, monkeypatch):
    # As a secret mounted from a file often ends: before, the newline went into the header and
    # the error that refused it printed the token.
    monkeypatch.setenv(TOKEN_ENV, "tok\n")
    reward = RewardWorker(config(assets, server), "reward", 0, 1)
    batch, rows = rollout(assets)
    torch.testing.assert_close(reward.score(0, batch, rows)["scores"],
                               torch.tensor([2., 1., 3., 1.]))
    monkeypatch.setenv(TOKEN_ENV, "to\x1bk")
    with pytest.raises(ConfigError) as err:
        RewardWorker(config(assets, server), "reward", 0, 1)
    assert str(err.value).startswith(f"reward.token_env: the value of the environment variable "
                                     f"{TOKEN_ENV} holds a control character")


def test_without_prompt_files_the_reward_reports_the_task_s_score_the_one_source(monkeypatch):
    # The task's own prompts: the reward workers score the rollout by the task's rule, which is
    # what ppo/task_score logs (the actor scores nothing). The reward model itself is stubbed.
    cfg = load(INLINE)
    reward = RewardWorker(cfg, "reward", 0, 1)
    monkeypatch.setattr(reward, "in_micro_batches", lambda batch, fn: torch.zeros(len(batch)))
    task = task_from_config(cfg)
    gen = torch.Generator().manual_seed(0)
    prompts = task.sample_prompts(6, gen)
    responses = task.sample_responses(prompts, gen)
    batch = join(PromptBatch(prompts, torch.ones_like(prompts)), responses,
                 task.tokenizer.eos_token_id)
    sums = reward.score(0, batch)["reward_sums"]
    expected = task.score(prompts, responses)
    assert 0 < expected.sum() < len(expected)  # neither all wrong nor all right
    assert sums == Sums(total={"count": 6.0, "task_score": float(expected.sum())})
