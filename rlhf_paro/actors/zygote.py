"""A process that has already imported the modules a Ray worker (or a driver) imports first, and
forks a child for each request: ``python -m MODULE ARGS`` (or ``python SCRIPT ARGS``) without the
seconds of a core each new interpreter spends on torch and transformers.

A run on its own machine starts its Ray workers this way (``actors/group.py``, ``init_ray``;
``actors/ray_worker.py`` is the set-up script Ray runs for each worker); the tests' drivers too.

The server (``python -m rlhf_paro.actors.zygote SOCKET PRELOAD``) listens at once, imports
``preload`` and then, for each request, forks a child that becomes what ``python -m`` would have
started: the request's environment, working directory, argument vector, ``sys.path[0]`` and
blocked signals; standard input from ``/dev/null`` and output into the caller's files (or the
caller's own descriptors); fresh seeds for ``random`` (and NumPy's global generator), which a
fork would otherwise share; and at the end what the interpreter's own exit does (non-daemon
threads joined, ``atexit`` run, streams flushed) and its exit status (1 and a traceback for an
uncaught exception). The caller gets a ``Driver``: its pid (the real process, for signals),
``poll``, ``wait`` and ``communicate``, as ``subprocess.Popen`` gives them. The server ends with
the process that started it, and blocks SIGINT as Ray's own processes do: a Ctrl-C in the
terminal is the driver's to handle.

What a fork cannot give: a module reads at import what the server's environment held, not the
request's (the server starts with the environment its first caller passes, and callers pass
one that differs only in what is read at run time; a Ray worker's own variables, its job id
and ``OMP_NUM_THREADS`` among them, are read after the fork: Ray is never preloaded, and torch
sizes its thread pool at first use); ``/proc/PID/cmdline`` and ``environ`` of the child are the
server's (its children, started after the environment is set, carry the request's); and
Python's string hash seed is the server's, the same in every child. CUDA is never initialised
in the server (a forked CUDA context is unusable): the preload only imports, and a server that
finds CUDA initialised after it exits, its callers falling back to a fresh interpreter.
"""

from __future__ import annotations

import os
import pickle
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

_LEN = struct.Struct("!I")
_STATUS = struct.Struct("!ii")  # pid, returncode (negative: the signal that ended it)


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise EOFError("the zygote closed the connection")
        data += chunk
    return data


def request(conn: socket.socket, what: dict,
            fds: Sequence[int] = ()) -> tuple[socket.socket, int]:
    """Ask the server for a child (``what``: module or script, args, env, cwd; optionally the
    signals it starts with blocked, ``blocked``, and the pid of a process it ends with,
    ``die_with``; the standard streams as ``fds`` or as the files ``stdout`` and ``stderr``); its
    pid. The connection then carries its exit status (``_STATUS``)."""
    payload = pickle.dumps(what)
    socket.send_fds(conn, [_LEN.pack(len(payload))], list(fds))
    conn.sendall(payload)
    (pid,) = struct.unpack("!i", _recv_exact(conn, 4))
    return conn, pid


class Driver:
    """A forked ``python -m``: ``pid``, ``returncode``, ``poll``, ``wait``, ``communicate``."""

    def __init__(self, conn: socket.socket, pid: int, stdout: Path, stderr: Path) -> None:
        self._conn, self.pid, self._out, self._err = conn, pid, stdout, stderr
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._conn], [], [], 0)[0]:
            self._collect()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._conn], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(f"zygote child {self.pid}", timeout)
            self._collect()
        assert self.returncode is not None
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        return (self._out.read_text(errors="replace"), self._err.read_text(errors="replace"))

    def _collect(self) -> None:
        pid, code = _STATUS.unpack(_recv_exact(self._conn, _STATUS.size))
        assert pid == self.pid, (pid, self.pid)
        self.returncode = code
        self._conn.close()


class Zygote:
    """The server process and a client's side of it."""

    def __init__(self, preload: list[str], env: dict[str, str]) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="zygote-"))
        self._path = str(self._dir / "socket")
        self._log = self._dir / "server.log"  # a file: nobody reads a pipe while it fills
        # SIGINT blocked from its first instruction on: the new process inherits the mask of
        # the thread that starts it (a Ctrl-C meanwhile waits here, pending, for the caller).
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            with self._log.open("wb") as log:
                self._proc = subprocess.Popen(
                    [sys.executable, "-m", __name__, self._path, ",".join(preload)], env=env,
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

    def _connect(self) -> socket.socket:
        deadline = time.monotonic() + 120  # the socket is there within a second or so
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(f"the zygote exited ({self._proc.returncode}): "
                                   f"{self._log.read_text(errors='replace')[-3000:]}")
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                conn.connect(self._path)
                return conn
            except (FileNotFoundError, ConnectionRefusedError):
                conn.close()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    @property
    def address(self) -> str:
        """The server's socket, for ``request`` from another process."""
        return self._path

    def run(self, module: str, args: list[str], env: dict[str, str], cwd: Path) -> Driver:
        out = Path(tempfile.mkstemp(dir=self._dir, suffix=".out")[1])
        err = Path(tempfile.mkstemp(dir=self._dir, suffix=".err")[1])
        conn, pid = request(self._connect(), {"module": module, "args": list(args),
                                              "env": dict(env), "cwd": str(cwd),
                                              "stdout": str(out), "stderr": str(err)})
        return Driver(conn, pid, out, err)

    def close(self) -> None:
        self._proc.terminate()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
        shutil.rmtree(self._dir, ignore_errors=True)


# The server's side.

def _exit_code(exc: SystemExit) -> int:
    """What the interpreter exits with for ``SystemExit(code)``."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def _ended(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX"
    except OSError:  # gone
        return True


def _die_with(pid: int) -> None:
    """End this process (SIGKILL) once process ``pid`` has ended: a thread's loop."""
    try:
        select.select([os.pidfd_open(pid)], [], [])
    except OSError:  # gone already, or a kernel without pidfd_open: look every second
        while not _ended(pid):
            time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGKILL)


def _become(request: dict, fds: list[int]) -> None:
    """In the forked child: become ``python -m MODULE ARGS`` (or ``python SCRIPT ARGS``) and
    exit as it would."""
    import atexit
    import random
    import runpy
    import threading
    import traceback

    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_SETMASK, request.get("blocked", ()))
    if fds:  # the caller's own standard streams
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
    else:
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_TRUNC), fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    script, module = request.get("script"), request.get("module")
    sys.path[0] = os.path.dirname(script) if script else request["cwd"]
    sys.argv = [script or module, *request["args"]]
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if request.get("die_with"):
        threading.Thread(target=_die_with, args=(request["die_with"],), daemon=True).start()
    code = 0
    try:
        if script:
            runpy.run_path(script, run_name="__main__")
        else:
            # As ``python -m``: the module runs once, as __main__ (the preload imported it under
            # its own name, which runpy would warn about).
            sys.modules.pop(module, None)
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = _exit_code(exc)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = 128 + signal.SIGINT
    except BaseException:  # noqa: BLE001 - the interpreter prints it and exits 1
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()  # type: ignore[attr-defined] - what the interpreter does first
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed stream has nothing left
                pass
        os._exit(code)


def _serve(path: str, preload: list[str]) -> None:
    import importlib

    sys.path[0] = os.getcwd()  # as ``python -m`` from here; each child sets its own
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    # Listening before the preload: a caller's request waits in the backlog until it is done.
    listener.listen(128)
    os.rename(path + ".tmp", path)
    for name in preload:
        importlib.import_module(name)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        raise SystemExit(f"CUDA was initialised by the preload ({', '.join(preload)}): a "
                         "forked child could not use it")
    try:
        parent_gone = [os.pidfd_open(parent)]  # readable once the parent has exited
    except OSError:  # a kernel without pidfd_open: the loop looks every second
        parent_gone = []
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    waiting: dict[int, socket.socket] = {}
    while os.getppid() == parent:  # the process that started it is gone: so is the server
        ready = select.select([listener, wake_r, *parent_gone], [], [], 1.0)[0]
        if set(parent_gone) & set(ready):
            break
        if wake_r in ready:
            os.read(wake_r, 4096)
        while waiting:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                code = os.waitstatus_to_exitcode(status)
                try:
                    conn.sendall(_STATUS.pack(pid, code))
                except OSError:  # the caller went away
                    pass
                conn.close()
        if listener in ready:
            conn, _ = listener.accept()
            conn.settimeout(30)
            try:
                header, fds, _, _ = socket.recv_fds(conn, _LEN.size, 3)
                header += _recv_exact(conn, _LEN.size - len(header))
                what = pickle.loads(_recv_exact(conn, _LEN.unpack(header)[0]))
            except (OSError, EOFError, pickle.UnpicklingError):  # a caller that went away
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                listener.close()
                conn.close()
                for other in waiting.values():
                    other.close()
                for fd in (wake_r, wake_w, *parent_gone):
                    os.close(fd)
                _become(what, fds)
            for fd in fds:
                os.close(fd)
            try:
                conn.sendall(struct.pack("!i", pid))
            except OSError:  # the caller went away; its child ends with it (``die_with``)
                pass
            waiting[pid] = conn
    # Without the interpreter's teardown of torch and transformers, seconds on a loaded machine
    # during which a finished run would still have a process.
    os._exit(0)


if __name__ == "__main__":
    _serve(sys.argv[1], [name for name in sys.argv[2].split(",") if name])
