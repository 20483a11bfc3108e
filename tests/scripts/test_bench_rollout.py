"""scripts/bench_rollout.py --transfer: the weight transfer to rollout replicas, per P level, on
4 gloo ranks of this machine's loopback and on two emulated nodes (scripts/emulate_cluster.py).

Each rank's sync bytes (the gather at P) and transfer bytes (the broadcast to the replicas it
serves) are checked by the script against the closed forms (``cost.traffic``,
``transfer.transfer_bytes``) and every replica's weights against the actor's, bit for bit; here,
besides its verdict, what the closed forms say independently of it: P = N gathers nothing and
P = I only inside a group, and every replica gets the weights exactly once, across the nodes
where it is not on its sender's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.scripts.test_emulate_cluster import _CAN_EMULATE, ROOT, SCRIPT, repo_environment

BENCH = [str(ROOT / "scripts" / "bench_rollout.py"), "--transfer", "--sync-reps", "1",
         "--layers", "2", "--hidden", "64", "--heads", "2", "--replicas", "3"]
EXACT = "closed forms and replicas' weights: exact"


def _check(done: subprocess.CompletedProcess, out: Path) -> None:
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert EXACT in done.stdout, done.stdout[-3000:]
    rows = json.loads(out.read_text())["transfer"]
    assert [r["strategy"] for r in rows] == ["NGG", "IGG", "GGG"]
    for row in rows:
        # Per rank: sync intra, sync inter, transfer intra, transfer inter. Replicas 0, 1, 2
        # on nodes 0, 1, 0 (j mod 2), served by ranks 0, 1, 2 (j mod 4) of nodes 0, 0, 1 (groups
        # of 2 ranks a node): the weights once to each, replica 0 on its sender's node, 1 and 2
        # across.
        size = row["weights_bytes"]
        transfer = [(intra, inter) for _, _, intra, inter in row["bytes"]]
        assert transfer == [(size, 0), (0, size), (0, size), (0, 0)] and size > 0, row
    assert all(a == b == 0 for a, b, _, _ in rows[0]["bytes"])  # P = N: nothing gathered
    assert all(b == 0 and a > 0 for a, b, _, _ in rows[1]["bytes"])  # P = I: inside a group
    assert sum(b for _, b, _, _ in rows[2]["bytes"]) > 0  # P = G: across the groups too


@pytest.mark.slow
@pytest.mark.dist
def test_transfer_bytes_equal_the_closed_forms_on_loopback(tmp_path):
    out = tmp_path / "transfer.json"
    done = subprocess.run([sys.executable, *BENCH, "--json", str(out)], capture_output=True,
                          text=True, env=repo_environment(), timeout=600)
    _check(done, out)


@pytest.mark.slow
@pytest.mark.skipif(not _CAN_EMULATE, reason="needs root, iproute2 (ip, tc) and Ray")
def test_transfer_bytes_equal_the_closed_forms_on_two_emulated_nodes(tmp_path):
    out = tmp_path / "transfer.json"
    prefix = f"b{os.getpid()}"  # apart from any other emulation on this machine
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--nodes", "2", "--gpus-per-node", "2", "--inter-rate",
         "160MB", "--prefix", prefix, "--", sys.executable, *BENCH, "--json", str(out)],
        capture_output=True, text=True, env=repo_environment(), timeout=600)
    _check(done, out)
