"""User code in the driver (``usercode.bounded``): the checks before a run (an environment's
import and build, tools' import and schemas, a reward function's import) are held to the bound
the same code meets on the workers, and past it stop the command in one line naming what was
waited on and the key that sets the bound, then exit at once."""

from __future__ import annotations

import _thread
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest

from rlhf_paro import envs, train, usercode
from rlhf_paro.compose import load_config
from rlhf_paro.config import ConfigError
from rlhf_paro.envs import tools
from tests import hf_assets

# A user's file whose pieces block for good: a thread waiting on them never returns.
USER_CODE = '''
import threading
import time

def block():
    threading.Event().wait()

class Blocks:
    def __init__(self, **row):
        block()
    def reset(self):
        return None
    def step(self, action):
        return None, 0.0, True

class Interrupts(Blocks):
    def __init__(self, **row):
        raise KeyboardInterrupt

class Naps(Blocks):
    def __init__(self, **row):
        time.sleep(0.3)

def tool(a: "block()") -> int:
    """A tool whose type hint runs code when it is read.

    Args:
        a: x
    """
    return a

def score(prompts, responses, **columns):
    return [0.0] * len(responses)
'''
# The same file, blocking as it is imported.
BLOCKS_ON_IMPORT = USER_CODE + "\nblock()\n"


@pytest.fixture(scope="module")
def user_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("user")
    (root / "code.py").write_text(USER_CODE)
    (root / "blocks.py").write_text(BLOCKS_ON_IMPORT)
    return {"root": root, "llama": hf_assets.save_llama(root / "llama",
                                                        hf_assets.word_tokenizer()),
            "prompts": hf_assets.write_prompts(root / "prompts.jsonl", 8)}


def _argv(user_files, tmp_path, *extra: str) -> list[str]:
    return [f"actor.path={user_files['llama']}", f"data.train_files={user_files['prompts']}",
            f"trainer.output_dir={tmp_path / 'out'}",
            *(e.replace("ROOT", str(user_files["root"])) for e in extra)]


@pytest.mark.slow  # the command line in a fresh interpreter (seconds)
def test_an_environment_that_blocks_as_it_is_built_stops_the_command_in_one_line_and_exits_2(
        tmp_path, user_files):
    # Before: the driver's check built the environment without env.timeout_s and the command
    # hung before the run started, saying nothing.
    argv = _argv(user_files, tmp_path, "env.function=ROOT/code.py:Blocks", "env.reward=env",
                 "env.timeout_s=1")
    proc = subprocess.Popen([sys.executable, "-m", "rlhf_paro.train", *argv], cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put((time.monotonic(), line))
                                     for line in proc.stderr], daemon=True).start()
    try:
        said_at, said = lines.get(timeout=90)
        status = proc.wait(timeout=30)
        ended_at = time.monotonic()
    finally:
        proc.kill()
        proc.wait()
    assert said == ("error: env.function: Blocks(**row) on the first prompt row did not return "
                    "within env.timeout_s=1 s; allowed: code that returns sooner, or a larger "
                    "env.timeout_s\n")
    # The blocked thread cannot be killed: the process ends without waiting for it.
    assert status == 2 and ended_at - said_at < 2, (status, ended_at - said_at)
    time.sleep(0.1)  # the reader's last put, if the process wrote more
    assert lines.empty(), list(lines.queue)
    assert not (tmp_path / "out").exists()


# (what the command line adds, the key and what its line says after the key). Before, each of
# these hung the command before the run started.
BLOCKING = {
    "environment_import": (["env.function=ROOT/blocks.py:Blocks", "env.reward=env",
                            "env.timeout_s=0.5"], "env.function",
                           "importing ROOT/blocks.py did not return within env.timeout_s=0.5 s"),
    "reward_function_import": (["reward.function=ROOT/blocks.py:score",
                                "trainer.step_timeout_s=0.5"], "reward.function",
                               "importing ROOT/blocks.py did not return within "
                               "trainer.step_timeout_s=0.5 s"),
    "score_function_import": (["reward.function=ROOT/code.py:score",
                               "reward.score_function=ROOT/blocks.py:score",
                               "trainer.step_timeout_s=0.5"], "reward.score_function",
                              "importing ROOT/blocks.py did not return within "
                              "trainer.step_timeout_s=0.5 s"),
    "environment_build": (["env.function=ROOT/code.py:Blocks", "env.reward=env",
                           "env.timeout_s=0.5"], "env.function",
                          "Blocks(**row) on the first prompt row did not return within "
                          "env.timeout_s=0.5 s"),
}


# Before, these hung: the timeout fails them instead of the suite's.
@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", list(BLOCKING))
def test_user_code_that_blocks_in_the_driver_s_checks_is_one_line_naming_it_and_its_bound(
        tmp_path, user_files, case):
    extra, key, said = BLOCKING[case]
    cfg = load_config(_argv(user_files, tmp_path, *extra))
    with pytest.raises(ConfigError) as info:
        train.prepare(cfg, "ppo_tiny")  # the entry point's checks, before Ray starts
    limit = said.rpartition(" within ")[2].partition("=")[0]
    assert str(info.value) == (f"{key}: {said.replace('ROOT', str(user_files['root']))}; "
                               f"allowed: code that returns sooner, or a larger {limit}")


@pytest.mark.timeout(60)
def test_tools_that_block_as_they_are_imported_or_their_schemas_read_are_held_to_the_bound(
        user_files):
    limit = usercode.Limit(0.5, "env.timeout_s")
    root = user_files["root"]
    with pytest.raises(ConfigError, match=rf"^env.tools: importing {root}/blocks.py did not "
                                          r"return within env.timeout_s=0.5 s; "):
        tools.load_tools(f"{root}/blocks.py:tool", limit)
    # transformers' get_json_schema reads the type hints, which evaluates a string annotation.
    with pytest.raises(ConfigError, match=rf"^env.tools: the schemas of {root}/code.py:tool did "
                                          r"not return within env.timeout_s=0.5 s; "):
        tools.load_tools(f"{root}/code.py:tool", limit)


def test_an_environment_built_within_its_bound_passes_the_check(tmp_path, user_files):
    cfg = load_config(_argv(user_files, tmp_path, "env.function=ROOT/code.py:Naps",
                            "env.reward=env", "env.timeout_s=5"))
    envs.check_factory(cfg, {"prompt": "p", "start": 0})


def test_a_keyboard_interrupt_an_environment_raises_as_it_is_built_is_its_own_line(
        tmp_path, user_files):
    # In the thread it runs in, a KeyboardInterrupt is the environment's, never a Ctrl-C: before,
    # it left the driver's check as one, a traceback instead of a line naming the environment.
    cfg = load_config(_argv(user_files, tmp_path, "env.function=ROOT/code.py:Interrupts",
                            "env.reward=env"))
    with pytest.raises(ConfigError, match=r"^env.function: Interrupts\(\*\*row\) raised on the "
                                          r"first prompt row \(KeyboardInterrupt\)$"):
        envs.check_factory(cfg, {"prompt": "p", "start": 0})


@pytest.mark.timeout(60)
def test_a_ctrl_c_still_stops_the_driver_while_it_waits_for_user_code(tmp_path, user_files):
    cfg = load_config(_argv(user_files, tmp_path, "env.function=ROOT/code.py:Blocks",
                            "env.reward=env", "env.timeout_s=30"))
    # Python's own Ctrl-C handler, which a process started in the background (SIGINT ignored)
    # lacks: there interrupt_main would interrupt nothing.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Timer(0.5, _thread.interrupt_main).start()
        start = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            envs.check_factory(cfg, {"prompt": "p", "start": 0})
        assert time.monotonic() - start < 10
    finally:
        signal.signal(signal.SIGINT, previous)
