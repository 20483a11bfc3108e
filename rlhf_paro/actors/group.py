"""Ray side of a PPO job: the devices (one placement group per topology group), one group of
Ray actors per model, rendezvous.

The run's models (``ppo/algorithms.roles``: actor, reward, and critic and ref where the algorithm
reads them) are colocated: rank r of every model runs on device r (``Placement``: bundle r % M of
group r // M, each group on one node), each taking an equal fraction of it (``bundle_share``: a
quarter of a GPU, or of a CPU slot here, for PPO's four models). Each model has its own process
group: rank 0 of the model picks a free port on its node and every rank of that model joins
``tcp://ip:port``, so the models never share collectives and each builds its own ``Topology``.

On one machine ``init_ray`` starts a private Ray, whose workers fork from a process that has
imported torch, transformers and the models once (``preloaded_workers``); on a cluster start
Ray on every node (``ray start --head`` on one, ``ray start --address=HEAD:6379`` on the
others) and set ``ray.address`` (a driver whose environment names the cluster in RAY_ADDRESS,
as a Ray job's does, joins it without): the same code then places each group on a node of its
own, waiting for devices other jobs hold (``place``), each worker binds gloo to its node's Ray
address (``worker.bind_gloo``), and Ray starts the workers as it always does. What Ray and the workers
print goes to the run's log (``RayOutput``); a phase of the start that takes more than a few
seconds says so on the console (``phase``).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import signal
import socket
import sys
import threading
import time
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import psutil
import ray
from ray.exceptions import RayActorError, RayError
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlhf_paro.actors.ray_worker import ZYGOTE_ENV
from rlhf_paro.actors.zygote import Zygote
from rlhf_paro.config import ConfigError
from rlhf_paro.ppo import algorithms

# Seconds the driver waits at most before it looks at its calls again (and a Ctrl-C lands).
POLL_S = 1.0
# After a first failure, seconds to wait at most for Ray to report a dead worker behind it (a
# loaded machine takes seconds to notice a killed process; see get).
GRACE_S = 10.0
# Seconds to wait for a Ray cluster's address (or a node's raylet) to answer before calling it
# gone.
CONNECT_S = 5.0
# Seconds between looks at the run's nodes while the driver waits for its workers (a lost node).
PROBE_S = 5.0
# Seconds without a placement before the run says what it waits for, when the free devices it
# saw as it began did not already tell it that it must wait (Ray's view of them lags a little).
NOTE_S = 5.0


class RayStartError(RuntimeError):
    """Ray did not start on this machine (``str()``: one line)."""


class Noise(NamedTuple):
    """A kind of line a library prints on every run that says nothing wrong about it."""

    kind: str  # what it is, in the summary line
    why: str  # why it is harmless here
    lines: re.Pattern  # searched in a worker's line: the first line of one message


# A vLLM log record: its level, time and [file:line], repeated on every line of a record that
# holds several (a traceback).
_VLLM_RECORD = re.compile(r"^(?:\(\w+ pid=\d+\) )?(?:DEBUG|INFO|WARNING) \d\d-\d\d [\d:]+ \[[^]]+\] ")
# Known-harmless lines of the workers' libraries (a vLLM engine in each actor rank, DeepSpeed,
# torch), each message summarised in workers.log as one line per kind with its count, the
# lines themselves in workers.noise.log. What matches none is kept, warnings and all.
NOISE = (
    Noise("vLLM's weight reload notes", "the actor's weights are loaded into the engine in "
          "place after every update (a rotary embedding has no weights to load); "
          "rollout/logprob_diff_* measures the engine against the trainer",
          re.compile(r"RotaryEmbedding: Failed to load weights|Reloading weights inplace"
                     r"|Reloading and processing weights took|Successfully reset prefix cache")),
    Noise("vLLM's chat template warmup and EOS notes", "the engine runs without a tokenizer, by "
          "design: token ids in, token ids out", re.compile(
              r"Chat template warmup failed|Using None for EOS token id because tokenizer is "
              r"not initialized")),
    Noise("vLLM's start-up notes (its settings, the model's load, its key/value cache)",
          "each actor rank builds its engine as the run's rollout.* keys say", re.compile(
              r"non-default args: |Using max model len |Initializing a V1 LLM engine"
              r"|Enabled custom fusions|is assigned as DP rank|Starting to load model"
              r"|Initializing model took|CPU KV cache size: |init engine \(profile"
              r"|Enforce eager set, disabling|Inductor compilation was disabled|Chunked prefill "
              r"is enabled|Using \w+ KV cache layout|Final IR op priority|Using ray runtime env"
              r"|Resolved architecture:|Explicitly set \S+ GiB for KV cache|The global random "
              r"seed is set to")),
    Noise("CPU performance advice (vLLM, Triton, NUMA, DeepSpeed)", "advice for a CPU build's "
          "speed; the results are the same", re.compile(
              r"is not found in LD_PRELOAD|doesn't allow to use `torch.set_num_threads`"
              r"|Triton is installed, but doesn't include CPU backend|Triton is not installed"
              r"|Model Runner V2 requires Triton|NUMA binding: Using MEMBIND policy"
              r"|Setting accelerator to CPU")),
    Noise("torch deprecation warnings inside vLLM", "vLLM's own code, not the run's",
          re.compile(r"FutureWarning: `torch.distributed.reduce_op` is deprecated")),
)
# The source line Python's warnings print under their message.
_WARNING_SOURCE = re.compile(r"^  \S")


class RayOutput:
    """What Ray and the workers print, kept off the console in ``path`` (the run's
    ``workers.log``): the workers' output (Ray forwards it to the driver, prefixed with the
    worker), Ray's own messages to the driver (its warnings, a lost node's log tail) and what
    ``ray.init`` prints while it starts or joins a cluster (C++ warnings included).

    Libraries print on every start what a user takes for errors (Ray's worker start-up warning,
    DeepSpeed's accelerator line per worker, vLLM's advice and notes): the run's own console
    lines are its progress and its one-line errors, which point here. The workers' lines of a
    kind in ``NOISE`` go to ``<path stem>.noise.log`` instead, and ``close`` ends the log with
    one line per kind seen: its count, why it is harmless, where its lines are.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = str(path)
        self.noise_path = re.sub(r"(\.log)?$", ".noise.log", self.path, count=1)
        self._file = open(self.path, "a", buffering=1, errors="replace")
        self._noise_file: Any = None
        self.noise_counts: dict[str, int] = {}  # kind -> messages
        # pid -> the record prefix (or pattern) that the lines of its last noise message go on
        # with: a traceback's lines, a warning's source line.
        self._going_on: dict[Any, str | re.Pattern] = {}
        self._attached: tuple[Any, Any] | None = None
        # The console's descriptor while ``capture`` holds stdout (None: stdout is the console);
        # ``say`` reads it from another thread, ``capture`` sets it: under the lock.
        self._console: int | None = None
        self._console_lock = threading.Lock()

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """This process's stdout and stderr into the log: file descriptors 1 and 2 (what C++
        and the streams Ray's loggers hold write to) and ``sys.stdout``, ``sys.stderr``."""
        streams = sys.stdout, sys.stderr
        for stream in streams:
            stream.flush()
        saved = [os.dup(1), os.dup(2)]
        with self._console_lock:
            self._console = saved[0]
        os.dup2(self._file.fileno(), 1)
        os.dup2(self._file.fileno(), 2)
        sys.stdout = sys.stderr = self._file
        try:
            yield
        finally:
            self._file.flush()
            sys.stdout, sys.stderr = streams
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            with self._console_lock:
                self._console = None
            for fd in saved:
                os.close(fd)

    def say(self, line: str) -> None:
        """``line`` on the console (this process's stdout), also while ``capture`` holds it; from
        any thread."""
        with self._console_lock:
            if self._console is None:
                print(line, flush=True)
            else:
                os.write(self._console, f"{line}\n".encode())

    def attach(self) -> None:
        """Route what Ray forwards to this driver into the log, until ``close``."""
        if self._attached is not None:
            return
        from ray._private import worker as ray_worker
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

        dispatcher.remove_handler("ray_print_logs")
        dispatcher.add_handler("rlhf_paro", self.write)
        # Ray's messages to the driver go through this module function (its error listener).
        self._attached = (ray_worker, ray_worker.print_to_stdstream)
        ray_worker.print_to_stdstream = self.write

    def write(self, data: dict[str, Any], ignore_prefix: bool = False) -> None:
        """One batch of lines Ray forwards, prefixed as Ray prints them: a worker's
        ``(ActorWorker pid=4711)`` (and ``ip=`` on another node), ``(raylet)``, and only the
        events of the autoscaler's status (as Ray filters them)."""
        from ray._private.worker import filter_autoscaler_events

        pid = data.get("pid")
        lines = data.get("lines", [])
        if pid == "autoscaler":
            lines = list(filter_autoscaler_events(lines))
        name = data.get("actor_name") or data.get("task_name")
        where = "" if data.get("ip") in (None, data.get("localhost")) else f", ip={data['ip']}"
        prefix = f"({pid}) " if pid in ("raylet", "autoscaler") else \
            f"({name + ' ' if name else ''}pid={pid}{where}) "
        for line in lines:
            (self._noise() if self._is_noise(pid, line) else self._file).write(
                prefix + line + "\n")

    def _is_noise(self, pid: Any, line: str) -> bool:
        """Whether ``line`` of worker ``pid`` is a message of a ``NOISE`` kind or goes on with
        the one before it (counted once, at its first line)."""
        going_on = self._going_on.pop(pid, None)
        if isinstance(going_on, str) and line.startswith(going_on) or \
                isinstance(going_on, re.Pattern) and going_on.match(line):
            self._going_on[pid] = going_on
            return True
        for noise in NOISE:
            if noise.lines.search(line):
                self.noise_counts[noise.kind] = self.noise_counts.get(noise.kind, 0) + 1
                record = _VLLM_RECORD.match(line)
                self._going_on[pid] = record.group(0) if record else _WARNING_SOURCE
                return True
        return False

    def _noise(self) -> Any:
        if self._noise_file is None:
            self._noise_file = open(self.noise_path, "a", buffering=1, errors="replace")
        return self._noise_file

    def close(self) -> None:
        """Give Ray its console back (after ``ray.shutdown``: until then it may still print)."""
        if self._attached is not None:
            from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

            module, original = self._attached
            module.print_to_stdstream = original
            dispatcher.remove_handler("rlhf_paro")
            self._attached = None
        whys = {noise.kind: noise.why for noise in NOISE}
        for kind, count in self.noise_counts.items():
            self._file.write(f"(rlhf_paro) {count} message{'s' * (count > 1)}: {kind}, "
                             f"harmless ({whys[kind]}); in {os.path.basename(self.noise_path)}\n")
        self.noise_counts.clear()
        if self._noise_file is not None:
            self._noise_file.close()
        self._file.close()


def init_ray(address: str | None, num_cpus: int | None, num_devices: int,
             output: RayOutput | None = None) -> None:
    """Join the cluster at ``address`` or start a private Ray on this machine; with ``output``,
    what Ray prints goes there (``RayOutput``), from the start when this call starts it.

    Raises ``ConnectionError`` (one line) within seconds when no cluster answers at ``address``,
    and when one refuses this driver (token authentication); ``RayStartError`` (one line) when a
    private Ray does not start.
    """
    if ray.is_initialized():  # by the entry point's check of a cluster's GPUs, or a caller
        if output is not None:
            output.attach()
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
        with output.capture() if output is not None else contextlib.nullcontext():
            _init(address, num_cpus, num_devices)
    except (ConnectionError, RayStartError) as err:
        if output is None:
            raise
        raise type(err)(f"{err} (Ray's messages: {output.path})") from None
    finally:
        ray._private.utils.set_sigterm_handler = install
        if ours:
            signal.signal(signal.SIGTERM, handler)
    if output is not None:
        output.attach()


def _init(address: str | None, num_cpus: int | None, num_devices: int) -> None:
    if address:
        check_address(address)
        try:
            ray.init(address=address)
        except Exception as err:  # noqa: BLE001 - Ray's reasons vary; each becomes one line
            raise ConnectionError(_join_failure(address, err)) from None
        return
    # A CPU bundle is a placement slot, not a core: N devices need N slots even on 2 cores.
    num_cpus = num_cpus or max(os.cpu_count() or 1, num_devices)
    # A private Ray binds loopback only, with no dashboard. On Linux Ray resolves "127.0.0.1"
    # to the machine's routable address unless its cluster mode is off; the variable carries
    # that to the raylet and the workers it starts, the constant to this already-imported driver.
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray._private.ray_constants.ENABLE_RAY_CLUSTER = False
    # "local": a new Ray even where RAY_ADDRESS names a cluster (ray.init would join that).
    try:
        with preloaded_workers():
            ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
                     _node_ip_address="127.0.0.1")
    except Exception as err:  # noqa: BLE001 - a start-up timeout under load, a full /tmp...
        if ray.is_initialized():
            ray.shutdown()
        raise RayStartError(f"Ray did not start on this machine ({_first_line(err)})") from None


# What every worker of a run imports before its first call (``python -X importtime``), imported
# once by the zygote that a private Ray's workers fork from (``preloaded_workers``). Not Ray, nor
# a module that imports it (the workers' own): Ray reads its configuration from the environment
# as it is imported, a worker's job id among it, so each worker imports it itself.
WORKER_PRELOAD = ["torch", "torch.distributed", "transformers",
                  "transformers.models.llama.modeling_llama", "safetensors.torch",
                  "rlhf_paro.models", "rlhf_paro.sharding.engine", "rlhf_paro.comm.collectives",
                  "rlhf_paro.comm.transfer", "rlhf_paro.ppo.core", "rlhf_paro.ppo.data",
                  "rlhf_paro.ppo.rewards", "rlhf_paro.rollout.hf", "rlhf_paro.metrics"]
# The zygote of this process (``preloaded_workers``), started with its first private Ray and
# ending with the process; every later Ray of the process (a multirun's jobs) forks from it too.
_worker_zygote: list[Zygote] = []


def start_worker_zygote() -> None:
    """Start this process's zygote (``preloaded_workers``) unless it runs: an entry point that
    will start a private Ray calls it first thing, so that the zygote imports while the driver
    reads its config, on a core the driver leaves idle."""
    if not _worker_zygote:
        _worker_zygote.append(Zygote(WORKER_PRELOAD, dict(os.environ)))
        # Stopped at exit with its socket and log, not left to notice its driver is gone.
        atexit.register(_worker_zygote[0].close)


@contextlib.contextmanager
def preloaded_workers() -> Iterator[None]:
    """A Ray started inside (``ray.init`` of a private Ray, or a test's cluster) starts its
    workers through ``actors/ray_worker.py``: each forks from this process's zygote, which has
    imported ``WORKER_PRELOAD``, instead of importing it again (about 4.5 s of a core a worker;
    ``actors/zygote.py`` says what a fork keeps). The zygote starts with this process's
    environment (the one the raylet and its workers inherit), here unless it runs already
    (``start_worker_zygote``), and imports while Ray starts; the raylet keeps its address from
    the environment it starts in. Only for a Ray of this machine:
    a run that joins a cluster keeps Ray's own start, on nodes where no zygote runs."""
    import ray._private.parameter as parameter

    start_worker_zygote()
    base = parameter.RayParams
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ray_worker.py")

    class Params(base):  # type: ignore[misc, valid-type] - Ray's class, its set-up script ours
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("setup_worker_path", script)
            super().__init__(*args, **kwargs)

    parameter.RayParams = Params
    os.environ[ZYGOTE_ENV] = _worker_zygote[0].address
    try:
        yield
    finally:
        parameter.RayParams = base
        os.environ.pop(ZYGOTE_ENV)


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


def _join_failure(address: str, err: BaseException) -> str:
    """One line for a cluster that answers at ``address`` but that ``ray.init`` cannot join:
    the cause Ray buries in its chain (an authentication token it refuses) named first."""
    chain, seen = [], err
    while seen is not None:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    if any("InvalidAuthToken" in str(e) or type(e).__name__ == "AuthenticationError"
           for e in chain):
        mode = os.environ.get("RAY_AUTH_MODE", "unset")
        return (f"the Ray cluster at {address} refused this driver's authentication token "
                f"(InvalidAuthToken; RAY_AUTH_MODE is {mode}): the cluster runs token "
                "authentication; set RAY_AUTH_MODE=token and give this driver the cluster's "
                "token (RAY_AUTH_TOKEN, or the file ~/.ray/auth_token of the head node)")
    return f"could not join the Ray cluster at {address} ({_first_line(err)})"


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


def missing_devices(num_devices: int, group_size: int, use_gpu: bool, replicas: int = 0
                    ) -> str | None:
    """Why the cluster can never hold ``num_devices`` devices in groups of ``group_size`` on one
    node each and ``replicas`` devices more on any node (counting every device, free or held),
    or None when it can. Wherever the groups go, they leave the cluster's other devices to the
    replicas."""
    kind = "GPU" if use_gpu else "CPU"
    total = _devices(kind, free=False)
    if (_groups_fit(total, group_size) >= num_devices // group_size
            and sum(total.values()) >= num_devices + replicas):
        return None
    groups = (f"in groups of {group_size} on one node each (cluster.num_devices, "
              "cluster.group_size)")
    need = (f"{num_devices + replicas} {kind}s: {num_devices} {groups} and {replicas} for the "
            "rollout (rollout.num_devices)") if replicas else f"{num_devices} {kind}s {groups}"
    return f"needs {need} but the Ray cluster has {_per_node_text(total, kind)}"


def _devices(kind: str, free: bool) -> dict[str, int]:
    """Whole devices of ``kind`` (a bundle takes one whole CPU slot or GPU) per alive node:
    all of them, or those free (Ray's view, refreshed every second or so)."""
    from ray._private import state

    alive = {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}
    resources = state.available_resources_per_node() if free else \
        {node: n["Resources"] for node, n in alive.items()}
    return {node: int(resources.get(node, {}).get(kind, 0)) for node in alive}


def _groups_fit(per_node: dict[str, int], group_size: int) -> int:
    """Groups of ``group_size`` devices on one node each that ``per_node`` holds."""
    return sum(n // group_size for n in per_node.values())


def _per_node_text(per_node: dict[str, int], kind: str, of: dict[str, int] | None = None
                   ) -> str:
    """'4 CPUs', or '1 of the cluster's 2 CPUs free' (``of``: all of them) on one node; per
    node on several, by address (a node of several on one machine also by its id)."""
    if len(per_node) <= 1:
        count = sum(per_node.values())
        return f"{count} {kind}s" if of is None else \
            f"{count} of the cluster's {sum(of.values())} {kind}s free"
    nodes = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    shared = {a for a in nodes.values() if list(nodes.values()).count(a) > 1}

    def name(node: str) -> str:
        address = nodes.get(node, "?")
        return f"{address} ({node[:8]})" if address in shared else address

    order = sorted(per_node, key=lambda node: (nodes.get(node, "?"), node))
    if of is None:
        return f"{kind}s per node: " + ", ".join(f"{per_node[node]} on {name(node)}"
                                                 for node in order)
    return f"free {kind}s per node: " + ", ".join(
        f"{per_node[node]} of {of.get(node, 0)} on {name(node)}" for node in order)


class Placement:
    """The run's devices: one placement group per topology group of M ranks, each packed onto
    one node (STRICT_PACK), so that the intra group of a rank is always its node's. Rank r is
    bundle r % M of group r // M.

    One placement group of N bundles packed as tightly as Ray could manage (PACK) split a group
    over two nodes whenever no node had M devices free, and its "intra" bytes then crossed nodes
    under that name; a group that cannot be placed on one node now waits, saying so."""

    def __init__(self, groups: list[PlacementGroup], nodes: list[str]) -> None:
        self.groups = groups
        self.group_size = len(nodes) // len(groups)
        self.nodes = nodes  # the Ray node id of each rank

    def strategy(self, rank: int) -> PlacementGroupSchedulingStrategy:
        """Where rank ``rank`` of every model runs."""
        return PlacementGroupSchedulingStrategy(
            placement_group=self.groups[rank // self.group_size],
            placement_group_bundle_index=rank % self.group_size)

    def lost_node(self, rank: int) -> str | None:
        """'node ADDRESS (Ray node ID, ranks ...)' when Ray lost rank ``rank``'s node, else
        None."""
        return self._lost(self.nodes[rank], ray.nodes())

    def lost(self) -> tuple[int, str] | None:
        """The first rank on a node of the run that Ray lost and ``lost_node``'s line for it,
        or None."""
        known = ray.nodes()
        for node in dict.fromkeys(self.nodes):
            line = self._lost(node, known)
            if line is not None:
                return self.nodes.index(node), line
        return None

    def _lost(self, node: str, known: list[dict[str, Any]]) -> str | None:
        """A node is lost when Ray marked it dead or its raylet does not take a connection:
        Ray marks a node dead only once its heartbeats time out, seconds after the workers on
        it fail, or, under load, much later."""
        info = next((n for n in known if n["NodeID"] == node), None)
        if info is None:
            return None
        address = info["NodeManagerAddress"]
        if info["Alive"]:
            try:
                socket.create_connection((address, info["NodeManagerPort"]),
                                         timeout=CONNECT_S).close()
                return None
            except OSError:
                pass
        ranks = [r for r, n in enumerate(self.nodes) if n == node]
        if len(ranks) == 1:
            which = f"rank {ranks[0]}"
        elif len(ranks) > 2 and ranks[-1] - ranks[0] == len(ranks) - 1:
            which = f"ranks {ranks[0]}-{ranks[-1]}"
        else:
            which = f"ranks {', '.join(map(str, ranks[:-1]))} and {ranks[-1]}"
        return f"node {address} (Ray node {node[:8]}, {which} of every model)"

    def remove(self) -> None:
        for pg in self.groups:
            ray.util.remove_placement_group(pg)


def place(num_devices: int, group_size: int, use_gpu: bool, timeout_s: float | None = None,
          stop: Callable[[], bool] | None = None, say: Callable[[str], None] = print
          ) -> Placement:
    """Reserve ``num_devices`` devices in groups of ``group_size`` on one node each.

    Devices other jobs hold are waited for, for ``timeout_s`` seconds at most (None: no limit):
    a line through ``say`` says what the run waits for (free devices per node) after a first
    poll when the cluster's free devices fell short as it began (else after ``NOTE_S``), and
    the ``ConfigError`` at the end (``cluster.num_devices``) says it again. ``stop()`` true
    ends the wait within ``POLL_S`` (``StopRequested``). A cluster that can never hold them is
    ``missing_devices``' to say.
    """
    kind = "GPU" if use_gpu else "CPU"
    bundle = {"CPU": 1, **({"GPU": 1} if use_gpu else {})}
    num_groups = num_devices // group_size
    need = f"{num_devices} {kind}s" + (f" in {num_groups} groups of {group_size} on one node "
                                       "each" if num_groups > 1 else " on one node")
    limit = "no limit" if timeout_s is None else f"ray.placement_timeout_s={timeout_s:g}"
    total = _devices(kind, free=False)
    # Free before the run reserves any: too few, and the run says so after its first poll.
    short = _groups_fit(_devices(kind, free=True), group_size) < num_groups
    groups = [placement_group([dict(bundle) for _ in range(group_size)], strategy="STRICT_PACK")
              for _ in range(num_groups)]
    start = time.monotonic()
    noted = False
    try:
        readies = [pg.ready() for pg in groups]
        pending = list(readies)
        while pending:
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=POLL_S)
            if not pending:
                break
            waited = time.monotonic() - start
            if stop is not None and stop():
                raise StopRequested
            over = timeout_s is not None and waited >= timeout_s
            if over or not noted and (short or waited >= NOTE_S):
                free = _devices(kind, free=True)
                for pg, ref in zip(groups, readies):
                    if ref not in pending:  # reserved by this run: free for it
                        node = placement_group_table(pg)["bundles_to_node_id"][0]
                        free[node] = free.get(node, 0) + group_size
                if over:
                    raise ConfigError("cluster.num_devices", f"the run's {need} were not free "
                                      f"within {limit} ({_per_node_text(free, kind, total)}); "
                                      "allowed: fewer devices, or a longer timeout while other "
                                      "jobs hold them")
                say(f"waiting for {need} ({_per_node_text(free, kind, total)}; {limit})")
                noted = True
    except BaseException:
        for pg in groups:
            ray.util.remove_placement_group(pg)
        raise
    nodes = []
    for g, pg in enumerate(groups):
        on = placement_group_table(pg)["bundles_to_node_id"]
        group_nodes = [on[b] for b in range(group_size)]
        if len(set(group_nodes)) > 1:  # STRICT_PACK promises one node; say so if it broke that
            ranks = range(g * group_size, (g + 1) * group_size)
            raise RuntimeError(f"ranks {', '.join(map(str, ranks))} of one group of "
                               f"cluster.group_size={group_size} were placed on nodes "
                               f"{', '.join(n[:8] for n in group_nodes)}, not on one")
        nodes.extend(group_nodes)
    return Placement(groups, nodes)


def bundle_share(cfg: Any) -> float:
    """The fraction of a bundle (a device) each model's rank takes: the run's models share every
    device equally."""
    return 1.0 / len(algorithms.roles(cfg))


@contextlib.contextmanager
def phase(line: str, say: Callable[[str], None]) -> Iterator[None]:
    """A phase of the run's start: ``line`` through ``say`` (from a timer thread, once) when it
    goes on for more than ``NOTE_S`` seconds, so that a start that takes long says what it
    waits for; nothing when it is quick."""
    timer = threading.Timer(NOTE_S, say, [line])
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


class Call(NamedTuple):
    """One rank's remote call, as the driver issued it: what a hang is traced back to."""

    ref: ray.ObjectRef  # its (first) result
    role: str
    rank: int
    method: str


class ModelGroup:
    """N Ray actors of one worker class, rank r where ``placement`` puts it, in one process group.

    Every call is appended to ``issued`` (shared by the run's groups, so in the order issued),
    which the trainer clears once a step's calls are done (``get``, [Note: naming a hang]).
    """

    def __init__(self, worker_cls: type, role: str, cfg: Any, placement: Placement,
                 use_gpu: bool, issued: list[Call] | None = None,
                 share: float | None = None) -> None:
        self.role = role
        self.num_ranks = len(placement.nodes)
        self.issued = [] if issued is None else issued
        remote_cls = ray.remote(worker_cls)
        # The fraction of its bundle each rank takes (``bundle_share``; a rollout replica has
        # its device to itself).
        share = bundle_share(cfg) if share is None else share
        self.workers = [
            remote_cls.options(
                num_cpus=share,
                num_gpus=share if use_gpu else 0,
                scheduling_strategy=placement.strategy(rank),
            ).remote(cfg, role, rank, self.num_ranks)
            for rank in range(self.num_ranks)
        ]

    def rendezvous(self) -> list[ray.ObjectRef]:
        """Start every rank's process-group init and model build; returns refs to wait on, which
        give each rank's process id.

        Rank 0 serves the store first; the other ranks get its address before any of them
        connects.
        """
        addr, port = ray.get(self.workers[0].serve_rendezvous.remote())
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

    def run(self, method: str, step: int, returns: tuple[str, ...] = (),
            keeps: tuple[str, ...] = (), takes: tuple[str, ...] = (),
            *after: Sequence[Any], sent: dict[str, Sequence[Any]] | None = None,
            common: dict[str, Any] | None = None) -> list[Any]:
        """One call of step ``step``'s plan on every rank (``Worker.run``): ``sent`` the values
        that travel to it, one per rank (refs or values), ``common`` values for every rank;
        ``after``: values it waits for without reading them, one per rank. Returns one ref per
        rank, or a tuple of ``len(returns)`` refs per rank."""
        sent = sent or {}
        count = max(len(returns), 1)
        refs = [w.run.options(num_returns=count).remote(
                    method, step, returns, keeps, takes, *(values[r] for values in after),
                    **{name: values[r] for name, values in sent.items()}, **(common or {}))
                for r, w in enumerate(self.workers)]
        self.issued.extend(Call(ref[0] if count > 1 else ref, self.role, r, method)
                           for r, ref in enumerate(refs))
        return refs

    @staticmethod
    def put(value: Any) -> Any:
        """``value`` in the object store, for the ranks to read (a dealt rollout)."""
        return ray.put(value)

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w)  # at once, even in a collective that waits for a dead peer


class WorkerError(RuntimeError):
    """Rank ``rank`` of model ``role`` died or raised; ``str()`` is one line. ``node``: the
    node Ray lost, which the rank died with (``Placement.lost_node``), or None."""

    def __init__(self, role: str, rank: int, died: bool, reason: str,
                 cause: BaseException | None = None, node: str | None = None) -> None:
        self.role, self.rank, self.died, self.reason, self.cause = role, rank, died, reason, cause
        self.node = node
        super().__init__(f"{node} was lost" if node else
                         f"{role} rank {rank} {'died' if died else 'raised'} ({reason})")


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
        pids: dict[str, list[int]] | None = None, stop: Callable[[], bool] | None = None,
        placements: dict[str, Placement] | None = None) -> dict[str, list[Any]]:
    """The results of ``calls`` (model -> one ref per rank), like ``ray.get``, except that the
    first failure is raised as soon as it is known: the failed rank's peers may wait for it in a
    collective for good, so waiting for every ref would hang. ``workers`` (model -> actor handle
    per rank) names a dead worker whose death reaches us through another model's call.

    After ``timeout_s`` seconds (None: never) without every result, raises ``NoAnswerError``
    naming the rank that holds the others up, traced through ``issued`` (the calls in flight,
    in the order issued) and ``pids`` (model -> process id per rank). [Note: naming a hang]
    Raises ``StopRequested`` within a second once ``stop()`` is true.

    Raises ``WorkerError``, naming the node when Ray lost one of ``placements``' (model ->
    where its ranks run): that of a
    dead rank, or one found lost every ``PROBE_S`` of a long wait, since the calls on a lost
    node may fail only once Ray marks it dead (minutes, on a loaded machine); a
    ``ConfigError`` a worker raised (a user's mistake it found) and a ``KeyboardInterrupt``
    come through as themselves.
    """
    owner = {ref: (role, rank) for role, refs in calls.items() for rank, ref in enumerate(refs)}
    results: dict[str, list[Any]] = {role: [None] * len(refs) for role, refs in calls.items()}
    pending = list(owner)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    probe = time.monotonic() + PROBE_S
    while pending:
        if deadline is not None and time.monotonic() >= deadline:
            raise _no_answer(pending, owner, issued, pids or {}, timeout_s)
        if stop is not None and stop():
            raise StopRequested
        if placements and time.monotonic() >= probe:
            for role, placement in placements.items():
                lost = placement.lost()
                if lost is not None:
                    rank, line = lost
                    raise WorkerError(role, rank, True, "its node was lost", node=line)
            probe = time.monotonic() + PROBE_S
        done, pending = ray.wait(pending, num_returns=len(pending), timeout=POLL_S)
        failures = []
        for ref in done:
            role, rank = owner[ref]
            try:
                results[role][rank] = ray.get(ref)
            except RayError as err:
                failures.append((err, role, rank))
        if failures:
            raise _failure(failures, pending, owner, workers, placements) from None
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
             owner: dict[ray.ObjectRef, tuple[str, int]], workers: dict[str, list[Any]],
             placements: dict[str, Placement] | None = None) -> BaseException:
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
                                                 "crashed",
                               node=placements[role].lost_node(rank)
                               if placements and role in placements else None)
    err, role, rank = failures[0]
    lines = str(cause).strip().splitlines()
    reason = f"{type(cause).__name__}: {lines[0]}" if lines else type(cause).__name__
    return WorkerError(role, rank, False, reason, cause)


def _cause(err: RayError) -> BaseException:
    """What the worker raised (a RayTaskError wraps it), or the Ray error itself."""
    return vars(err).get("cause") or err
