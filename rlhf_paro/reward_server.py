"""A reward function behind HTTP, for ``reward.url``:

    python -m rlhf_paro.reward_server path/to/file.py:name --port 8000 [--host H]
        [--token-env NAME] [--max-body-mb 64] [--timeout-s 10]

``POST /score`` with ``{"prompts": [...], "responses": [...], "columns": {...}}`` as
``Content-Type: application/json`` answers ``{"rewards": [...]}``: the function's items (numbers,
or dicts with a ``score`` and named extras), checked as ``reward.function``'s are
(``ppo/rewards.py``). A function that raises or returns anything else answers HTTP 500 with
``{"error": "<one line>"}``, which stops the run.

It listens on 127.0.0.1 unless ``--host`` says otherwise. With ``--token-env NAME`` every request
must carry ``Authorization: Bearer <the value of NAME>``; another host than loopback is refused
without one, as it would score for anyone who reaches it. The function runs one request at a
time, so it need not be thread-safe. Nothing is logged per request; a failing function is said
in one line on stderr.

[Note: a request's cost]
What a request may cost the server, whoever sends it:

- its headers must arrive whole within ``--timeout-s`` of the connection (at most 16 KiB);
- the token, the path, the method, the content type and a declared ``Content-Length`` over
  ``--max-body-mb`` are answered (401, 404, 405, 415, 413) from the headers alone, before a
  byte of the body is read; a chunked body is refused (413) once it grows past the cap;
- a body read stops when no byte comes for ``--timeout-s`` (408);
- a body that is not JSON, or JSON nested deeper than Python's recursion limit, is a 400;
- after an answer the connection is closed. An early answer leaves the client's body unread:
  the server stops sending, then drops what still comes for at most ``--timeout-s`` before it
  closes, so that the client reads the answer instead of a reset connection.

The HTTP parsing is h11's (a maintained HTTP/1.1 state machine, the one under httpx and
uvicorn: framing, chunked bodies, header syntax and size); the deadlines are asyncio's, one event
loop for every connection, the function in a worker thread behind a lock.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import ipaddress
import json
import logging
import math
import os
import socket
import sys
import threading
from http import HTTPStatus
from typing import Any, NoReturn

import h11

from rlhf_paro.config import ConfigError, cli_errors
from rlhf_paro import usercode
from rlhf_paro.ppo import rewards

PATH = "/score"
# A batch's text is a few MiB: 64 MiB leaves room for long responses and many columns.
DEFAULT_MAX_BODY_MB = 64.0
# Long enough for a client on a busy machine to send its headers or the next part of its body,
# short enough that a client that stalls holds a connection for seconds, not forever.
DEFAULT_TIMEOUT_S = 10.0
MAX_HEADER_BYTES = 16 * 2**10  # h11's bound on a request's head
READ_BYTES = 64 * 2**10  # one read from a connection


class RewardServer:
    """Serves ``function`` (``spec``, for its error lines) at ``PATH`` on ``address``: bound
    on construction (``OSError`` when it cannot be), serving from ``serve_forever`` until
    ``shutdown`` (from another thread)."""

    def __init__(self, address: tuple[str, int], function: rewards.RewardFunction, spec: str,
                 token: str | None, max_body_bytes: int = int(DEFAULT_MAX_BODY_MB * 2**20),
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.socket = socket.create_server(address, family=family)
        self.function = function
        self.spec = spec
        # The whole header value to compare against, as bytes: it is compared as it came.
        self.expected = None if token is None else b"Bearer " + token.encode("latin-1")
        self.max_body_bytes = max_body_bytes
        self.timeout_s = timeout_s
        self.lock: asyncio.Lock | None = None  # one call of the function at a time
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._stop_asked = threading.Event()  # shutdown() before the loop started
        self._done = threading.Event()

    @property
    def url(self) -> str:
        host, port = self.socket.getsockname()[:2]
        return f"http://{f'[{host}]' if ':' in host else host}:{port}{PATH}"

    def serve_forever(self) -> None:
        try:
            asyncio.run(self._serve())
        finally:
            self._done.set()

    def shutdown(self) -> None:
        """Stops ``serve_forever`` and waits for it to return."""
        self._stop_asked.set()
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None:
            try:
                loop.call_soon_threadsafe(stop.set)
            except RuntimeError:  # the loop has closed already
                pass
            self._done.wait()

    def server_close(self) -> None:
        self.socket.close()

    async def _serve(self) -> None:
        self.lock = asyncio.Lock()  # made here: it belongs to this loop
        self._stop = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        if self._stop_asked.is_set():
            return
        server = await asyncio.start_server(self._connection, sock=self.socket,
                                            limit=READ_BYTES)
        async with server:
            await self._stop.wait()

    async def _connection(self, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
        """One request and its answer, then the connection is closed. Nothing a client sends
        or fails to send ends the server: a connection that breaks is only closed."""
        try:
            await _Exchange(self, reader, writer).run()
        except (ConnectionError, asyncio.TimeoutError):
            pass  # the client went away, or stalled: nothing to answer
        except Exception as err:  # a defect here: said in one line, the server goes on
            said = str(err).strip().splitlines()
            print(f"reward server: a request failed: {type(err).__name__}"
                  f"{': ' + said[0] if said else ''}", file=sys.stderr, flush=True)
        finally:
            writer.close()
            try:
                await writer.wait_closed()
            except (ConnectionError, OSError):
                pass


class _Exchange:
    """One connection of ``server``: read a request, answer it, linger if its body was left."""

    def __init__(self, server: RewardServer, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.server, self.reader, self.writer = server, reader, writer
        self.conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEADER_BYTES)
        self.loop = asyncio.get_running_loop()
        self.method = b""

    async def run(self) -> None:
        head_deadline = self.loop.time() + self.server.timeout_s
        try:
            request = await self._event(head_deadline)
        except h11.RemoteProtocolError as err:  # not HTTP, or a head over MAX_HEADER_BYTES
            return await self._answer(err.error_status_hint, f"bad request: {err}")
        if not isinstance(request, h11.Request):
            return  # closed, or stalled before a whole head: nothing to answer
        self.method = request.method
        refused = self._refusal(request)
        if refused is not None:
            return await self._answer(*refused, linger=True)
        if self.conn.they_are_waiting_for_100_continue:  # curl's way to be refused unsent
            self.writer.write(self.conn.send(h11.InformationalResponse(status_code=100)))
        try:
            body = await self._body()
        except asyncio.TimeoutError:
            return await self._answer(408, f"no part of the body came within "
                                           f"{self.server.timeout_s:g} s")
        except h11.RemoteProtocolError as err:
            return await self._answer(err.error_status_hint, f"bad request: {err}")
        if body is None:
            return await self._answer(413, self._too_large(), linger=True)
        server = self.server
        try:
            prompts, responses, columns = await asyncio.to_thread(_request, body)
        except ValueError as err:
            return await self._answer(400, f"bad request: {err}")
        try:
            async with server.lock:
                out = await asyncio.to_thread(rewards.call_function, server.function,
                                              server.spec, None, prompts, responses, columns)
        except rewards.RewardFunctionError as err:
            print(err, file=sys.stderr, flush=True)
            return await self._answer(500, str(err))
        await self._answer(200, {"rewards": out.items()})

    def _refusal(self, request: h11.Request) -> tuple[int, str] | None:
        """What the head alone refuses, in the order that says nothing to a client without the
        token."""
        headers = {name: value for name, value in request.headers}
        if self.server.expected is not None and not hmac.compare_digest(
                headers.get(b"authorization", b""), self.server.expected):
            return 401, "needs Authorization: Bearer <token>"
        if request.target.partition(b"?")[0] != PATH.encode():
            return 404, f"no such path; allowed: POST {PATH}"
        if request.method != b"POST":
            return 405, f"allowed: POST {PATH}"
        kind = headers.get(b"content-type", b"").partition(b";")[0].strip().lower()
        if kind != b"application/json":
            return 415, "allowed: Content-Type: application/json"
        length = headers.get(b"content-length")
        if length is not None and int(length) > self.server.max_body_bytes:  # h11 checked it
            return 413, self._too_large()
        return None

    def _too_large(self) -> str:
        return f"a request body is at most {self.server.max_body_bytes} bytes (--max-body-mb)"

    async def _body(self) -> bytes | None:
        """The whole body, or None once it grows past the cap (a chunked one). Each read waits
        at most ``timeout_s``."""
        body = bytearray()
        while True:
            event = await self._event(self.loop.time() + self.server.timeout_s)
            if isinstance(event, h11.Data):
                body += event.data
                if len(body) > self.server.max_body_bytes:
                    return None
            elif isinstance(event, h11.EndOfMessage):
                return bytes(body)
            else:  # the connection closed before the body ended
                raise ConnectionResetError

    async def _event(self, deadline: float) -> Any:
        """The next h11 event, reading as needed; ``asyncio.TimeoutError`` at ``deadline``."""
        while True:
            event = self.conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            data = await asyncio.wait_for(self.reader.read(READ_BYTES),
                                          max(deadline - self.loop.time(), 0))
            self.conn.receive_data(data)  # b"": the client closed

    async def _answer(self, status: int, payload: dict[str, Any] | str,
                      linger: bool = False) -> None:
        """``payload`` as JSON, or a string as ``{"error": payload}``; then, with ``linger``,
        the unread body is dropped until the client stops sending or ``timeout_s`` passes."""
        if self.conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return
        data = json.dumps(payload if isinstance(payload, dict) else {"error": payload}).encode()
        headers = [("Content-Type", "application/json"), ("Content-Length", str(len(data))),
                   ("Connection", "close")]
        if status == 401:
            headers.append(("WWW-Authenticate", "Bearer"))
        if status == 405:
            headers.append(("Allow", "POST"))
        out = self.conn.send(h11.Response(status_code=status, headers=headers,
                                          reason=HTTPStatus(status).phrase))
        if self.method != b"HEAD":
            out += self.conn.send(h11.Data(data=data))
        out += self.conn.send(h11.EndOfMessage())
        self.writer.write(out)
        await asyncio.wait_for(self.writer.drain(), self.server.timeout_s)
        if linger and not self._body_read():
            await self._drop_rest()

    def _body_read(self) -> bool:
        """Whether the client has nothing more to send: its body ended (one of no bytes ends
        without a read), or the connection broke."""
        try:
            while self.conn.their_state is h11.SEND_BODY:
                if self.conn.next_event() in (h11.NEED_DATA, h11.PAUSED):
                    return False
        except h11.RemoteProtocolError:
            pass
        return True

    async def _drop_rest(self) -> None:
        """[Note: lingering close]
        A socket closed with bytes unread sends a reset, which can reach the client before it
        has read the answer: so stop sending, and read and drop what comes until the client is
        done, for ``timeout_s`` at most and never more than the body cap."""
        if self.writer.can_write_eof():
            self.writer.write_eof()
        deadline = self.loop.time() + self.server.timeout_s
        dropped = 0
        while dropped <= self.server.max_body_bytes:
            data = await asyncio.wait_for(self.reader.read(READ_BYTES),
                                          max(deadline - self.loop.time(), 0))
            if not data:
                return
            dropped += len(data)


def _request(body: bytes) -> tuple[list[str], list[str], dict[str, list[Any]]]:
    """The prompts, responses and columns of a request body, or ``ValueError`` saying what is
    wrong with it."""
    try:
        request = json.loads(body)
    except RecursionError:  # the C decoder's own depth check
        raise ValueError(f"JSON nested deeper than {sys.getrecursionlimit()} levels") from None
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


def _positive(key: str, value: float, what: str) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(key, f"got {value:g}; allowed: a positive number of {what}")


def main(argv: list[str] | None = None) -> None:
    parser = _Parser(prog="python -m rlhf_paro.reward_server",
                     description="Serve a reward function over HTTP for reward.url.")
    parser.add_argument("spec", help="path/to/file.py:function_name")
    parser.add_argument("--port", type=int, required=True, help="0 picks a free port")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1; another needs --token-env)")
    parser.add_argument("--token-env", metavar="NAME",
                        help="environment variable holding the bearer token requests must carry")
    parser.add_argument("--max-body-mb", type=float, default=DEFAULT_MAX_BODY_MB,
                        help="largest request body, in MiB (default %(default)g)")
    parser.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S,
                        help="seconds a client may take to send its headers, or between two "
                             "parts of its body (default %(default)g)")
    args = parser.parse_args(argv)
    with cli_errors():
        if not 0 <= args.port <= 65535:
            raise ConfigError("--port", f"got {args.port}; allowed: 0 (any free port) to 65535")
        _positive("--max-body-mb", args.max_body_mb, "MiB")
        _positive("--timeout-s", args.timeout_s, "seconds")
        token = None
        if args.token_env is not None:
            token = os.environ.get(args.token_env)
            if not token:
                raise ConfigError("--token-env", f"the environment variable {args.token_env} "
                                                 "is not set (or empty)")
            token = rewards.clean_token(token, args.token_env, "--token-env")
        if token is None and not _is_loopback(args.host):
            raise ConfigError("--host", f"{args.host} is not a loopback address, so anyone who "
                                        "reaches it could use the server; allowed: 127.0.0.1, "
                                        "or another host with --token-env")
        function = usercode.load_function(args.spec, "spec")
    try:
        server = RewardServer((args.host, args.port), function, args.spec, token,
                              max(int(args.max_body_mb * 2**20), 1), args.timeout_s)
    except OSError as err:  # the port taken, an address not of this machine
        print(f"error: cannot listen on {args.host}:{args.port}: {err.strerror or err}",
              file=sys.stderr)
        raise SystemExit(1) from None
    # asyncio warns on stderr of writes to connections a client reset: the client's business.
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)
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
