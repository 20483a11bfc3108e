"""User code named on the command line as ``file.py:NAME`` (a reward function, an environment,
a tool), loaded from its file as a fresh module.

Below both of its readers: ``ppo`` (reward functions) and ``envs`` (environments and tools) load
through here, so neither imports the other for it.
"""

from __future__ import annotations

import difflib
import importlib.util
import inspect
import math
import numbers
import reprlib
import sys
from pathlib import Path
from typing import Any, Callable

from rlhf_paro.config import ConfigError, check_function_spec


def function_file(spec: str, key: str = "reward.function") -> Path:
    """The file of ``file.py:name``; ``ConfigError`` naming ``key`` when there is none."""
    check_function_spec(key, spec)
    file = spec.rpartition(":")[0]
    if not Path(file).expanduser().is_file():
        raise ConfigError(key, f"no file {file!r}; allowed: an existing .py file")
    return Path(file).expanduser().resolve()


def load_function(spec: str, key: str = "reward.function") -> Callable[..., Any]:
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
        raise ConfigError(key, f"{file} fails on import: {described(err)}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        what = (f"has no class or function {name!r}" if fn is None else
                f"defines {name} = {reprlib.repr(fn)}, not a class or function")
        raise ConfigError(key, f"{file} {what}{_defined_names(module, name)}")
    return fn


def _defined_names(module: Any, name: str) -> str:
    """What ``module`` defines that ``file.py:NAME`` could name, each said as what it is (class
    or function), the close ones to ``name`` first: the end of the error's line."""
    found = {attr: "class" if inspect.isclass(obj) else "function"
             for attr, obj in vars(module).items()
             if (inspect.isclass(obj) or inspect.isfunction(obj)) and not attr.startswith("_")
             and getattr(obj, "__module__", None) == module.__name__}
    if not found:
        return "; it defines no class or function"
    close = difflib.get_close_matches(name, list(found), n=1, cutoff=0.6)
    hint = f" (did you mean {found[close[0]]} {close[0]}?)" if close else ""
    return f"{hint}; allowed: " + ", ".join(f"{kind} {attr}" for attr, kind in found.items())


def one_line(text: str, limit: int = 300) -> str:
    """The first line of ``text``, cut at ``limit`` characters: what an error line quotes."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[:limit] + "..."


def described(err: BaseException) -> str:
    """``Kind: first line`` of what user code raised, or its kind alone."""
    message = one_line(str(err))
    return f"{type(err).__name__}: {message}" if message else type(err).__name__


# float32's largest finite value. Rewards, episode scores and the losses that read them are
# float32: a finite float64 past this (``1e300``) is inf there, and every loss of the step NaN.
FLOAT32_MAX = 3.4028234663852886e38
# What a number that user code returns may be, as an error line's "allowed:".
FINITE32 = f"a finite real number within float32's range (|x| <= {FLOAT32_MAX:.4g})"


def finite32(value: numbers.Real) -> bool:
    """Whether float32 holds ``value`` finite: the one rule for every number user code returns
    (reward items and extras, a reward server's answers, environment rewards, episode scores)."""
    try:
        value = float(value)
    except OverflowError:  # an int past even float64's range
        return False
    return math.isfinite(value) and abs(value) <= FLOAT32_MAX
