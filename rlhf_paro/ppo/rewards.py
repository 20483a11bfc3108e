"""Reward functions: ``reward.function=path/to/file.py:name``, run on the reward workers.

The function is ``name(prompts: list[str], responses: list[str], **columns) -> list[float]``:
prompts as the model saw them, responses decoded without special tokens, and each other column
of the prompts' dataset rows as a keyword list of the same length. One that raises or returns
something else than one number per response stops the run with ``RewardFunctionError``, one
line naming the function and the PPO step.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from typing import Any, Callable

from rlhf_paro.config import ConfigError

RewardFunction = Callable[..., Any]


class RewardFunctionError(RuntimeError):
    """A reward function failed at a step; ``str()`` is one line."""


def load_function(spec: str, key: str = "reward.function") -> RewardFunction:
    """The function ``name`` of ``file.py:name``, the file run as a fresh module."""
    file, _, name = spec.rpartition(":")
    path = Path(file).expanduser().resolve()
    module_spec = importlib.util.spec_from_file_location(f"rlhf_paro_user_{path.stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    # Registered before it runs, as an import would: a dataclass in the file looks itself up.
    sys.modules[module_spec.name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as err:  # the user's file, whatever it raises
        del sys.modules[module_spec.name]
        raise ConfigError(key, f"{file} fails on import: {type(err).__name__}: {err}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(key, f"{file} has no function {name!r}")
    return fn


def call_function(fn: RewardFunction, spec: str, step: int, prompts: list[str],
                  responses: list[str], columns: dict[str, list[Any]]) -> list[float]:
    """``fn``'s rewards, checked: one finite-or-not float per response."""
    where = f"reward function {spec} at step {step}"
    try:
        out = fn(prompts, responses, **columns)
    except Exception as err:  # the user's function, whatever it raises
        message = str(err).splitlines()[0] if str(err) else ""
        raise RewardFunctionError(f"{where} raised {type(err).__name__}: {message}") from None
    try:
        values = [float(v) for v in out]
    except (TypeError, ValueError):
        raise RewardFunctionError(f"{where} returned {type(out).__name__}; expected a list of "
                                  f"{len(responses)} numbers") from None
    if len(values) != len(responses):
        raise RewardFunctionError(f"{where} returned {len(values)} values for "
                                  f"{len(responses)} responses")
    if not all(math.isfinite(v) for v in values):
        raise RewardFunctionError(f"{where} returned a value that is not finite")
    return values
