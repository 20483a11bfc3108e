"""The built-in tool environment (``env.tools=file.py:a,b``): plain Python functions the model
calls in its chat template's tool-call format.

Each function's signature and docstring (a Google-style ``Args:`` section, what transformers'
``get_json_schema`` reads) become a schema that the prompts' chat template receives as
``tools=``. A turn's tool calls are parsed from the model's text in the convention of
Qwen2.5/Hermes-style templates: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
one block per call. Each call's result comes back as a ``{"role": "tool", ...}`` message; a
turn that calls no tool is the agent's answer and ends the episode. A malformed call (not JSON,
JSON nested too deep to parse, an unknown tool, arguments the function refuses, a tool that
raises, a result that JSON cannot encode) is an observation the agent sees, never a crash:
whatever the policy can write, it will. A tool that would end the process (``sys.exit``,
``KeyboardInterrupt``) stops the run in one line naming it. The episode's reward is the reward
section's (a tool only answers).
"""

from __future__ import annotations

import json
from typing import Any, Callable

from rlhf_paro import usercode
from rlhf_paro.config import ConfigError

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"


class ToolExit(Exception):
    """A tool raised what would end the process; ``str()`` names the tool, in one line."""


def load_tools(spec: str, limit: usercode.Limit | None = None) -> dict[str, Callable[..., Any]]:
    """The functions ``a, b`` of ``file.py:a,b`` by name; ``ConfigError`` naming ``env.tools``
    for a file or function that is not there, or one without the docstring a schema needs.
    ``limit``: how long the file's import and the schemas may take (``usercode.bounded``)."""
    file, _, names = spec.rpartition(":")
    functions = {}
    for name in (n.strip() for n in names.split(",")):
        function = usercode.load_function(f"{file}:{name}", "env.tools", limit)
        if not callable(function):
            raise ConfigError("env.tools", f"{name} in {file} is not a function")
        functions[name] = function
    # Refuses a function whose schema cannot be made, before the run. Reading its type hints
    # evaluates the file's annotations: user code, held to the same limit as the import.
    usercode.bounded(lambda: schemas(functions), f"the schemas of {spec}", "env.tools", limit)
    return functions


def schemas(functions: dict[str, Callable[..., Any]]) -> list[dict[str, Any]]:
    """The JSON schemas of the tools, as chat templates take them (``tools=``)."""
    from transformers.utils import get_json_schema

    out = []
    for name, function in functions.items():
        try:
            out.append(get_json_schema(function))
        except Exception as err:  # transformers' docstring and type-hint parse errors
            detail = str(err).splitlines()[0]
            raise ConfigError("env.tools", f"no tool schema from {name}: {detail}; allowed: a "
                                           "function with type hints and a docstring whose "
                                           "Args: section describes every argument") from None
    return out


def parse_tool_calls(text: str) -> tuple[list[tuple[str, dict[str, Any]]], list[str]]:
    """(calls as (name, arguments), problems of malformed ones) in a turn's text."""
    calls, problems = [], []
    bodies, unclosed = _bodies(text)
    for body in bodies:
        try:
            call = json.loads(body)
        except ValueError as err:
            problems.append(f"the tool call is not JSON ({str(err).splitlines()[0]})")
            continue
        except RecursionError:
            problems.append("the tool call's JSON is nested too deep to read")
            continue
        arguments = call.get("arguments", {}) if isinstance(call, dict) else None
        if isinstance(arguments, str):  # some templates emit the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError):
                arguments = None
        if not (isinstance(call, dict) and isinstance(call.get("name"), str)
                and isinstance(arguments, dict)):
            problems.append('a tool call needs {"name": "...", "arguments": {...}}')
            continue
        calls.append((call["name"], arguments))
    if unclosed:
        problems.append("a <tool_call> is not closed by </tool_call>")
    return calls, problems


def _bodies(text: str) -> tuple[list[str], bool]:
    """(the texts between each <tool_call> and the </tool_call> after it, whether one is left
    open), in one pass over ``text``: a turn of many opening tags costs its length, not its
    square."""
    bodies, pos = [], 0
    while (start := text.find(OPEN_TAG, pos)) >= 0:
        end = text.find(CLOSE_TAG, start + len(OPEN_TAG))
        if end < 0:
            return bodies, True
        bodies.append(text[start + len(OPEN_TAG):end])
        pos = end + len(CLOSE_TAG)
    return bodies, False


class ToolEnv:
    """One sample's tool environment: each turn runs the calls it makes; a turn without a call
    ends the episode. ``tool_calls`` and ``tool_errors`` count what happened
    (``env/tool_calls``, ``env/tool_errors``)."""

    def __init__(self, functions: dict[str, Callable[..., Any]], **row: Any) -> None:
        self.functions = functions
        self.tool_calls = 0
        self.tool_errors = 0

    def reset(self) -> None:
        return None

    def step(self, action: str) -> tuple[list[dict[str, str]] | None, float, bool]:
        calls, problems = parse_tool_calls(action)
        if not calls and not problems:
            return None, 0.0, True
        self.tool_calls += len(problems)  # a malformed call is a call that failed
        messages = [self._error(problem) for problem in problems]
        for name, arguments in calls:
            self.tool_calls += 1
            function = self.functions.get(name)
            if function is None:
                messages.append(self._error(f"no tool {name!r}; the tools are "
                                            f"{', '.join(self.functions)}", name))
                continue
            try:
                result = function(**arguments)
                content = result if isinstance(result, str) else json.dumps(result, default=str)
            except Exception as err:  # the tool's own failure (or its result's) is the agent's
                detail = str(err).splitlines()[0] if str(err) else ""
                messages.append(self._error(f"{type(err).__name__}: {detail}", name))
                continue
            except BaseException as err:  # sys.exit, KeyboardInterrupt: not the agent's to see
                detail = str(err).splitlines()[0] if str(err) else ""
                raise ToolExit(f"the tool {name} raised {type(err).__name__}"
                               + (f": {detail}" if detail else "")) from None
            messages.append(_message(content, name))
        return messages, 0.0, False

    def _error(self, problem: str, name: str | None = None) -> dict[str, str]:
        self.tool_errors += 1
        return _message(f"error: {problem}", name)


def _message(content: str, name: str | None) -> dict[str, str]:
    """A tool message; a lone surrogate (a JSON escape the model wrote, echoed) becomes "?":
    what the model wrote must not stop the run as text without UTF-8."""
    content = content.encode("utf-8", "replace").decode("utf-8")
    return {"role": "tool", "content": content} if name is None else {
        "role": "tool", "name": name, "content": content}
