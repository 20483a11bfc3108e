"""Ray side of a PPO job: one placement group, one group of Ray actors per model, rendezvous.

The run's models (``ppo/algorithms.roles``: actor, reward, and critic and ref where the algorithm
reads them) are colocated: rank r of every model runs on bundle r of one placement group, each
taking an equal fraction of the bundle (``bundle_share``: a quarter of a GPU, or of a CPU slot
here, for PPO's four models). Each model has its own process group: rank 0 of the model picks a
free port on its node and every rank of that model joins ``tcp://ip:port``, so the models never
share collectives and each builds its own ``Topology``.

On one machine ``init_ray`` starts a private Ray; on a cluster start Ray on every node
(``ray start --head`` on one, ``ray start --address=HEAD:6379`` on the others) and set
``ray.address=auto`` (a driver whose environment names the cluster in RAY_ADDRESS, as a Ray job's
does, joins it without): the same code then places bundles node by node, and each worker binds
gloo to its node's Ray address (``worker.bind_gloo``).
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from typing import Any, Callable, NamedTuple, Sequence

import psutil
import ray
from ray.exceptions import RayActorError, RayError
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlhf_paro.config import ConfigError
from rlhf_paro.ppo import algorithms

# Seconds the driver waits at most before it looks at its calls again (and a Ctrl-C lands).
POLL_S = 1.0
# After a first failure, seconds to wait at most for Ray to report a dead worker behind it (a
# loaded machine takes seconds to notice a killed process; see get).
GRACE_S = 10.0
# Seconds to wait for a Ray cluster's address to answer before calling it gone.
CONNECT_S = 5.0


def init_ray(address: str | None, num_cpus: int | None, num_devices: int) -> None:
    """Join the cluster at ``address`` or start a private Ray on this machine.

    Raises ``ConnectionError`` (one line) within seconds when no cluster answers at ``address``.
    """
    if ray.is_initialized():
        return
    # ray.init first sets a SIGTERM handler of its own, a bare exit raised wherever the driver
    # is: inside an at-fork hook (logging's, as Ray starts its processes) Python prints it and
    # goes on, and the signal is lost (seen). An entry point's handler, which stops the run at a
    # safe point, stays in place throughout instead.
    handler = signal.getsignal(signal.SIGTERM)
    ours = callable(handler) and threading.current_thread() is threading.main_thread()
    install = ray._private.utils.set_sigterm_handler
    if ours:
        ray._private.utils.set_sigterm_handler = lambda _handler: None
    try:
        _init(address, num_cpus, num_devices)
    finally:
        ray._private.utils.set_sigterm_handler = install
        if ours:
            signal.signal(signal.SIGTERM, handler)


def _init(address: str | None, num_cpus: int | None, num_devices: int) -> None:
    if address:
        check_address(address)
        ray.init(address=address)
        return
    # A CPU bundle is a placement slot, not a core: N devices need N slots even on 2 cores.
    num_cpus = num_cpus or max(os.cpu_count() or 1, num_devices)
    # A private Ray binds loopback only, with no dashboard. On Linux Ray resolves "127.0.0.1"
    # to the machine's routable address unless its cluster mode is off; the variable carries
    # that to the raylet and the workers it starts, the constant to this already-imported driver.
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray._private.ray_constants.ENABLE_RAY_CLUSTER = False
    # "local": a new Ray even where RAY_ADDRESS names a cluster (ray.init would join that).
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
             _node_ip_address="127.0.0.1")


def check_address(address: str) -> None:
    """Raise ``ConnectionError`` (one line) within seconds when no Ray cluster answers at
    ``address``, where ``ray.init`` would retry for minutes: ``auto`` finds the address of the
    last cluster started on this machine even after that cluster has stopped."""
    from ray._private.services import canonicalize_bootstrap_address_or_die

    try:
        resolved = canonicalize_bootstrap_address_or_die(address)
    except ValueError as err:
        raise ConnectionError(str(err)) from None
    host, _, port = resolved.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_S).close()
    except OSError as err:
        stale = " (the address a stopped cluster left behind?)" if address == "auto" else ""
        raise ConnectionError(f"no Ray cluster answers at {resolved}{stale}: "
                              f"{err.strerror or err}") from None


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


def bundle_share(cfg: Any) -> float:
    """The fraction of a bundle (a device) each model's rank takes: the run's models share every
    device equally."""
    return 1.0 / len(algorithms.roles(cfg))


class Call(NamedTuple):
    """One rank's remote call, as the driver issued it: what a hang is traced back to."""

    ref: ray.ObjectRef  # its (first) result
    role: str
    rank: int
    method: str


class ModelGroup:
    """N Ray actors of one worker class, rank r on bundle ``bundles[r]``, in one process group.

    Every call is appended to ``issued`` (shared by the run's groups, so in the order issued),
    which the trainer clears once a step's calls are done (``get``, [Note: naming a hang]).
    """

    def __init__(self, worker_cls: type, role: str, cfg: Any, pg: PlacementGroup,
                 bundles: Sequence[int], use_gpu: bool, issued: list[Call] | None = None,
                 share: float | None = None) -> None:
        self.role = role
        self.num_ranks = len(bundles)
        self.issued = [] if issued is None else issued
        remote_cls = ray.remote(worker_cls)
        # The fraction of its bundle each rank takes (``bundle_share``; a rollout replica has
        # its device to itself).
        share = bundle_share(cfg) if share is None else share
        self.workers = [
            remote_cls.options(
                num_cpus=share,
                num_gpus=share if use_gpu else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=bundle),
            ).remote(cfg, role, rank, self.num_ranks)
            for rank, bundle in enumerate(bundles)
        ]

    def rendezvous(self) -> list[ray.ObjectRef]:
        """Start every rank's process-group init and model build; returns refs to wait on, which
        give each rank's process id.

        Rank 0 picks the address first; the other ranks get it before any of them connects.
        """
        addr, port = ray.get(self.workers[0].free_address.remote())
        refs = [w.setup.remote(addr, port) for w in self.workers]
        self.issued.extend(Call(ref, self.role, r, "setup") for r, ref in enumerate(refs))
        return refs

    def call(self, method: str, *per_rank: Sequence[Any], num_returns: int = 1,
             **common: Any) -> list[Any]:
        """Call ``method`` on every rank; positional arguments are per-rank lists (already
        sliced, or object refs of each rank's slice), keyword arguments go to every rank.
        Returns one ref per rank, or a tuple of ``num_returns`` refs per rank."""
        for arg in per_rank:
            assert len(arg) == self.num_ranks, f"{method}: {len(arg)} slices for {self.num_ranks}"
        refs = [getattr(w, method).options(num_returns=num_returns).remote(
                    *(arg[r] for arg in per_rank), **common)
                for r, w in enumerate(self.workers)]
        self.issued.extend(Call(ref[0] if num_returns > 1 else ref, self.role, r, method)
                           for r, ref in enumerate(refs))
        return refs

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w)  # at once, even in a collective that waits for a dead peer


class WorkerError(RuntimeError):
    """Rank ``rank`` of model ``role`` died or raised; ``str()`` is one line."""

    def __init__(self, role: str, rank: int, died: bool, reason: str,
                 cause: BaseException | None = None) -> None:
        self.role, self.rank, self.died, self.reason, self.cause = role, rank, died, reason, cause
        super().__init__(f"{role} rank {rank} {'died' if died else 'raised'} ({reason})")


class StopRequested(Exception):
    """The driver was asked to stop (SIGTERM) while it waited for its workers."""


class NoAnswerError(RuntimeError):
    """Rank ``rank`` of model ``role`` did not answer its call ``phase`` (None: not known)
    within ``timeout_s``; ``stopped``: its process is stopped (SIGSTOP). ``str()`` is one line.
    """

    def __init__(self, role: str, rank: int, phase: str | None, timeout_s: float,
                 stopped: bool) -> None:
        self.role, self.rank, self.phase, self.stopped = role, rank, phase, stopped
        where = f" in {phase}" if phase else ""
        super().__init__(f"{role} rank {rank} did not answer{where} within "
                         f"trainer.step_timeout_s={timeout_s:g}"
                         + (" (its process is stopped)" if stopped else ""))


def get(calls: dict[str, list[ray.ObjectRef]], workers: dict[str, list[Any]],
        timeout_s: float | None = None, issued: Sequence[Call] = (),
        pids: dict[str, list[int]] | None = None, stop: Callable[[], bool] | None = None
        ) -> dict[str, list[Any]]:
    """The results of ``calls`` (model -> one ref per rank), like ``ray.get``, except that the
    first failure is raised as soon as it is known: the failed rank's peers may wait for it in a
    collective for good, so waiting for every ref would hang. ``workers`` (model -> actor handle
    per rank) names a dead worker whose death reaches us through another model's call.

    After ``timeout_s`` seconds (None: never) without every result, raises ``NoAnswerError``
    naming the rank that holds the others up, traced through ``issued`` (the calls in flight,
    in the order issued) and ``pids`` (model -> process id per rank). [Note: naming a hang]
    Raises ``StopRequested`` within a second once ``stop()`` is true.

    Raises ``WorkerError``; a ``ConfigError`` a worker raised (a user's mistake it found) and a
    ``KeyboardInterrupt`` come through as themselves.
    """
    owner = {ref: (role, rank) for role, refs in calls.items() for rank, ref in enumerate(refs)}
    results: dict[str, list[Any]] = {role: [None] * len(refs) for role, refs in calls.items()}
    pending = list(owner)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while pending:
        if deadline is not None and time.monotonic() >= deadline:
            raise _no_answer(pending, owner, issued, pids or {}, timeout_s)
        if stop is not None and stop():
            raise StopRequested
        done, pending = ray.wait(pending, num_returns=len(pending), timeout=POLL_S)
        failures = []
        for ref in done:
            role, rank = owner[ref]
            try:
                results[role][rank] = ray.get(ref)
            except RayError as err:
                failures.append((err, role, rank))
        if failures:
            raise _failure(failures, pending, owner, workers) from None
    return results


def _no_answer(pending: list[ray.ObjectRef], owner: dict[ray.ObjectRef, tuple[str, int]],
               issued: Sequence[Call], pids: dict[str, list[int]], timeout_s: float
               ) -> NoAnswerError:
    """[Note: naming a hang]
    The rank waited on is often not the one to blame: the peers of a stopped rank wait for it in
    a collective, and a call that takes another model's output (make_experience takes the
    reward's scores) waits for that model. So the oldest call still in flight is the likely
    cause, unless a rank's process is plainly stopped (this node's ranks only): that one is.
    """
    ready, _ = ray.wait([c.ref for c in issued], num_returns=len(issued), timeout=0)
    ready_set = set(ready)
    late = [(c.role, c.rank, c.method) for c in issued if c.ref not in ready_set]
    late = late or [(*owner[ref], None) for ref in pending]
    stopped = [c for c in late if _is_stopped(pids, c[0], c[1])]
    role, rank, method = (stopped or late)[0]
    return NoAnswerError(role, rank, method, timeout_s, bool(stopped))


def _is_stopped(pids: dict[str, list[int]], role: str, rank: int) -> bool:
    """Whether the process of rank ``rank`` of ``role`` is known and stopped on this node."""
    known = pids.get(role) or []
    if rank >= len(known) or known[rank] is None:
        return False
    try:
        return psutil.Process(known[rank]).status() == psutil.STATUS_STOPPED
    except psutil.Error:
        return False


def _failure(failures: list[tuple[RayError, str, int]], pending: list[ray.ObjectRef],
             owner: dict[ray.ObjectRef, tuple[str, int]], workers: dict[str, list[Any]]
             ) -> BaseException:
    """The exception that says best what went wrong, given the failures seen so far."""
    cause = _cause(failures[0][0])
    if isinstance(cause, (ConfigError, KeyboardInterrupt)):
        return cause
    if pending and not any(isinstance(err, RayActorError) for err, _, _ in failures):
        # A killed worker's peers may fail first, on the collective it left (a connection
        # closed by peer): give Ray a moment to report the death itself, to name the right one.
        done, _ = ray.wait(pending, num_returns=len(pending), timeout=GRACE_S)
        for ref in done:
            try:
                ray.get(ref)
            except RayError as err:
                failures.append((err, *owner[ref]))
    ids = {w._actor_id.hex(): (role, rank)
           for role, handles in workers.items() for rank, w in enumerate(handles)}
    for err, role, rank in failures:
        if isinstance(err, RayActorError):  # also a RayTaskError caused by one
            # A task that took a dead worker's output fails with that worker's death.
            role, rank = ids.get(err.actor_id, (role, rank))
            return WorkerError(role, rank, True, "its process exited: killed, out of memory or "
                                                 "crashed")
    err, role, rank = failures[0]
    lines = str(cause).strip().splitlines()
    reason = f"{type(cause).__name__}: {lines[0]}" if lines else type(cause).__name__
    return WorkerError(role, rank, False, reason, cause)


def _cause(err: RayError) -> BaseException:
    """What the worker raised (a RayTaskError wraps it), or the Ray error itself."""
    return vars(err).get("cause") or err
