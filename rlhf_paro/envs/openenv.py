"""OpenEnv environments as multi-turn episodes (the ``openenv`` extra; README, "Environments
from OpenEnv").

OpenEnv serves an environment behind a WebSocket: each connection is a session with its own
instance of the environment, and ``reset`` / ``step(action)`` answer an observation with its
reward and done. ``OpenEnv`` is one sample's episode as one such session, in the contract of
``rlhf_paro.envs``. A subclass says where the environment runs and how text crosses over:

    url         the address of a running server (a container, a Space, ``uvicorn``), or None:
    served      (Environment factory, Action class, Observation class) of an environment whose
                code is installed here, served by OpenEnv on 127.0.0.1 in this process (one
                server for all the process's samples, started by the first episode)
    client      the ``EnvClient`` class that talks to it: ``GenericEnvClient`` (the default)
                takes actions as dicts and gives observations as dicts; an environment
                package's typed client takes and gives its own classes
    action(text)             the model's turn as the action ``client.step`` takes
    observation(observation) OpenEnv's observation as text, chat messages or None

What maps to what: ``reset`` sends the sample's seed and its prompt row's columns (a row's own
``seed`` column wins, so the samples of a prompt can meet one game); the server hands an
environment's ``reset`` the ones it names. OpenEnv's reward of a step is the step's reward (None,
no reward, is 0); its done ends the episode (as may rlhf_paro's budgets); the session is closed
once the rank's episodes have all ended (``close``). Anything the server or the connection
raises in a reset or a step is that call's error (``EnvError``).

The library's clients are async: every session of the process runs on one event loop in a
thread of its own, and a runner thread's ``reset`` or ``step`` waits for its call's result.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from typing import Any, Callable, ClassVar, Coroutine

try:
    from openenv.core import GenericEnvClient, create_fastapi_app
    from websockets.exceptions import ConnectionClosed
except ImportError:
    raise ModuleNotFoundError("OpenEnv environments need the openenv extra: "
                              "pip install -e '.[openenv]'") from None

# Sessions a served environment holds at once: every sample of a rank's rollout holds one for its
# whole episode, far fewer than this; it only bounds a leak.
MAX_SESSIONS = 4096
# How long a served environment's server may take to start listening.
START_S = 60.0
# How long a server may take to end a session and close its connection once asked to.
CLOSE_S = 10.0

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_served: dict[tuple[Any, ...], str] = {}  # the address of each environment served here


def _event_loop() -> asyncio.AbstractEventLoop:
    """The process's event loop for OpenEnv, running in a daemon thread from the first call."""
    global _loop
    with _lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="openenv", daemon=True).start()
        return _loop


def _call(coroutine: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run_coroutine_threadsafe(coroutine, _event_loop()).result()


def serve(environment: Callable[[], Any], action_cls: type, observation_cls: type) -> str:
    """The address of ``environment`` served by OpenEnv on 127.0.0.1 in this process (on the
    process's event loop), started by the first call for it."""
    import uvicorn

    key = (environment, action_cls, observation_cls)
    loop = _event_loop()
    with _lock:
        if key not in _served:
            app = create_fastapi_app(environment, action_cls, observation_cls,
                                     max_concurrent_envs=MAX_SESSIONS)
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
            running = asyncio.run_coroutine_threadsafe(server.serve(sockets=[sock]), loop)
            deadline = time.monotonic() + START_S
            while not server.started:
                if running.done():  # it stopped before it listened: its error says why
                    running.result()
                    raise RuntimeError("the OpenEnv server stopped before it started")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the OpenEnv server did not start in {START_S:g} s")
                time.sleep(0.01)
            _served[key] = f"http://127.0.0.1:{sock.getsockname()[1]}"
        return _served[key]


class OpenEnv:
    """One sample's episode as a session of an OpenEnv environment; subclass it (the module's
    docstring). Built from the sample's prompt row (``NAME(**row)``); connects at ``reset``."""

    url: ClassVar[str | None] = None
    served: ClassVar[tuple[Callable[[], Any], type, type] | None] = None
    client: ClassVar[type] = GenericEnvClient

    def __init__(self, **row: Any) -> None:
        # Checked here, so that the run refuses the class before anything starts.
        name = type(self).__name__
        if self.url is None and self.served is None:
            raise ValueError(f"{name} sets neither url (a running server) nor served (an "
                             "environment to serve in this process)")
        for method in ("action", "observation"):
            if getattr(type(self), method) is getattr(OpenEnv, method):
                raise ValueError(f"{name} defines no {method}(): "
                                 + ("the model's turn as the action its client's step takes"
                                    if method == "action" else "OpenEnv's observation as text, "
                                    "chat messages or None"))
        self.row = row
        self.session: Any = None  # the connected client, from reset to close

    def action(self, text: str) -> Any:
        """The model's turn as the action ``client.step`` takes."""
        raise NotImplementedError

    def observation(self, observation: Any) -> Any:
        """OpenEnv's observation as text, chat messages or None."""
        raise NotImplementedError

    def address(self) -> str:
        return self.url if self.url is not None else serve(*self.served)

    def reset(self, seed: int | None = None) -> Any:
        self.close()  # a reset starts a new session
        session = self.client(base_url=self.address())
        _call(session.connect())
        self.session = session
        result = _call(session.reset(**{"seed": seed, **self.row}))
        return self.observation(result.observation)

    def step(self, action: str) -> tuple[Any, float, bool]:
        result = _call(self.session.step(self.action(action)))
        reward = 0.0 if result.reward is None else float(result.reward)
        return self.observation(result.observation), reward, bool(result.done)

    def close(self) -> None:
        session, self.session = self.session, None
        if session is not None:
            _call(_close(session))


async def _close(session: Any) -> None:
    """Ends ``session`` as its server expects: a close message, then the server ends the session
    and closes the connection. (The client's own ``close`` closes the connection at once, and
    the server, closing it again, logs a traceback for every episode.) The episode is over:
    a connection already lost, or a server that keeps it open, is closed from this side."""
    ws = session._ws
    if ws is not None:
        try:
            await ws.send(json.dumps({"type": "close"}))
            await asyncio.wait_for(ws.wait_closed(), CLOSE_S)
            session._ws = None
        except (ConnectionClosed, asyncio.TimeoutError):
            pass
    await session.close()
