"""The zygote a private Ray's workers and the job tests' drivers fork from
(``rlhf_paro/actors/zygote.py``): a child is what ``python -m`` (or ``python SCRIPT``) would have
started, and ends as it would; the server leaves a Ctrl-C to its caller and ends with it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from rlhf_paro.actors.zygote import _STATUS, Zygote, _recv_exact, request

# A module the child runs: what it was given, then the exit its first argument asks for.
PROBE = '''
import json, os, sys, time
print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "mark": os.environ.get("MARK"),
                  "path0": sys.path[0], "main": __name__}), flush=True)
how = sys.argv[1]
if how == "blocked":
    import signal
    print(sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, ())), flush=True)
    sys.exit(0)
if how == "raise":
    raise ValueError("from the probe")
if how == "sleep":
    time.sleep(60)
sys.exit(int(how))
'''


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    where = tmp_path_factory.mktemp("zygote")
    (where / "zygote_probe.py").write_text(PROBE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(where), *sys.path])}
    server = Zygote(["json"], env)
    yield server, where, env
    server.close()


def test_a_child_gets_the_callers_arguments_environment_and_directory_and_its_exit(zygote,
                                                                                   tmp_path):
    server, _, env = zygote
    child = server.run("zygote_probe", ["3", "x=1"], {**env, "MARK": "this run"}, tmp_path)
    out, err = child.communicate(timeout=60)
    assert child.returncode == 3, err
    assert err == ""  # no warning of the module imported twice, nothing else
    assert out.strip() == (f'{{"argv": ["3", "x=1"], "cwd": "{tmp_path}", "mark": "this run", '
                           f'"path0": "{tmp_path}", "main": "__main__"}}')


def test_an_uncaught_exception_is_a_traceback_and_exit_1(zygote, tmp_path):
    server, _, env = zygote
    child = server.run("zygote_probe", ["raise"], env, tmp_path)
    _, err = child.communicate(timeout=60)
    assert child.returncode == 1
    assert err.startswith("Traceback") and err.strip().endswith("ValueError: from the probe")


def test_a_signal_reaches_the_child_and_ends_it_as_its_returncode(zygote, tmp_path):
    server, _, env = zygote
    child = server.run("zygote_probe", ["sleep"], env, tmp_path)
    deadline = time.monotonic() + 60
    while not child._out.read_text() and time.monotonic() < deadline:  # it has started
        time.sleep(0.05)
    assert child.poll() is None
    os.kill(child.pid, signal.SIGTERM)
    assert child.wait(timeout=60) == -signal.SIGTERM


def test_a_script_child_takes_the_callers_streams_and_dies_with_the_process_it_names(zygote,
                                                                                      tmp_path):
    server, where, env = zygote
    out = (tmp_path / "out").open("w")
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(server.address)
    caller = subprocess.Popen(["sleep", "60"])  # it dies with this process
    conn, pid = request(conn, {"script": str(where / "zygote_probe.py"), "args": ["sleep"],
                               "env": env, "cwd": str(tmp_path), "die_with": caller.pid},
                        [0, out.fileno(), 2])
    deadline = time.monotonic() + 60
    while not (tmp_path / "out").read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert f'"path0": "{where}"' in (tmp_path / "out").read_text()
    caller.kill()
    caller.wait()
    _, code = _STATUS.unpack(_recv_exact(conn, _STATUS.size))
    assert code == -signal.SIGKILL


def test_a_ctrl_c_in_the_terminal_leaves_the_server_serving_and_a_child_gets_the_callers_mask(
        zygote, tmp_path):
    # The server is in the driver's process group: a Ctrl-C reaches it too, and it was the
    # driver's to handle (before, the server died of it and every later worker start fell back
    # to a fresh interpreter). A Ray worker's set-up process has SIGINT blocked, as Ray's own
    # processes do; its forked child keeps that mask, as the exec'd worker would.
    server, where, env = zygote
    os.kill(server._proc.pid, signal.SIGINT)
    time.sleep(0.5)
    assert server._proc.poll() is None
    out = (tmp_path / "out").open("w")
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(server.address)
    conn, _ = request(conn, {"script": str(where / "zygote_probe.py"), "args": ["blocked"],
                             "env": env, "cwd": str(tmp_path),
                             "blocked": {signal.SIGINT, signal.SIGUSR1}}, [0, out.fileno(), 2])
    _, code = _STATUS.unpack(_recv_exact(conn, _STATUS.size))
    assert code == 0
    lines = (tmp_path / "out").read_text().splitlines()
    assert lines[-1] == str(sorted([int(signal.SIGINT), int(signal.SIGUSR1)]))
