"""The reward server and its client (``reward.url``), on loopback: the reference server in a
subprocess, a stub server in a thread for answers the reference server never gives, and the
``reward.url`` keys of the config."""

from __future__ import annotations

import http.client
import os
import re
import select
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from rlhf_paro.config import Config, ConfigError, ModelConfig
from rlhf_paro.ppo import rewards
from rlhf_paro.ppo.rewards import RewardFunctionError
from rlhf_paro.resolve import check_files

ROOT = Path(__file__).resolve().parent.parent
TOKEN_ENV = "RLHF_PARO_TEST_REWARD_TOKEN"
TOKEN = "s3cret-token"
PROMPTS = ["1 + 1 =", "2 + 2 ="]
RESPONSES = ["x = 2", "5"]
COLUMNS = {"answer": ["2", "4"]}

FUNCTIONS = '''
import time

def score(prompts, responses, **columns):
    if "sleep_s" in columns:
        time.sleep(columns["sleep_s"][0])
    if "bad" in columns:
        return "1111"
    return [{"score": len(r) / 4, "words": float(len(r.split()))} if "=" in r else len(r) / 4
            for r in responses]
'''


def server_command(spec: str, *flags: str) -> list[str]:
    return [sys.executable, "-m", "rlhf_paro.reward_server", spec, "--port", "0", *flags]


def environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    return {**env, "PYTHONPATH": str(ROOT), **extra}


@pytest.fixture(scope="module")
def spec(tmp_path_factory) -> str:
    file = tmp_path_factory.mktemp("server") / "fns.py"
    file.write_text(FUNCTIONS)
    return f"{file}:score"


@pytest.fixture(scope="module")
def server(spec):
    """The reference server with a token: its URL, killed at the end whatever happens."""
    with subprocess.Popen(server_command(spec, "--token-env", TOKEN_ENV),
                          env=environment(**{TOKEN_ENV: TOKEN}), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as proc:
        try:
            ready, _, _ = select.select([proc.stdout], [], [], 60)
            line = proc.stdout.readline() if ready else ""
            found = re.fullmatch(r"reward server: .*:score at (http://127\.0\.0\.1:\d+/score), "
                                 r"bearer token required\n", line)
            assert found, (line, proc.poll())
            yield found[1]
        finally:
            proc.kill()  # leaving the with block then closes its pipes and waits for it


def refusal(call) -> str:
    with pytest.raises(RewardFunctionError) as err:
        call()
    line = str(err.value)
    assert "\n" not in line
    return line


# --- the reference server ------------------------------------------------------------------

def test_with_the_token_the_server_answers_what_the_function_gives_in_process(server, spec):
    got = rewards.call_server(server, 5, PROMPTS, RESPONSES, COLUMNS, 10.0, TOKEN)
    assert got == rewards.call_function(rewards.load_function(spec), spec, 5, PROMPTS,
                                        RESPONSES, COLUMNS)
    # "x = 2": 5 characters / 4 with 3 words; "5": 1 / 4, no extras.
    assert got.scores == [1.25, 0.25] and got.extras == {"words": [3.0, None]}


def test_without_the_token_or_with_another_the_server_refuses_in_one_line(server):
    where = f"reward server {server} at step 5: HTTP 401: the server"
    assert refusal(lambda: rewards.call_server(server, 5, PROMPTS, RESPONSES, COLUMNS, 10.0)) \
        == f"{where} wants a token; set reward.token_env to the variable holding it"
    assert refusal(lambda: rewards.call_server(server, 5, PROMPTS, RESPONSES, COLUMNS, 10.0,
                                               "s3cret-tokem")) == f"{where} refused the token"


def test_a_server_slower_than_timeout_s_stops_at_the_timeout(server):
    start = time.perf_counter()
    line = refusal(lambda: rewards.call_server(server, 2, PROMPTS, RESPONSES,
                                               {**COLUMNS, "sleep_s": [1.5, 1.5]}, 0.5, TOKEN))
    assert line == f"reward server {server} at step 2: timed out after 0.5 s"
    assert time.perf_counter() - start < 1.4  # not retried, not waiting for the 1.5 s


def test_a_function_result_the_server_refuses_reaches_the_client_as_its_line(server, spec):
    line = refusal(lambda: rewards.call_server(server, 3, PROMPTS, RESPONSES,
                                               {**COLUMNS, "bad": [1, 1]}, 10.0, TOKEN))
    assert line == (f"reward server {server} at step 3: 3 attempts failed, the last: HTTP 500: "
                    f"reward function {spec} returned a str; expected a list of 2 numbers or "
                    "dicts with a numeric 'score'")


def test_other_paths_methods_and_oversized_bodies_are_refused(server):
    port = int(server.rsplit(":", 1)[1].split("/")[0])
    auth = {"Authorization": f"Bearer {TOKEN}"}

    def status(method: str, path: str, headers: dict[str, str], body: bytes = b"") -> int:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        try:
            conn.request(method, path, body=body, headers=headers)
            return conn.getresponse().status
        finally:
            conn.close()

    assert status("POST", "/other", auth, b"{}") == 404
    assert status("GET", "/score", auth) == 405
    assert status("GET", "/score", {}) == 401  # nothing is said without the token
    assert status("POST", "/score", auth, b"not json") == 400
    # The size is refused from the header alone, before any of the body is read.
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.putrequest("POST", "/score")
        conn.putheader("Authorization", auth["Authorization"])
        conn.putheader("Content-Length", str(64 * 2**20 + 1))
        conn.endheaders()
        assert conn.getresponse().status == 413
    finally:
        conn.close()


@pytest.mark.parametrize("flags, env, said", [
    (["--host", "0.0.0.0"], {}, "error: --host: 0.0.0.0 is not a loopback address, so anyone "
                                "who reaches it could use the server"),
    (["--token-env", TOKEN_ENV], {}, f"error: --token-env: the environment variable {TOKEN_ENV} "
                                     "is not set"),
    (["--port", "70000"], {}, "error: --port: got 70000; allowed: 0 (any free port) to 65535"),
], ids=["public_host_without_token", "token_env_unset", "bad_port"])
def test_a_server_that_would_be_unsafe_or_cannot_start_exits_2_in_one_line(spec, flags, env,
                                                                             said):
    done = subprocess.run(server_command(spec, *flags), env=environment(**env),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith(said) and done.stderr.count("\n") == 1, done.stderr


def test_a_bad_spec_or_a_missing_file_exits_2_in_one_line(tmp_path):
    for spec, said in [("fns.py", "error: spec: got 'fns.py'; allowed: path/to/file.py:"),
                       (f"{tmp_path}/nope.py:score", "error: spec: no file")]:
        done = subprocess.run(server_command(spec), env=environment(), capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 2 and done.stdout == ""
        assert done.stderr.startswith(said) and done.stderr.count("\n") == 1, done.stderr


# --- the client against answers the reference server never gives -----------------------------

class _Stub(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.server.hits += 1
        status, body = self.server.answer
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, format, *args) -> None:
        pass


@pytest.fixture
def stub():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    server.hits = 0
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("status, body, said, hits", [
    (200, '{"rewards": [1.0]}', " returned 1 values for 2 responses", 1),
    (200, '{"rewards": {"0": 1.0, "1": 2.0}}', " returned a dict; expected a list of 2", 1),
    (200, '{"rewards": [1.0, NaN]}', ": item 1 is not finite (nan)", 1),
    (200, '{"rewards": [1.0, {"score": 1, "ok": true}]}', ": item 1's extra 'ok' is a bool", 1),
    (200, "<html>busy</html>", ": the answer is not JSON (Expecting value", 1),
    (200, '{"scores": [1.0, 2.0]}', ": the answer has no 'rewards'", 1),
    (400, "no prompts\nat all", ": HTTP 400: no prompts", 1),
    (403, "", ": HTTP 403: the server refused the token", 1),
    (503, '{"error": "warming up"}', ": 3 attempts failed, the last: HTTP 503: warming up", 3),
], ids=["length", "dict", "nan", "extra", "not_json", "no_rewards", "400", "403", "503"])
def test_a_bad_answer_is_one_line_and_only_5xx_is_tried_again(stub, status, body, said, hits):
    stub.answer = (status, body)
    url = f"http://127.0.0.1:{stub.server_address[1]}/score"
    line = refusal(lambda: rewards.call_server(url, 4, PROMPTS, RESPONSES, COLUMNS, 10.0, "t"))
    assert line.startswith(f"reward server {url} at step 4{said}"), line
    assert stub.hits == hits


def test_an_unreachable_server_is_tried_three_times_then_said_in_one_line():
    with socket.socket() as s:  # a port nothing listens on once it is closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/score"
    start = time.perf_counter()
    line = refusal(lambda: rewards.call_server(url, 1, PROMPTS, RESPONSES, COLUMNS, 10.0))
    elapsed = time.perf_counter() - start
    assert line.startswith(f"reward server {url} at step 1: 3 attempts failed, the last: "
                           "unreachable ("), line
    # The two waits between the three attempts, 0.25 s and 0.5 s, and no more.
    assert 0.75 <= elapsed < 2.5


# --- the reward.url keys ---------------------------------------------------------------------

def refused_config(**keys) -> str:
    with pytest.raises(ConfigError) as err:
        ModelConfig(**keys)
    return str(err.value)


def test_url_excludes_a_model_and_a_function(tmp_path):
    fns = tmp_path / "fns.py"
    fns.write_text("")
    url = "http://127.0.0.1:8000/score"
    assert refused_config(url=url, config={"hidden_size": 8}) == (
        "url: set either url (a reward server) or config, not both; unset one with ~")
    assert refused_config(url=url, function=f"{fns}:score").startswith(
        "url: set either url (a reward server) or function, not both")
    assert ModelConfig(url=url).url == url


@pytest.mark.parametrize("url", ["ftp://127.0.0.1/score", "127.0.0.1:8000", "http://",
                                 "http://127.0.0.1:port/score", "http://127.0.0.1:0/score",
                                 "http://127.0.0.1:8000/a b"])
def test_url_must_be_http_or_https_with_a_host(url):
    assert refused_config(url=url) == (f"url: got {url!r}; allowed: an http:// or https:// URL "
                                       "such as http://127.0.0.1:8000/score")


def test_token_env_must_name_a_set_variable_when_url_is_set(monkeypatch):
    # The schema reads no environment; resolving the config does, before the run starts.
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    url = "https://rewards.example/score"

    def run_config(**reward):
        return Config(actor=ModelConfig(config={}), reward=ModelConfig(**reward))

    with pytest.raises(ConfigError) as err:
        check_files(run_config(url=url, token_env=TOKEN_ENV))
    assert str(err.value).startswith(
        f"reward.token_env: the environment variable {TOKEN_ENV} is not set")
    check_files(run_config(token_env=TOKEN_ENV))  # no url: not read
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    check_files(run_config(url=url, token_env=TOKEN_ENV))


@pytest.mark.parametrize("timeout_s", [0.0, -1.0, float("inf"), float("nan")])
def test_timeout_s_must_be_a_positive_number_of_seconds(timeout_s):
    assert refused_config(timeout_s=timeout_s).startswith(
        f"timeout_s: must be a positive number of seconds, got {timeout_s}")
