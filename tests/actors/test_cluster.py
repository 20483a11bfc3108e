"""The run on a Ray cluster of several nodes (``actors/group.py``): a local cluster of two nodes of
2 CPUs each (``ray.cluster_utils.Cluster``), on which other jobs hold CPUs, a node is lost, or
the driver lacks the cluster's token.

- devices other jobs hold make the run wait, saying for what (free per node), and stop within
  ``ray.placement_timeout_s`` in one line, or at once on SIGTERM;
- the M ranks of a group always share a node: with one CPU held on each node, a group of 2 waits
  instead of spanning both;
- a node whose raylet dies is named as a node, and Ray's dump of its log stays off the console;
- a driver without the cluster's token is told so in one line.

The tests share one cluster and run in file order; the last one removes a node.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rlhf_paro.actors.group import (
    POLL_S, PROBE_S, Placement, RayOutput, StopRequested, WorkerError, get, place,
)
from rlhf_paro.config import ConfigError
from tests.confs import INLINE

pytestmark = [pytest.mark.ray, pytest.mark.slow]

# Seconds Ray's view of free resources may lag behind an actor that took one (it syncs them
# about every second), and a loaded machine's slack on top of any bound below.
SYNC_S = 10.0
SLACK_S = 10.0


@ray.remote(num_cpus=1)
class Hold:
    """Another job's task: it holds one CPU of its node while it lives."""

    def ready(self) -> bool:
        return True


@ray.remote(num_cpus=0.25)
class Rank:
    """A rank of a model, as the run places it (a quarter of a device)."""

    def block(self) -> None:
        time.sleep(3600)  # in a step, as its node goes


@ray.remote(num_cpus=0.25)
def node_of_task() -> str:
    return ray.get_runtime_context().get_node_id()


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    # Without token authentication, which a driver of another process joins as it is (the
    # token test below starts its own cluster).
    saved = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 2,
                                                          "include_dashboard": False})
    worker = nodes.add_node(num_cpus=2)
    nodes.wait_for_nodes()
    ray.init(address=nodes.address)
    yield nodes, nodes.head_node, worker
    ray.shutdown()
    nodes.shutdown()
    if saved is None:
        os.environ.pop("RAY_AUTH_MODE")
    else:
        os.environ["RAY_AUTH_MODE"] = saved


def _hold(*nodes) -> list:
    """One CPU held on each of ``nodes``, once Ray's view of free CPUs shows it."""
    holds = [Hold.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n.node_id, False))
             .remote() for n in nodes]
    ray.get([h.ready.remote() for h in holds])
    _free_cpus_become(4 - len(nodes))
    return holds


def _release(holds: list) -> None:
    for h in holds:
        ray.kill(h)
    _free_cpus_become(4)


def _free_cpus_become(count: int) -> None:
    deadline = time.monotonic() + SYNC_S
    while ray.available_resources().get("CPU", 0) != count:
        assert time.monotonic() < deadline, ray.available_resources()
        time.sleep(0.2)


def _names(cluster) -> tuple[str, str]:
    """How the run's lines name the head and the other node: both on this machine's address,
    so with their ids too."""
    _, head, worker = cluster
    return (f"{head.node_ip_address} ({head.node_id[:8]})",
            f"{worker.node_ip_address} ({worker.node_id[:8]})")


def _per_node(cluster, head_text: str, worker_text: str) -> str:
    """The nodes' parts of a line in the run's order: by address, then by node id."""
    _, head, worker = cluster
    on_head, on_worker = _names(cluster)
    parts = sorted([(head.node_id, f"{head_text} on {on_head}"),
                    (worker.node_id, f"{worker_text} on {on_worker}")])
    return ", ".join(part for _, part in parts)


def test_a_held_cpu_makes_the_run_wait_saying_for_what_then_stop_within_the_bound(cluster):
    _, head, _ = cluster
    free = _per_node(cluster, "1 of 2", "2 of 2")
    holds = _hold(head)
    lines: list[str] = []
    start = time.monotonic()
    with pytest.raises(ConfigError) as info:
        place(4, 2, use_gpu=False, timeout_s=3, say=lines.append)
    waited = time.monotonic() - start
    assert 3 <= waited < 3 + POLL_S + SLACK_S
    # Said at once, from the free CPUs (the total counts 4, enough): one group fits, not two.
    assert lines == [f"waiting for 4 CPUs in 2 groups of 2 on one node each (free CPUs per "
                     f"node: {free}; ray.placement_timeout_s=3)"]
    # The group placed on the other node counts as free for the run.
    assert str(info.value) == ("cluster.num_devices: the run's 4 CPUs in 2 groups of 2 on one node"
                               " each were not free within ray.placement_timeout_s=3 (free CPUs "
                               f"per node: {free}); allowed: fewer devices, or a longer timeout "
                               "while other jobs hold them")
    # Nothing of the run is left holding CPUs.
    assert all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())
    _free_cpus_become(3)

    # No limit, and a stop asked for after a second: the wait ends within POLL_S of it.
    start = time.monotonic()
    with pytest.raises(StopRequested):
        place(4, 2, use_gpu=False, timeout_s=None, stop=lambda: time.monotonic() > start + 1,
              say=lambda line: None)
    assert time.monotonic() - start < 1 + POLL_S + SLACK_S
    _release(holds)


def test_with_one_cpu_held_on_each_node_a_group_waits_rather_than_span_them(cluster):
    _, head, worker = cluster
    holds = _hold(head, worker)
    # Two CPUs are free, one per node: the placement of old (one group of N bundles, PACK)
    # took them, and the "intra" group crossed the nodes.
    free = _per_node(cluster, "1 of 2", "1 of 2")
    with pytest.raises(ConfigError, match=re.escape(f"(free CPUs per node: {free})")):
        place(2, 2, use_gpu=False, timeout_s=2, say=lambda line: None)
    _release(holds)
    placement = place(4, 2, use_gpu=False, timeout_s=60)
    try:
        ran_on = ray.get([node_of_task.options(scheduling_strategy=placement.strategy(r)).remote()
                          for r in range(4)])
        assert ran_on == placement.nodes
        assert ran_on[0] == ran_on[1] and ran_on[2] == ran_on[3] and ran_on[0] != ran_on[2]
    finally:
        placement.remove()


def _train(*args: str, tmp_path, **popen) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "rlhf_paro.train", *INLINE, "logger.wandb.mode=disabled",
         "logger.progress=false", f"trainer.output_dir={tmp_path / 'out'}", *args],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def test_the_command_line_waits_in_one_line_and_stops_in_one_line_or_on_sigterm(cluster,
                                                                                  tmp_path):
    nodes, head, _ = cluster
    holds = _hold(head)
    join = [f"ray.address={nodes.address}", "cluster.num_devices=4", "cluster.group_size=2"]
    proc = _train(*join, "ray.placement_timeout_s=3", tmp_path=tmp_path)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 2, stderr
    assert stderr.startswith("error: cluster.num_devices: the run's 4 CPUs in 2 groups of 2 on "
                             "one node each were not free within ray.placement_timeout_s=3 ("), \
        stderr
    assert len(stderr.splitlines()) == 1 and "waiting for 4 CPUs" in stdout

    # Before, the wait ignored SIGTERM (13 minutes and still waiting).
    proc = _train(*join, "trainer.output_dir=" + str(tmp_path / "out2"), tmp_path=tmp_path)
    waiting = proc.stdout.readline()  # the first line of the run's own is the wait's
    assert waiting.startswith("waiting for 4 CPUs"), (waiting, proc.stderr.read())
    proc.send_signal(signal.SIGTERM)
    start = time.monotonic()
    _, stderr = proc.communicate(timeout=120)
    assert time.monotonic() - start < 1 + POLL_S + SLACK_S
    assert proc.returncode == 143, stderr
    assert stderr.startswith("error: terminated (SIGTERM) while starting; resume with: ")
    assert len(stderr.splitlines()) == 1, stderr
    _release(holds)


def test_a_lost_node_is_named_as_a_node_and_rays_dump_of_it_stays_off_the_console(
        cluster, tmp_path, capfd):
    nodes, _, worker = cluster
    placement: Placement = place(4, 2, use_gpu=False, timeout_s=60)
    log = RayOutput(tmp_path / "workers.log")
    log.attach()
    try:
        ranks = [Rank.options(scheduling_strategy=placement.strategy(r)).remote()
                 for r in range(4)]
        lost = [r for r in range(4) if placement.nodes[r] == worker.node_id]
        assert len(lost) == 2
        calls = {"actor": [w.block.remote() for w in ranks]}
        nodes.remove_node(worker, allow_graceful=False)  # its raylet killed
        start = time.monotonic()
        with pytest.raises(WorkerError) as info:
            get(calls, {"actor": ranks}, placements={"actor": placement})
        # Ray's own word on the calls may come minutes later on a loaded machine (seen): the
        # driver's look at the nodes every PROBE_S finds the node first.
        assert time.monotonic() - start < PROBE_S + SLACK_S
        # Before: "actor rank 2 died (its process exited: killed, out of memory or crashed)".
        assert str(info.value) == (f"node {worker.node_ip_address} (Ray node "
                                   f"{worker.node_id[:8]}, ranks {lost[0]} and {lost[1]} of "
                                   "every model) was lost")
        assert info.value.rank in lost
        # Ray's own message on the lost raylet, with the tail of its log, goes to the log.
        deadline = time.monotonic() + 60
        while "Raylet is terminated" not in (tmp_path / "workers.log").read_text():
            assert time.monotonic() < deadline, "Ray said nothing of the lost raylet"
            time.sleep(0.5)
    finally:
        log.close()
    console = capfd.readouterr()
    assert "Raylet is terminated" not in console.out + console.err
    assert "state-dump" not in console.out + console.err


# A head that runs token authentication, as `ray start --head` does once a token exists; it
# prints its address and lives until its stdin closes.
TOKEN_HEAD = """
import sys
from ray.cluster_utils import Cluster
head = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
print(head.address, flush=True)
sys.stdin.read()
head.shutdown()
"""


def test_a_driver_without_the_clusters_token_is_told_so_in_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    head = subprocess.Popen([sys.executable, "-c", TOKEN_HEAD], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True,
                            env={**env, "RAY_AUTH_MODE": "token",
                                 "RAY_AUTH_TOKEN": "a0b1c2d3e4f5a6b7c8d9e0f1a2b3c4d5"})
    try:
        address = head.stdout.readline().strip()
        assert address, "the head did not start"
        home = tmp_path / "home"  # no ~/.ray/auth_token: this driver has no token
        home.mkdir()
        # Ray retries a refused connection for 20 s by default; 2 tries say the same.
        proc = _train(f"ray.address={address}", "cluster.num_devices=1", "cluster.group_size=1",
                      tmp_path=tmp_path, env={**env, "HOME": str(home),
                                              "RAY_gcs_server_port_wait_time_s": "2"})
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        head.stdin.close()
        head.wait(timeout=60)
    assert proc.returncode == 2, stderr
    # Before: 16-20 lines of InvalidAuthToken warnings, then "Failed to connect to Ray cluster".
    assert stderr.startswith(f"error: ray.address: the Ray cluster at {address} refused this "
                             "driver's authentication token (InvalidAuthToken; RAY_AUTH_MODE is "
                             "unset): "), stderr
    assert len(stderr.splitlines()) == 1 and stdout == "", (stdout, stderr)
    assert "InvalidAuthToken" in (tmp_path / "out" / "workers.log").read_text()
