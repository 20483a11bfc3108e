"""The reward server and its client (``reward.url``), on loopback: the reference server in a
subprocess, stub servers in threads for answers the reference server never gives, the attacks
the server and the client must withstand, and the ``reward.url`` keys of the config.

Every attack on the server ends with a good request, answered at once: nothing a client does
holds up the others."""

from __future__ import annotations

import http.client
import json
import os
import re
import select
import socket
import subprocess
import sys
import threading
import time
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable, Iterator

import psutil
import pytest

from rlhf_paro.config import Config, ConfigError, ModelConfig
from rlhf_paro import usercode
from rlhf_paro.ppo import rewards
from rlhf_paro.ppo.rewards import RewardFunctionError
from rlhf_paro.resolve import check_files

ROOT = Path(__file__).resolve().parent.parent
TOKEN_ENV = "RLHF_PARO_TEST_REWARD_TOKEN"
# Letters, digits and _ only, so that a server can also echo it as the name of an extra.
TOKEN = "s3cret_token_42"
PROMPTS = ["1 + 1 =", "2 + 2 ="]
RESPONSES = ["x = 2", "5"]
COLUMNS = {"answer": ["2", "4"]}
# The reference server's limits here: short enough that a stalled client is cut off within the
# test, far above what a good request on loopback takes (milliseconds).
TIMEOUT_S = 3.0
MAX_BODY_MB = 1

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


class Served:
    """The reference server's process, its URL and what it wrote on stderr so far."""

    def __init__(self, proc: subprocess.Popen, url: str) -> None:
        self.proc, self.url = proc, url
        self.port = int(url.rsplit(":", 1)[1].split("/")[0])
        self._stderr = ""
        os.set_blocking(proc.stderr.fileno(), False)

    def stderr(self) -> str:
        self._stderr += proc_read(self.proc.stderr)
        return self._stderr

    def connections(self) -> list:
        """Its TCP connections other than the listening one."""
        return [c for c in psutil.Process(self.proc.pid).net_connections("tcp")
                if c.status != psutil.CONN_LISTEN]

    def answers_at_once(self) -> None:
        """A good request is answered well before any stalled client is cut off."""
        start = time.perf_counter()
        got = rewards.call_server(self.url, 0, PROMPTS, RESPONSES, COLUMNS, 10.0, TOKEN)
        assert got.scores == [1.25, 0.25]
        assert time.perf_counter() - start < TIMEOUT_S / 2


def proc_read(pipe) -> str:
    try:
        return pipe.read() or ""
    except BlockingIOError:
        return ""


@pytest.fixture(scope="module")
def served(spec) -> Iterator[Served]:
    """The reference server with a token (set with the newline a file-mounted secret ends in),
    killed at the end whatever happens."""
    with subprocess.Popen(server_command(spec, "--token-env", TOKEN_ENV, "--timeout-s",
                                         str(TIMEOUT_S), "--max-body-mb", str(MAX_BODY_MB)),
                          env=environment(**{TOKEN_ENV: TOKEN + "\n"}), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as proc:
        try:
            ready, _, _ = select.select([proc.stdout], [], [], 60)
            line = proc.stdout.readline() if ready else ""
            found = re.fullmatch(r"reward server: .*:score at (http://127\.0\.0\.1:\d+/score), "
                                 r"bearer token required\n", line)
            assert found, (line, proc.poll())
            yield Served(proc, found[1])
        finally:
            proc.kill()  # leaving the with block then closes its pipes and waits for it


@pytest.fixture(scope="module")
def server(served) -> str:
    return served.url


def refusal(call) -> str:
    with pytest.raises(RewardFunctionError) as err:
        call()
    line = str(err.value)
    assert "\n" not in line
    return line


def raw(port: int, data: bytes, timeout_s: float = 10.0) -> tuple[bytes, float]:
    """What the server at ``port`` sends back to ``data`` until it closes, and after how many
    seconds."""
    start = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.sendall(data)
        got = b""
        while chunk := sock.recv(65536):
            got += chunk
    return got, time.perf_counter() - start


def head(path: str = "/score", auth: str | None = TOKEN, content_type: str = "application/json",
         length: int | None = None, method: str = "POST", chunked: bool = False) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1"]
    if auth is not None:
        lines.append(f"Authorization: Bearer {auth}")
    if content_type:
        lines.append(f"Content-Type: {content_type}")
    if length is not None:
        lines.append(f"Content-Length: {length}")
    if chunked:
        lines.append("Transfer-Encoding: chunked")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def status_of(answer: bytes) -> tuple[int, dict]:
    """The status and the JSON body of a raw answer."""
    first, _, rest = answer.partition(b"\r\n")
    return int(first.split()[1]), json.loads(rest.partition(b"\r\n\r\n")[2] or b"{}")


# --- the reference server ------------------------------------------------------------------

def test_with_the_token_the_server_answers_what_the_function_gives_in_process(server, spec):
    got = rewards.call_server(server, 5, PROMPTS, RESPONSES, COLUMNS, 10.0, TOKEN)
    assert got == rewards.call_function(usercode.load_function(spec), spec, 5, PROMPTS,
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
    assert line == f"reward server {server} at step 2: timed out after 0.5 s (reward.timeout_s)"
    assert time.perf_counter() - start < 1.4  # not retried, not waiting for the 1.5 s


def test_a_function_result_the_server_refuses_reaches_the_client_as_its_line(server, spec):
    line = refusal(lambda: rewards.call_server(server, 3, PROMPTS, RESPONSES,
                                               {**COLUMNS, "bad": [1, 1]}, 10.0, TOKEN))
    assert line == (f"reward server {server} at step 3: 3 attempts failed, the last: HTTP 500: "
                    f"reward function {spec} returned a str; expected a list of 2 numbers or "
                    "dicts with a numeric 'score'")


def test_paths_methods_and_content_types_are_refused_from_the_head(served):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    json_auth = {**auth, "Content-Type": "application/json"}

    def status(method: str, path: str, headers: dict[str, str], body: bytes = b"") -> int:
        conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=10)
        try:
            conn.request(method, path, body=body, headers=headers)
            return conn.getresponse().status
        finally:
            conn.close()

    assert status("POST", "/other", json_auth, b"{}") == 404
    assert status("GET", "/score", auth) == 405
    assert status("GET", "/score", {}) == 401  # nothing is said without the token
    assert status("POST", "/other", {}, b"{}") == 401
    assert status("POST", "/score", {**auth, "Content-Type": "text/plain"}, b"{}") == 415
    assert status("POST", "/score", auth, b"{}") == 415  # http.client sends no type
    assert status("POST", "/score", json_auth, b"not json") == 400
    good = json.dumps({"prompts": PROMPTS, "responses": RESPONSES}).encode()
    assert status("POST", "/score", {**auth, "Content-Type": "application/json; charset=utf-8"},
                  good) == 200
    served.answers_at_once()


def test_a_body_over_max_body_mb_is_refused_unread_or_once_it_grows_past_it(served):
    cap = MAX_BODY_MB * 2**20
    said = {"error": f"a request body is at most {cap} bytes (--max-body-mb)"}
    # Declared: answered from the head alone, before any of the body is sent.
    answer, _ = raw(served.port, head(length=64 * 2**20))
    assert status_of(answer) == (413, said)
    # Chunked: no length to read, so refused once the chunks pass the cap.
    chunk = b"%x\r\n" % 2**16 + b" " * 2**16 + b"\r\n"
    answer, _ = raw(served.port, head(chunked=True) + chunk * (cap // 2**16 + 2) + b"0\r\n\r\n")
    assert status_of(answer) == (413, said)
    served.answers_at_once()


def test_json_nested_100000_deep_or_not_http_is_a_400_and_the_server_lives_on(served):
    deep = b"[" * 100_000 + b"]" * 100_000
    answer, _ = raw(served.port, head(length=len(deep)) + deep)
    status, said = status_of(answer)
    # The limit is the server process's own recursion limit, which libraries imported into this
    # test process may have raised: only its form is checked here.
    assert status == 400 and re.fullmatch(r"bad request: JSON nested deeper than \d+ levels",
                                          said["error"]), said
    answer, _ = raw(served.port, b"\x00\x01 not http\r\n\r\n")
    assert status_of(answer)[0] == 400
    answer, _ = raw(served.port, head(length=5) + b"{oops")
    assert status_of(answer)[0] == 400
    served.answers_at_once()
    stderr = served.stderr()
    assert "Traceback" not in stderr and "RecursionError" not in stderr, stderr


def test_stalled_clients_cost_no_memory_and_are_cut_off_within_the_timeout(served):
    server = psutil.Process(served.proc.pid)
    served.answers_at_once()
    before = server.memory_info().rss
    declared = 64 * 2**20
    start = time.perf_counter()
    # Six clients without the token declare 64 MiB bodies, send 64 KiB of them and stall.
    stalled = [socket.create_connection(("127.0.0.1", served.port), timeout=10)
               for _ in range(6)]
    for sock in stalled:
        sock.sendall(head(auth=None, length=declared) + b" " * 2**16)
    # One sends half a head and stalls; one with the token declares a body and stalls.
    half = socket.create_connection(("127.0.0.1", served.port), timeout=10)
    half.sendall(head()[:30])
    slow = socket.create_connection(("127.0.0.1", served.port), timeout=10)
    slow.sendall(head(length=2**16) + b'{"prompts": ')
    try:
        # Refused from the head: the 401 comes at once, and then the server sends no more.
        for sock in stalled:
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
            assert status_of(answer)[0] == 401
        assert time.perf_counter() - start < TIMEOUT_S / 2
        ours = {sock.getsockname()[1] for sock in [*stalled, half, slow]}

        def held() -> set[int]:
            return ours & {c.raddr.port for c in served.connections() if c.raddr}

        # All eight held. A connection the server has not accepted yet waits in the listen
        # backlog, on no descriptor of the server's: the last two can still be there when the
        # six answers are read (seen once in a CI run); well before any timeout, they are not.
        while held() != ours and time.perf_counter() - start < TIMEOUT_S / 2:
            time.sleep(0.02)
        assert held() == ours
        served.answers_at_once()  # while all eight are held
        # Each connection holds at most a read's 64 KiB and h11's 16 KiB head, not what it
        # declared (384 MiB in all): 32 MiB is room for the allocator's own growth.
        assert server.memory_info().rss - before < 32 * 2**20
        # The half head is closed unanswered, the stalled body answered 408, both at the timeout.
        assert half.recv(65536) == b""
        cut = time.perf_counter() - start
        answer = b""
        while chunk := slow.recv(65536):
            answer += chunk
        assert status_of(answer) == (408, {"error": f"no part of the body came within "
                                                    f"{TIMEOUT_S:g} s"})
        # The six are dropped once their lingering ends, TIMEOUT_S after their answer. 2 s more
        # is room for a loaded machine; each cut is a timer, not the client going away.
        while held() and time.perf_counter() - start < TIMEOUT_S + 2:
            time.sleep(0.1)
        assert held() == set()
        assert TIMEOUT_S * 0.9 <= cut and time.perf_counter() - start < TIMEOUT_S + 2
    finally:
        for sock in [*stalled, half, slow]:
            sock.close()
    served.answers_at_once()


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
    """Answers ``server.answer`` (status, body, headers) to every POST and notes each request's
    headers in ``server.seen``."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.server.seen.append(dict(self.headers))
        status, body, headers = (*self.server.answer, {})[:3]
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    do_GET = do_POST  # what a client that followed a 302 would send

    def log_message(self, format, *args) -> None:
        pass


class _StubServer(ThreadingHTTPServer):
    daemon_threads = True
    seen: list[dict[str, str]]
    answer: tuple

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/score"

    @property
    def hits(self) -> int:
        return len(self.seen)


def make_stub() -> Iterator[_StubServer]:
    server = _StubServer(("127.0.0.1", 0), _Stub)
    server.seen = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


stub = pytest.fixture(make_stub)
other_stub = pytest.fixture(make_stub)


class RawStub:
    """A server in a thread that runs ``handle(connection)`` for each connection."""

    def __init__(self, handle: Callable[[socket.socket], object]) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/score"
        self.handle = handle
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed: the test is over
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                self.handle(conn)
            except OSError:  # the client gave up
                pass

    def __enter__(self) -> "RawStub":
        return self

    def __exit__(self, *exc) -> None:
        self.sock.close()


ANSWER = b'{"rewards": [1.0, 2.0]}'


def trickle(conn: socket.socket) -> None:
    """The head of a 1000-byte answer at once, then its body a byte every 0.1 s: 100 s."""
    conn.recv(65536)
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000\r\n\r\n")
    for byte in ANSWER.ljust(1000):
        conn.sendall(bytes([byte]))
        time.sleep(0.1)


def silent(conn: socket.socket) -> None:
    """Reads the request and never answers, until the client closes."""
    while conn.recv(65536):
        pass


@pytest.mark.parametrize("server", [trickle, silent], ids=["trickle", "silent"])
def test_an_answer_trickled_or_never_sent_stops_at_timeout_s(served, server):
    served.answers_at_once()  # httpx imported, its TLS context made: not counted below
    with RawStub(server) as stub:
        start = time.perf_counter()
        line = refusal(lambda: rewards.call_server(stub.url, 6, PROMPTS, RESPONSES, COLUMNS,
                                                   1.0, TOKEN))
        elapsed = time.perf_counter() - start
    assert line == f"reward server {stub.url} at step 6: timed out after 1 s (reward.timeout_s)"
    # The deadline is the attempt's whole, where each byte of the trickle came within 0.1 s;
    # cancelling the attempt takes a few turns of its event loop: 0.5 s is room for a loaded
    # machine, and 100 times less than the trickle would take.
    assert 1.0 <= elapsed < 1.5
    served.answers_at_once()


@pytest.mark.parametrize("code", [302, 307])
def test_a_redirect_is_refused_in_one_line_and_the_token_goes_nowhere_else(served, stub,
                                                                          other_stub, code):
    stub.answer = (code, "", {"Location": other_stub.url})
    line = refusal(lambda: rewards.call_server(stub.url, 4, PROMPTS, RESPONSES, COLUMNS, 10.0,
                                               TOKEN))
    assert line == (f"reward server {stub.url} at step 4: HTTP {code}: the server redirects to "
                    f"{other_stub.url}; redirects are not followed (the token would go with "
                    "them): set reward.url to the address that answers")
    assert stub.seen[0]["Authorization"] == f"Bearer {TOKEN}"
    assert other_stub.seen == []  # nothing at all reached the other server
    served.answers_at_once()


def test_an_answer_nested_too_deep_or_too_large_is_the_server_s_line(stub):
    stub.answer = (200, '{"rewards": ' + "[" * 100_000 + "]" * 100_000 + "}")
    line = refusal(lambda: rewards.call_server(stub.url, 2, PROMPTS, RESPONSES, COLUMNS, 10.0))
    assert line == (f"reward server {stub.url} at step 2: the answer is JSON nested deeper than "
                    f"{sys.getrecursionlimit()} levels")
    stub.answer = (200, " " * (rewards.MAX_ANSWER_BYTES + 1))
    line = refusal(lambda: rewards.call_server(stub.url, 2, PROMPTS, RESPONSES, COLUMNS, 10.0))
    assert line.startswith(f"reward server {stub.url} at step 2: the answer is over "
                           f"{rewards.MAX_ANSWER_BYTES} bytes")


def test_whatever_else_fails_in_the_client_is_the_server_s_line(monkeypatch):
    # What reached the trainer as "actor rank 0 raised" must name the server instead.
    def broken(*args):
        raise ValueError("something unforeseen")

    monkeypatch.setattr(rewards, "_post", broken)
    url = "http://127.0.0.1:1/score"
    assert refusal(lambda: rewards.call_server(url, 8, PROMPTS, RESPONSES, COLUMNS, 10.0)) == \
        f"reward server {url} at step 8: ValueError: something unforeseen"


def test_no_failure_path_ever_shows_the_token(served, stub, other_stub, capfd, monkeypatch):
    """Every way the client or the server can fail, the server echoing the token included:
    the token is in no line, no repr and no traceback, nor in anything printed."""
    other = "0ther_token_7"  # refused by the reference server
    seen: list[str] = []

    def record(call: Callable[[], object]) -> None:
        try:
            call()
        except (RewardFunctionError, ConfigError) as err:
            seen.extend([str(err), repr(err), "".join(traceback.format_exception(err))])
        else:
            pytest.fail(f"no failure: case {len(seen) // 3}")

    def client(url: str, token: str = TOKEN, timeout_s: float = 10.0, **columns) -> Callable:
        return lambda: rewards.call_server(url, 1, PROMPTS, RESPONSES, {**COLUMNS, **columns},
                                           timeout_s, token)

    echo = f"Authorization: Bearer {TOKEN}"
    for answer in [(302, "", {"Location": f"{other_stub.url}?token={TOKEN}"}),
                   (500, json.dumps({"error": echo})),
                   (400, echo),
                   (200, echo),  # not JSON
                   (200, "[" * 100_000),
                   (200, json.dumps({"rewards": [1.0, {"score": 1.0, TOKEN: "x"}]})),
                   (200, json.dumps({"rewards": [1.0]}))]:
        stub.answer = answer
        record(client(stub.url))
    with RawStub(lambda conn: (conn.recv(65536),
                               conn.sendall(f"HTTP/1.1 2OO {echo}\r\n\r\n".encode()))) as raw_stub:
        record(client(raw_stub.url))  # a status line that is not HTTP
    with RawStub(trickle) as raw_stub:
        record(client(raw_stub.url, timeout_s=0.5))
    record(client(served.url, token=other))  # 401
    record(client(served.url, bad=[1, 1]))  # the function's 500
    record(client("http://127.0.0.1:1/score"))  # unreachable
    # Tokens no header can carry: refused where they are read, and by the client.
    for bad in [f"{TOKEN}\nX-Extra: 1", f"\x01{TOKEN}", f"{TOKEN}\u20ac"]:
        record(client(served.url, token=bad))
        record(lambda: rewards.clean_token(bad, TOKEN_ENV, "reward.token_env"))
        monkeypatch.setenv(TOKEN_ENV, bad)
        record(lambda: check_files(Config(actor=ModelConfig(config={}), reward=ModelConfig(
            url=served.url, token_env=TOKEN_ENV))))
    out, err = capfd.readouterr()
    everything = "\n".join([*seen, out, err, served.stderr()])
    assert len(seen) == 3 * 21  # every case failed
    assert TOKEN not in everything and other not in everything
    assert "<token>" in everything  # what the server echoed, shown masked
    served.answers_at_once()


@pytest.mark.parametrize("status, body, said, hits", [
    (200, '{"rewards": [1.0]}', " returned 1 values for 2 responses", 1),
    (200, '{"rewards": {"0": 1.0, "1": 2.0}}', " returned a dict; expected a list of 2", 1),
    (200, '{"rewards": [1.0, NaN]}', ": item 1 is nan; allowed", 1),
    # Finite as JSON reads it (float64), inf in float32: every loss of the step was NaN.
    (200, '{"rewards": [1.0, 1e300]}', ": item 1 is 1e+300; allowed: a finite real number "
                                       "within float32's range", 1),
    (200, '{"rewards": [1.0, {"score": 1, "len": -1e39}]}', ": item 1's 'len' is -1e+39; allowed",
     1),
    (200, '{"rewards": [1.0, {"score": 1, "ok": true}]}', ": item 1's extra 'ok' is a bool", 1),
    (200, "<html>busy</html>", ": the answer is not JSON (Expecting value", 1),
    (200, '{"scores": [1.0, 2.0]}', ": the answer has no 'rewards'", 1),
    (400, "no prompts\nat all", ": HTTP 400: no prompts", 1),
    (403, "", ": HTTP 403: the server refused the token", 1),
    (503, '{"error": "warming up"}', ": 3 attempts failed, the last: HTTP 503: warming up", 3),
], ids=["length", "dict", "nan", "past_float32", "extra_past_float32", "extra", "not_json", "no_rewards", "400", "403", "503"])
def test_a_bad_answer_is_one_line_and_only_5xx_is_tried_again(stub, status, body, said, hits):
    stub.answer = (status, body)
    url = stub.url
    line = refusal(lambda: rewards.call_server(url, 4, PROMPTS, RESPONSES, COLUMNS, 10.0, TOKEN))
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
    with pytest.raises(ConfigError, match="url"):  # a token for no server: refused
        run_config(token_env=TOKEN_ENV)
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    check_files(run_config(url=url, token_env=TOKEN_ENV))
    monkeypatch.setenv(TOKEN_ENV, TOKEN + "\n")  # stripped where it is read
    check_files(run_config(url=url, token_env=TOKEN_ENV))


@pytest.mark.parametrize("timeout_s", [0.0, -1.0, float("inf"), float("nan")])
def test_timeout_s_must_be_a_positive_number_of_seconds(timeout_s):
    assert refused_config(timeout_s=timeout_s).startswith(
        f"timeout_s: must be a positive number of seconds, got {timeout_s}")
