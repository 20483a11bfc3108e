"""Step time of the PaRO engine against DeepSpeed ZeRO and PyTorch FSDP2, pair by pair.

    python scripts/bench_peers.py                          # 7 pairs, 4 ranks as 2 x 2
    python scripts/bench_peers.py --contenders zero3,fsdp_full --rounds 5 --profile zero3
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

All runs share one process group. Every round runs each of them (a fresh model, --warmup steps,
then --steps timed steps) in a rotating order, so that drift on the machine hits all alike; a
strategy that two pairs share (NGG, GGG) runs once per round and serves both. A step's time is
the slowest rank's. Rank 0 prints per run the median over all rounds, the bytes sent in the
last step on intra and inter links (mean over ranks; PaRO and DeepSpeed meter them, FSDP2 does
not) and rank 0's last loss (equal on both sides of a pair up to rounding, as the same training
gives), then per pair the ratio ours/peer against the goal: at most 0.9x DeepSpeed's time, at
most 1.0x FSDP2's. ``--profile PAIR`` then profiles both sides of one pair for --steps steps
and prints rank 0's operators by self time.

Runs on --world local ranks by default, or as one rank of a launched job (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT in the environment, and GROUP_SIZE = M as ``emulate_cluster.py`` sets
it; --group-size otherwise).
"""

from __future__ import annotations

import argparse
import gc
import os
import socket
import statistics
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# The model, built as bench_engine builds it (this script's folder is on the path when it runs).
from bench_engine import _model

OPTIM = dict(lr=1e-4)
MAX_GRAD_NORM = 1.0
GOALS = {"DeepSpeed": 0.9, "FSDP2": 1.0}  # ours / peer at most this

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


def _steps(engine: Any, ids: torch.Tensor, count: int) -> tuple[list[float], Any, float]:
    """Times of ``count`` optimizer steps (the slowest rank's), the last step's (intra, inter)
    bytes, mean over ranks (None without a meter), and this rank's last loss."""
    times: list[float] = []
    for _ in range(count):
        if engine.meter is not None:
            engine.meter.reset()
        dist.barrier()
        start = time.perf_counter()
        for k in range(ids.shape[0]):
            with torch.profiler.record_function("forward"):
                loss = engine(input_ids=ids[k], labels=ids[k]).loss
            with torch.profiler.record_function("backward"):
                engine.backward(loss)
        with torch.profiler.record_function("step"):
            engine.step()
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(elapsed.item())
    sent = None
    if engine.meter is not None:
        t = engine.meter.totals()
        traffic = torch.tensor([t["intra_bytes"], t["inter_bytes"]], dtype=torch.float64)
        dist.all_reduce(traffic)
        sent = (traffic / dist.get_world_size()).tolist()
    return times, sent, loss.item()


def _label(run: str) -> str:
    return PAIRS[run].peer if run in PAIRS else f"PaRO {run}"


def _report(args: argparse.Namespace, topo: Any, pairs: list[str],
            results: dict[str, dict[str, Any]]) -> str:
    lines = [f"{topo.num_ranks} gloo ranks as {topo.num_groups} groups x {topo.group_size}, "
             f"comm={args.comm}, fp32, s={args.micro} micro-batches of {args.batch} x {args.seq} "
             f"tokens, hidden={args.hidden} layers={args.layers} vocab={args.vocab}; median of "
             f"{args.rounds} rounds x {args.steps} steps (slowest rank per step)"]
    head = f"{'run':22} {'median ms':>9} {'min ms':>8} {'intra MB/step':>13} " \
           f"{'inter MB/step':>13} {'last loss':>10}"
    lines += ["", head, "-" * len(head)]
    for run, r in results.items():
        sent = ("".join(f" {b / 1e6:13.2f}" for b in r["sent"]) if r["sent"] is not None
                else f" {'-':>13} {'-':>13}")
        lines.append(f"{_label(run):22} {statistics.median(r['times']) * 1e3:9.1f} "
                     f"{min(r['times']) * 1e3:8.1f}{sent} {r['loss']:10.6f}")
    head = f"{'pair':12} {'ours':>4} {'ours ms':>8}  {'peer':22} {'peer ms':>8} " \
           f"{'ours/peer':>9}  goal"
    lines += ["", head, "-" * len(head)]
    for name in pairs:
        pair = PAIRS[name]
        ours = statistics.median(results[pair.ours]["times"])
        peer = statistics.median(results[name]["times"])
        ratio = ours / peer
        verdict = "met" if ratio <= pair.goal else "missed"
        lines.append(f"{name:12} {pair.ours:>4} {ours * 1e3:8.1f}  {pair.peer:22} "
                     f"{peer * 1e3:8.1f} {ratio:9.3f}  <= {pair.goal:.1f}x {verdict}")
    return "\n".join(lines)


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
    """Every rank's part, in a process group that is already up."""
    from rlhf_paro.sharding import Topology
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    # DeepSpeed calls torch.distributed's deprecated names; one warning per call would bury
    # the tables.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated")
    topo = Topology.from_process_group(group_size=group_size)
    world_mesh = init_device_mesh("cpu", (topo.num_ranks,))
    gen = torch.Generator().manual_seed(topo.rank)
    ids = torch.randint(0, args.vocab, (args.micro, args.batch, args.seq), generator=gen)
    pairs = args.contenders.split(",")
    runs = list(dict.fromkeys([PAIRS[name].ours for name in pairs] + pairs))
    results: dict[str, dict[str, Any]] = {run: {"times": []} for run in runs}
    for round_ in range(args.rounds):
        shift = round_ % len(runs)
        for run in runs[shift:] + runs[:shift]:
            engine = _engine(run, args, topo, world_mesh)
            _steps(engine, ids, args.warmup)
            times, sent, loss = _steps(engine, ids, args.steps)
            results[run]["times"] += times
            results[run].update(sent=sent, loss=loss)
            del engine
            gc.collect()
            torch.nn.functional.linear = _TORCH_LINEAR  # [Note: DeepSpeed's linear]
    if topo.rank == 0 and args.rounds:
        print(_report(args, topo, pairs, results), flush=True)
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


def main() -> None:
    from rlhf_paro.comm.meter import ALGORITHM_CHOICES
    from rlhf_paro.config import CommConfig

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contenders", default=",".join(PAIRS),
                        help=f"comma-separated pairs: {', '.join(PAIRS)}")
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
    args = parser.parse_args()
    unknown = [name for name in args.contenders.split(",") if name not in PAIRS]
    if unknown:
        parser.error(f"--contenders: unknown {', '.join(unknown)}; allowed: {', '.join(PAIRS)}")
    if args.steps < 1 or args.rounds < 0 or args.warmup < 0:
        parser.error("--steps must be at least 1, --rounds and --warmup at least 0")
    if not args.rounds and not args.profile:
        parser.error("--rounds 0 times nothing; give --profile PAIR or some rounds")
    if "RANK" in os.environ:  # one rank of a launched job (emulate_cluster.py, torchrun)
        dist.init_process_group("gloo")
        try:
            bench(args, int(os.environ.get("GROUP_SIZE", args.group_size)))
        finally:
            dist.destroy_process_group()
    else:
        mp.spawn(_spawned, args=(args, _free_port()), nprocs=args.world)


if __name__ == "__main__":
    main()
