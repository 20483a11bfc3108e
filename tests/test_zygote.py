"""The zygote the job tests' drivers and workers fork from (``tests/zygote.py``): a child is what
``python -m`` (or ``python SCRIPT``) would have started, and ends as it would."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.zygote import _STATUS, Zygote, _recv_exact, request

# A module the child runs: what it was given, then the exit its first argument asks for.
PROBE = '''
import json, os, sys, time
print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "mark": os.environ.get("MARK"),
                  "path0": sys.path[0], "main": __name__}), flush=True)
how = sys.argv[1]
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
