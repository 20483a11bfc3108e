"""Emulate a cluster of g nodes x M ranks on one Linux machine and run a command on every rank.

    sudo python scripts/emulate_cluster.py --nodes 2 --gpus-per-node 2 -- \\
        python scripts/bench_collectives.py

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
GLOO_SOCKET_IFNAME, plus EMU_INTER_RATE_BPS (the shaped rate, bytes/s) for reporting. The
namespaces are named ``<prefix>-*`` and are removed on exit, on error, on Ctrl-C and on SIGTERM;
nothing outside them is touched. Needs root, ``ip`` and ``tc`` (iproute2).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from typing import Sequence

MASTER_PORT = 29400
SUBNET = "10.77"


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
    return float(number) * scale / per_byte


class Cluster:
    """The namespaces, links and shaping of one emulated cluster; ``close()`` removes them."""

    def __init__(self, nodes: int, gpus_per_node: int, prefix: str) -> None:
        self.nodes, self.gpus, self.prefix = nodes, gpus_per_node, prefix
        self.switch = f"{prefix}-sw"
        self.node_ns = [f"{prefix}-n{i}" for i in range(nodes)]
        self.created: list[str] = []  # namespaces made by us, the only ones close() removes

    def address(self, node: int, local: int) -> str:
        return f"{SUBNET}.{local}.{node + 1}"

    def build(self) -> None:
        existing = _run("ip", "netns", "list")
        for name in [self.switch, *self.node_ns]:
            if re.search(rf"^{re.escape(name)}\b", existing, re.MULTILINE):
                raise RuntimeError(f"network namespace {name} exists already; remove it with "
                                   f"'ip netns del {name}' or pick another --prefix")
        for name in [self.switch, *self.node_ns]:
            _run("ip", "netns", "add", name)
            self.created.append(name)
            _ns(name, "ip", "link", "set", "lo", "up")
        # One bridge per rail, as in a rail-optimised fabric. A single bridge would let a node
        # answer ARP for rail j's address from its rail-0 NIC too (Linux answers for any local
        # address on any interface), and traffic would then share the wrong NIC's queue.
        for j in range(self.gpus):
            _ns(self.switch, "ip", "link", "add", f"br{j}", "type", "bridge")
            _ns(self.switch, "ip", "link", "set", f"br{j}", "up")
        for i, ns in enumerate(self.node_ns):
            for j in range(self.gpus):
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
            for j in range(self.gpus):
                for where, dev, delay in ((ns, f"r{j}", delay_ms), (self.switch, f"n{i}r{j}", 0)):
                    _ns(where, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf",
                        "rate", rate, "burst", "256kb", "latency", "100ms")
                    if delay > 0:
                        _ns(where, "tc", "qdisc", "add", "dev", dev, "parent", "1:1", "handle",
                            "10:", "netem", "delay", f"{delay}ms", "limit", "100000")

    def close(self) -> None:
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


def _raise_on_signal(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Run a command on g emulated nodes of M ranks (network namespaces, "
                    "shaped veth NICs); everything is removed at exit.")
    parser.add_argument("--nodes", type=int, default=2, help="g")
    parser.add_argument("--gpus-per-node", type=int, default=2, help="M")
    parser.add_argument("--inter-rate", default="auto",
                        help="per-NIC rate, e.g. 1.5gbit; auto: 1/8 of one loopback stream")
    parser.add_argument("--inter-delay-ms", type=float, default=0.0,
                        help="added one-way latency (needs the kernel's sch_netem)")
    parser.add_argument("--prefix", default="paro-emu", help="namespace name prefix")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- command to run per rank")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run on every rank after --")
    if args.nodes < 1 or args.gpus_per_node < 1 or args.nodes > 250 or args.gpus_per_node > 250:
        parser.error("--nodes and --gpus-per-node must be between 1 and 250")
    if os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("tc")):
        parser.error("needs root and iproute2 (ip, tc)")

    if args.inter_rate != "auto":
        try:
            parse_rate(args.inter_rate)
        except ValueError as err:
            parser.error(str(err))
    cluster = Cluster(args.nodes, args.gpus_per_node, args.prefix)
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
        print(f"emulate_cluster: {args.nodes} nodes x {args.gpus_per_node} ranks, NIC "
              f"{rate / 1e6:.0f} MB/s each way, {args.inter_delay_ms} ms one way",
              file=sys.stderr)
        return launch(cluster, command, rate)
    except KeyboardInterrupt:
        print("emulate_cluster: interrupted, tearing down", file=sys.stderr)
        return 130
    finally:
        cluster.close()


if __name__ == "__main__":
    sys.exit(main())
