"""Ray side of a PPO job: one placement group, one group of Ray actors per model, rendezvous.

The four models (actor, critic, reward, ref) are colocated: rank r of every model runs on bundle
r of one placement group, each taking a fraction of the bundle (a quarter of a GPU, or of a CPU
slot here). Each model has its own process group: rank 0 of the model picks a free port on its
node and every rank of that model joins ``tcp://ip:port``, so the four models never share
collectives and each builds its own ``Topology``.

On one machine ``init_ray`` starts a private Ray; on a cluster start Ray on every node
(``ray start --head`` on one, ``ray start --address=HEAD:6379`` on the others) and set
``ray.address=auto``: the same code then places bundles node by node.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

# Fraction of a bundle each model's rank takes: four models share every device.
SHARE = 0.25


def init_ray(address: str | None, num_cpus: int | None, num_devices: int) -> None:
    """Join the cluster at ``address`` or start a private Ray on this machine."""
    if ray.is_initialized():
        return
    if address:
        ray.init(address=address)
        return
    # A CPU bundle is a placement slot, not a core: N devices need N slots even on 2 cores.
    num_cpus = num_cpus or max(os.cpu_count() or 1, num_devices)
    # A private Ray binds loopback only, with no dashboard. On Linux Ray resolves "127.0.0.1"
    # to the machine's routable address unless its cluster mode is off; the variable carries
    # that to the raylet and the workers it starts, the constant to this already-imported driver.
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray._private.ray_constants.ENABLE_RAY_CLUSTER = False
    ray.init(num_cpus=num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1")


def missing_devices(num_devices: int, use_gpu: bool) -> str | None:
    """Why the cluster cannot hold ``num_devices`` bundles, or None when it can."""
    kind = "GPU" if use_gpu else "CPU"
    have = int(ray.cluster_resources().get(kind, 0))
    if have >= num_devices:
        return None
    return f"needs {num_devices} {kind}s (cluster.num_devices) but the Ray cluster has {have}"


def make_placement_group(num_devices: int, use_gpu: bool) -> tuple[PlacementGroup, list[int]]:
    """One bundle per device; returns the group and the bundle of each rank.

    Ranks are assigned to bundles sorted by node, so that the M consecutive ranks of a
    topology group land on one node whenever each node holds M bundles.
    """
    bundle = {"CPU": 1, **({"GPU": 1} if use_gpu else {})}
    pg = placement_group([dict(bundle) for _ in range(num_devices)], strategy="PACK")
    ray.get(pg.ready())
    nodes = placement_group_table(pg)["bundles_to_node_id"]
    order = sorted(range(num_devices), key=lambda b: (nodes[b], b))
    return pg, order


class ModelGroup:
    """N Ray actors of one worker class, rank r on bundle ``bundles[r]``, in one process group."""

    def __init__(self, worker_cls: type, role: str, cfg: Any, pg: PlacementGroup,
                 bundles: Sequence[int], use_gpu: bool) -> None:
        self.role = role
        self.num_ranks = len(bundles)
        remote_cls = ray.remote(worker_cls)
        self.workers = [
            remote_cls.options(
                num_cpus=SHARE,
                num_gpus=SHARE if use_gpu else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=bundle),
            ).remote(cfg, role, rank, self.num_ranks)
            for rank, bundle in enumerate(bundles)
        ]

    def rendezvous(self) -> list[ray.ObjectRef]:
        """Start every rank's process-group init and model build; returns refs to wait on.

        Rank 0 picks the address first; the other ranks get it before any of them connects.
        """
        addr, port = ray.get(self.workers[0].free_address.remote())
        return [w.setup.remote(addr, port) for w in self.workers]

    def call(self, method: str, *per_rank: Sequence[Any], num_returns: int = 1,
             **common: Any) -> list[Any]:
        """Call ``method`` on every rank; positional arguments are per-rank lists (already
        sliced, or object refs of each rank's slice), keyword arguments go to every rank.
        Returns one ref per rank, or a tuple of ``num_returns`` refs per rank."""
        for arg in per_rank:
            assert len(arg) == self.num_ranks, f"{method}: {len(arg)} slices for {self.num_ranks}"
        return [getattr(w, method).options(num_returns=num_returns).remote(
                    *(arg[r] for arg in per_rank), **common)
                for r, w in enumerate(self.workers)]

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w)
