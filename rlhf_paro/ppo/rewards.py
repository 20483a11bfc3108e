"""Rewards without a model: a Python function (``reward.function=path/to/file.py:name``, run on
the reward workers) or a reward server (``reward.url``, ``rlhf_paro/reward_server.py``).

The function is ``name(prompts: list[str], responses: list[str], **columns)``: prompts as the
model saw them, responses decoded without special tokens, and each other column of the prompts'
dataset rows as a keyword list of the same length. It returns one item per response, as a list,
a tuple, or a 1-D numpy array or torch tensor. An item is a real number (not a bool), or a dict
with a numeric ``score`` and optional named numeric extras (``{"score": 1.0, "has_answer": 1.0}``;
an extra that is None is absent), logged as ``reward/<name>``. A server answers
``{"rewards": [items]}`` to a POST of ``{"prompts", "responses", "columns"}`` and its items are
checked by the same rules. Anything else, a value that is not finite, or a function that raises
stops the run with ``RewardFunctionError``, one line naming the function or server and the step.
"""

from __future__ import annotations

import importlib.util
import json
import math
import numbers
import re
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from http.client import HTTPException
from pathlib import Path
from typing import Any, Callable

from rlhf_paro.config import ConfigError, check_function_spec

RewardFunction = Callable[..., Any]

# A reward server gets this many attempts when it cannot be reached or answers 5xx; the wait
# before the next one starts here and doubles, so a restarting server has about a second.
SERVER_ATTEMPTS = 3
RETRY_DELAY_S = 0.25
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


def function_file(spec: str, key: str = "reward.function") -> Path:
    """The file of ``file.py:name``; ``ConfigError`` naming ``key`` when there is none."""
    check_function_spec(key, spec)
    file = spec.rpartition(":")[0]
    if not Path(file).expanduser().is_file():
        raise ConfigError(key, f"no file {file!r}; allowed: an existing .py file")
    return Path(file).expanduser().resolve()


def load_function(spec: str, key: str = "reward.function") -> RewardFunction:
    """The function ``name`` of ``file.py:name``, the file run as a fresh module."""
    path = function_file(spec, key)
    file, _, name = spec.rpartition(":")
    module_spec = importlib.util.spec_from_file_location(f"rlhf_paro_user_{path.stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    # Registered before it runs, as an import would: a dataclass in the file looks itself up.
    sys.modules[module_spec.name] = module
    try:
        module_spec.loader.exec_module(module)
    except KeyboardInterrupt:
        raise
    except BaseException as err:  # the user's file, whatever it raises, sys.exit() included
        del sys.modules[module_spec.name]
        raise ConfigError(key, f"{file} fails on import: {_described(err)}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(key, f"{file} has no function {name!r}")
    return fn


def call_function(fn: RewardFunction, spec: str, step: int | None, prompts: list[str],
                  responses: list[str], columns: dict[str, list[Any]]) -> RewardOutput:
    """``fn``'s rewards, checked (``check_rewards``). ``step`` None: outside a run (the reward
    server), and the errors name no step."""
    where = f"reward function {spec}" + (f" at step {step}" if step is not None else "")
    try:
        out = fn(prompts, responses, **columns)
    except Exception as err:  # the user's function, whatever it raises
        raise RewardFunctionError(f"{where} raised {_described(err)}") from None
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


def call_server(url: str, step: int, prompts: list[str], responses: list[str],
                columns: dict[str, list[Any]], timeout_s: float, token: str | None = None
                ) -> RewardOutput:
    """The rewards a reward server at ``url`` answers, checked as a function's are.

    POSTs ``{"prompts", "responses", "columns"}`` as JSON (with ``Authorization: Bearer
    <token>`` when a token is given) and reads ``{"rewards": [items]}``. An unreachable server
    or an HTTP 5xx is tried again, ``SERVER_ATTEMPTS`` times in all; any other failure stops at
    once, a timeout included (a server past its time would most likely be again)."""
    where = f"reward server {url} at step {step}"
    try:
        body = json.dumps({"prompts": prompts, "responses": responses, "columns": columns})
    except (TypeError, ValueError) as err:
        raise RewardFunctionError(f"{where}: the prompts' columns do not go as JSON: "
                                  f"{_described(err)}") from None
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, data=body.encode(), headers=headers, method="POST")
    for attempt in range(1, SERVER_ATTEMPTS + 1):
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as answer:
                text = answer.read()
            break
        except urllib.error.HTTPError as err:
            with err:  # the failed answer's connection
                if err.code in (401, 403):
                    why = ("refused the token" if token else
                           "wants a token; set reward.token_env to the variable holding it")
                    raise RewardFunctionError(f"{where}: HTTP {err.code}: the server {why}"
                                              ) from None
                problem = f"HTTP {err.code}: {_error_text(err)}"
            if err.code < 500:
                raise RewardFunctionError(f"{where}: {problem}") from None
        except TimeoutError:
            raise RewardFunctionError(f"{where}: timed out after {timeout_s:g} s") from None
        except urllib.error.URLError as err:
            if isinstance(err.reason, TimeoutError):
                raise RewardFunctionError(f"{where}: timed out after {timeout_s:g} s") from None
            problem = f"unreachable ({_one_line(str(err.reason))})"
        except (HTTPException, OSError) as err:  # the connection broke during the answer
            problem = f"unreachable ({_described(err)})"
        if attempt < SERVER_ATTEMPTS:
            time.sleep(RETRY_DELAY_S * 2 ** (attempt - 1))
    else:
        raise RewardFunctionError(f"{where}: {SERVER_ATTEMPTS} attempts failed, the last: "
                                  f"{problem}")
    try:
        answer = json.loads(text)
    except ValueError as err:
        raise RewardFunctionError(f"{where}: the answer is not JSON ({err})") from None
    if not isinstance(answer, dict) or "rewards" not in answer:
        raise RewardFunctionError(f"{where}: the answer has no 'rewards'; expected "
                                  '{"rewards": [one item per response]}')
    return check_rewards(answer["rewards"], len(responses), where)


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
    if not math.isfinite(value):
        raise RewardFunctionError(f"{what} is not finite ({value})")
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

def _one_line(text: str, limit: int = 300) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[:limit] + "..."


def _described(err: BaseException) -> str:
    message = _one_line(str(err))
    return f"{type(err).__name__}: {message}" if message else type(err).__name__


def _error_text(err: urllib.error.HTTPError) -> str:
    """What a failed answer says: its JSON ``error`` (as ``reward_server`` sends), else its
    first line, else the status's name."""
    try:
        body = err.read(64 * 1024).decode(errors="replace")
    except (HTTPException, OSError):
        body = ""
    try:
        said = json.loads(body).get("error")
    except (ValueError, AttributeError):
        said = body
    return _one_line(str(said or "")) or str(err.reason)
