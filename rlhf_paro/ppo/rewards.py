"""Reward functions: ``reward.function=path/to/file.py:name``, run on the reward workers.

The function is ``name(prompts: list[str], responses: list[str], **columns)``: prompts as the
model saw them, responses decoded without special tokens, and each other column of the prompts'
dataset rows as a keyword list of the same length. It returns one item per response, as a list,
a tuple, or a 1-D numpy array or torch tensor. An item is a real number (not a bool), or a dict
with a numeric ``score`` and optional named numeric extras (``{"score": 1.0, "has_answer": 1.0}``;
an extra that is None is absent), logged as ``reward/<name>``. Anything else, a value that is
not finite, or a function that raises stops the run with ``RewardFunctionError``, one line naming
the function and the step.
"""

from __future__ import annotations

import importlib.util
import math
import numbers
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from rlhf_paro.config import ConfigError, _check_function_spec

RewardFunction = Callable[..., Any]

# Extras become metric names (``reward/<name>``, ``reward/<name>:count``): no separators in them.
EXTRA_NAME = re.compile(r"[A-Za-z0-9_]+")


class RewardFunctionError(RuntimeError):
    """A reward function failed at a step; ``str()`` is one line."""


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


def load_function(spec: str, key: str = "reward.function") -> RewardFunction:
    """The function ``name`` of ``file.py:name``, the file run as a fresh module."""
    _check_function_spec(key, spec)
    file, _, name = spec.rpartition(":")
    path = Path(file).expanduser().resolve()
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
    """``fn``'s rewards, checked (``check_rewards``). ``step`` None: outside a run, and the
    errors name no step."""
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
