"""A reward function behind HTTP, for ``reward.url``:

    python -m rlhf_paro.reward_server path/to/file.py:name --port 8000 [--host H] [--token-env NAME]

``POST /score`` with ``{"prompts": [...], "responses": [...], "columns": {...}}`` answers
``{"rewards": [...]}``: the function's items (numbers, or dicts with a ``score`` and named
extras), checked as ``reward.function``'s are (``ppo/rewards.py``). A function that raises or
returns anything else answers HTTP 500 with ``{"error": "<one line>"}``, which stops the run.

It listens on 127.0.0.1 unless ``--host`` says otherwise. With ``--token-env NAME`` every request
must carry ``Authorization: Bearer <the value of NAME>``; another host than loopback is refused
without one, as it would score for anyone who reaches it. The function runs one request at a
time, so it need not be thread-safe. Nothing is logged per request; a failing function is said
in one line on stderr.
"""

from __future__ import annotations

import argparse
import hmac
import ipaddress
import json
import os
import socket
import sys
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from threading import Lock
from typing import Any, NoReturn

from rlhf_paro.config import ConfigError, cli_errors
from rlhf_paro.ppo import rewards

PATH = "/score"
# A request body past this is refused unread (413): a rollout's text is a few MiB at most.
MAX_BODY_BYTES = 64 * 2**20


class RewardServer(ThreadingHTTPServer):
    """Serves ``function`` (``spec``, for its error lines) at ``PATH`` on ``address``."""

    daemon_threads = True  # a request still running does not hold the process at exit

    def __init__(self, address: tuple[str, int], function: rewards.RewardFunction, spec: str,
                 token: str | None) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.function = function
        self.spec = spec
        self.token = token
        self.lock = Lock()  # one call of the function at a time
        super().__init__(address, _Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{f'[{host}]' if ':' in host else host}:{port}{PATH}"


class _Handler(BaseHTTPRequestHandler):
    server: RewardServer

    def _handle(self) -> None:
        length = self.headers.get("Content-Length", "0")
        if not length.isdigit():
            return self._answer(400, "Content-Length is not a number")
        if int(length) > MAX_BODY_BYTES:
            self.close_connection = True  # the body stays unread
            return self._answer(413, f"a request body is at most {MAX_BODY_BYTES} bytes")
        # Read whatever the answer: a connection closed with bytes unread is reset, and the
        # client could lose the answer with it.
        body = self.rfile.read(int(length))
        if self.server.token is not None and not hmac.compare_digest(
                self.headers.get("Authorization", "").encode(),
                f"Bearer {self.server.token}".encode()):
            return self._answer(401, "needs Authorization: Bearer <token>")
        if urllib.parse.urlsplit(self.path).path != PATH:
            return self._answer(404, f"no such path; allowed: POST {PATH}")
        if self.command != "POST":
            return self._answer(405, f"allowed: POST {PATH}")
        try:
            prompts, responses, columns = _request(body)
        except ValueError as err:
            return self._answer(400, f"bad request: {err}")
        try:
            with self.server.lock:
                out = rewards.call_function(self.server.function, self.server.spec, None,
                                            prompts, responses, columns)
        except rewards.RewardFunctionError as err:
            print(err, file=sys.stderr, flush=True)
            return self._answer(500, str(err))
        self._answer(200, {"rewards": out.items()})

    do_POST = do_GET = do_HEAD = do_PUT = do_PATCH = do_DELETE = do_OPTIONS = _handle

    def _answer(self, status: int, payload: dict[str, Any] | str) -> None:
        """``payload`` as JSON, or a string as ``{"error": payload}``."""
        data = json.dumps(payload if isinstance(payload, dict) else {"error": payload}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if status == 401:
            self.send_header("WWW-Authenticate", "Bearer")
        if status == 405:
            self.send_header("Allow", "POST")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # nothing per request; a failing function is said in _handle


def _request(body: bytes) -> tuple[list[str], list[str], dict[str, list[Any]]]:
    """The prompts, responses and columns of a request body, or ``ValueError`` saying what is
    wrong with it."""
    request = json.loads(body)
    if not isinstance(request, dict):
        raise ValueError('expected {"prompts": [...], "responses": [...], "columns": {...}}')
    prompts, responses = request.get("prompts"), request.get("responses")
    columns = request.get("columns", {})
    for key, texts in (("prompts", prompts), ("responses", responses)):
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise ValueError(f"{key!r} must be a list of strings")
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts for {len(responses)} responses")
    if not isinstance(columns, dict) or not all(
            isinstance(v, list) and len(v) == len(prompts) for v in columns.values()):
        raise ValueError(f"'columns' must map names to lists of {len(prompts)} values")
    return prompts, responses, columns


def _is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, as every entry point's
        print(f"error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)


def main(argv: list[str] | None = None) -> None:
    parser = _Parser(prog="python -m rlhf_paro.reward_server",
                     description="Serve a reward function over HTTP for reward.url.")
    parser.add_argument("spec", help="path/to/file.py:function_name")
    parser.add_argument("--port", type=int, required=True, help="0 picks a free port")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1; another needs --token-env)")
    parser.add_argument("--token-env", metavar="NAME",
                        help="environment variable holding the bearer token requests must carry")
    args = parser.parse_args(argv)
    with cli_errors():
        if not 0 <= args.port <= 65535:
            raise ConfigError("--port", f"got {args.port}; allowed: 0 (any free port) to 65535")
        token = None
        if args.token_env is not None:
            token = os.environ.get(args.token_env)
            if not token:
                raise ConfigError("--token-env", f"the environment variable {args.token_env} "
                                                 "is not set (or empty)")
        if token is None and not _is_loopback(args.host):
            raise ConfigError("--host", f"{args.host} is not a loopback address, so anyone who "
                                        "reaches it could use the server; allowed: 127.0.0.1, "
                                        "or another host with --token-env")
        function = rewards.load_function(args.spec, "spec")
    try:
        server = RewardServer((args.host, args.port), function, args.spec, token)
    except OSError as err:  # the port taken, an address not of this machine
        print(f"error: cannot listen on {args.host}:{args.port}: {err.strerror or err}",
              file=sys.stderr)
        raise SystemExit(1) from None
    print(f"reward server: {args.spec} at {server.url}, "
          f"{'bearer token required' if token else 'no token required'}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
