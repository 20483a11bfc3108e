"""User code named on the command line as ``file.py:NAME`` (a reward function, an environment,
a tool), loaded from its file as a fresh module.

Below both of its readers: ``ppo`` (reward functions) and ``envs`` (environments and tools) load
through here, so neither imports the other for it. The driver's calls of user code before a run
(imports, an environment's first build, tools' schemas) go through ``bounded``, held to the
bound the same code meets on the workers.
"""

from __future__ import annotations

import difflib
import importlib.util
import inspect
import math
import numbers
import reprlib
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple, TypeVar

from rlhf_paro.config import ConfigError, check_function_spec


def function_file(spec: str, key: str = "reward.function") -> Path:
    """The file of ``file.py:name``; ``ConfigError`` naming ``key`` when there is none."""
    check_function_spec(key, spec)
    file = spec.rpartition(":")[0]
    if not Path(file).expanduser().is_file():
        raise ConfigError(key, f"no file {file!r}; allowed: an existing .py file")
    return Path(file).expanduser().resolve()


# How often the driver, waiting for user code, looks at the clock and for a Ctrl-C.
_POLL_S = 0.05


class Limit(NamedTuple):
    """How long the driver waits for one call of user code, and the key that sets it."""

    seconds: float | None  # None: as long as it takes (the key set to null)
    key: str


T = TypeVar("T")


def bounded(call: Callable[[], T], what: str, key: str, limit: Limit | None) -> T:
    """``call()``'s result, the call run in a thread of its own and waited for ``limit`` (None:
    run in this thread); what it raises is raised here. Past the limit, ``ConfigError`` naming
    ``key`` (the user code's key), ``what`` was waited on and the key that sets the limit.

    The same bound as the user's code meets on the workers (``env.timeout_s`` for an
    environment's calls, ``trainer.step_timeout_s`` for a reward function's import). A blocked
    thread cannot be killed, so it is a daemon: the command stops on the error raised here and
    ends its process without waiting for the thread (``cli.exit_when_done``)."""
    if limit is None:
        return call()
    outcome: list[tuple[bool, Any]] = []
    done = threading.Event()

    def run() -> None:
        try:
            outcome.append((True, call()))
        except BaseException as err:  # noqa: BLE001 - raised again in the waiting thread
            outcome.append((False, err))
        finally:
            done.set()

    threading.Thread(target=run, name=f"user code: {what}", daemon=True).start()
    deadline = None if limit.seconds is None else time.monotonic() + limit.seconds
    # Waited for in slices: a Ctrl-C that the kernel hands another thread is handled in this one
    # between two waits, never only once the user's code returns.
    while not done.wait(_POLL_S):
        if deadline is not None and time.monotonic() > deadline:
            raise ConfigError(key, f"{what} did not return within {limit.key}="
                                   f"{limit.seconds:g} s; allowed: code that returns sooner, or "
                                   f"a larger {limit.key}")
    returned, value = outcome[0]
    if not returned:
        raise value
    return value


def load_function(spec: str, key: str = "reward.function", limit: Limit | None = None
                  ) -> Callable[..., Any]:
    """The function ``name`` of ``file.py:name``, the file run as a fresh module; its import
    held to ``limit`` (``bounded``)."""
    path = function_file(spec, key)
    file, _, name = spec.rpartition(":")
    module_spec = importlib.util.spec_from_file_location(f"rlhf_paro_user_{path.stem}", path)
    module = importlib.util.module_from_spec(module_spec)

    def run_file() -> None:
        # Registered before it runs, as an import would: a dataclass in the file looks itself up.
        sys.modules[module_spec.name] = module
        try:
            module_spec.loader.exec_module(module)
        except BaseException as err:  # the user's file, whatever it raises, sys.exit() included
            del sys.modules[module_spec.name]
            # Signals reach the main thread only: there a KeyboardInterrupt is a Ctrl-C of the
            # command, in a thread of its own it is the file's.
            if isinstance(err, KeyboardInterrupt) and \
                    threading.current_thread() is threading.main_thread():
                raise
            raise ConfigError(key, f"{file} fails on import: {described(err)}") from None

    bounded(run_file, f"importing {file}", key, limit)
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
