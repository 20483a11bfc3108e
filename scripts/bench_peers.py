"""Step time of the PaRO engine against DeepSpeed ZeRO and PyTorch FSDP2, pair by pair.

    python scripts/bench_peers.py                          # 7 pairs, 4 ranks as 2 x 2
    python scripts/bench_peers.py --contenders zero3,fsdp_full --rounds 5 --profile zero3
    python scripts/bench_peers.py --contenders zero2,zero2@2544b5e   # against an older engine
    python scripts/emulate_cluster.py --nodes 2 --gpus-per-node 2 -- \\
        python scripts/bench_peers.py

Pairs (PaRO strategy against the peer a user would pick instead):

  zero1        NNG  DeepSpeed ZeRO-1
  zero2        NGG  DeepSpeed ZeRO-2
  zero3        GGG  DeepSpeed ZeRO-3
  hpz          IGG  DeepSpeed ZeRO-3 + hpZ, zero_hpz_partition_size = M
  fsdp_full    GGG  FSDP2 fully_shard per decoder block + root, on a 1-D mesh of all ranks
  fsdp_hybrid  III  FSDP2 on the (g, M) mesh: replicated across groups, sharded within one
  fsdp_gradop  NGG  FSDP2 with reshard_after_forward=False (SHARD_GRAD_OP)

Every run builds the same Llama from the same seed and trains it on the same batches: s
micro-batches per optimizer step, loss / s, AdamW (lr 1e-4, torch's defaults otherwise, torch's
AdamW on every side), clipping at 1.0, fp32. How each side accumulates its s micro-batches:

  - PaRO reduce-scatters each micro-batch's gradient to the G level and adds it up there; the
    boundary reduces the sum to the OS level (sharding/schedule.py).
  - DeepSpeed runs its own schedule with its default buckets. DeepSpeed keeps parameters under
    1e5 elements whole on every rank by default; ZeRO-3 and hpZ run with
    stage3_param_persistence_threshold 0, so that they partition every parameter, as GGG and
    IGG do.
  - FSDP2 reduce-scatters every micro-batch (set_requires_gradient_sync stays on) into sharded
    gradients. fsdp_hybrid all-reduces across groups on the last micro-batch only
    (set_requires_all_reduce), as III does once per step; fsdp_gradop keeps the parameters
    gathered until the last micro-batch's backward (set_reshard_after_backward), one all-gather
    per step as NGG's replicated parameters need. FSDP2 clips with clip_grad_norm_ on its
    DTensor parameters.

All runs of a job share one process group. Every round runs each of them (a fresh model,
--warmup steps, then --steps timed steps) in a rotating order, so that drift on the machine hits
all alike; a strategy that two pairs share (NGG, GGG) runs once per round and serves both. A
step's time is the slowest rank's. Rank 0 prints per run the median over all rounds, the median
CPU time, the bytes sent in the last step on intra and inter links (mean over ranks; PaRO and
DeepSpeed meter them, FSDP2 does not) and rank 0's last loss (equal on both sides of a pair up
to rounding, as the same training gives), then per pair the ratio ours/peer of both times and
the wall ratio against the goal: at most 0.9x DeepSpeed's time, at most 1.0x FSDP2's.
``--profile PAIR`` then profiles both sides of one pair for --steps steps and prints rank 0's
operators by self time.

Next to the wall time, every step's CPU time: the user and system seconds that all ranks spent
in it (``getrusage``, summed over the ranks). Wall time is what the goals are stated in, on a quiet
machine; CPU time is what stays put when the machine is not quiet: a rank that other work keeps
off the cores uses none while it waits, so a loaded machine moves wall ratios far more than CPU
ratios, and what a step does costs the same CPU either way (page faults show as system time, the
sys % of a run). CPU time does not see waiting: a slow link, a sleep, a rank idle on a
collective. The tables give per run the median CPU ms per step and per pair both ratios.

Contenders of other engines: ``NAME@REV`` runs pair NAME on the engine of git revision REV (its
files extracted into a temporary folder), and ``--python A,B`` runs every contender under
each interpreter (another environment: other transformers or torch releases). Two revisions of
the package cannot share a process, so then every (revision, interpreter) is a job of its own:
this script again, under that interpreter, with that revision's package first on PYTHONPATH and
the harness (this script, ``bench_engine``) always the working tree's, so that every engine is
measured the same way. Round r runs each job for one round, in an order that rotates per round;
the tables put all jobs side by side (``zero2@2544b5e py2``: pair zero2, revision 2544b5e, the
second interpreter; no ``@``: the working tree).

    python scripts/bench_peers.py --contenders zero2,zero2@2544b5e \\
        --python /path/to/env-a/bin/python,/path/to/env-b/bin/python

``--json FILE`` writes every step time and the pair ratios (``scripts/check_peers.py`` reads
them). ``--slow-collectives-ms MS`` is for testing that check: every collective of the PaRO
engine sleeps MS first, an engine slowed on purpose (the peers' are untouched).
``--free-collectives`` measures the opposite end: every collective of the PaRO engine does only
this rank's own part and sends nothing, so our step takes what it would if moving bytes between
ranks cost nothing. Our results are wrong then (each rank trains on its own gradient), so the
losses are not comparable; the ratios are the floor that no transport or algorithm can go below
on this machine, and the distance from them to the ratios of a normal run is what our
communication costs there.

Runs on --world local ranks by default, or as one rank of a launched job (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT in the environment, and GROUP_SIZE = M as ``emulate_cluster.py`` sets
it; --group-size otherwise); jobs of other revisions or interpreters spawn their own local ranks.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# The model, built as bench_engine builds it, and an old revision's files, as bench_ppo takes
# them (this script's folder is on the path when it runs).
from bench_engine import _model
from bench_ppo import source_tree

OPTIM = dict(lr=1e-4)
MAX_GRAD_NORM = 1.0
GOALS = {"DeepSpeed": 0.9, "FSDP2": 1.0}  # ours / peer at most this
ROOT = Path(__file__).resolve().parents[1]

# [Note: DeepSpeed's linear]
# DeepSpeed's ZeRO-3 replaces torch.nn.functional.linear with its own autograd function,
# process-wide and for good; every run after it would train through that one. Each run puts
# torch's back when it ends, and the next ZeRO-3 run installs DeepSpeed's again.
_TORCH_LINEAR = torch.nn.functional.linear


@dataclass(frozen=True)
class Pair:
    ours: str  # the PaRO strategy
    system: str  # a key of GOALS
    peer: str  # the peer's name in the tables
    options: dict[str, Any] = field(default_factory=dict)  # how _engine builds the peer

    @property
    def goal(self) -> float:
        return GOALS[self.system]


PAIRS: dict[str, Pair] = {
    "zero1": Pair("NNG", "DeepSpeed", "DeepSpeed ZeRO-1", dict(zero_stage=1)),
    "zero2": Pair("NGG", "DeepSpeed", "DeepSpeed ZeRO-2", dict(zero_stage=2)),
    "zero3": Pair("GGG", "DeepSpeed", "DeepSpeed ZeRO-3", dict(zero_stage=3)),
    "hpz": Pair("IGG", "DeepSpeed", "DeepSpeed ZeRO-3+hpZ", dict(zero_stage=3, hpz=True)),
    "fsdp_full": Pair("GGG", "FSDP2", "FSDP2 full shard", dict(mesh="world")),
    "fsdp_hybrid": Pair("III", "FSDP2", "FSDP2 hybrid shard", dict(mesh="groups")),
    "fsdp_gradop": Pair("NGG", "FSDP2", "FSDP2 grad-op", dict(mesh="world", gradop=True)),
}


@dataclass(frozen=True)
class Job:
    """The runs of one process group: the engine of one revision under one interpreter."""

    revision: str | None  # git revision of the engine; None: the working tree
    python: str  # the interpreter
    python_label: str  # "py1", "py2"... in the order of --python; "" with one interpreter
    pairs: tuple[str, ...]  # the pairs it runs

    @property
    def label(self) -> str:
        """What the tables append to a run or pair name: ``@REV`` and the interpreter."""
        at = f"@{self.revision}" if self.revision else ""
        return at + (f" {self.python_label}" if self.python_label else "")


def parse_contenders(text: str) -> list[tuple[str, str | None]]:
    """``zero2,zero2@2544b5e`` as (pair, revision) in order, each once; revision None: the
    working tree. A ValueError names what is wrong and what is allowed."""
    contenders: list[tuple[str, str | None]] = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, at, revision = item.partition("@")
        if name not in PAIRS:
            raise ValueError(f"--contenders: unknown pair {name!r} in {item!r}; allowed: "
                             f"{', '.join(PAIRS)}, each optionally @REVISION")
        if at and not revision:
            raise ValueError(f"--contenders: {item!r} names no revision after '@'")
        if (name, revision or None) not in contenders:
            contenders.append((name, revision or None))
    if not contenders:
        raise ValueError(f"--contenders: empty; allowed: {', '.join(PAIRS)}, each optionally "
                         f"@REVISION")
    return contenders


def plan_jobs(contenders: list[tuple[str, str | None]], pythons: list[str]) -> list[Job]:
    """One job per revision and interpreter, revisions in the order the contenders name them:
    every revision's pairs run under every interpreter."""
    revisions = list(dict.fromkeys(revision for _, revision in contenders))
    labels = [f"py{i + 1}" for i in range(len(pythons))] if len(pythons) > 1 else [""]
    return [Job(revision, python, label,
                tuple(name for name, rev in contenders if rev == revision))
            for revision in revisions for python, label in zip(pythons, labels)]


def _slow_collectives(ms: float) -> None:
    """Every collective of the PaRO engine sleeps ``ms`` before it runs: an engine slowed on
    purpose, which ``check_peers.py`` must flag. The dry run (cost model) keeps its own."""
    from rlhf_paro.comm.collectives import Communicator

    for name in ("all_gather", "reduce_scatter", "all_reduce"):
        def slowed(self: Any, *args: Any, _run: Any = getattr(Communicator, name),
                   **kwargs: Any) -> Any:
            time.sleep(ms / 1e3)
            return _run(self, *args, **kwargs)
        setattr(Communicator, name, slowed)


def _free_collectives() -> None:
    """Every collective of the PaRO engine does only this rank's own part, without a message:
    an all-gather copies the rank's shard to its place in the output (the other places keep
    what they held), a reduce-scatter keeps the rank's own chunk of its unreduced buffer, an
    all-reduce leaves the buffer as it is. Nothing is metered. The peers' collectives are
    untouched; the dry run (cost model) keeps its own."""
    from rlhf_paro.comm.collectives import Communicator, Pending, _done

    def own(comm: Any, scope: str, chunk: int, total: int) -> slice:
        """This rank's chunk of a scope's buffer: its place in the scope's order, clipped to a
        buffer short of a padded tail."""
        topo = comm.topo
        index = {"world": topo.chunk_index(), "intra": topo.local_index,
                 "inter": topo.group_index}[scope]
        lo = min(index * chunk, total)
        return slice(lo, min(lo + chunk, total))

    def all_gather(self: Any, out: torch.Tensor, shard: torch.Tensor, scope: str, phase: str,
                   async_op: bool = False) -> Pending:
        flat = out.view(-1)
        place = own(self, scope, shard.numel(), flat.numel())
        flat[place].copy_(shard.reshape(-1)[:place.stop - place.start])
        return _done()

    def reduce_scatter(self: Any, out: torch.Tensor, full: torch.Tensor, scope: str,
                       phase: str, async_op: bool = False, overwrite: bool = False) -> Pending:
        flat, mine = full.reshape(-1), out.view(-1)
        place = own(self, scope, mine.numel(), flat.numel())
        kept = place.stop - place.start
        mine[:kept].copy_(flat[place])
        mine[kept:].zero_()
        return _done()

    def all_reduce(self: Any, buf: torch.Tensor, scope: str, phase: str,
                   async_op: bool = False) -> Pending:
        return _done()

    Communicator.all_gather = all_gather
    Communicator.reduce_scatter = reduce_scatter
    Communicator.all_reduce = all_reduce


class FSDP2:
    """A model under FSDP2's ``fully_shard`` (each decoder block, then the root) behind the
    engine surface: ``engine(**inputs)``, ``backward(loss)`` per micro-batch, ``step()``."""

    meter = None  # FSDP2 counts no bytes

    def __init__(self, model: torch.nn.Module, mesh: Any, micro: int, gradop: bool) -> None:
        from torch.distributed.fsdp import fully_shard

        for block in model.model.layers:
            fully_shard(block, mesh=mesh, reshard_after_forward=not gradop)
        self.model = fully_shard(model, mesh=mesh, reshard_after_forward=not gradop)
        self.optimizer = torch.optim.AdamW(model.parameters(), **OPTIM)
        self.micro = micro
        self.gradop = gradop
        self.hybrid = mesh.ndim == 2
        self._micro_batches = 0  # backward() calls since the last step()

    def __call__(self, **inputs: Any) -> Any:
        # Set before the forward, read at the end of this micro-batch's backward.
        last = self._micro_batches == self.micro - 1
        if self.gradop:
            self.model.set_reshard_after_backward(last)
        if self.hybrid:
            self.model.set_requires_all_reduce(last)
        return self.model(**inputs)

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self.micro).backward()
        self._micro_batches += 1

    def step(self) -> float:
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), MAX_GRAD_NORM)
        self.optimizer.step()
        self.optimizer.zero_grad()
        self._micro_batches = 0
        return float(norm.full_tensor())  # replicated already: no collective


def _engine(run: str, args: argparse.Namespace, topo: Any, world_mesh: Any) -> Any:
    """A fresh model under ``run``: a PaRO strategy, or the peer of a pair."""
    from rlhf_paro.sharding import shard

    model = _model(args)
    if run not in PAIRS:
        return shard(model, run, topo, optim=OPTIM, max_grad_norm=MAX_GRAD_NORM,
                     grad_accum_steps=args.micro, comm=args.comm)
    options = PAIRS[run].options
    if "zero_stage" in options:
        from rlhf_paro.sharding.deepspeed_engine import deepspeed_engine

        stage = options["zero_stage"]
        extra = {"zero_optimization": {"stage3_param_persistence_threshold": 0}} \
            if stage == 3 else None
        return deepspeed_engine(model, topo, zero_stage=stage,
                                hpz_partition_size=topo.group_size if options.get("hpz") else 1,
                                optim=OPTIM, max_grad_norm=MAX_GRAD_NORM,
                                grad_accum_steps=args.micro, extra=extra)
    mesh = topo.mesh if options["mesh"] == "groups" else world_mesh
    return FSDP2(model, mesh, args.micro, options.get("gradop", False))


def _cpu_seconds() -> tuple[float, float]:
    """User and system CPU seconds of this process so far, all its threads (gloo's too)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime, usage.ru_stime


def _steps(engine: Any, ids: torch.Tensor, count: int) -> dict[str, Any]:
    """``count`` optimizer steps: their times (the slowest rank's), their user and system CPU
    seconds (summed over the ranks), the last step's (intra, inter) bytes, mean over ranks
    (None without a meter), and this rank's last loss."""
    times: list[float] = []
    user: list[float] = []
    system: list[float] = []
    loss = None  # --warmup 0: no step, no loss
    for _ in range(count):
        if engine.meter is not None:
            engine.meter.reset()
        dist.barrier()
        cpu_start = _cpu_seconds()
        start = time.perf_counter()
        for k in range(ids.shape[0]):
            with torch.profiler.record_function("forward"):
                loss = engine(input_ids=ids[k], labels=ids[k]).loss
            with torch.profiler.record_function("backward"):
                engine.backward(loss)
        with torch.profiler.record_function("step"):
            engine.step()
        elapsed = torch.tensor([time.perf_counter() - start])
        cpu = torch.tensor([end - begin for end, begin in zip(_cpu_seconds(), cpu_start)],
                           dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        dist.all_reduce(cpu)
        times.append(elapsed.item())
        user.append(cpu[0].item())
        system.append(cpu[1].item())
    sent = None
    if engine.meter is not None:
        t = engine.meter.totals()
        traffic = torch.tensor([t["intra_bytes"], t["inter_bytes"]], dtype=torch.float64)
        dist.all_reduce(traffic)
        sent = (traffic / dist.get_world_size()).tolist()
    return dict(times=times, user=user, system=system, sent=sent,
                loss=None if loss is None else loss.item())


def _label(run: str) -> str:
    return PAIRS[run].peer if run in PAIRS else f"PaRO {run}"


def _cpu_per_step(r: dict[str, Any]) -> list[float]:
    return [u + s for u, s in zip(r["user"], r["system"])]


def pair_rows(jobs: list[Job], results: dict[str, dict[str, dict[str, Any]]]
              ) -> list[dict[str, Any]]:
    """Per pair of every job, both sides' median wall and CPU seconds per step and the ratios
    ours / peer; ``results`` maps a job's label to its runs."""
    rows = []
    for job in jobs:
        for name in job.pairs:
            pair = PAIRS[name]
            ours, peer = results[job.label][pair.ours], results[job.label][name]
            wall = [statistics.median(r["times"]) for r in (ours, peer)]
            cpu = [statistics.median(_cpu_per_step(r)) for r in (ours, peer)]
            rows.append(dict(name=name + job.label, pair=name, revision=job.revision,
                             python=job.python_label or None, ours=pair.ours, peer=pair.peer,
                             ours_s=wall[0], peer_s=wall[1], wall=wall[0] / wall[1],
                             ours_cpu_s=cpu[0], peer_cpu_s=cpu[1], cpu=cpu[0] / cpu[1],
                             goal=pair.goal))
    return rows


def _settings(args: argparse.Namespace, ranks: int, groups: int, group_size: int) -> str:
    changed = ""  # --slow-collectives-ms and --free-collectives exclude each other (main)
    if args.slow_collectives_ms:
        changed = f"; every PaRO collective slowed by {args.slow_collectives_ms:g} ms"
    elif args.free_collectives:
        changed = ("; PaRO's collectives free (--free-collectives: no message, our losses "
                   "wrong, our times a floor)")
    return (f"{ranks} gloo ranks as {groups} groups x {group_size}, comm={args.comm}, fp32, "
            f"s={args.micro} micro-batches of {args.batch} x {args.seq} tokens, "
            f"hidden={args.hidden} layers={args.layers} vocab={args.vocab}; median of "
            f"{args.rounds} rounds x {args.steps} steps (wall: slowest rank per step; CPU: user "
            f"+ system of all ranks per step){changed}")


def _report(settings: str, jobs: list[Job], results: dict[str, dict[str, dict[str, Any]]],
            versions: dict[str, dict[str, Any]]) -> str:
    lines = [settings]
    for job in jobs:
        v = versions[job.label]
        lines.append(f"  {job.label.strip() or 'working tree'}: engine of "
                     f"{job.revision or 'the working tree'}, torch {v['torch']}, "
                     f"transformers {v['transformers']}, deepspeed {v['deepspeed']}")
    head = f"{'run':34} {'median ms':>9} {'min ms':>8} {'CPU ms':>8} {'sys %':>5} " \
           f"{'intra MB/step':>13} {'inter MB/step':>13} {'last loss':>10}"
    lines += ["", head, "-" * len(head)]
    for job in jobs:
        for run, r in results[job.label].items():
            sent = ("".join(f" {b / 1e6:13.2f}" for b in r["sent"]) if r["sent"] is not None
                    else f" {'-':>13} {'-':>13}")
            cpu = _cpu_per_step(r)
            system = 100 * sum(r["system"]) / max(sum(cpu), 1e-9)
            lines.append(f"{_label(run) + job.label:34} {statistics.median(r['times']) * 1e3:9.1f} "
                         f"{min(r['times']) * 1e3:8.1f} {statistics.median(cpu) * 1e3:8.1f} "
                         f"{system:5.1f}{sent} {r['loss']:10.6f}")
    head = f"{'pair':24} {'ours':>4} {'ours ms':>8}  {'peer':22} {'peer ms':>8} " \
           f"{'wall':>6} {'ours CPU':>8} {'peer CPU':>8} {'CPU':>6}  goal (wall)"
    lines += ["", head, "-" * len(head)]
    for row in pair_rows(jobs, results):
        verdict = "met" if row["wall"] <= row["goal"] else "missed"
        lines.append(f"{row['name']:24} {row['ours']:>4} {row['ours_s'] * 1e3:8.1f}  "
                     f"{row['peer']:22} {row['peer_s'] * 1e3:8.1f} {row['wall']:6.3f} "
                     f"{row['ours_cpu_s'] * 1e3:8.1f} {row['peer_cpu_s'] * 1e3:8.1f} "
                     f"{row['cpu']:6.3f}  <= {row['goal']:.1f}x {verdict}")
    return "\n".join(lines)


def _write_json(path: str, args: argparse.Namespace, settings: str, jobs: list[Job],
                results: dict[str, dict[str, dict[str, Any]]],
                versions: dict[str, dict[str, Any]]) -> None:
    """Every step of every run and the pairs' ratios, for ``check_peers.py`` and the like."""
    document = dict(settings=settings, rounds=args.rounds, steps=args.steps,
                    warmup=args.warmup,
                    jobs=[dict(label=job.label, revision=job.revision,
                               python=job.python_label or None, pairs=list(job.pairs),
                               versions=versions[job.label]) for job in jobs],
                    runs=results, pairs=pair_rows(jobs, results))
    Path(path).write_text(json.dumps(document, indent=1) + "\n")


def _versions() -> dict[str, Any]:
    """The releases under this process's engine (metadata only: importing deepspeed is slow)."""
    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    return {name: version(name) for name in ("torch", "transformers", "deepspeed")}


def _profile(run: str, args: argparse.Namespace, topo: Any, world_mesh: Any,
             ids: torch.Tensor) -> str:
    """Operators of ``run`` by self time on this rank over --steps steps, after --warmup."""
    from torch.profiler import ProfilerActivity, profile

    engine = _engine(run, args, topo, world_mesh)
    _steps(engine, ids, args.warmup)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _steps(engine, ids, args.steps)
    torch.nn.functional.linear = _TORCH_LINEAR  # [Note: DeepSpeed's linear]
    return prof.key_averages().table(sort_by="self_cpu_time_total",
                                     row_limit=args.profile_rows)


def bench(args: argparse.Namespace, group_size: int) -> None:
    """Every rank's part, in a process group that is already up: the rounds of one job."""
    from rlhf_paro.sharding import Topology
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    # DeepSpeed calls torch.distributed's deprecated names; one warning per call would bury
    # the tables.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated")
    if args.slow_collectives_ms:
        _slow_collectives(args.slow_collectives_ms)
    if args.free_collectives:
        _free_collectives()
    topo = Topology.from_process_group(group_size=group_size)
    world_mesh = init_device_mesh("cpu", (topo.num_ranks,))
    gen = torch.Generator().manual_seed(topo.rank)
    ids = torch.randint(0, args.vocab, (args.micro, args.batch, args.seq), generator=gen)
    pairs = [name for name, _ in parse_contenders(args.contenders)]
    runs = list(dict.fromkeys([PAIRS[name].ours for name in pairs] + pairs))
    results: dict[str, dict[str, Any]] = {
        run: dict(times=[], user=[], system=[]) for run in runs}
    for round_ in range(args.first_round, args.first_round + args.rounds):
        shift = round_ % len(runs)
        for run in runs[shift:] + runs[:shift]:
            engine = _engine(run, args, topo, world_mesh)
            _steps(engine, ids, args.warmup)
            measured = _steps(engine, ids, args.steps)
            for key in ("times", "user", "system"):
                results[run][key] += measured[key]
            results[run].update(sent=measured["sent"], loss=measured["loss"])
            del engine
            gc.collect()
            torch.nn.functional.linear = _TORCH_LINEAR  # [Note: DeepSpeed's linear]
    if topo.rank == 0 and args.rounds:
        if args.job_out:  # the parent prints the tables of all its jobs
            Path(args.job_out).write_text(json.dumps(dict(runs=results, versions=_versions())))
        else:
            job = Job(None, sys.executable, "", tuple(pairs))
            settings = _settings(args, topo.num_ranks, topo.num_groups, topo.group_size)
            versions = {"": _versions()}
            print(_report(settings, [job], {"": results}, versions), flush=True)
            if args.json:
                _write_json(args.json, args, settings, [job], {"": results}, versions)
    if args.profile:
        for run in (PAIRS[args.profile].ours, args.profile):
            table = _profile(run, args, topo, world_mesh, ids)
            if topo.rank == 0:
                print(f"\n{_label(run)}: rank 0's operators by self time over {args.steps} "
                      f"steps (c10d::barrier: the wait before each step, which the times leave "
                      f"out)\n{table}", flush=True)


def _spawned(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=args.world)
    try:
        bench(args, args.group_size)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What a job takes over from the command line as given (the rest it is told per round).
_JOB_OPTIONS = ("steps", "warmup", "comm", "world", "group_size", "micro", "batch", "seq",
                "hidden", "layers", "vocab", "profile_rows", "slow_collectives_ms")


def _job_command(job: Job, args: argparse.Namespace, source: Path | None, rounds: int,
                 first_round: int, out: Path | None) -> tuple[list[str], dict[str, str]]:
    """This script under the job's interpreter, its revision's package first on the path."""
    command = [job.python, str(Path(__file__).resolve()), "--contenders", ",".join(job.pairs),
               "--rounds", str(rounds), "--first-round", str(first_round)]
    for key in _JOB_OPTIONS:
        command += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    if args.free_collectives:
        command.append("--free-collectives")
    if out is not None:
        command += ["--job-out", str(out)]
    if args.profile and out is None:
        command += ["--profile", args.profile]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(source or ROOT),
                                                      env.get("PYTHONPATH")]))
    return command, env


def run_jobs(args: argparse.Namespace, jobs: list[Job]) -> None:
    """Round r runs every job for one round, in an order that rotates per round; then the
    tables of all of them (and the profiles of --profile, job by job)."""
    results: dict[str, dict[str, dict[str, Any]]] = {job.label: {} for job in jobs}
    versions: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="bench_peers_") as tmp:
        revisions = dict.fromkeys(job.revision for job in jobs if job.revision)
        sources = {rev: source_tree(rev, Path(tmp) / f"source_{i}")
                   for i, rev in enumerate(revisions)}
        for round_ in range(args.rounds):
            shift = round_ % len(jobs)
            for job in jobs[shift:] + jobs[:shift]:
                print(f"round {round_ + 1}/{args.rounds}: {job.label.strip() or 'working tree'}",
                      file=sys.stderr, flush=True)
                out = Path(tmp) / "job.json"
                command, env = _job_command(job, args, sources.get(job.revision), 1, round_, out)
                done = subprocess.run(command, env=env, capture_output=True, text=True)
                if done.returncode:
                    raise SystemExit(f"error: the job of {job.label.strip()} failed:\n"
                                     f"{done.stderr[-3000:]}")
                got = json.loads(out.read_text())
                versions[job.label] = got["versions"]
                for run, r in got["runs"].items():
                    mine = results[job.label].setdefault(run, dict(times=[], user=[], system=[]))
                    for key in ("times", "user", "system"):
                        mine[key] += r[key]
                    mine.update(sent=r["sent"], loss=r["loss"])
        if args.rounds:
            settings = _settings(args, args.world, args.world // args.group_size,
                                 args.group_size)
            print(_report(settings, jobs, results, versions), flush=True)
            if args.json:
                _write_json(args.json, args, settings, jobs, results, versions)
        if args.profile:
            for job in jobs:
                print(f"\n== {args.profile}{job.label}", flush=True)
                command, env = _job_command(job, args, sources.get(job.revision), 0, 0, None)
                if subprocess.run(command, env=env).returncode:
                    raise SystemExit(f"error: the profile of {job.label.strip()} failed")


def main() -> None:
    from rlhf_paro.comm.meter import ALGORITHM_CHOICES
    from rlhf_paro.config import CommConfig

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contenders", default=",".join(PAIRS),
                        help=f"comma-separated pairs: {', '.join(PAIRS)}; NAME@REV runs NAME on "
                             f"the engine of git revision REV")
    parser.add_argument("--python", default="",
                        help="comma-separated interpreters: every contender runs under each")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per run and round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    parser.add_argument("--comm", default=CommConfig().algorithm, choices=ALGORITHM_CHOICES)
    parser.add_argument("--world", type=int, default=4, help="local ranks (not when launched)")
    parser.add_argument("--group-size", type=int, default=2, help="M (GROUP_SIZE when set)")
    parser.add_argument("--micro", type=int, default=2, help="micro-batches per step (s)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--profile", choices=list(PAIRS), help="profile both sides of a pair")
    parser.add_argument("--profile-rows", type=int, default=25)
    parser.add_argument("--json", metavar="FILE", help="write every step and the ratios here")
    parser.add_argument("--slow-collectives-ms", type=float, default=0.0, metavar="MS",
                        help="testing: every PaRO collective sleeps MS first")
    parser.add_argument("--free-collectives", action="store_true",
                        help="every PaRO collective does only this rank's part and sends "
                             "nothing: our step's floor (our losses are wrong)")
    # A job's own (run_jobs): its first round's number, for the rotation, and its results file.
    parser.add_argument("--first-round", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--job-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    try:
        contenders = parse_contenders(args.contenders)
    except ValueError as e:
        parser.error(str(e))
    pythons = [p for p in args.python.split(",") if p]
    missing = [p for p in pythons if not os.access(p, os.X_OK)]
    if missing:
        parser.error(f"--python: {', '.join(missing)} is not an executable interpreter")
    if args.steps < 1 or args.rounds < 0 or args.warmup < 0:
        parser.error("--steps must be at least 1, --rounds and --warmup at least 0")
    if not args.rounds and not args.profile:
        parser.error("--rounds 0 times nothing; give --profile PAIR or some rounds")
    if args.slow_collectives_ms < 0:
        parser.error(f"--slow-collectives-ms must be >= 0, got {args.slow_collectives_ms:g}")
    if args.slow_collectives_ms and args.free_collectives:
        parser.error("--slow-collectives-ms and --free-collectives exclude each other; give one")
    if pythons or any(revision for _, revision in contenders):
        if "RANK" in os.environ:
            parser.error("NAME@REV and --python run jobs of local ranks of their own; not as "
                         "one rank of a launched job (RANK is set)")
        if args.world % args.group_size:
            parser.error(f"--group-size {args.group_size} must divide --world {args.world}")
        run_jobs(args, plan_jobs(contenders, pythons or [sys.executable]))
    elif "RANK" in os.environ:  # one rank of a launched job (emulate_cluster.py, torchrun)
        dist.init_process_group("gloo")
        try:
            bench(args, int(os.environ.get("GROUP_SIZE", args.group_size)))
        finally:
            dist.destroy_process_group()
    else:
        mp.spawn(_spawned, args=(args, _free_port()), nprocs=args.world)


if __name__ == "__main__":
    main()
