"""Environments of multi-turn episodes: the contract, loading one, running them on a rank's
samples at once, and their observations as tokens (docs/design.md, "Multi-turn episodes").

The contract (``env.function=file.py:NAME``): ``NAME(**row)`` builds one environment per sample
from the columns of its prompt's row (the prompt column as the text the model sees), and

    reset() -> observation | None          # None: the prompt alone starts the episode
    step(action: str) -> (observation | None, reward: float, done: bool)
    close()                                # optional: called once the rollout's episodes end

``action`` is the model's turn decoded without special tokens. An observation is text, or chat
messages (a ``{"role": "tool" | "user", "content": ...}`` dict or a list of them) rendered with
the tokenizer's chat template (``data.apply_chat_template=true``). A ``reset`` that takes a
``seed`` keyword (gymnasium's convention) gets one drawn from the run's seed, the step and the
sample, so a resumed run meets the same episodes. ``env.tools`` builds ``envs.tools.ToolEnv``
instead. An observation's text is tokenised as text (a ``<|im_end|>`` in it is characters, not
the control token) unless ``env.observation_special_tokens=true``, and only as far as the
episode's budget: one too long for the room left is dropped without being tokenised whole.

An environment that raises (``sys.exit`` and ``KeyboardInterrupt`` included: in its thread they
are the environment's, never a Ctrl-C of the run), returns something else (an observation that
is not valid Unicode too), or takes longer than ``env.timeout_s`` for one call stops the run with
``EnvError``: one line naming the environment, the step, the sample and what went wrong.
"""

from __future__ import annotations

import inspect
import numbers
import reprlib
import time
import uuid
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Sequence

from rlhf_paro import usercode
from rlhf_paro.config import Config, ConfigError

# How often the driver of a batch of environment calls looks for one past its deadline.
_POLL_S = 0.05


class EnvError(RuntimeError):
    """An environment failed at a step; ``str()`` is one line."""


class StepResult(NamedTuple):
    observation: Any  # text, chat messages, or None
    reward: float
    done: bool


def check_step(value: Any, name: str, where: str) -> StepResult:
    """``step``'s return as a ``StepResult``; ``EnvError`` naming ``name`` and ``where`` for
    anything but ``(observation | None, real reward finite in float32, bool done)``."""
    if not isinstance(value, (tuple, list)) or len(value) != 3:
        got = f"a {type(value).__name__}" + (f" of {len(value)}" if isinstance(
            value, (tuple, list)) else "")
        raise EnvError(f"{name}.step returned {got} {where}; allowed: (observation | None, "
                       "reward, done)")
    observation, reward, done = value
    # Within float32 (``usercode.finite32``), the rollout's scores' dtype: 1e300 is inf there.
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or \
            not usercode.finite32(reward):
        raise EnvError(f"{name}.step returned the reward {reprlib.repr(reward)} {where}; "
                       f"allowed: {usercode.FINITE32}")
    if not isinstance(done, bool):
        raise EnvError(f"{name}.step returned done={done!r} {where}; allowed: True or False")
    check_observation(observation, f"{name}.step", where)
    return StepResult(observation, float(reward), done)


def check_observation(observation: Any, what: str, where: str) -> None:
    """``EnvError`` unless ``observation`` is None, text, a message dict or a list of them, all
    of its text valid Unicode (a lone surrogate has no UTF-8, which the tokenizer needs)."""
    if observation is None:
        return
    messages = [observation] if isinstance(observation, dict) else observation
    if isinstance(observation, str):
        texts = [observation]
    elif isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str) for m in messages):
        texts = [m["content"] for m in messages]
    else:
        raise EnvError(f"{what} returned the observation {str(observation)[:60]!r} {where}; "
                       'allowed: None, text, or chat messages {"role": ..., "content": ...}')
    for text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            raise EnvError(f"{what} returned an observation with {err.object[err.start]!r} at "
                           f"character {err.start} {where}; allowed: text without lone "
                           "surrogates (valid Unicode)") from None


def limit(cfg: Config) -> usercode.Limit:
    """The bound on each call of an environment's code: its file's import and its tools'
    schemas as much as a build, ``reset`` or ``step``."""
    return usercode.Limit(cfg.env.timeout_s, "env.timeout_s")


def load(cfg: Config) -> tuple[Callable[..., Any], str]:
    """(factory of one sample's environment, its name for error lines) of ``env.function`` or
    ``env.tools``; ``ConfigError`` naming the key when the file or the name is not there, or
    when its import takes longer than ``env.timeout_s``."""
    env = cfg.env
    if env.tools is not None:
        from rlhf_paro.envs import tools

        functions = tools.load_tools(env.tools, limit(cfg))
        return (lambda **row: tools.ToolEnv(functions, **row)), "env.tools"
    factory = usercode.load_function(env.function, "env.function", limit(cfg))
    if not callable(factory):
        raise ConfigError("env.function", f"{env.function} is a {type(factory).__name__}; "
                                          "allowed: a class or a function that builds one "
                                          "sample's environment")
    return factory, env.function.rpartition(":")[2]


def tool_schemas(cfg: Config) -> list[dict[str, Any]] | None:
    """The tools' schemas for the chat template (``env.tools``); None without tools."""
    if cfg.env.tools is None:
        return None
    from rlhf_paro.envs import tools

    functions = tools.load_tools(cfg.env.tools, limit(cfg))
    return usercode.bounded(lambda: tools.schemas(functions), f"the schemas of {cfg.env.tools}",
                            "env.tools", limit(cfg))


def check_factory(cfg: Config, row: dict[str, Any]) -> None:
    """``ConfigError`` before anything starts when the environment cannot be built from the
    columns of a prompt row (``NAME(**row)`` refused), lacks ``reset`` / ``step``, or takes
    longer than ``env.timeout_s`` to build, as on the workers."""
    factory, name = load(cfg)

    def build() -> Any:
        try:
            return factory(**row)
        except TypeError as err:
            raise ConfigError("env.function", f"{name}(**row) refuses the prompt rows' columns "
                              f"{', '.join(sorted(row))} ({usercode.described(err)}); allowed: a "
                              "class whose constructor takes those columns (or **row)") from None
        except BaseException as err:  # in its thread, whatever it raises is the constructor's
            raise ConfigError("env.function", f"{name}(**row) raised on the first prompt row "
                                              f"({usercode.described(err)})") from None

    env = usercode.bounded(build, f"{name}(**row) on the first prompt row", "env.function",
                           limit(cfg))
    for method in ("reset", "step"):
        if not callable(getattr(env, method, None)):
            raise ConfigError("env.function", f"{name} has no {method}() method; allowed: an "
                                              "environment with reset() and step(action)")


def takes_seed(method: Callable[..., Any]) -> bool:
    """Whether ``method`` takes a ``seed`` keyword (gymnasium's ``reset(seed=...)``)."""
    try:
        params = inspect.signature(method).parameters
    except (TypeError, ValueError):
        return False
    return "seed" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def sample_seed(run_seed: int, step: int, sample: int) -> int:
    """A sample's environment seed: a pure function of the run's seed, the step and the sample,
    so a resumed run's episodes are those of a run that never stopped."""
    return ((run_seed * 1_000_003 + step) * 1_000_003 + sample) & 0x7FFFFFFF


@dataclass
class Calls:
    """Counts and time of one rank's environment calls in a rollout."""

    steps: int = 0
    step_time_s: float = 0.0  # summed over steps (calls running at once all count)
    latencies_s: list[float] = field(default_factory=list)  # each step's own seconds


@dataclass
class _Timing:
    """When a call's thread started it (None: queued), and its seconds once it returned."""

    began: float | None = None
    elapsed: float = 0.0


class EnvRunner:
    """Builds, resets and steps one rank's environments, ``num_workers`` calls at a time in
    threads (a slow environment does not serialise the rank), each within ``timeout_s``.

    A call past its deadline cannot be killed in a thread: the runner raises ``EnvError`` and the
    run stops (its process is ended by the trainer), which leaves the last checkpoint intact.
    Signals reach a process's main thread only, so whatever a call raises, ``SystemExit`` and
    ``KeyboardInterrupt`` included, is its environment's; a Ctrl-C or SIGTERM of the run meets
    the runner waiting in the main thread and stops it as before.

    Steps go in as a batch (``step``: all of a turn's, waited for together) or one at a time
    (``submit_step``, then ``poll``: an episode's next turn as soon as its own step returns).
    """

    def __init__(self, factory: Callable[..., Any], name: str, num_workers: int,
                 timeout_s: float) -> None:
        self.factory = factory
        self.name = name
        self.timeout_s = timeout_s
        self.pool = ThreadPoolExecutor(max_workers=num_workers, thread_name_prefix="env")
        self.calls = Calls()
        # Calls in flight: their timing and (call name, sample) for a line naming the late one.
        self._timing: dict[Future, tuple[_Timing, str, str]] = {}

    def start(self, rows: Sequence[dict[str, Any]], seeds: Sequence[int], where: Callable[
            [int], str]) -> tuple[list[Any], list[Any]]:
        """(environments, first observations): one per row, each built as ``factory(**row)``
        and reset (with its seed where ``reset`` takes one)."""

        def build(i: int) -> tuple[Any, Any]:
            try:
                env = self.factory(**rows[i])
            except BaseException as err:  # in a thread: the environment's own
                raise EnvError(f"{self.name}(**row) raised {where(i)} ({usercode.described(err)})"
                               ) from None
            try:
                obs = env.reset(seed=seeds[i]) if takes_seed(env.reset) else env.reset()
            except BaseException as err:  # in a thread: the environment's own
                raise EnvError(f"{self.name}.reset raised {where(i)} ({usercode.described(err)})"
                               ) from None
            check_observation(obs, f"{self.name}.reset", where(i))
            return env, obs

        built = self._run([lambda i=i: build(i) for i in range(len(rows))], "reset", where)
        return [b[0] for b in built], [b[1] for b in built]

    def step(self, envs: Sequence[Any], actions: Sequence[str], where: Callable[[int], str]
             ) -> list[StepResult]:
        """``env.step(action)`` of each, checked (``check_step``)."""
        return self._run([lambda i=i: self._step(envs[i], actions[i], where(i))
                          for i in range(len(envs))], "step", where)

    def submit_step(self, env: Any, action: str, where: str) -> Future:
        """``env.step(action)`` started in a thread; its future's result is the checked
        ``StepResult``. ``poll`` collects it and holds it to the deadline."""
        return self._submit(lambda: self._step(env, action, where), "step", where)

    def poll(self, futures: set[Future], timeout: float) -> set[Future]:
        """The futures of ``futures`` that are done, waiting up to ``timeout`` seconds for the
        first (0: none); raises the first error of one, or ``EnvError`` for a call past
        ``timeout_s``."""
        done, _ = wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)
        for future in done:
            self._finish(future)
            if future.exception() is not None:
                raise future.exception()
        self._check_late()
        return done

    def _step(self, env: Any, action: str, where: str) -> StepResult:
        try:
            value = env.step(action)
        except BaseException as err:  # in a thread: the environment's own
            raise EnvError(f"{self.name}.step raised {where} ({usercode.described(err)})"
                           ) from None
        return check_step(value, self.name, where)

    def end(self, envs: Sequence[Any], where: Callable[[int], str]) -> None:
        """``close()`` of each environment that has one, once the rollout's episodes have
        ended (what an environment holds for its episode, a session or a process, is freed
        then; gymnasium's convention)."""
        closing = [i for i, env in enumerate(envs) if callable(getattr(env, "close", None))]

        def one(i: int) -> None:
            try:
                envs[i].close()
            except BaseException as err:  # in a thread: the environment's own
                raise EnvError(f"{self.name}.close raised {where(i)} ({usercode.described(err)})"
                               ) from None

        self._run([lambda i=i: one(i) for i in closing], "close", lambda k: where(closing[k]))

    def _submit(self, call: Callable[[], Any], what: str, where: str) -> Future:
        """``call`` in a thread, its own time (from when a thread starts it) recorded."""
        timing = _Timing()

        def timed() -> Any:
            timing.began = time.monotonic()
            try:
                return call()
            finally:
                timing.elapsed = time.monotonic() - timing.began

        future = self.pool.submit(timed)
        self._timing[future] = (timing, what, where)
        return future

    def _finish(self, future: Future) -> None:
        """A done call's time into ``calls`` (a step's)."""
        timing, what, _ = self._timing.pop(future)
        if what == "step" and future.exception() is None:
            self.calls.steps += 1
            self.calls.step_time_s += timing.elapsed
            self.calls.latencies_s.append(timing.elapsed)

    def _check_late(self) -> None:
        now = time.monotonic()
        late = [(what, where) for timing, what, where in self._timing.values()
                if timing.began is not None and now - timing.began > self.timeout_s]
        if late:
            what, where = late[0]
            raise EnvError(f"{self.name}.{what} took longer than env.timeout_s="
                           f"{self.timeout_s:g} {where}")

    def _run(self, calls: list[Callable[[], Any]], what: str, where: Callable[[int], str]
             ) -> list[Any]:
        """Every call's result, in order; each call's own time (from when a thread starts it)
        is held to ``timeout_s``, and the first error of a call is raised as it is."""
        futures = [self._submit(call, what, where(i)) for i, call in enumerate(calls)]
        pending = set(futures)
        try:
            while pending:
                pending -= self.poll(pending, _POLL_S)
        except BaseException:
            self.cancel(pending)
            raise
        return [f.result() for f in futures]

    def cancel(self, futures: set[Future]) -> None:
        """Drop calls no one will wait for (a run stopping): queued ones never start."""
        for future in futures:
            future.cancel()
            self._timing.pop(future, None)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class Observations:
    """Observations as the token ids appended to an episode's context: text as the tokenizer
    encodes it without special tokens, chat messages as the chat template renders them after an
    assistant turn (what the template puts between the end of the model's turn and the start
    of its next one, generation prompt included).

    The observation's own text is tokenised as text: a ``<|im_end|>`` an environment returns is
    its characters, not the control token the model ends its turns with (how chat templates
    treat tool output), unless ``special_tokens`` (``env.observation_special_tokens``) says the
    environment writes the tokenizer's special tokens on purpose."""

    def __init__(self, tokenizer: Any, chat: bool, tools: list[dict] | None = None,
                 special_tokens: bool = False) -> None:
        self.tokenizer = tokenizer
        self.chat = chat
        self.tools = tools
        self.special_tokens = special_tokens
        # No token stands for more characters than the longest entry of the vocabulary (a
        # byte-level entry holds one character per byte): text of more than n times that many
        # characters has more than n tokens, known before any of it is tokenised.
        self.token_chars = max(map(len, tokenizer.get_vocab()), default=1)

    def encode(self, observation: Any, limit: int) -> list[int] | None:
        """The observation's token ids, or None when they are more than ``limit``: text too long
        for ``limit`` tokens is never tokenised, so a huge observation costs the work of the
        budget, not of its size."""
        if isinstance(observation, str) and not self.chat:
            if len(observation) > limit * self.token_chars:
                return None
            ids = self._ids(observation, self.special_tokens)
            return ids if len(ids) <= limit else None
        messages = ([{"role": "user", "content": observation}] if isinstance(observation, str)
                    else [observation] if isinstance(observation, dict) else list(observation))
        if not self.chat:
            raise EnvError("an observation of chat messages needs data.apply_chat_template=true "
                           "(the tokenizer's chat template renders them)")
        if sum(len(m["content"]) for m in messages) > limit * self.token_chars:
            return None
        ids = self._rendered(messages)
        return ids if len(ids) <= limit else None

    def _ids(self, text: str, special: bool) -> list[int]:
        """``text``'s ids; ``special``: the tokenizer's special tokens in it are those tokens."""
        if not text:
            return []
        return list(self.tokenizer(text, add_special_tokens=False,
                                   split_special_tokens=not special)["input_ids"])

    def _rendered(self, messages: list[dict[str, Any]]) -> list[int]:
        # The template renders whole conversations: the observation's tokens are what a
        # conversation gains past the end of an assistant turn (the text after its eos) when the
        # messages and the next generation prompt follow it. The assistant's text is a stand-in.
        tok = self.tokenizer
        base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
        render = (lambda conv, gen: tok.apply_chat_template(
            conv, tools=self.tools, add_generation_prompt=gen, tokenize=False))
        before, after = render(base, False), render(base + messages, True)
        eos = tok.eos_token or ""
        cut = before.rfind(eos) + len(eos) if eos and eos in before else len(before)
        if not after.startswith(before[:cut]):
            raise EnvError("the chat template renders the conversation before an observation "
                           "differently once the observation follows it; allowed: a template "
                           "that appends turns")
        if self.special_tokens:
            return self._ids(after[cut:], True)
        # The template's own text (its special tokens) and the messages' contents (text) apart:
        # rendered again with a mark in place of each content, the template's text is what lies
        # around the marks.
        marks = [uuid.uuid4().hex for _ in messages]
        marked = render(base + [{**m, "content": k} for m, k in zip(messages, marks)], True)
        pieces, contents, pos = [], [], cut
        for mark, message in zip(marks, messages):
            at = marked.find(mark, pos)
            if at >= 0:  # (a template may leave a role's content out)
                pieces.append(marked[pos:at])
                contents.append(message["content"])
                pos = at + len(mark)
        pieces.append(marked[pos:])
        text = after[cut:]
        if _interleaved(pieces, contents) != text:  # the template changes a content (trim, tojson)
            contents = _between(text, pieces)
            if contents is None:
                raise EnvError("the chat template renders an observation's content in a way that "
                               "cannot be told apart from its own text; allowed: "
                               "env.observation_special_tokens=true (the rendered text "
                               "tokenised whole, special tokens included)")
        ids = self._ids(pieces[0], True)
        for content, piece in zip(contents, pieces[1:]):
            ids += self._ids(content, False) + self._ids(piece, True)
        return ids


def _interleaved(pieces: list[str], contents: list[str]) -> str:
    return pieces[0] + "".join(c + p for c, p in zip(contents, pieces[1:]))


def _between(text: str, pieces: list[str]) -> list[str] | None:
    """The texts that ``text`` holds between ``pieces`` in order (None: it does not hold them
    so): how a template rendered the contents the pieces surround."""
    first, last = pieces[0], pieces[-1]
    if len(pieces) < 2 or not text.startswith(first) or not text.endswith(last) or \
            len(text) < len(first) + len(last):
        return None
    pos, end, out = len(first), len(text) - len(last), []
    for piece in pieces[1:-1]:
        at = text.find(piece, pos, end)
        if at < 0:
            return None
        out.append(text[pos:at])
        pos = at + len(piece)
    return out + [text[pos:end]]
