"""Ray's worker set-up script where a run starts its own Ray (``setup_worker_path``;
``actors/group.py``, ``preloaded_workers``): the worker forks from a process that has already
imported what every worker of a run imports (torch, transformers, the model classes, the
engine; ``actors/zygote.py``), instead of a new interpreter importing them again, about 4.5 s of
a core per worker.

Ray starts this script as it starts its own ``setup_worker.py``: ``--serialized-runtime-env-
context``, ``--language`` and the worker's command line. With no runtime environment to set up
(a run sets none) it asks the zygote named by ``ZYGOTE_ENV`` for a child that runs the worker's
command line with this process's environment, working directory, standard streams and blocked
signals, forwards the signals it gets, and exits as the child does; the child ends when this
process does. Anything else (another language, a runtime environment, no zygote, or a zygote
that ended before it forked) is Ray's own set-up. It imports only the standard library and the
zygote's client: it is a new interpreter per worker.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import socket
import sys

ZYGOTE_ENV = "RLHF_PARO_WORKER_ZYGOTE"


def _rays_own() -> None:
    spec = importlib.util.find_spec("ray")  # finds the package without importing it
    assert spec is not None and spec.submodule_search_locations
    script = os.path.join(spec.submodule_search_locations[0], "_private", "workers",
                          "setup_worker.py")
    os.execv(sys.executable, [sys.executable, script, *sys.argv[1:]])


def main() -> None:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--serialized-runtime-env-context", default="{}")
    parser.add_argument("--language", default="PYTHON")
    args, command = parser.parse_known_args()
    context = json.loads(args.serialized_runtime_env_context or "{}")
    plain = (args.language == "PYTHON" and command and command[0].endswith(".py")
             and not any(context.get(key) for key in ("command_prefix", "env_vars",
                                                       "override_worker_entrypoint",
                                                       "java_jars"))
             and context.get("py_executable") in (None, sys.executable))
    address = os.environ.get(ZYGOTE_ENV)
    if not plain or not address:
        _rays_own()
    # This file's package, wherever it is installed (run as a script, its own directory is
    # sys.path[0]).
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from rlhf_paro.actors.zygote import _STATUS, _recv_exact, request

    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(address)
        conn, pid = request(conn, {"script": command[0], "args": command[1:],
                                   "env": dict(os.environ), "cwd": os.getcwd(),
                                   "blocked": signal.pthread_sigmask(signal.SIG_BLOCK, ()),
                                   "die_with": os.getpid()}, [0, 1, 2])
    except (OSError, EOFError):  # the zygote is gone, or ended before it forked: Ray's own
        _rays_own()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, lambda signum, _frame: os.kill(pid, signum))
    _, code = _STATUS.unpack(_recv_exact(conn, _STATUS.size))
    if code < 0:  # ended by a signal: so does this process
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    main()
