"""What every test shares.

- What the entry points do before they read a command line, done for every test: ``${demo:NAME}``
  in the confs names the demo's assets (``rlhf_paro.cli.register_demo_resolver``).
- One Ray cluster for the job tests (``shared_ray``): a run that joins it (``ray.address``)
  skips starting and stopping a Ray of its own, about half of what a small run costs beyond its
  workers. Runs stay apart by output directory and Ray job; a test about Ray's own start-up (a
  refused address, token authentication, a lost node), one whose workers must read the
  driver's environment (``train(..., private=True)``) and an in-process ``PPOTrainer`` keep a
  private Ray. The workers of the shared cluster fork from a process that has imported what a
  worker imports, as those of every private Ray do (``actors/group.py``,
  ``preloaded_workers``); every job test shares one demo cache (``demo_cache``).
- ``train``: ``python -m rlhf_paro.train`` on the tiny job, as a user runs it, with the faults
  the job tests inject (a killed worker or driver, a signal during a save, a NaN loss), and what
  it left: rows, the one error line, processes still alive. A joined run's driver forks from a
  process that has already imported what a driver imports (``rlhf_paro/actors/zygote.py``),
  with the environment it imported in: about 5 s less a run.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Callable, Iterator, NamedTuple

from rlhf_paro.actors import checkpoint
from rlhf_paro.actors.group import preloaded_workers
from rlhf_paro.actors.worker import NAN_LOSS_ENV
from rlhf_paro.actors.zygote import Driver, Zygote
from rlhf_paro.cli import register_demo_resolver
from rlhf_paro.metrics import read_jsonl

register_demo_resolver()

# The tiny job of tests/actors/test_ppo_job.py: one optimizer step per model per PPO step.
SMALL = ["task.model.hidden_size=32", "task.model.intermediate_size=64", "task.sft_steps=10",
         "task.train_prompts=64", "task.val_prompts=8",
         "actor.micro_batch_size=1", "critic.micro_batch_size=1", "reward.micro_batch_size=2",
         "ref.micro_batch_size=1", "ppo.rollout_batch_size=8", "ppo.mini_batch_size=8",
         "ppo.ppo_epochs=1", "task.reward_pairs=256", "task.reward_eval_pairs=64",
         "task.reward_steps=20", "logger.wandb.mode=disabled", "logger.progress=false"]
# Every process a run starts (a private Ray's included) inherits the environment: a mark in it
# finds them.
MARK = "RLHF_PARO_TEST_RUN"
# CPU slots of the shared cluster: a slot is a device's placement, not a core (the largest job
# test asks for 4 devices and 2 of a rollout's own), with room for a run whose workers Ray is
# still stopping when the next one places its own.
SHARED_SLOTS = 16
# Seconds Ray has to stop a joined run's workers after its driver exits (the job's end reaches
# the raylet through the GCS; a private Ray stops them before its driver exits).
SHARED_STOP_S = 10.0

# Ports of the shared cluster's workers: below Linux's ephemeral range (32768-60999), where a
# model's rank 0 draws its rendezvous port (``Worker.serve_rendezvous``) and the transfer groups
# theirs; and apart from Ray's default range (10002-19999), which a private Ray's workers take.
# Ray's test Cluster otherwise lets its workers listen on ephemeral ports, and one took a
# rendezvous port once, when rank 0 still released it until its process group listened on it
# (EADDRINUSE at a model's setup).
WORKER_PORTS = (20000, 29999)

_shared: dict[str, object] = {}


@contextlib.contextmanager
def _loopback_without_auth() -> Iterator[None]:
    """The environment the shared cluster starts in: loopback addresses only (as
    ``actors/group.py`` starts a private Ray) and no token authentication, which a driver of
    another process would otherwise need the cluster's token for."""
    import ray

    saved = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
    constants = ray._private.ray_constants
    enabled = constants.ENABLE_RAY_CLUSTER
    os.environ.update(RAY_AUTH_MODE="disabled", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        constants.ENABLE_RAY_CLUSTER = enabled
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def shared_ray() -> str:
    """The address of this session's Ray cluster, started on first use and stopped when the
    session ends (``pytest_sessionfinish``)."""
    if "address" not in _shared:
        from ray.cluster_utils import Cluster

        # Its workers fork from this session's zygote, as a run's on its own machine do.
        with _loopback_without_auth(), preloaded_workers():
            cluster = Cluster(initialize_head=True, head_node_args={
                "num_cpus": SHARED_SLOTS, "include_dashboard": False,
                "node_ip_address": "127.0.0.1", "object_store_memory": 1 << 30,
                "min_worker_port": WORKER_PORTS[0], "max_worker_port": WORKER_PORTS[1]})
        _shared.update(cluster=cluster, address=cluster.address)
    return str(_shared["address"])


def shared_env() -> dict[str, str]:
    """This process's environment for a driver that joins the shared cluster."""
    return {**os.environ, "RAY_ADDRESS": shared_ray(),
            "RAY_AUTH_MODE": "disabled", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


# What a driver imports before it starts its workers (``python -X importtime -m
# rlhf_paro.train``): imported once by the zygote its drivers fork from.
DRIVER_PRELOAD = ["rlhf_paro.train", "rlhf_paro.trainer", "rlhf_paro.resolve", "rlhf_paro.runs",
                  "rlhf_paro.report", "rlhf_paro.ppo.demo", "rlhf_paro.sources",
                  "rlhf_paro.plan", "transformers", "transformers.utils.type_validators",
                  "transformers.models.auto", "tokenizers", "datasets", "deepspeed",
                  "matplotlib", "matplotlib.pyplot", "safetensors.torch"]


def _zygote() -> Zygote:
    """The process a joined run's driver forks from (``rlhf_paro/actors/zygote.py``), started on
    first use with the environment of a joined run."""
    if "zygote" not in _shared:
        _shared["zygote"] = Zygote(DRIVER_PRELOAD, shared_env())
    return _shared["zygote"]  # type: ignore[return-value]


def pytest_sessionfinish(session, exitstatus) -> None:  # noqa: ARG001 - pytest's signature
    cluster = _shared.pop("cluster", None)
    if cluster is not None:
        cluster.shutdown()
    zygote = _shared.pop("zygote", None)  # after the cluster: no driver asks any more
    if zygote is not None:
        zygote.close()
    cache = _shared.pop("demo_cache", None)
    if cache is not None:
        shutil.rmtree(cache, ignore_errors=True)


class Run(NamedTuple):
    out: Path
    returncode: int
    stdout: str
    stderr: str
    rows: list[dict]
    exit_s: float  # seconds from the kill (or from the start) to the driver's exit
    left: list[str]  # processes of the run still alive after it exited
    watched: list[str] = []  # what ``watch`` found while the run went on


def demo_cache() -> Path:
    """The demo's assets of this session (``task.cache_dir``), shared by every job test: made
    once for each task (the cache keys them by everything they depend on,
    ``rlhf_paro.ppo.demo.cache_key``): its models are trained once, not once per module."""
    if "demo_cache" not in _shared:
        _shared["demo_cache"] = Path(tempfile.mkdtemp(prefix="rlhf-paro-demo-"))
    return _shared["demo_cache"]  # type: ignore[return-value]


def train(out: Path, *args: str, cache: Path, nan_loss: str | None = None,
          kill_after_step: int | None = None, kill: signal.Signals = signal.SIGKILL,
          kill_driver: bool = False, kill_in_save: int | None = None,
          watch: Callable[[str], list[str]] | None = None,
          kill_role: tuple[str, int] = ("actor", 1), private: bool = False) -> Run:
    """``python -m rlhf_paro.train`` on the tiny job, joining the shared cluster (``private``:
    a Ray of its own; implied by ``nan_loss`` and ``watch``, whose workers must carry the
    driver's environment); with ``kill_after_step``, SIGKILL actor rank 1 (``kill``: another
    signal; ``kill_role``: another (role, rank); ``kill_driver``: the driver instead) once that
    step's row is logged (its pid from the run's workers.json); with ``kill_in_save``, send
    ``kill`` to the driver while the checkpoint of that step is being written (its scratch
    directory exists; the run's ``watched`` says whether it still did once the signal was
    sent); ``nan_loss`` (``role:rank:step``): that worker's loss is NaN at that step;
    ``watch(mark)`` is called every half second while the run goes on, and what it returns is
    collected."""
    mark = uuid.uuid4().hex
    private = private or nan_loss is not None or watch is not None
    env = {**(os.environ if private else shared_env()), MARK: mark}
    env.pop(NAN_LOSS_ENV, None)
    if nan_loss:
        env[NAN_LOSS_ENV] = nan_loss
    argv = [*SMALL, f"task.cache_dir={cache}", f"trainer.output_dir={out}", *args]
    proc: subprocess.Popen | Driver
    if private:  # a fresh interpreter: what Ray reads at import is this environment's
        proc = subprocess.Popen([sys.executable, "-m", "rlhf_paro.train", *argv], env=env,
                                cwd=out.parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    else:
        proc = _zygote().run("rlhf_paro.train", argv, env, out.parent)
    watched: list[str] = []
    if watch is not None:
        def sample() -> None:
            while proc.poll() is None:
                watched.extend(watch(mark))
                time.sleep(0.5)

        threading.Thread(target=sample, daemon=True).start()
    start = time.monotonic()
    if kill_after_step is not None:
        while proc.poll() is None and kill_after_step not in _steps(out):
            time.sleep(0.1)
        if proc.poll() is not None:  # ended before that step: its own error says why
            stdout, stderr = proc.communicate()
            raise AssertionError(f"the run ended (exit {proc.returncode}) before step "
                                 f"{kill_after_step} was logged:\n{stdout[-2000:]}\n"
                                 f"{stderr[-3000:]}")
        role, rank = kill_role
        target = proc.pid if kill_driver else _workers(out)[role][rank]
        os.kill(target, kill)
        start = time.monotonic()
    if kill_in_save is not None:
        pattern = f"{checkpoint.CHECKPOINTS}/.step_{kill_in_save}-*"
        while proc.poll() is None and not list(out.glob(pattern)):
            time.sleep(0.002)
        assert proc.poll() is None, f"the run ended before its save of step {kill_in_save}"
        os.kill(proc.pid, kill)
        start = time.monotonic()
        if list(out.glob(pattern)):  # published with a rename: still there, still saving
            watched.append("signalled during the save")
    stdout, stderr = proc.communicate(timeout=900)
    exit_s = time.monotonic() - start
    left = _left(mark, _workers(out), 2.0 if private else SHARED_STOP_S)
    return Run(out, proc.returncode, stdout, stderr, rows(out), exit_s, left,
               sorted(set(watched)))


def _workers(out: Path) -> dict[str, list[int]]:
    """The run's worker pids by role (its workers.json; none before the workers started)."""
    path = out / "workers.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _left(mark: str, workers: dict[str, list[int]], grace_s: float) -> list[str]:
    """The run's processes still alive ``grace_s`` after its driver exited (what a shutdown
    stops has that long to go); sooner when none is left. Its processes: those that carry its
    mark, and its workers by pid (a joined cluster's workers are the raylet's children, so they
    carry the cluster's environment, not the run's)."""
    pids = [pid for pids in workers.values() for pid in pids]
    deadline = time.monotonic() + grace_s
    while (found := marked(mark) + _alive(pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


def _alive(pids: list[int]) -> list[str]:
    """The command lines of those of ``pids`` still running as Ray workers (a zombie has
    exited; a pid taken again by another program is not the run's)."""
    found = []
    for pid in pids:
        try:
            stat, cmd = Path(f"/proc/{pid}/stat").read_text(), _cmdline(pid)
        except OSError:  # gone
            continue
        if stat.rsplit(")", 1)[1].split()[0] != "Z" and cmd.startswith("ray::"):
            found.append(cmd)
    return found


def rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return read_jsonl(str(path)) if path.is_file() else []


def _steps(out: Path) -> list[int]:
    try:
        return [row["step"] for row in rows(out)]
    except ValueError:  # a line being written
        return []


def marked(mark: str) -> list[str]:
    """The command lines of the processes that carry ``mark`` in their environment."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if f"{MARK}={mark}".encode() in Path(f"/proc/{pid}/environ").read_bytes():
                found.append(_cmdline(pid))
        except OSError:  # gone meanwhile, or not ours to read
            pass
    return found


def _cmdline(pid: int | str) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes()[:80].decode(errors="replace")


def error_line(run: Run) -> str:
    """The one line a run that stopped printed; nothing else of ours, no traceback."""
    ours = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert len(ours) == 1 and run.stderr.strip().splitlines()[-1] == ours[0], run.stderr
    assert "Traceback" not in run.stderr
    return ours[0]


def fixed_rollout(vocab: int, pad: int):
    """A GRPO rollout of 8 sequences (4 prompts x 2 samples) for a worker's step without a
    rollout engine: prompts of 4 random tokens (a fixed seed), responses of 3 to 6."""
    import torch

    from rlhf_paro.rollout import RolloutBatch

    lengths = [6, 3, 5, 6, 4, 6, 6, 5]
    action = torch.tensor([[1.0] * r + [0.0] * (6 - r) for r in lengths])
    mask = torch.cat([torch.ones(8, 4, dtype=torch.long), action.long()], 1)
    ids = torch.randint(3, vocab, mask.shape, generator=torch.Generator().manual_seed(0))
    return RolloutBatch(torch.where(mask.bool(), ids, pad), mask, action)


def compared(row: dict) -> dict:
    """What two runs of the same arithmetic must agree on: the loop's metrics, losses and
    gradient norms (not times, bytes or memory)."""
    return {k: v for k, v in row.items()
            if k.startswith("ppo/") or k.endswith(("/loss", "/grad_norm"))}
