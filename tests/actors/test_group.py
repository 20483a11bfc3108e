"""The driver's wait on its workers (``group.get``) with tiny Ray actors standing in for ranks: a
rank that raises or dies is reported at once even while its peers wait for it for good, and a
user's mistake found by a worker comes back as the one-line ``ConfigError`` it is."""

from __future__ import annotations

import os
import signal
import time

import pytest
import ray

from rlhf_paro.actors.group import (
    GRACE_S, Call, NoAnswerError, WorkerError, get, init_ray,
)
from rlhf_paro.config import ConfigError

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@ray.remote(num_cpus=0)
class Rank:
    def pid(self) -> int:
        return os.getpid()

    def value(self, x: int) -> int:
        return x

    def block(self) -> None:
        time.sleep(3600)  # a peer blocked in a collective with a rank that is gone

    def fail(self, err: Exception) -> None:
        raise err


@pytest.fixture(scope="module")
def ranks():
    # A private Ray even where RAY_ADDRESS names a cluster (here one where nothing answers),
    # which ray.init would otherwise join.
    saved = os.environ.get("RAY_ADDRESS")
    os.environ["RAY_ADDRESS"] = "127.0.0.1:1"
    try:
        init_ray(None, num_cpus=2, num_devices=2)
    finally:
        if saved is None:
            os.environ.pop("RAY_ADDRESS")
        else:
            os.environ["RAY_ADDRESS"] = saved
    handles = {"actor": [Rank.remote(), Rank.remote()], "critic": [Rank.remote()]}
    yield handles
    ray.shutdown()


def _fresh(ranks, role: str, rank: int) -> None:
    """Replace a worker a test killed or left blocked."""
    ray.kill(ranks[role][rank])
    ranks[role][rank] = Rank.remote()


def test_results_come_back_per_model_and_rank(ranks):
    calls = {role: [w.value.remote(10 * k) for k, w in enumerate(handles)]
             for role, handles in ranks.items()}
    assert get(calls, ranks) == {"actor": [0, 10], "critic": [0]}


def test_a_rank_that_raises_is_named_while_its_peer_still_waits(ranks):
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        get({"actor": [ranks["actor"][0].block.remote(),
                       ranks["actor"][1].fail.remote(RuntimeError("bad\nshape"))]}, ranks)
    assert time.monotonic() - start < GRACE_S + 10
    err = info.value
    assert (err.role, err.rank, err.died) == ("actor", 1, False)
    assert str(err) == "actor rank 1 raised (RuntimeError: bad)"
    _fresh(ranks, "actor", 0)


def test_a_killed_rank_is_named_rather_than_the_peer_that_lost_its_connection(ranks):
    pid = ray.get(ranks["actor"][1].pid.remote())
    os.kill(pid, signal.SIGKILL)
    # Rank 0 fails on the collective its dead peer left, and comes first in the call.
    calls = {"actor": [ranks["actor"][0].fail.remote(RuntimeError("Connection closed by peer")),
                       ranks["actor"][1].block.remote()]}
    ray.wait(calls["actor"], num_returns=2, timeout=30)  # both failed by the time we look
    with pytest.raises(WorkerError) as info:
        get(calls, ranks)
    assert (info.value.role, info.value.rank, info.value.died) == ("actor", 1, True)
    _fresh(ranks, "actor", 1)


def test_a_killed_rank_is_named_even_through_another_models_call(ranks):
    pid = ray.get(ranks["actor"][1].pid.remote())
    blocked = ranks["actor"][1].block.remote()
    # The critic's call takes the dead actor rank's output: its failure names the actor.
    downstream = ranks["critic"][0].value.remote(blocked)
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        get({"critic": [downstream]}, ranks)
    assert time.monotonic() - start < 10
    assert (info.value.role, info.value.rank, info.value.died) == ("actor", 1, True)
    assert str(info.value).startswith("actor rank 1 died (its process exited")
    _fresh(ranks, "actor", 1)


def test_a_users_mistake_found_by_a_worker_is_its_one_line_config_error(ranks):
    with pytest.raises(ConfigError) as info:
        get({"actor": [ranks["actor"][0].fail.remote(ConfigError("actor.path", "no weights"))]},
            ranks)
    assert type(info.value) is ConfigError and str(info.value) == "actor.path: no weights"



def test_a_rank_that_does_not_answer_is_named_by_the_oldest_call_in_flight(ranks):
    # The critic's call waits for the actor's (as make_experience waits for the reward's
    # scores): the actor's blocked call, issued first, is the one named.
    blocked = ranks["actor"][1].block.remote()
    downstream = ranks["critic"][0].value.remote(blocked)
    issued = [Call(blocked, "actor", 1, "generate"), Call(downstream, "critic", 0, "values")]
    start = time.monotonic()
    with pytest.raises(NoAnswerError) as info:
        get({"critic": [downstream]}, ranks, timeout_s=2, issued=issued)
    assert 2 <= time.monotonic() - start < 10
    assert str(info.value) == ("actor rank 1 did not answer in generate within "
                               "trainer.step_timeout_s=2")
    _fresh(ranks, "actor", 1)


# A fresh driver: every SIGTERM handler installed while init_ray starts a private Ray, and the
# one in place after it. Ray's own (an exit raised wherever the driver is) once lost a SIGTERM
# raised inside an at-fork hook; the entry point's must stay in place throughout.
INIT_SCRIPT = """
import signal, sys
import ray
from rlhf_paro.actors.group import init_ray
installed = []
real = signal.signal
def recording(signum, handler):
    if signum == signal.SIGTERM:
        installed.append(handler)
    return real(signum, handler)
signal.signal = recording
def ours(signum, frame):
    pass
real(signal.SIGTERM, ours)
init_ray(None, num_cpus=1, num_devices=1)
signal.signal = real
print(all(h is ours for h in installed), signal.getsignal(signal.SIGTERM) is ours)
ray.shutdown()
"""


def test_init_ray_keeps_the_entry_point_s_sigterm_handler_throughout():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", INIT_SCRIPT], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-2:] == ["True", "True"], done.stdout
