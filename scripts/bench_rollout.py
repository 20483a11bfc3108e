"""Generated tokens per second of the rollout engines, hf against vllm, on one model and prompts.

    python scripts/bench_rollout.py                        # fixed lengths and the mix, 3 rounds
    python scripts/bench_rollout.py --rounds 5 --json rollout.json
    python scripts/bench_rollout.py --profile              # and where each engine's time goes
    python scripts/bench_rollout.py --against-generate     # hf against plain generate, same weights
    python scripts/bench_rollout.py --sync                 # the weight sync under P = N, I, G
    python scripts/bench_rollout.py --transfer             # the transfer to rollout replicas
    python scripts/bench_rollout.py --transfer-store       # gloo against Ray's object store

Both engines run in this process on one device (a gloo group of one rank), on the same random
Llama (built from --seed, fp32) and the same random prompts of 4 to 16 tokens, left-padded as a
rank's prompts are. The hf engine generates on the actor's sharded engine (strategy NNN) with all
prompts in one chunk, as ``rollout.micro_batch_size=null`` runs it; the vllm engine is synced
from that engine's parameters the way the actor syncs it, so both sample from the same weights.

Cases:
  fixed  every response exactly as long as the budget: the <eos> is an id outside the model's
         vocabulary, which neither engine can sample (--batch-sizes x --lengths)
  mix    responses of varied length: at temperature 1 a random model's logits are near uniform,
         so each step samples the <eos> (--mix-eos) with a chance of about 1/--vocab and lengths
         are about geometric, mean about --vocab, capped at --budget (--mix-batch-sizes); the
         table gives each engine's mean response length, which must be at most a quarter of
         the budget
Every round runs each case on both engines, back to back, the engine that goes first taking turns
from round to round, so slow drifts of the machine fall on both alike. Generated tokens are the
real response tokens (``action_mask``); the first call of each engine warms up and is reported
apart. The table gives each engine's median tokens/s over the rounds and their ratio.

``--sync`` runs 4 gloo ranks as 2 groups of 2 instead (``torch.multiprocessing``), each with
the actor sharded as NGG, IGG and GGG in turn and a vllm engine of its own, and times the sync
(``models.hf_weights`` of ``engine.unit_parameters(SYNC)`` into ``VLLMRollout.sync``): per P
level the bytes one rank sends on intra and inter links (the engine's meter, phase ``sync``),
the slowest rank's seconds of the gathers alone and of the whole sync (median of --sync-reps).
On an emulated cluster every rank is a process of its own, which takes RANK, WORLD_SIZE,
GROUP_SIZE and the rest from the environment:

    sudo python scripts/emulate_cluster.py --nodes 2 --gpus-per-node 2 --inter-rate 160MB -- \\
        python scripts/bench_rollout.py --sync

``--transfer`` runs the same 4 ranks (or the emulated cluster's) as the actor, sharded as NGG,
IGG and GGG in turn, and sends its weights to --replicas rollout replicas on devices of their own
as a run does (``comm/transfer.py``: replica j served by actor rank j mod N, on a transfer group
met on a store rank 0 holds): every rank gathers each unit at P (phase ``sync``), a rank that
serves replicas broadcasts each weight to them (phase ``transfer``). Replica j lives on node
--replica-nodes[j], as a thread of a rank process of that node (its transfer group is its own,
bound to that process's address, so its bytes cross that node's links as a replica's process
there would). Per P level: each rank's sync and transfer bytes, checked against the closed forms
(``cost.traffic`` with ``syncs=1``; ``transfer.transfer_bytes``: the weights once per replica
served, intra for a replica on the sender's node, inter otherwise), that every replica holds
exactly the actor's weights, and the slowest rank's seconds (median of --sync-reps).

``--transfer-store`` compares, on this machine's loopback, the two ways of moving the same
model's weights from one sender to --replicas replica processes (Ray actors): a gloo broadcast
of each weight on a transfer group, against one ``ray.put`` of all the weights by the sender and
a ``ray.get`` by every replica; seconds until every replica holds them, median of --sync-reps,
interleaved.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import json
import os
import pstats
import socket
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

# The tables are the output; vLLM's progress lines would bury them.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

ENGINES = ("hf", "vllm")
PAD = 0
SYNC_STRATEGIES = ("NGG", "IGG", "GGG")


@dataclass(frozen=True)
class Case:
    """One way of calling ``generate``: ``batch`` prompts, a budget of ``length`` tokens; fixed:
    every response that long; mix: responses ended by the <eos>."""

    kind: str  # "fixed" or "mix"
    batch: int
    length: int

    @property
    def name(self) -> str:
        return f"{self.kind} {self.batch}x{self.length}"


def model_config(args: argparse.Namespace) -> str:
    """The actor's inline config as a command-line value: a Llama as wide as --hidden, its MLP
    twice that, --heads heads (vLLM's CPU attention takes head sizes of 32 and up)."""
    return (f"{{model_type: llama, hidden_size: {args.hidden}, intermediate_size: "
            f"{2 * args.hidden}, num_hidden_layers: {args.layers}, num_attention_heads: "
            f"{args.heads}, num_key_value_heads: {args.heads}, vocab_size: {args.vocab}, "
            f"max_position_embeddings: {args.max_prompt + args.budget}}}")


def load(args: argparse.Namespace, num_devices: int, group_size: int, batch: int,
         engine: str = "vllm") -> Any:
    """The run's config with this model and ``batch`` prompts per device (what the vllm engine
    sizes its key/value cache by), budget --budget, rollout.engine=``engine``."""
    from rlhf_paro.compose import load_config
    from rlhf_paro.resolve import resolve

    total = batch * num_devices
    return resolve(load_config([
        f"actor.config={model_config(args)}", "reward.path=null", "data.train_files=null",
        f"cluster.num_devices={num_devices}", f"cluster.group_size={group_size}",
        f"data.max_prompt_length={args.max_prompt}", f"ppo.max_new_tokens={args.budget}",
        f"ppo.rollout_batch_size={total}", f"ppo.mini_batch_size={total}",
        f"actor.micro_batch_size={batch}", f"critic.micro_batch_size={batch}",
        f"rollout.engine={engine}", f"trainer.seed={args.seed}"]))


def build_actor(cfg: Any, strategy: str, group_size: int) -> Any:
    """The actor's module, built from the run's seed, sharded by ``strategy`` on the default
    process group."""
    from rlhf_paro import models
    from rlhf_paro.ppo.data import vocab_sizes
    from rlhf_paro.sharding import Topology, shard

    module = models.build_model("actor", cfg.actor, vocab_sizes(cfg)["actor"],
                                seed=cfg.trainer.seed)
    return shard(module, strategy, Topology.from_process_group(group_size=group_size),
                 precision=cfg.actor.precision)


def sync(rollout: Any, engine: Any) -> None:
    """The actor's weights into ``rollout``, as ``ActorWorker.sync_engine`` hands them over
    (no LoRA here: the scale multiplies nothing)."""
    from rlhf_paro import models
    from rlhf_paro.comm.meter import SYNC

    rollout.sync(models.hf_weights(engine.module, engine.unit_parameters(SYNC), 1.0))


def prompts(batch: int, vocab: int, longest: int, seed: int) -> Any:
    """``batch`` random prompts of 4 to ``longest`` tokens, left-padded to the longest drawn."""
    from rlhf_paro.rollout import PromptBatch

    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, longest + 1, (batch,), generator=gen)
    width = int(lengths.max())
    ids = torch.full((batch, width), PAD, dtype=torch.long)
    mask = torch.zeros(batch, width, dtype=torch.long)
    for row, n in enumerate(lengths.tolist()):
        ids[row, width - n:] = torch.randint(0, vocab, (n,), generator=gen)
        mask[row, width - n:] = 1
    return PromptBatch(ids, mask)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def median_rate(runs: list[dict]) -> float:
    return statistics.median(r["tokens"] / r["seconds"] for r in runs)


def mean_length(runs: list[dict]) -> float:
    """Mean response length over every response of ``runs``."""
    return sum(r["tokens"] for r in runs) / sum(r["rows"] for r in runs)


def rate_table(cases: list[Case], runs: dict[tuple[str, str], list[dict]]) -> str:
    """Per case: each engine's median tokens/s over the rounds, vllm's over hf's, and each
    engine's mean response length."""
    lines = ["| case | hf tokens/s | vllm tokens/s | vllm/hf | hf mean length | "
             "vllm mean length |", "|---|---|---|---|---|---|"]
    for case in cases:
        hf, vllm = (runs[(engine, case.name)] for engine in ENGINES)
        lines.append(f"| {case.name} | {median_rate(hf):.0f} | {median_rate(vllm):.0f} | "
                     f"{median_rate(vllm) / median_rate(hf):.2f} | {mean_length(hf):.1f} | "
                     f"{mean_length(vllm):.1f} |")
    return "\n".join(lines)


def generation(args: argparse.Namespace) -> dict:
    from rlhf_paro.rollout import Sampling
    from rlhf_paro.rollout.hf import HFRollout
    from rlhf_paro.rollout.vllm import VLLMRollout

    fixed = [Case("fixed", b, n) for b in args.batch_sizes for n in args.lengths]
    mix = [Case("mix", b, args.budget) for b in args.mix_batch_sizes]
    cases = fixed + mix
    if max(args.lengths) > args.budget:
        raise SystemExit("error: --lengths must not exceed --budget")
    if not 0 <= args.mix_eos < args.vocab:
        raise SystemExit(f"error: --mix-eos must be an id of the vocabulary (0..{args.vocab - 1})")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    torch.manual_seed(args.seed)  # hf samples from torch's generator
    cfg = load(args, 1, 1, max(c.batch for c in cases))
    engine = build_actor(cfg, "NNN", 1)
    device = torch.device("cpu")
    # One engine of each kind for every case: a vllm engine takes seconds to build, and each
    # case's <eos> is set on the engines before it runs.
    rollouts = {"hf": HFRollout(engine, PAD, args.vocab, device),
                "vllm": VLLMRollout(cfg, engine.module.lm.config, args.vocab, PAD, device,
                                    seed=args.seed + 1)}
    sync(rollouts["vllm"], engine)

    def run(name: str, case: Case, seed: int) -> dict:
        rollout = rollouts[name]
        rollout.eos_token_id = args.vocab if case.kind == "fixed" else args.mix_eos
        batch = prompts(case.batch, args.vocab, args.max_prompt, seed)
        start = time.perf_counter()
        out = rollout.generate(batch, Sampling(case.length))
        seconds = time.perf_counter() - start
        tokens = int(out.action_mask.sum())
        if case.kind == "fixed" and tokens != case.batch * case.length:
            raise SystemExit(f"error: {name} ended a response early in {case.name}")
        return {"seconds": seconds, "tokens": tokens, "rows": case.batch}

    warmup = {name: run(name, cases[0], seed=-1) for name in ENGINES}
    runs: dict[tuple[str, str], list[dict]] = {(e, c.name): [] for e in ENGINES for c in cases}
    for round_ in range(args.rounds):
        print(f"round {round_ + 1}/{args.rounds}", file=sys.stderr, flush=True)
        order = ENGINES if round_ % 2 == 0 else ENGINES[::-1]
        for i, case in enumerate(cases):
            for name in order:
                runs[(name, case.name)].append(run(name, case, seed=round_ * len(cases) + i))

    print(f"{args.layers} blocks, hidden {args.hidden}, {args.heads} heads, vocab {args.vocab}, "
          f"fp32, threads {torch.get_num_threads()}; prompts of 4-{args.max_prompt} tokens; "
          f"median of {args.rounds} rounds; mix: <eos> {args.mix_eos} at temperature 1, budget "
          f"{args.budget}")
    print(rate_table(cases, runs))
    print("warm-up (first call, " + cases[0].name + "): " + ", ".join(
        f"{name} {w['seconds']:.2f} s" for name, w in warmup.items()))
    limit = args.budget / 4
    for case in mix:
        for name in ENGINES:
            mean = mean_length(runs[(name, case.name)])
            if mean > limit:
                print(f"warning: {name} {case.name}: mean response length {mean:.1f} is "
                      f"above a quarter of the budget ({limit:.0f}): a smaller --vocab (the "
                      f"mean is about --vocab) or another --mix-eos", file=sys.stderr)
    result = {"args": vars(args), "cases": [asdict(c) for c in cases], "warmup": warmup,
              "runs": {f"{e} {c}": r for (e, c), r in runs.items()}}
    if args.profile:
        # Where it loses most: the fixed case of the lowest ratio.
        worst = min(fixed, key=lambda c: median_rate(runs[("vllm", c.name)])
                    / median_rate(runs[("hf", c.name)]))
        for name in ENGINES:
            print(f"\n{name}, {worst.name}: functions by own time (cProfile, one call)")
            profiler = cProfile.Profile()
            profiler.runcall(run, name, worst, seed=0)
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.top)
            total, _, rest = text.getvalue().strip().partition("\n\n")
            print(total.strip())
            print(rest.split("\n\n", 1)[-1].rstrip())
    # The process group stays: vLLM's exit hook takes down its own groups on it.
    return result


def against_generate(args: argparse.Namespace) -> dict:
    """``--against-generate``: the hf engine against plain ``generate`` on the same weights
    (an unsharded copy of the module, which no engine hooks), the same prompts and the same
    random stream, so both sample the same tokens; the engine's log-probs are in its time."""
    from rlhf_paro import models
    from rlhf_paro.ppo.data import vocab_sizes
    from rlhf_paro.rollout import Sampling, response_mask
    from rlhf_paro.rollout.hf import HFRollout

    cases = ([Case("fixed", b, n) for b in args.batch_sizes for n in args.lengths]
             + [Case("mix", b, args.budget) for b in args.mix_batch_sizes])
    if max(args.lengths) > args.budget or args.budget < 40:
        raise SystemExit("error: --against-generate needs --budget >= --lengths and >= 40 (the "
                         "count of calls generates 40 tokens)")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    cfg = load(args, 1, 1, max(c.batch for c in cases), engine="hf")
    engine = build_actor(cfg, "NNN", 1)
    rollout = HFRollout(engine, PAD, args.vocab, torch.device("cpu"))
    plain = models.build_model("actor", cfg.actor, vocab_sizes(cfg)["actor"]).eval()
    with engine.gathered() as module:
        plain.load_state_dict(module.state_dict())

    def run(name: str, case: Case, seed: int) -> dict:
        eos = args.vocab if case.kind == "fixed" else args.mix_eos
        batch = prompts(case.batch, args.vocab, args.max_prompt, seed)
        torch.manual_seed(seed)
        start = time.perf_counter()
        if name == "hf":
            rollout.eos_token_id = eos
            tokens = int(rollout.generate(batch, Sampling(case.length)).action_mask.sum())
        else:
            with torch.no_grad():
                out = plain.lm.generate(input_ids=batch.input_ids,
                                        attention_mask=batch.attention_mask,
                                        max_new_tokens=case.length, do_sample=True,
                                        temperature=1.0, top_k=0, pad_token_id=PAD,
                                        eos_token_id=eos)
            tokens = int(response_mask(out[:, batch.input_ids.shape[1]:], eos).sum())
        return {"seconds": time.perf_counter() - start, "tokens": tokens, "rows": case.batch}

    names = ("hf", "generate")
    for name in names:
        run(name, cases[0], seed=-1)  # warm-up
    runs: dict[tuple[str, str], list[dict]] = {(e, c.name): [] for e in names for c in cases}
    for round_ in range(args.rounds):
        print(f"round {round_ + 1}/{args.rounds}", file=sys.stderr, flush=True)
        for i, case in enumerate(cases):
            for name in names if round_ % 2 == 0 else names[::-1]:
                runs[(name, case.name)].append(run(name, case, seed=round_ * len(cases) + i))
    print(f"{args.layers} blocks, hidden {args.hidden}, {args.heads} heads, vocab {args.vocab}, "
          f"fp32, threads {torch.get_num_threads()}; median of {args.rounds} rounds")
    # A round's two calls ran back to back, so their ratio cancels what the machine did over
    # the rounds; one call's time still moves by several percent, so the ratio is given as
    # the median of the rounds' with its quartiles.
    lines = ["| case | hf tokens/s | generate tokens/s | hf / generate (median of rounds) | "
             "quartiles |", "|---|---|---|---|---|"]
    for case in cases:
        hf, gen = (median_rate(runs[(name, case.name)]) for name in names)
        if runs[("hf", case.name)][-1]["tokens"] != runs[("generate", case.name)][-1]["tokens"]:
            print(f"warning: {case.name}: the two sampled different tokens", file=sys.stderr)
        ratios = [g["seconds"] / h["seconds"] for h, g in zip(runs[("hf", case.name)],
                                                               runs[("generate", case.name)])]
        low, mid, high = (statistics.quantiles(ratios, n=4) if len(ratios) > 1
                          else ratios * 3)
        lines.append(f"| {case.name} | {hf:.0f} | {gen:.0f} | {statistics.median(ratios):.2f} "
                     f"| {low:.2f}-{high:.2f} |")
    print("\n".join(lines))
    # Python calls a decoding step: those of a call of 40 tokens less one of 8, over 32 steps.
    fixed = Case("fixed", 8, 40)
    calls = {}
    for name in names:
        counts = []
        for length in (8, 40):
            profiler = cProfile.Profile()
            profiler.runcall(run, name, dataclasses.replace(fixed, length=length), seed=0)
            counts.append(pstats.Stats(profiler).total_calls)
        calls[name] = (counts[1] - counts[0]) / 32
    print("Python calls a decoding step (8 prompts): " + ", ".join(
        f"{name} {count:.0f}" for name, count in calls.items()))
    return {"args": vars(args), "calls_per_step": calls,
            "runs": {f"{e} {c}": r for (e, c), r in runs.items()}}


def sync_rank(rank: int, args: argparse.Namespace, port: int | None) -> None:
    """One rank of ``--sync``: rank 0 prints the table (and writes --json)."""
    from rlhf_paro import models
    from rlhf_paro.comm.meter import SYNC
    from rlhf_paro.ppo.data import vocab_sizes
    from rlhf_paro.rollout.vllm import VLLMRollout

    torch.set_num_threads(1)  # four ranks share the machine's cores
    if port is None:  # every rank a process of its own (emulate_cluster.py)
        dist.init_process_group("gloo")
        group_size = int(os.environ["GROUP_SIZE"])
    else:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=args.world)
        group_size = args.group_size
    world = dist.get_world_size()
    # A short budget and two prompts a rank: the four engines' key/value caches stay small.
    cfg = load(args, world, group_size, batch=2)
    vocab = vocab_sizes(cfg)["actor"]
    rollout = VLLMRollout(cfg, models.hf_config("actor", cfg.actor, vocab), args.vocab, PAD,
                          torch.device("cpu"), seed=args.seed + rank + 1)
    rows = []
    for strategy in SYNC_STRATEGIES:
        engine = build_actor(cfg, strategy, group_size)
        gather_s, sync_s = [], []
        for _ in range(args.sync_reps + 1):  # the first warms up
            dist.barrier()
            start = time.perf_counter()
            for _ in engine.unit_parameters(SYNC):
                pass
            gather_s.append(slowest(time.perf_counter() - start))
            engine.meter.reset()
            dist.barrier()
            start = time.perf_counter()
            sync(rollout, engine)
            sync_s.append(slowest(time.perf_counter() - start))
        sent = engine.meter.totals(phase=SYNC)
        counts = torch.tensor([sent["intra_bytes"], sent["inter_bytes"]], dtype=torch.float64)
        dist.all_reduce(counts)
        rows.append({"strategy": strategy, "intra_bytes": counts[0].item() / world,
                     "inter_bytes": counts[1].item() / world,
                     "gather_s": statistics.median(gather_s[1:]),
                     "sync_s": statistics.median(sync_s[1:])})
    if dist.get_rank() == 0:
        params = models.count_parameters("actor", cfg.actor, vocab)[0]
        print(f"sync on {world} gloo ranks as {world // group_size} groups x {group_size}; "
              f"{params / 1e6:.2f}M parameters (fp32, {params * 4 / 1e6:.1f} MB); median of "
              f"{args.sync_reps} repetitions, the slowest rank of each")
        print(sync_table(rows))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"sync": rows}, f, indent=1)
    # Torn down before the exit, as in transfer_rank (vLLM's teardown may have taken the
    # default group down already).
    del rollout
    if dist.is_initialized():
        dist.destroy_process_group()


def transfer_rank(rank: int, args: argparse.Namespace, port: int | None) -> None:
    """One rank of ``--transfer``: rank 0 prints the table (and writes --json)."""
    from concurrent.futures import ThreadPoolExecutor

    from rlhf_paro import models
    from rlhf_paro.comm import transfer
    from rlhf_paro.comm.meter import SYNC, TRANSFER
    from rlhf_paro.ppo.data import vocab_sizes
    from rlhf_paro.sharding import cost
    from rlhf_paro.sharding.layout import unit_sizes
    from rlhf_paro.sharding.strategy import Strategy

    torch.set_num_threads(1)  # the ranks share the machine's cores
    if port is None:  # every rank a process of its own (emulate_cluster.py)
        dist.init_process_group("gloo")
        group_size = int(os.environ["GROUP_SIZE"])
        host = os.environ["MASTER_ADDR"]
    else:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=args.world)
        group_size = args.group_size
        host = "127.0.0.1"
    rank, world = dist.get_rank(), dist.get_world_size()
    nodes = world // group_size
    placed = args.replica_nodes or [j % nodes for j in range(args.replicas)]
    if len(placed) != args.replicas or not all(0 <= n < nodes for n in placed):
        raise SystemExit(f"error: --replica-nodes needs {args.replicas} nodes in 0..{nodes - 1}")
    # The store the transfer groups meet on, held by rank 0 as the driver holds it in a run.
    held = transfer.serve_store(host) if rank == 0 else None
    store_port = torch.tensor([held[1] if held else 0])
    dist.broadcast(store_port, 0)
    store_port = int(store_port.item())
    cfg = load(args, world, group_size, batch=1)
    vocab = vocab_sizes(cfg)["actor"]
    units = unit_sizes(models.build_model("actor", cfg.actor, vocab, meta=True))
    served = transfer.served(rank, world, args.replicas)
    same_node = [placed[j] == rank // group_size for j in served]
    # The replicas this process hosts: those of its node, dealt to the node's ranks in turn.
    hosted = [j for j in range(args.replicas) if placed[j] == rank // group_size
              and [i for i in range(args.replicas) if placed[i] == placed[j]].index(j)
              % group_size == rank % group_size]
    pool = ThreadPoolExecutor(max(1, len(hosted)))

    def replica_group(j: int) -> Any:
        source = transfer.serving(j, world)
        group = transfer.served(source, world, args.replicas)
        return transfer.TransferGroup(host, store_port, f"transfer{source}/",
                                      group.index(j) + 1, len(group) + 1, torch.device("cpu"))

    # Every group's members join at once: a group forms only when all of them are there.
    joined = [pool.submit(replica_group, j) for j in hosted]
    sender = transfer.TransferGroup(host, store_port, f"transfer{rank}/", 0, len(served) + 1,
                                    torch.device("cpu"), same_node=same_node) if served else None
    replica_groups = [f.result() for f in joined]

    def receive(group: Any, manifest: list) -> dict:
        out = {}
        for name, shape, dtype in manifest:
            tensor = torch.empty(shape, dtype=dtype)
            group.broadcast(tensor)
            out[name] = tensor
        return out

    rows, failures = [], []
    for strategy in SYNC_STRATEGIES:
        engine = build_actor(cfg, strategy, group_size)
        if sender is not None:
            sender.meter = engine.meter
        weights = {n: t.clone() for n, t in models.hf_weights(
            engine.module, engine.unit_parameters(SYNC), 1.0)}
        manifest = [(n, tuple(t.shape), t.dtype) for n, t in weights.items()]
        gather_s, send_s, received = [], [], []
        for _ in range(args.sync_reps + 1):  # the first warms up
            dist.barrier()
            start = time.perf_counter()
            for _ in engine.unit_parameters(SYNC):
                pass
            gather_s.append(slowest(time.perf_counter() - start))
            engine.meter.reset()
            dist.barrier()
            start = time.perf_counter()
            takes = [pool.submit(receive, g, manifest) for g in replica_groups]
            for _, tensor in models.hf_weights(engine.module, engine.unit_parameters(SYNC), 1.0):
                if sender is not None:
                    sender.broadcast(tensor.contiguous())
            received = [f.result() for f in takes]
            send_s.append(slowest(time.perf_counter() - start))
        sync = engine.meter.totals(phase=SYNC)
        sent = engine.meter.totals(phase=TRANSFER)
        closed_sync = cost.traffic(Strategy.parse(strategy), units, world, group_size, 1,
                                   cfg.actor.precision, cfg.comm.algorithm, rank=rank,
                                   syncs=1)["sync"]
        size = sum(t.numel() * t.element_size() for t in weights.values())
        closed_transfer = transfer.transfer_bytes(size // 4, 4, same_node)
        exact = all(set(r) == set(weights) and all(torch.equal(r[n], weights[n]) for n in r)
                    for r in received)
        if (sync["intra_bytes"], sync["inter_bytes"]) != tuple(closed_sync):
            failures.append(f"{strategy} rank {rank}: sync {sync} != closed form {closed_sync}")
        if (sent["intra_bytes"], sent["inter_bytes"]) != tuple(closed_transfer):
            failures.append(f"{strategy} rank {rank}: transfer {sent} != {closed_transfer}")
        if not exact:
            failures.append(f"{strategy}: a replica on rank {rank}'s process differs")
        per_rank = [None] * world
        dist.all_gather_object(per_rank, (sync["intra_bytes"], sync["inter_bytes"],
                                          sent["intra_bytes"], sent["inter_bytes"]))
        rows.append({"strategy": strategy, "bytes": per_rank, "weights_bytes": size,
                     "gather_s": statistics.median(gather_s[1:]),
                     "send_s": statistics.median(send_s[1:])})
    everyone = [None] * world
    dist.all_gather_object(everyone, failures)
    if rank == 0:
        params = models.count_parameters("actor", cfg.actor, vocab)[0]
        print(f"transfer on {world} gloo ranks as {nodes} groups x {group_size} to "
              f"{args.replicas} replicas on nodes {placed}; {params / 1e6:.2f}M parameters "
              f"(fp32, {rows[0]['weights_bytes'] / 1e6:.1f} MB); median of {args.sync_reps} "
              f"repetitions, the slowest rank of each")
        print(transfer_table(rows))
        problems = [f for fs in everyone for f in fs]
        print("closed forms and replicas' weights: " + ("exact" if not problems else
                                                        "MISMATCH\n" + "\n".join(problems)))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"transfer": rows}, f, indent=1)
    pool.shutdown()
    dist.barrier()  # rank 0's store serves until every group is done
    # Torn down before the interpreter exits: gloo groups left to the exit's destructors can
    # abort a rank ("terminate called without an active exception") after its work is done.
    del sender, replica_groups
    dist.destroy_process_group()


def transfer_table(rows: list[dict]) -> str:
    lines = ["| P | rank | sync intra MB | sync inter MB | transfer intra MB | transfer inter MB "
             "| gather s | sync + transfer s |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for rank, sent in enumerate(r["bytes"]):
            times = (f"{r['gather_s']:.3f} | {r['send_s']:.3f}" if rank == 0 else " | ")
            lines.append(f"| {r['strategy'][0]} | {rank} | "
                         + " | ".join(f"{b / 1e6:.2f}" for b in sent) + f" | {times} |")
    return "\n".join(lines)


def transfer_store(args: argparse.Namespace) -> None:
    """``--transfer-store``: a gloo broadcast against Ray's object store, on loopback."""
    import ray

    from rlhf_paro import models
    from rlhf_paro.comm import transfer

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    cfg = load(args, 1, 1, batch=1)
    from rlhf_paro.ppo.data import vocab_sizes

    module = models.build_model("actor", cfg.actor, vocab_sizes(cfg)["actor"], seed=args.seed)
    weights = {n: t.detach().contiguous() for n, t in models.hf_state_dict(
        module, module.state_dict()).items()}
    manifest = [(n, tuple(t.shape), t.dtype) for n, t in weights.items()]
    size = sum(t.numel() * t.element_size() for t in weights.values())
    ray.init(num_cpus=args.replicas + 1, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"GLOO_SOCKET_IFNAME": "lo"}})

    @ray.remote(num_cpus=1)
    class Replica:
        def join(self, port: int, rank: int, size: int) -> None:
            torch.set_num_threads(1)
            self.group = transfer.TransferGroup("127.0.0.1", port, "transfer0/", rank, size,
                                                torch.device("cpu"))

        def gloo(self) -> int:
            got = 0
            for _, shape, dtype in manifest:
                tensor = torch.empty(shape, dtype=dtype)
                self.group.broadcast(tensor)
                got += tensor.numel() * tensor.element_size()
            return got

        def store(self, refs: list) -> int:
            got = ray.get(refs[0])  # the weights, copied out of the store into this process
            return sum(t.numel() * t.element_size() for t in got.values())

    store, port = transfer.serve_store("127.0.0.1")
    replicas = [Replica.remote() for _ in range(args.replicas)]
    joins = [r.join.remote(port, j + 1, args.replicas + 1) for j, r in enumerate(replicas)]
    sender = transfer.TransferGroup("127.0.0.1", port, "transfer0/", 0, args.replicas + 1,
                                    torch.device("cpu"), same_node=[True] * args.replicas)
    ray.get(joins)

    def gloo() -> float:
        start = time.perf_counter()
        calls = [r.gloo.remote() for r in replicas]
        for tensor in weights.values():
            sender.broadcast(tensor)
        assert ray.get(calls) == [size] * args.replicas
        return time.perf_counter() - start

    def object_store() -> float:
        start = time.perf_counter()
        ref = ray.put(weights)
        assert ray.get([r.store.remote([ref]) for r in replicas]) == [size] * args.replicas
        del ref
        return time.perf_counter() - start

    ways = {"gloo broadcast": gloo, "ray object store": object_store}
    seconds: dict[str, list[float]] = {w: [] for w in ways}
    for i in range(args.sync_reps + 1):  # the first warms up; the order takes turns
        for way in (list(ways) if i % 2 == 0 else list(reversed(ways))):
            t = ways[way]()
            if i:
                seconds[way].append(t)
    print(f"weights of {size / 1e6:.1f} MB (fp32) from one sender to {args.replicas} replica "
          f"processes on loopback; median of {args.sync_reps} repetitions")
    print("| way | s | MB/s per replica |\n|---|---|---|")
    for way, values in seconds.items():
        median = statistics.median(values)
        print(f"| {way} | {median:.3f} | {size / median / 1e6:.0f} |")
    ratio = statistics.median(seconds["ray object store"]) / statistics.median(
        seconds["gloo broadcast"])
    print(f"ray object store / gloo broadcast: {ratio:.2f}x the time")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"transfer_store": seconds, "bytes": size}, f, indent=1)
    del store
    ray.shutdown()


def slowest(seconds: float) -> float:
    t = torch.tensor([seconds])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def sync_table(rows: list[dict]) -> str:
    lines = ["| P | strategy | intra MB / rank | inter MB / rank | gather s | sync s |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['strategy'][0]} | {r['strategy']} | {r['intra_bytes'] / 1e6:.2f} | "
                     f"{r['inter_bytes'] / 1e6:.2f} | {r['gather_s']:.3f} | {r['sync_s']:.3f} |")
    return "\n".join(lines)


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-sizes", type=ints, default=[8, 32, 64],
                        help="prompts per call of the fixed cases")
    parser.add_argument("--lengths", type=ints, default=[64, 256],
                        help="response lengths of the fixed cases")
    parser.add_argument("--mix-batch-sizes", type=ints, default=[16, 64],
                        help="prompts per call of the mix")
    parser.add_argument("--budget", type=int, default=256, help="the mix's max_new_tokens")
    parser.add_argument("--mix-eos", type=int, default=2, help="the mix's <eos> id")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--max-prompt", type=int, default=16, help="longest prompt (tokens)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", action="store_true",
                        help="also profile one call of each engine on the fixed case where vllm "
                             "does worst")
    parser.add_argument("--top", type=int, default=15, help="functions --profile prints")
    parser.add_argument("--sync", action="store_true", help="time the weight sync instead")
    parser.add_argument("--sync-reps", type=int, default=3)
    parser.add_argument("--world", type=int, default=4, help="--sync: ranks")
    parser.add_argument("--group-size", type=int, default=2, help="--sync: ranks per group")
    parser.add_argument("--transfer", action="store_true",
                        help="time the weight transfer to rollout replicas instead")
    parser.add_argument("--transfer-store", action="store_true",
                        help="time a gloo broadcast against Ray's object store instead")
    parser.add_argument("--replicas", type=int, default=3,
                        help="--transfer, --transfer-store: rollout replicas")
    parser.add_argument("--replica-nodes", type=ints, default=None,
                        help="--transfer: the node of each replica (default: j mod nodes)")
    parser.add_argument("--against-generate", action="store_true",
                        help="the hf engine against plain generate on the same weights instead")
    parser.add_argument("--json", help="also write the raw numbers here")
    args = parser.parse_args()
    if args.rounds < 1:
        raise SystemExit("error: --rounds must be at least 1")
    if args.transfer_store:
        transfer_store(args)
        return
    if args.sync or args.transfer:
        rank_fn = transfer_rank if args.transfer else sync_rank
        if "WORLD_SIZE" in os.environ:
            rank_fn(int(os.environ["RANK"]), args, None)
        else:
            torch.multiprocessing.spawn(rank_fn, args=(args, free_port()), nprocs=args.world)
        return
    result = against_generate(args) if args.against_generate else generation(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
