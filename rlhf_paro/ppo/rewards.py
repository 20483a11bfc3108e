"""Rewards without a model: a Python function (``reward.function=path/to/file.py:name``, run on
the reward workers) or a reward server (``reward.url``, ``rlhf_paro/reward_server.py``).

The function is ``name(prompts: list[str], responses: list[str], **columns)``: prompts as the
model saw them, responses decoded without special tokens, and each other column of the prompts'
dataset rows as a keyword list of the same length. It returns one item per response, as a list,
a tuple, or a 1-D numpy array or torch tensor. An item is a real number (not a bool), or a dict
with a numeric ``score`` and optional named numeric extras (``{"score": 1.0, "has_answer": 1.0}``;
an extra that is None is absent), logged as ``reward/<name>``. A server answers
``{"rewards": [items]}`` to a POST of ``{"prompts", "responses", "columns"}`` and its items are
checked by the same rules. Anything else, a value that float32 does not hold finite (``1e300``
too: the rewards are float32), or a function that raises stops the run with
``RewardFunctionError``, one line naming the function or server, the step and the item.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import numbers
import re
import sys
import time
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Callable

from rlhf_paro.config import ConfigError
from rlhf_paro.usercode import FINITE32, described, finite32, one_line

# The function's own arguments: a column of these names would be passed twice (a TypeError
# blaming the function, or a reward server's 500), so the prompt files may not have one.
ARGUMENTS = ("prompts", "responses")

RewardFunction = Callable[..., Any]

# A reward server gets this many attempts when it cannot be reached or answers 5xx; the wait
# before the next one starts here and doubles, so a restarting server has about a second.
SERVER_ATTEMPTS = 3
RETRY_DELAY_S = 0.25
# A reward server's answer past this is refused unparsed: the rewards of a batch are KiBs.
MAX_ANSWER_BYTES = 16 * 2**20
# The part of a failed answer read for its reason.
ERROR_BYTES = 64 * 2**10
# Extras become metric names (``reward/<name>``, ``reward/<name>:count``): no separators in them.
EXTRA_NAME = re.compile(r"[A-Za-z0-9_]+")


class RewardFunctionError(RuntimeError):
    """A reward function or server failed at a step; ``str()`` is one line."""


@dataclass
class RewardOutput:
    """Checked rewards: one score per response, and each extra any item named, with None where
    an item lacks it."""

    scores: list[float]
    extras: dict[str, list[float | None]] = field(default_factory=dict)

    def items(self) -> list[float | dict[str, float]]:
        """Back in a function's form: a number, or a dict where the item had extras."""
        out: list[float | dict[str, float]] = []
        for i, score in enumerate(self.scores):
            extras = {name: v[i] for name, v in self.extras.items() if v[i] is not None}
            out.append({"score": score, **extras} if extras else score)
        return out


def call_function(fn: RewardFunction, spec: str, step: int | None, prompts: list[str],
                  responses: list[str], columns: dict[str, list[Any]]) -> RewardOutput:
    """``fn``'s rewards, checked (``check_rewards``). ``step`` None: outside a run (the reward
    server), and the errors name no step.

    ``fn`` gets copies of the lists: one that empties or extends its arguments still has its
    count checked against the responses as given. Whatever it raises, ``KeyboardInterrupt`` and
    ``SystemExit`` (``sys.exit``) included, is a ``RewardFunctionError``: on a worker they would
    read as a Ctrl-C of the run or the worker's own exit, blaming no function."""
    where = f"reward function {spec}" + (f" at step {step}" if step is not None else "")
    try:
        out = fn(list(prompts), list(responses),
                 **{name: list(values) for name, values in columns.items()})
    except BaseException as err:  # the user's function, whatever it raises
        raise RewardFunctionError(f"{where} raised {described(err)}") from None
    return check_rewards(out, len(responses), where)


def check_rewards(out: Any, num_responses: int, where: str) -> RewardOutput:
    """``out`` as ``RewardOutput`` if it holds one valid item per response (the module's
    docstring says which), else ``RewardFunctionError`` starting with ``where``."""
    items = _as_list(out)
    if items is None:
        raise RewardFunctionError(f"{where} returned {_kind(out)}; expected a list of "
                                  f"{num_responses} numbers or dicts with a numeric 'score'")
    if len(items) != num_responses:
        raise RewardFunctionError(f"{where} returned {len(items)} values for {num_responses} "
                                  "responses")
    scores: list[float] = []
    extras: dict[str, list[float | None]] = {}
    for i, item in enumerate(items):
        if isinstance(item, dict):
            score, what = _number(item.get("score")), f"item {i}'s score"
            if score is None:
                raise RewardFunctionError(f"{where}: item {i} is a dict without a numeric "
                                          "'score'")
        else:
            score, what = _number(item), f"item {i}"
            if score is None:
                raise RewardFunctionError(f"{where}: item {i} is {_kind(item)}; expected a "
                                          "number or a dict with a numeric 'score'")
        scores.append(_finite(score, f"{where}: {what}"))
        for name, value in item.items() if isinstance(item, dict) else ():
            if name == "score" or value is None:
                continue
            if not isinstance(name, str) or not EXTRA_NAME.fullmatch(name):
                raise RewardFunctionError(f"{where}: item {i} has an extra named {name!r}; "
                                          "allowed: letters, digits and _")
            number = _number(value)
            if number is None:
                raise RewardFunctionError(f"{where}: item {i}'s extra {name!r} is "
                                          f"{_kind(value)}; expected a number")
            extras.setdefault(name, [None] * num_responses)[i] = _finite(
                number, f"{where}: item {i}'s {name!r}")
    return RewardOutput(scores, extras)


def clean_token(token: str, name: str, key: str) -> str:
    """A bearer token read from the environment variable ``name``, without the whitespace around
    it (a secret mounted from a file often ends in a newline); ``ConfigError`` naming ``key``,
    never the token, when what is left cannot go in an HTTP header."""
    token = token.strip()
    if not token:
        raise ConfigError(key, f"the environment variable {name} holds only whitespace; allowed: "
                               "a token of printable characters")
    if not header_text(token):
        raise ConfigError(key, f"the value of the environment variable {name} holds a control "
                               "character or one outside Latin-1 (the value is not shown); "
                               "allowed: a token of printable characters, as an HTTP header "
                               "carries")
    return token


def header_text(text: str) -> bool:
    """Whether ``text`` can be an HTTP header value as it is: printable Latin-1, no controls."""
    return all(" " <= c <= "~" or "\xa0" <= c <= "\xff" for c in text)


def call_server(url: str, step: int, prompts: list[str], responses: list[str],
                columns: dict[str, list[Any]], timeout_s: float, token: str | None = None
                ) -> RewardOutput:
    """The rewards a reward server at ``url`` answers, checked as a function's are.

    POSTs ``{"prompts", "responses", "columns"}`` as JSON (with ``Authorization: Bearer
    <token>`` when a token is given) and reads ``{"rewards": [items]}``. ``timeout_s`` bounds
    each attempt whole: connecting, sending, and the answer to its last byte. An unreachable
    server or an HTTP 5xx is tried again, ``SERVER_ATTEMPTS`` times in all; any other failure
    stops at once, a timeout included (a server past its time would most likely be again). A
    redirect is never followed: the token would go wherever it points.

    Every failure is a ``RewardFunctionError`` naming the server and the step. The token is
    never in it: what the server said (its error text, its redirect, its malformed answer) is
    quoted with the token, should the server echo it, as ``<token>``."""
    where = f"reward server {url} at step {step}"

    def hide(said: str) -> str:  # a part of the line that the server wrote
        return said.replace(token, "<token>") if token else said

    try:
        return _call_server(where, url, prompts, responses, columns, timeout_s, token, hide)
    except RewardFunctionError:
        raise
    except Exception as err:  # anything else is the answer's doing: never the actor's
        raise RewardFunctionError(f"{where}: {hide(described(err))}") from None


def _call_server(where: str, url: str, prompts: list[str], responses: list[str],
                 columns: dict[str, list[Any]], timeout_s: float, token: str | None,
                 hide: Callable[[str], str]) -> RewardOutput:
    try:
        body = json.dumps({"prompts": prompts, "responses": responses, "columns": columns})
    except (TypeError, ValueError) as err:
        raise RewardFunctionError(f"{where}: the prompts' columns do not go as JSON: "
                                  f"{described(err)}") from None
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    if token:
        if not header_text(token):
            raise RewardFunctionError(f"{where}: the token holds a control character or one "
                                      "outside Latin-1, which no HTTP header can carry")
        headers["Authorization"] = b"Bearer " + token.encode("latin-1")
    for attempt in range(1, SERVER_ATTEMPTS + 1):
        try:
            status, location, text = _post(url, body.encode(), headers, timeout_s)
        except _TimedOut:
            raise RewardFunctionError(f"{where}: timed out after {timeout_s:g} s "
                                      "(reward.timeout_s)") from None
        except _Unreachable as err:
            problem = f"unreachable ({hide(str(err))})"
        else:
            if 300 <= status < 400:
                raise RewardFunctionError(
                    f"{where}: HTTP {status}: the server redirects to "
                    f"{hide(one_line(location)) or 'nowhere'}; redirects are not followed (the "
                    "token would go with them): set reward.url to the address that answers")
            if status in (401, 403):
                why = ("refused the token" if token else
                       "wants a token; set reward.token_env to the variable holding it")
                raise RewardFunctionError(f"{where}: HTTP {status}: the server {why}")
            if status < 300:
                break
            problem = f"HTTP {status}: {hide(_error_text(text, status))}"
            if status < 500:
                raise RewardFunctionError(f"{where}: {problem}")
        if attempt < SERVER_ATTEMPTS:
            time.sleep(RETRY_DELAY_S * 2 ** (attempt - 1))
    else:
        raise RewardFunctionError(f"{where}: {SERVER_ATTEMPTS} attempts failed, the last: "
                                  f"{problem}")
    if text is None:
        raise RewardFunctionError(f"{where}: the answer is over {MAX_ANSWER_BYTES} bytes; "
                                  "expected {\"rewards\": [one item per response]}")
    try:
        answer = json.loads(text)
    except RecursionError:
        raise RewardFunctionError(f"{where}: the answer is JSON nested deeper than "
                                  f"{sys.getrecursionlimit()} levels") from None
    except ValueError as err:
        raise RewardFunctionError(f"{where}: the answer is not JSON ({hide(one_line(str(err)))})"
                                  ) from None
    if not isinstance(answer, dict) or "rewards" not in answer:
        raise RewardFunctionError(f"{where}: the answer has no 'rewards'; expected "
                                  '{"rewards": [one item per response]}')
    try:
        return check_rewards(answer["rewards"], len(responses), where)
    except RewardFunctionError as err:  # an extra's name is the server's
        raise RewardFunctionError(where + hide(str(err)[len(where):])) from None


@functools.cache
def _tls_context() -> Any:
    """httpx's default TLS context (certifi's roots, or ``SSL_CERT_FILE``), made once: loading
    the roots takes a tenth of a second, which every step would pay again."""
    import httpx

    return httpx.create_ssl_context()


class _TimedOut(Exception):
    """An attempt ran past its ``timeout_s``."""


class _Unreachable(Exception):
    """An attempt found no server, or lost the connection before a whole answer; ``str()`` is
    one line."""


def _post(url: str, body: bytes, headers: dict[str, Any], timeout_s: float
          ) -> tuple[int, str, bytes | None]:
    """One POST: the answer's status, its ``Location`` and its body (None: a 2xx body over
    ``MAX_ANSWER_BYTES``; the first ``ERROR_BYTES`` of any other).

    [Note: a total deadline]
    httpx's timeouts bound each network operation, so a server that sends its answer a byte at
    a time would never trip them. The attempt runs as a task that is cancelled at ``timeout_s``
    instead, wherever it is: connecting, sending, or reading the body; cancelled, httpx closes
    the connection. The event loop is this call's own."""
    import httpx  # here, not at the top: a run without a reward server never pays its import

    async def attempt() -> tuple[int, str, bytes | None]:
        async with httpx.AsyncClient(follow_redirects=False, timeout=timeout_s,
                                     verify=_tls_context()) as client:
            async with client.stream("POST", url, content=body, headers=headers) as answer:
                limit = MAX_ANSWER_BYTES if answer.status_code < 300 else ERROR_BYTES
                data = bytearray()
                async for chunk in answer.aiter_bytes():
                    data += chunk
                    if len(data) > limit:
                        break
                else:
                    return answer.status_code, answer.headers.get("location", ""), bytes(data)
                over = answer.status_code < 300
                return (answer.status_code, answer.headers.get("location", ""),
                        None if over else bytes(data[:limit]))

    try:
        return asyncio.run(asyncio.wait_for(attempt(), timeout_s))
    except (asyncio.TimeoutError, httpx.TimeoutException):
        raise _TimedOut from None
    except (httpx.NetworkError, httpx.RemoteProtocolError, httpx.ProxyError) as err:
        raise _Unreachable(described(err)) from None


# --- checking items -------------------------------------------------------------------------

def _as_list(out: Any) -> list[Any] | None:
    """The items of a list, tuple or 1-D array or tensor; None for anything else. numpy and
    torch are looked up, not imported: a value of theirs means they are loaded already."""
    if isinstance(out, (list, tuple)):
        return list(out)
    for module, kind in (("numpy", "ndarray"), ("torch", "Tensor")):
        lib = sys.modules.get(module)
        if lib is not None and isinstance(out, getattr(lib, kind)):
            return out.tolist() if out.ndim == 1 else None
    return None


def _number(value: Any) -> float | None:
    """``value`` as a float if it is a real number (a numpy scalar or a 0-d torch tensor too),
    else None: a bool is a yes or no, not a reward."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor) and value.ndim == 0:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        return float(value)
    except OverflowError:  # an int past the float range
        return math.inf


def _finite(value: float, what: str) -> float:
    """``value`` if float32 holds it (``usercode.finite32``): the scores become a float32
    tensor, where a finite float64 past its range is inf and the step's every loss NaN."""
    if not finite32(value):
        raise RewardFunctionError(f"{what} is {value:g}; allowed: {FINITE32}")
    return value


def _kind(value: Any) -> str:
    """``value``'s type in words: ``None``, ``a str``, ``an int``, ``a 2-D ndarray of float64``."""
    if value is None:
        return "None"
    name = type(value).__name__
    if name in ("ndarray", "Tensor") and getattr(value, "ndim", 1) != 1:
        name = f"{value.ndim}-D {name} of {value.dtype}"
    return f"{'an' if name[0].lower() in 'aeiou' else 'a'} {name}"


# --- one-line messages ----------------------------------------------------------------------

def _error_text(body: bytes, status: int) -> str:
    """What a failed answer says: its JSON ``error`` (as ``reward_server`` sends), else its
    first line, else the status's name."""
    text = body.decode(errors="replace")
    try:
        said = json.loads(text).get("error")
    except (ValueError, AttributeError, RecursionError):
        said = text
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:  # a status of the server's own
        phrase = "no reason given"
    return one_line(str(said or "")) or phrase
