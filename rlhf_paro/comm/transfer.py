"""The weight transfer from the actor's ranks to rollout replicas on devices of their own
(docs/design.md, "Asynchronous rollouts"): a process group of one actor rank and the replicas it
serves, apart from every model's own group, and a metered broadcast on it.

Replica j is served by actor rank j mod N, so the N actor ranks share the sending when there are
at least as many replicas as actor ranks. A group is made on a ``TCPStore`` that the driver holds
(each group under a prefix of its own), with the backend of the devices: gloo on CPUs, NCCL on
GPUs. Its rank 0 is the actor rank; a broadcast from it sends each weight to every replica of the
group, so the sender's bytes are the weight's times its replicas (what a broadcast sends from its
root), each on an intra link when the replica is on the sender's node and an inter link
otherwise (``transfer_bytes``, which the cost model and the tests hold the meter to).
"""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

from rlhf_paro.comm.meter import TRANSFER, CommMeter, LinkBytes

# Long enough for a replica that is still generating a previous step when the sender starts.
TIMEOUT = datetime.timedelta(minutes=30)


def serving(replica: int, num_actor_ranks: int) -> int:
    """The actor rank that sends replica ``replica`` its weights."""
    return replica % num_actor_ranks


def served(actor_rank: int, num_actor_ranks: int, num_replicas: int) -> list[int]:
    """The replicas actor rank ``actor_rank`` sends weights to, in order."""
    return list(range(actor_rank, num_replicas, num_actor_ranks))


def transfer_bytes(numel: int, elem_size: int, same_node: list[bool]) -> LinkBytes:
    """What the sender of a group sends for one weight of ``numel`` elements to replicas on its
    node (True) or not (False)."""
    size = numel * elem_size
    return LinkBytes(size * sum(same_node), size * (len(same_node) - sum(same_node)))


def serve_store(host: str) -> tuple[dist.TCPStore, int]:
    """A store served by the caller (the driver, for the transfer groups; a model's rank 0, for
    its process group) on a port of ``host`` that the system draws and that it listens on from
    that moment; keep the store alive while the groups run."""
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    return store, store.port


class TransferGroup:
    """One actor rank (group rank 0) and the replicas it serves, on their own process group."""

    def __init__(self, host: str, port: int, prefix: str, rank: int, size: int,
                 device: torch.device, meter: CommMeter | None = None,
                 same_node: list[bool] | None = None, backend: str | None = None) -> None:
        store = dist.PrefixStore(prefix, dist.TCPStore(host, port, is_master=False,
                                                       timeout=TIMEOUT))
        # NCCL for CUDA devices (one device a process: ranks on one GPU take gloo, which moves
        # CUDA tensors through host memory).
        if (backend or ("nccl" if device.type == "cuda" else "gloo")) == "nccl":
            self.group = dist.ProcessGroupNCCL(store, rank, size)
        else:
            self.group = dist.ProcessGroupGloo(store, rank, size, TIMEOUT)
        self.rank, self.size, self.device = rank, size, device
        self.meter = meter if meter is not None else CommMeter()
        # Sender only: whether each receiver (group ranks 1..) is on the sender's node.
        self.same_node = same_node or []

    @torch.no_grad()
    def broadcast(self, tensor: torch.Tensor, phase: str = TRANSFER) -> None:
        """``tensor`` from the sender to every replica of the group, in place on the replicas;
        metered (``phase``: ``transfer``, or a LoRA actor's ``base_transfer``) on the sender."""
        start = time.perf_counter()
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.group.broadcast([tensor], opts).wait()
        if self.rank == 0:
            self.meter.record(phase, "broadcast", "transfer", "native",
                              transfer_bytes(tensor.numel(), tensor.element_size(),
                                             self.same_node),
                              time.perf_counter() - start)
