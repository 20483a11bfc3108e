"""scripts/emulate_cluster.py: the commands and environments it builds and its command-line
checks (pure), and, where this machine lets it (root, iproute2, Ray), a Ray cluster of two
emulated nodes on which the ranks of a topology group share a node."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "emulate_cluster.py"
_spec = importlib.util.spec_from_file_location("emulate_cluster", SCRIPT)
emu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(emu)


@pytest.mark.parametrize("text, bytes_per_s", [
    ("160MB", 160e6),  # B: bytes
    ("1.5gbit", 1.5e9 / 8),
    ("200mbit", 200e6 / 8),
    ("8e8", 1e8),  # no unit: bits/s, as tc takes it
])
def test_rates_read_as_tc_and_people_write_them(text, bytes_per_s):
    assert emu.parse_rate(text) == pytest.approx(bytes_per_s)


@pytest.mark.parametrize("text", ["fast", "1.2.3MB", "10 TB"])
def test_a_rate_that_is_not_one_is_refused_with_an_example(text):
    with pytest.raises(ValueError, match="expected e.g. 1.5gbit"):
        emu.parse_rate(text)


def test_bytes_sent_come_from_the_root_qdisc_line_of_tc():
    stats = ("qdisc tbf 1: root refcnt 2 rate 1280Mbit burst 256Kb lat 100ms\n"
             " Sent 16912345 bytes 11800 pkt (dropped 0, overlimits 310 requeues 0)\n"
             " backlog 0b 0p requeues 0\n")
    assert emu.sent_bytes(stats) == 16912345
    assert emu.sent_bytes("") == 0  # a NIC without a qdisc sent nothing we shaped


def test_in_ray_mode_a_node_has_one_nic_and_its_address_is_the_ray_nodes():
    cluster = emu.Cluster(3, 4, "t", rails=1)
    assert (cluster.gpus, cluster.rails) == (4, 1)
    assert [cluster.address(i, 0) for i in range(3)] == ["10.77.0.1", "10.77.0.2", "10.77.0.3"]
    head = emu.ray_start_command(cluster, 0, "/tmp/x/n0")
    other = emu.ray_start_command(cluster, 2, "/tmp/x/n2")
    for cmd, own in ((head, "10.77.0.1"), (other, "10.77.0.3")):
        assert cmd[:5] == [sys.executable, "-m", "ray.scripts.scripts", "start", "--block"]
        # M slots per node: a placement group of N one-CPU bundles takes M on every node.
        assert {f"--node-ip-address={own}", "--num-cpus=4", "--num-gpus=0"} <= set(cmd)
    assert {"--head", f"--port={emu.RAY_PORT}", "--include-dashboard=false",
            "--temp-dir=/tmp/x/n0"} <= set(head)
    assert f"--address=10.77.0.1:{emu.RAY_PORT}" in other and "--head" not in other
    assert "--temp-dir=/tmp/x/n2" in other  # every node its own files


def test_ray_env_turns_cluster_mode_on_and_keeps_a_chosen_auth_mode():
    # As rlhf_paro's private Ray leaves it in the environment of the process that started it.
    base = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_ADDRESS": "10.0.0.9:6379", "A": "1"}
    env = emu.ray_env(base)
    assert env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "1"
    assert env["RAY_AUTH_MODE"] == "disabled"
    assert "RAY_ADDRESS" not in env and env["A"] == "1"
    assert emu.ray_env({"RAY_AUTH_MODE": "token"})["RAY_AUTH_MODE"] == "token"
    assert base["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"  # the caller's own is untouched


@pytest.mark.parametrize("argv, message", [
    (["--ray"], "give the command to run after --"),
    (["--nodes", "0", "--", "true"], "--nodes and --gpus-per-node must be between 1 and 250"),
    (["--inter-rate", "fast", "--", "true"],
     "--inter-rate 'fast': expected e.g. 1.5gbit, 200mbit or 190MB"),
    (["--inter-delay-ms", "-1", "--", "true"], "--inter-delay-ms must be >= 0, got -1.0"),
])
def test_a_bad_command_line_exits_2_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        emu.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err == f"emulate_cluster: error: {message}\n"


def repo_environment() -> dict[str, str]:
    """This environment with the repository first on PYTHONPATH: the emulated nodes' processes
    import this checkout's package wherever they start."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))


_CAN_EMULATE = (hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("ip")
                and shutil.which("tc") and importlib.util.find_spec("ray") is not None)

# Run as the driver: rlhf_paro's placement of N = 4 one-CPU bundles in groups of M = 2, and the
# address of the node of each rank's bundle; exits 3 so that the test sees the status come through.
_WHERE = textwrap.dedent("""
    import os, sys, ray
    from rlhf_paro.actors.group import place
    ray.init(address="auto", logging_level="ERROR")
    placement = place(4, 2, use_gpu=False)
    node_ip = ray.remote(num_cpus=1)(ray.util.get_node_ip_address)
    ips = ray.get([node_ip.options(scheduling_strategy=placement.strategy(r)).remote()
                   for r in range(4)])
    print("ranks on", " ".join(ips), "driver", os.environ["RAY_ADDRESS"])
    sys.exit(3)
""")


@pytest.mark.slow
@pytest.mark.skipif(not _CAN_EMULATE, reason="needs root, iproute2 (ip, tc) and Ray")
def test_on_two_emulated_nodes_the_ranks_of_a_group_share_a_node(tmp_path):
    program = tmp_path / "where.py"
    program.write_text(_WHERE)
    prefix = f"t{os.getpid()}"  # apart from any other emulation on this machine
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--nodes", "2", "--gpus-per-node", "2", "--inter-rate",
         "160MB", "--ray", "--prefix", prefix, "--", sys.executable, str(program)],
        capture_output=True, text=True, env=repo_environment(), timeout=300)
    assert done.returncode == 3, done.stderr[-2000:]  # the command's own status
    line = next(l for l in done.stdout.splitlines() if l.startswith("ranks on"))
    ips = line.split()[2:6]
    # Ranks 0, 1 on one node and 2, 3 on the other: group i of M = 2 ranks is one node.
    assert ips[0] == ips[1] and ips[2] == ips[3]
    assert sorted({ips[0], ips[2]}) == ["10.77.0.1", "10.77.0.2"]
    assert line.endswith(f"driver 10.77.0.1:{emu.RAY_PORT}")
    assert "2 Ray nodes joined (10.77.0.1, 10.77.0.2), 2 CPU slots each" in done.stderr
    assert prefix not in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                        text=True).stdout  # all torn down
