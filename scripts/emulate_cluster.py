"""Emulate a cluster of g nodes x M ranks on one Linux machine and run a command on it.

    sudo python scripts/emulate_cluster.py --nodes 2 --gpus-per-node 2 -- \\
        python scripts/bench_collectives.py
    sudo python scripts/emulate_cluster.py --nodes 2 --gpus-per-node 2 --inter-rate 160MB --ray \\
        -- python -m rlhf_paro.train ray.address=auto trainer.steps=5

Every node is a network namespace; the M ranks of a node run in it, so traffic between them
crosses that namespace's loopback (the "NVLink"). Every rank has its own NIC, as on a DGX: a veth
pair from its node to a switch namespace holding one bridge per rail, shaped with ``tc`` (a
token-bucket rate in both directions, optionally a netem latency on the way out). Rank (i, j)
has address 10.77.j.(i+1) on rail j (interface ``r<j>``), and gloo binds to it
(GLOO_SOCKET_IFNAME). Routing is by destination, so inter-node traffic between ranks of the same
local index j, which is all the traffic of the inter rings of H-Ring and HO-Ring, stays on rail
j; a cross-rail hop (the world ring's from (i, M-1) to (i+1, 0)) leaves by the rail of its
destination, whose NIC that ring leaves idle in that step.

Each rank gets RANK, WORLD_SIZE, LOCAL_RANK, GROUP_SIZE, MASTER_ADDR, MASTER_PORT and
GLOO_SOCKET_IFNAME, plus EMU_INTER_RATE_BPS (the shaped rate, bytes/s) for reporting.

With ``--ray`` the command runs once, as the driver of a Ray cluster of g nodes: a Ray head in
node 0's namespace and one Ray node in every other node's, each started with its node's address
as ``--node-ip-address`` and M CPU slots (``--num-cpus M``, no GPUs). rlhf_paro places each
topology group of M one-slot bundles on one node (a placement group per group, STRICT_PACK), so
the M ranks of a group share a node. A Ray node is known by
one address, so in this mode a node has one NIC (rail 0: ``r0``, 10.77.0.(i+1)) that its M ranks
share: everything the node sends to other nodes crosses it at --inter-rate, and traffic between
its own ranks stays on its loopback. rlhf_paro's workers bind gloo to their Ray node's address
themselves; a program of your own sets GLOO_SOCKET_IFNAME=r0. The command runs in node 0's
namespace with RAY_ADDRESS set (``ray.address=auto`` finds the cluster) and
EMU_INTER_RATE_BPS. Each namespace has its own ports, so Ray's default ones serve and nothing
binds outside the namespaces; every Ray node keeps its files in its own fresh temporary
directory, the dashboard is off, and so is token authentication unless RAY_AUTH_MODE says
otherwise (all processes share one home, and nothing outside the namespaces reaches the
cluster). Progress goes to stderr: the head up, the nodes joined.

When the command ends, the bytes each node sent through its shaped NICs (their ``tc`` counters)
go to stderr. The namespaces are named ``<prefix>-*``; on exit, on error, on Ctrl-C and on
SIGTERM every process left in them (ranks, Ray nodes and their workers, the driver) is stopped,
they are removed, and so are the Ray directories; nothing outside them is touched. The exit
status is the command's (the first failing rank's), 2 for a bad command line, 130 when
interrupted. Needs root, ``ip`` and ``tc`` (iproute2), and Ray for ``--ray``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Mapping, NoReturn, Sequence

MASTER_PORT = 29400
SUBNET = "10.77"
# The Ray head's GCS port, in node 0's namespace.
RAY_PORT = 6379
# Seconds for the Ray head to come up, and then for every other node to join it (a loaded
# machine takes a while to start Ray's processes).
RAY_JOIN_S = 120.0
# Seconds a Ray node or the driver gets to stop on SIGTERM before it is killed.
STOP_GRACE_S = 10.0


class UsageError(RuntimeError):
    """A mistake on the command line found only once it meets the machine (exit status 2)."""


def _run(*cmd: str) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()}")
    return done.stdout


def _ns(name: str, *cmd: str) -> str:
    return _run("ip", "netns", "exec", name, *cmd)


def parse_rate(text: str) -> float:
    """'1.5gbit', '200mbit', '190MB' (bytes), '8e8' (bits/s) -> bytes per second."""
    match = re.fullmatch(r"([0-9.eE+]+)\s*([kKmMgG]?)(bit|b|B|bps)?", text.strip())
    if not match:
        raise ValueError(f"--inter-rate {text!r}: expected e.g. 1.5gbit, 200mbit or 190MB")
    number, prefix, unit = match.groups()
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[prefix.lower()]
    per_byte = 1 if unit == "B" else 8
    try:
        return float(number) * scale / per_byte
    except ValueError:  # matched the characters of a number, not a number ('1.2.3')
        raise ValueError(f"--inter-rate {text!r}: expected e.g. 1.5gbit, 200mbit or 190MB"
                         ) from None


def sent_bytes(tc_stats: str) -> int:
    """Bytes a device's root qdisc sent, from ``tc -s qdisc show dev DEV``."""
    match = re.search(r"Sent (\d+) bytes", tc_stats)
    return int(match.group(1)) if match else 0


class Cluster:
    """The namespaces, links and shaping of one emulated cluster; ``close()`` removes them."""

    def __init__(self, nodes: int, gpus_per_node: int, prefix: str,
                 rails: int | None = None) -> None:
        self.nodes, self.gpus, self.prefix = nodes, gpus_per_node, prefix
        self.rails = gpus_per_node if rails is None else rails  # NICs per node, one per rail
        self.switch = f"{prefix}-sw"
        self.node_ns = [f"{prefix}-n{i}" for i in range(nodes)]
        self.created: list[str] = []  # namespaces made by us, the only ones close() removes

    def address(self, node: int, rail: int) -> str:
        return f"{SUBNET}.{rail}.{node + 1}"

    def build(self) -> None:
        existing = _run("ip", "netns", "list")
        for name in [self.switch, *self.node_ns]:
            if re.search(rf"^{re.escape(name)}\b", existing, re.MULTILINE):
                raise UsageError(f"network namespace {name} exists already; remove it with "
                                 f"'ip netns del {name}' or pick another --prefix")
        for name in [self.switch, *self.node_ns]:
            _run("ip", "netns", "add", name)
            self.created.append(name)
            _ns(name, "ip", "link", "set", "lo", "up")
        # One bridge per rail, as in a rail-optimised fabric. A single bridge would let a node
        # answer ARP for rail j's address from its rail-0 NIC too (Linux answers for any local
        # address on any interface), and traffic would then share the wrong NIC's queue.
        for j in range(self.rails):
            _ns(self.switch, "ip", "link", "add", f"br{j}", "type", "bridge")
            _ns(self.switch, "ip", "link", "set", f"br{j}", "up")
        for i, ns in enumerate(self.node_ns):
            for j in range(self.rails):
                nic, port = f"r{j}", f"n{i}r{j}"
                # Created inside the switch namespace and one end moved: the root namespace
                # never holds either end.
                _ns(self.switch, "ip", "link", "add", port, "type", "veth", "peer", "name", nic)
                _ns(self.switch, "ip", "link", "set", nic, "netns", ns)
                _ns(self.switch, "ip", "link", "set", port, "master", f"br{j}")
                _ns(self.switch, "ip", "link", "set", port, "up")
                _ns(ns, "ip", "addr", "add", f"{self.address(i, j)}/24", "dev", nic)
                _ns(ns, "ip", "link", "set", nic, "up")

    def shape(self, rate_bps: float, delay_ms: float) -> None:
        """Rate both ways on every NIC (full duplex), the latency once per crossing.

        The rate is a token bucket (``tbf``): a burst of 256 KB covers the 64 KB segments veth
        hands over, and a 100 ms queue lets TCP back off on delay rather than on drops. The
        latency is a ``netem`` under it, only when asked for: not every kernel has netem."""
        rate = f"{rate_bps * 8:.0f}bit"
        for i, ns in enumerate(self.node_ns):
            for j in range(self.rails):
                for where, dev, delay in ((ns, f"r{j}", delay_ms), (self.switch, f"n{i}r{j}", 0)):
                    _ns(where, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf",
                        "rate", rate, "burst", "256kb", "latency", "100ms")
                    if delay > 0:
                        _ns(where, "tc", "qdisc", "add", "dev", dev, "parent", "1:1", "handle",
                            "10:", "netem", "delay", f"{delay}ms", "limit", "100000")

    def sent(self) -> list[int]:
        """Bytes each node has sent through its shaped NICs so far."""
        return [sum(sent_bytes(_ns(ns, "tc", "-s", "qdisc", "show", "dev", f"r{j}"))
                    for j in range(self.rails))
                for ns in self.node_ns]

    def close(self) -> None:
        """Kill every process left in our namespaces (only we start processes there), then
        remove the namespaces: a namespace with a process in it would outlive its name."""
        for name in self.created:
            pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True,
                                  text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        while self.created:
            name = self.created.pop()
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def loopback_rate(ns: str, seconds: float = 0.5, trials: int = 3) -> float:
    """Bytes/s of one TCP stream over the loopback of namespace ``ns``: the best of a few short
    trials, since other work on the machine only ever slows a trial down."""
    probe = (
        "import socket, threading, time\n"
        "srv = socket.socket(); srv.bind(('127.0.0.1', 0)); srv.listen(1)\n"
        "buf_in = bytearray(4 << 20)\n"
        "def sink():\n"
        "    conn, _ = srv.accept()\n"
        "    while conn.recv_into(buf_in): pass\n"
        "threading.Thread(target=sink, daemon=True).start()\n"
        "cli = socket.create_connection(srv.getsockname()); data = bytes(16 << 20)\n"
        f"best = 0.0\n"
        f"for _ in range({trials}):\n"
        "    sent, start = 0, time.perf_counter()\n"
        f"    while time.perf_counter() - start < {seconds}:\n"
        "        cli.sendall(data); sent += len(data)\n"
        "    best = max(best, sent / (time.perf_counter() - start))\n"
        "print(best)\n"
    )
    return float(_ns(ns, sys.executable, "-c", probe))


def launch(cluster: Cluster, command: Sequence[str], rate_bps: float) -> int:
    """Run ``command`` as every rank; returns the first non-zero exit status, or 0."""
    world = cluster.nodes * cluster.gpus
    procs: list[subprocess.Popen] = []
    try:
        for i, ns in enumerate(cluster.node_ns):
            for j in range(cluster.gpus):
                env = dict(os.environ, RANK=str(i * cluster.gpus + j), WORLD_SIZE=str(world),
                           LOCAL_RANK=str(j), GROUP_SIZE=str(cluster.gpus),
                           MASTER_ADDR=cluster.address(0, 0), MASTER_PORT=str(MASTER_PORT),
                           GLOO_SOCKET_IFNAME=f"r{j}", EMU_INTER_RATE_BPS=f"{rate_bps:.0f}")
                procs.append(subprocess.Popen(["ip", "netns", "exec", ns, *command], env=env))
        status = 0
        pending = list(procs)
        while pending:
            for p in list(pending):
                code = p.poll()
                if code is None:
                    continue
                pending.remove(p)
                if code and not status:
                    status = code
                    print(f"emulate_cluster: a rank exited with status {code}; stopping the "
                          f"others", file=sys.stderr)
                    for other in pending:
                        other.terminate()
            time.sleep(0.05)
        return status
    finally:
        for p in procs:  # only the ranks started here, by their own handles
            if p.poll() is None:
                p.kill()
                p.wait()


# -- --ray: one Ray node per emulated node ---------------------------------------------------

def ray_env(base: Mapping[str, str]) -> dict[str, str]:
    """The environment of the Ray nodes and of the driver.

    Ray's cluster mode on (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1): rlhf_paro's private Ray turns
    it off in the environment of the process that starts it, and with it off a node refuses to
    join a head and takes loopback for its address. Token authentication off unless
    RAY_AUTH_MODE says otherwise: a token some other cluster left in the home directory would
    lock the driver out. No RAY_ADDRESS of some other cluster: the driver gets the head's."""
    env = dict(base, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="1")
    env.setdefault("RAY_AUTH_MODE", "disabled")
    env.pop("RAY_ADDRESS", None)
    return env


def ray_start_command(cluster: Cluster, node: int, temp_dir: str) -> list[str]:
    """``ray start`` for emulated node ``node`` (the head on node 0), blocking until killed:
    the node's one address, M CPU slots, no GPU, its own files."""
    own = cluster.address(node, 0)
    role = (["--head", f"--port={RAY_PORT}", "--include-dashboard=false"] if node == 0 else
            [f"--address={cluster.address(0, 0)}:{RAY_PORT}"])
    return [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", *role,
            f"--node-ip-address={own}", f"--num-cpus={cluster.gpus}", "--num-gpus=0",
            f"--temp-dir={temp_dir}", "--disable-usage-stats"]


# Probes run in node 0's namespace. This one waits until argv[1] (host:port) takes a TCP
# connection, for argv[2] seconds at most.
_PORT_PROBE = """
import socket, sys, time
host, port = sys.argv[1].rsplit(":", 1)
deadline = time.monotonic() + float(sys.argv[2])
while True:
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
        break
    except OSError as err:
        if time.monotonic() > deadline:
            sys.exit(f"nothing answers at {sys.argv[1]}: {err}")
        time.sleep(0.2)
"""
# This one waits until argv[2] Ray nodes are alive (argv[3] seconds at most), prints their
# addresses.
_ALIVE_PROBE = """
import sys, time, ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
want, deadline = int(sys.argv[2]), time.monotonic() + float(sys.argv[3])
while True:
    alive = sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"])
    if len(alive) >= want or time.monotonic() > deadline:
        break
    time.sleep(0.5)
print(" ".join(alive))
"""


class RayNodes:
    """A Ray node in every namespace of ``cluster``; ``stop()`` stops them and removes their
    files. Each ``ray start --block`` leads a process group of its own with the node's raylet
    and GCS; Ray's workers make groups of their own, and ``Cluster.close`` kills them with
    whatever else is left in the namespaces."""

    def __init__(self, cluster: Cluster, env: Mapping[str, str]) -> None:
        self.cluster, self.env = cluster, dict(env)
        self.head = f"{cluster.address(0, 0)}:{RAY_PORT}"
        self.temp = tempfile.mkdtemp(prefix=f"{cluster.prefix}-ray-")
        self.procs: list[subprocess.Popen] = []  # node i's ray start, in node order
        self.logs: list[str] = []  # node i's ray start output

    def start(self) -> None:
        """The head, then the other nodes once its GCS answers; returns once all are alive."""
        self._start_node(0)
        self._wait(_PORT_PROBE, self.head, str(RAY_JOIN_S))
        print(f"emulate_cluster: Ray head up at {self.head} (node 0)", file=sys.stderr)
        for i in range(1, self.cluster.nodes):
            self._start_node(i)
        alive = self._wait(_ALIVE_PROBE, self.head, str(self.cluster.nodes), str(RAY_JOIN_S)
                           ).split()
        if len(alive) < self.cluster.nodes:
            last = len(self.procs) - 1
            raise RuntimeError(f"{len(alive)} of {self.cluster.nodes} Ray nodes joined within "
                               f"{RAY_JOIN_S:.0f} s; node {last}'s log: {self._tail(last)}")
        print(f"emulate_cluster: {len(alive)} Ray nodes joined ({', '.join(alive)}), "
              f"{self.cluster.gpus} CPU slots each", file=sys.stderr)

    def _start_node(self, i: int) -> None:
        log = os.path.join(self.temp, f"n{i}.log")
        self.logs.append(log)
        with open(log, "w") as out:
            self.procs.append(subprocess.Popen(
                ["ip", "netns", "exec", self.cluster.node_ns[i],
                 *ray_start_command(self.cluster, i, os.path.join(self.temp, f"n{i}"))],
                env=self.env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True))

    def _wait(self, probe_code: str, *args: str) -> str:
        """Run a probe in node 0's namespace; its output. Raises ``RuntimeError`` when the probe
        fails or a node's ``ray start`` exits meanwhile."""
        probe = subprocess.Popen(
            ["ip", "netns", "exec", self.cluster.node_ns[0], sys.executable, "-c", probe_code,
             *args], env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True)
        try:
            while probe.poll() is None:
                for i, p in enumerate(self.procs):
                    if p.poll() is not None:
                        raise RuntimeError(f"Ray node {i} exited with status {p.returncode}: "
                                           f"{self._tail(i)}")
                time.sleep(0.2)
            out, err = probe.communicate()
            if probe.returncode:
                last = (err.strip().splitlines() or ["no output"])[-1]
                raise RuntimeError(f"Ray did not come up ({last}); node 0's log: "
                                   f"{self._tail(0)}")
            return out
        finally:
            if probe.poll() is None:
                probe.kill()
                probe.wait()

    def _tail(self, i: int) -> str:
        with open(self.logs[i]) as f:
            lines = [line.strip() for line in f if line.strip()]
        return lines[-1] if lines else "(no output)"

    def stop(self) -> None:
        """The other nodes on SIGTERM, so that each tells the head it leaves (SIGKILL after
        STOP_GRACE_S), then the head on SIGKILL: on SIGTERM it would wait out its own drain."""
        for p in self.procs[1:]:
            _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for p in self.procs[1:]:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in self.procs:  # what is left of each node's group
            _signal_group(p, signal.SIGKILL)
            p.wait()
        shutil.rmtree(self.temp, ignore_errors=True)


def _signal_group(p: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(p.pid, signum)  # p leads its own group (start_new_session)
    except ProcessLookupError:
        pass


def run_on_ray(cluster: Cluster, command: Sequence[str], rate_bps: float) -> int:
    """Start a Ray node on every emulated node and run ``command`` once in node 0's namespace
    as its driver; returns the command's exit status."""
    env = ray_env(os.environ)
    nodes = RayNodes(cluster, env)
    try:
        nodes.start()
        driver = subprocess.Popen(["ip", "netns", "exec", cluster.node_ns[0], *command],
                                  env=dict(env, RAY_ADDRESS=nodes.head,
                                           EMU_INTER_RATE_BPS=f"{rate_bps:.0f}"))
        try:
            return driver.wait()
        finally:
            if driver.poll() is None:  # interrupted: give it the time a Ctrl-C would
                driver.terminate()
                try:
                    driver.wait(STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    driver.kill()
                    driver.wait()
    finally:
        nodes.stop()


def _raise_on_signal(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, no usage block
        self.exit(2, f"emulate_cluster: error: {message}\n")


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """The options and the command; exits with status 2 and one line on a bad command line."""
    parser = _Parser(
        description="Run a command on g emulated nodes of M ranks (network namespaces, "
                    "shaped veth NICs); everything is removed at exit.")
    parser.add_argument("--nodes", type=int, default=2, help="g")
    parser.add_argument("--gpus-per-node", type=int, default=2, help="M")
    parser.add_argument("--inter-rate", default="auto",
                        help="per-NIC rate, e.g. 1.5gbit; auto: 1/8 of one loopback stream")
    parser.add_argument("--inter-delay-ms", type=float, default=0.0,
                        help="added one-way latency (needs the kernel's sch_netem)")
    parser.add_argument("--ray", action="store_true",
                        help="run the command once, as the driver of a Ray cluster with one "
                             "node per emulated node (one NIC each)")
    parser.add_argument("--prefix", default="paro-emu", help="namespace name prefix")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="-- command to run per rank (with --ray: once)")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    if not (1 <= args.nodes <= 250 and 1 <= args.gpus_per_node <= 250):
        parser.error("--nodes and --gpus-per-node must be between 1 and 250")
    if args.inter_delay_ms < 0:
        parser.error(f"--inter-delay-ms must be >= 0, got {args.inter_delay_ms}")
    if args.inter_rate != "auto":
        try:
            parse_rate(args.inter_rate)
        except ValueError as err:
            parser.error(str(err))
    if args.ray and importlib.util.find_spec("ray") is None:
        parser.error("--ray needs Ray (pip install ray)")
    if os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("tc")):
        parser.error("needs root and iproute2 (ip, tc)")
    return args, command


def main(argv: list[str] | None = None) -> int:
    args, command = parse_args(argv)
    cluster = Cluster(args.nodes, args.gpus_per_node, args.prefix,
                      rails=1 if args.ray else args.gpus_per_node)
    signal.signal(signal.SIGTERM, _raise_on_signal)
    try:
        cluster.build()
        if args.inter_rate == "auto":
            loop = loopback_rate(cluster.node_ns[0])
            rate = loop / 8
            print(f"emulate_cluster: loopback {loop / 1e9:.2f} GB/s, inter-node NICs shaped to "
                  f"1/8: {rate / 1e6:.0f} MB/s", file=sys.stderr)
        else:
            rate = parse_rate(args.inter_rate)
        cluster.shape(rate, args.inter_delay_ms)
        nics = "one NIC per node" if args.ray else "one NIC per rank"
        print(f"emulate_cluster: {args.nodes} nodes x {args.gpus_per_node} ranks, {nics}, "
              f"{rate / 1e6:.0f} MB/s each way, {args.inter_delay_ms} ms one way",
              file=sys.stderr)
        try:
            if args.ray:
                return run_on_ray(cluster, command, rate)
            return launch(cluster, command, rate)
        finally:
            sent = ", ".join(f"node {i} {b / 1e6:.1f} MB" for i, b in enumerate(cluster.sent()))
            print(f"emulate_cluster: sent through the shaped NICs: {sent}", file=sys.stderr)
    except KeyboardInterrupt:
        print("emulate_cluster: interrupted, tearing down", file=sys.stderr)
        return 130
    except UsageError as err:
        print(f"emulate_cluster: error: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:
        print(f"emulate_cluster: error: {err}", file=sys.stderr)
        return 1
    finally:
        cluster.close()


if __name__ == "__main__":
    sys.exit(main())
