"""Two-level topology of a model's ranks: g groups (nodes) of M consecutive ranks.

The three scopes a collective can run on, and how many ranks each has, are defined here once:
``intra`` (the M ranks of this rank's group), ``inter`` (the g ranks with this rank's local
index) and ``world`` (all N). On a process group they are the two dimensions of a
``DeviceMesh`` of shape (g, M) named ("inter", "intra"), and the mesh's whole group.

[Note: nested chunk order]
A flat buffer of S elements is cut into N chunks of c = S/N. Rank (i, j) owns G-chunk ``j*g + i``.
Its I-shard is block j of M equal blocks, i.e. chunks ``j*g .. j*g + g-1``, which are exactly the
G-chunks of ranks (0..g-1, j). Hence every level change is a slice or one collective:
N -> I is block j, I -> G is sub-chunk i of block j, an intra all-gather of I-shards yields the full
buffer in local-rank order, an inter all-gather of G-chunks yields the I-block in group order.
Native world collectives number chunks by rank (i*M + j); ``world_to_nested`` and
``nested_to_world`` convert between the two orders with a view, never by changing the layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # only tensors' type; arithmetic users (cost model, planner) need no torch
    import torch

SCOPES = ("intra", "inter", "world")


class TopologyError(ValueError):
    """An impossible cluster shape (the message names the sizes)."""


@dataclass(frozen=True)
class Topology:
    """N ranks in g = N/M groups of M; pure arithmetic plus, when built from a process group,
    the intra, inter and world groups of this rank."""

    num_ranks: int  # N
    group_size: int  # M
    rank: int = 0
    # The (inter, intra) DeviceMesh and the process groups of this rank; None when the topology
    # only does arithmetic (cost model, planner, tests).
    mesh: Any = field(default=None, compare=False, repr=False)
    world: Any = field(default=None, compare=False, repr=False)
    intra: Any = field(default=None, compare=False, repr=False)
    inter: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.num_ranks < 1 or self.group_size < 1:
            raise TopologyError(
                f"cluster.num_devices ({self.num_ranks}) and cluster.group_size "
                f"({self.group_size}) must be positive"
            )
        if self.num_ranks % self.group_size:
            raise TopologyError(
                f"cluster.group_size M={self.group_size} must divide the number of devices "
                f"N={self.num_ranks}; allowed: a divisor of {self.num_ranks}"
            )
        if not 0 <= self.rank < self.num_ranks:
            raise TopologyError(f"rank {self.rank} is outside 0..{self.num_ranks - 1}")

    @property
    def num_groups(self) -> int:  # g
        return self.num_ranks // self.group_size

    @property
    def group_index(self) -> int:  # i
        return self.rank // self.group_size

    @property
    def local_index(self) -> int:  # j
        return self.rank % self.group_size

    def scope_size(self, scope: str) -> int:
        """Number of ranks of a scope's group (the one rule from scope to group size)."""
        sizes = {"intra": self.group_size, "inter": self.num_groups, "world": self.num_ranks}
        if scope not in sizes:
            raise ValueError(f"unknown scope {scope!r}; allowed: {', '.join(SCOPES)}")
        return sizes[scope]

    def group(self, scope: str) -> Any:
        """The process group of a scope (None on an arithmetic-only topology)."""
        self.scope_size(scope)  # validates the name
        return {"intra": self.intra, "inter": self.inter, "world": self.world}[scope]

    def chunk_index(self, rank: int | None = None) -> int:
        """Nested-order G-chunk owned by ``rank`` (this rank by default)."""
        rank = self.rank if rank is None else rank
        return (rank % self.group_size) * self.num_groups + rank // self.group_size

    def with_rank(self, rank: int) -> Topology:
        return Topology(self.num_ranks, self.group_size, rank)

    def world_to_nested(self, flat: torch.Tensor) -> torch.Tensor:
        """Reorder a buffer whose N chunks are in rank order into nested order (a copy)."""
        g, m = self.num_groups, self.group_size
        return flat.view(g, m, -1).transpose(0, 1).reshape(-1)

    def nested_to_world(self, flat: torch.Tensor) -> torch.Tensor:
        """Reorder a buffer whose N chunks are in nested order into rank order (a copy)."""
        g, m = self.num_groups, self.group_size
        return flat.view(m, g, -1).transpose(0, 1).reshape(-1)

    @classmethod
    def from_process_group(cls, group_size: int) -> Topology:
        """Build the topology of this rank over the default process group: a (g, M) DeviceMesh
        whose dimension "intra" holds the M ranks of a group and "inter" the g ranks with the
        same local index.

        Every rank must call this, in the same order as any other ``new_group`` calls, because
        creating a process group is itself collective.
        """
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        arithmetic = cls(dist.get_world_size(), group_size, dist.get_rank())
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        mesh = init_device_mesh(device, (arithmetic.num_groups, group_size),
                                mesh_dim_names=("inter", "intra"))
        return cls(arithmetic.num_ranks, group_size, arithmetic.rank, mesh=mesh,
                   world=dist.group.WORLD, intra=mesh.get_group("intra"),
                   inter=mesh.get_group("inter"))
