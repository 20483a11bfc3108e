"""A step's generation and the order of its stages, predicted: the rollout's generation time,
the weights' transfer to replicas of their own, the step synchronous or K steps off, and the
table over the devices given to the rollout.

[Note: generation time]
Decoding is bound by memory, not arithmetic: a decoding step of an engine reads all its
weights and the key/value cache of every sequence it decodes at once, and computes only
2 x Psi FLOPs per sequence. So a step takes the longer of (weights + cache read) / its devices'
``cluster.memory_gbps`` and 2 x Psi x sequences / its devices' ``cluster.tflops``; the cache
read is a sequence's prompt bound plus half its decoded length, as its cache grows from the
prompt to the end. ``vllm`` decodes at most ``rollout.max_num_seqs`` sequences at once, fewer
when the cache of that many at their longest does not fit in its share of a CUDA device
(``rollout.gpu_memory_utilization`` x ``cluster.memory_gb`` less the weights), and refills a
finished sequence's place, so its decoding steps are its sequences' expected tokens over the
sequences at once (``ppo.expected_response_length``). ``hf`` decodes padded batches of
``rollout.micro_batch_size`` prompts x ``rollout.n`` that run until the response bound. The
prefill is compute-bound: 2 x Psi FLOPs a prompt token, every sample's prompt (what prefix
caching shares between a prompt's samples is left out). An engine spans
``rollout.tensor_parallel_size`` devices (vllm) whose bandwidth and FLOPs add up; its
all-reduces, the sampling and the engine's own overheads are left out. The engines are the
training devices' (``rollout.num_devices=0``) or the rollout's own, each with its share of the
step's samples.

[Note: the rollout on devices of its own]
With ``rollout.num_devices=D`` the engines live on D devices of their own: the training devices
hold no engine (none of its memory in the actor's peaks; ``strategy=auto`` chooses with what is
left), and the actor still gathers every unit at its P scope once per update, then each actor
rank sends the weights to the replicas it serves (replica j by rank j mod N; the rollout's
devices are counted after the training ones, in nodes of ``cluster.group_size``, so a replica
on a training rank's node takes intra links, any other inter), at the links' bandwidths: the
sync is that gather plus the busiest rank's transfer. The step follows ``ppo/pipeline.py``:
``step_seconds`` over ``order(rollout.max_staleness)``, the synchronous order adding sync,
generation and training, the K-step-off order the sync and the longer of the other two. The
table over D splits the run's devices every way the conf can run, plans each split's
strategies afresh on its training devices, and gives both orders.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

from rlhf_paro.config import Config, ConfigError
from rlhf_paro.plan.cost import GB, GIB
from rlhf_paro.plan.search import Plan, make_plan
from rlhf_paro.ppo import pipeline
from rlhf_paro.rollout import vllm as vllm_engine

class Generation(NamedTuple):
    """A rollout's predicted generation ([Note: generation time])."""

    seconds: float
    engines: int  # engines generating side by side
    devices: int  # devices one engine spans (rollout.tensor_parallel_size for vllm)
    sequences: int  # one engine's share of the step's samples
    concurrent: int  # sequences one engine decodes at once
    steps: int  # decoding steps of one engine
    step_seconds: float  # one decoding step
    memory_bound: bool  # whether reading weights and cache sets a step's time (not FLOPs)
    prefill_seconds: float


def generation(cfg: Config, num_params: int, weights_bytes: int, kv_token_bytes: int
               ) -> Generation:
    """[Note: generation time] of one step's rollout: on the rollout's own devices
    (``rollout.num_devices``) or on the training devices; ``weights_bytes``: the engine's
    copy, ``kv_token_bytes``: the key/value cache of one token."""
    r, c = cfg.rollout, cfg.cluster
    vllm = r.engine == vllm_engine.NAME
    devices = r.num_devices or c.num_devices
    span = r.tensor_parallel_size if vllm else 1
    engines = max(1, devices // span)
    samples = cfg.ppo.rollout_batch_size * r.n
    sequences = math.ceil(samples / engines)
    prompt, bound = cfg.prompt_bound()[1], cfg.response_bound()[1]
    expected = cfg.ppo.expected_response_length or bound
    if vllm:
        concurrent = min(r.max_num_seqs, sequences)
        if c.device == "cuda" and c.memory_gb is not None and r.gpu_memory_utilization != "auto":
            # sequences at their longest
            room = r.gpu_memory_utilization * c.memory_gb * GIB * span - weights_bytes
            concurrent = min(concurrent, max(1, int(room // (kv_token_bytes * (prompt + bound)))))
        # Continuous batching refills a finished sequence's place: the engine's tokens over
        # the sequences it decodes at once; each sequence's cache grows to its own length.
        steps, decoded = math.ceil(sequences * expected / concurrent), expected
    else:
        prompts = r.micro_batch_size or math.ceil(cfg.ppo.rollout_batch_size / engines)
        concurrent = min(sequences, prompts * r.n)
        # hf decodes padded batches that run until their longest reaches the bound.
        steps, decoded = math.ceil(sequences / concurrent) * bound, bound
    read = weights_bytes + concurrent * kv_token_bytes * (prompt + decoded / 2)
    memory_s = read / (span * c.memory_gbps * GB)
    compute_s = 2 * num_params * concurrent / (span * c.tflops * 1e12)
    prefill = 2 * num_params * sequences * prompt / (span * c.tflops * 1e12)
    step = max(memory_s, compute_s)
    return Generation(steps * step + prefill, engines, span, sequences, concurrent, steps, step,
                      memory_s >= compute_s, prefill)


def transfer_seconds(cfg: Config, weights_bytes: float, node_size: int | None = None
                     ) -> tuple[float, float, float]:
    """The weights' transfer to the replicas on the rollout's own devices, per update: the
    intra and inter bytes of the busiest actor rank and its seconds ([Note: the rollout on
    devices of its own]); ``node_size``: devices a node (None: ``cluster.group_size``)."""
    c, replicas = cfg.cluster, cfg.rollout.num_devices
    node = node_size or c.group_size
    worst = (0.0, 0.0, 0.0)
    for rank in range(min(c.num_devices, replicas)):
        served = range(rank, replicas, c.num_devices)
        intra = sum((c.num_devices + j) // node == rank // node for j in served)
        inter = len(served) - intra
        sent = (intra * weights_bytes, inter * weights_bytes)
        seconds = sent[0] / (c.intra_gbps * GB) + sent[1] / (c.inter_gbps * GB)
        worst = max(worst, (seconds, *sent))
    return worst[1], worst[2], worst[0]


class StepPrediction(NamedTuple):
    """A step's predicted seconds by ``ppo/pipeline.py``'s order of its stages."""

    order: str  # synchronous or K steps off
    sync: float  # the actor's gather at P's scope, and the transfer to replicas
    transfer: float  # of which the transfer
    generate: float
    train: float  # experience and training: the run's models, less the sync
    seconds: float


def predict_step(cfg: Config, plan: Plan, max_staleness: int | None = None,
                 node_size: int | None = None) -> StepPrediction | None:
    """The step with generation ([Note: generation time]) and the planned models, as
    ``pipeline.step_seconds`` reads ``pipeline.order(max_staleness)`` (None: the conf's
    ``rollout.max_staleness``); None when no combination fits. ``node_size``: as
    ``transfer_seconds`` takes it."""
    if plan.best is None:
        return None
    k = cfg.rollout.max_staleness if max_staleness is None else max_staleness
    actor = plan.models["actor"]
    gather = actor.gather[plan.best["actor"].strategy.params]
    transfer = transfer_seconds(cfg, actor.engine_weights, node_size)[2]
    gen = generation(cfg, actor.num_params, actor.engine_weights, actor.kv_token_bytes).seconds
    train = sum(ch.seconds for ch in plan.best.values()) - gather
    stages = pipeline.order(k)
    name = "synchronous" if not pipeline.overlaps(stages) else f"{k} step{'s' * (k > 1)} off"
    return StepPrediction(name, gather + transfer, transfer, gen, train,
                          pipeline.step_seconds(stages, gather + transfer, gen, train))


class Split(NamedTuple):
    """One row of the table over the devices given to the rollout."""

    rollout_devices: int  # D
    training_devices: int  # N: the rest
    synchronous: StepPrediction | None  # None: nothing fits
    overlapped: StepPrediction | None  # K steps off (D > 0), or None


def rollout_splits(cfg: Config, vocab_sizes: dict[str, int]
                   ) -> tuple[list[Split], dict[int, str]]:
    """The run's devices, ``cluster.num_devices + rollout.num_devices``, split every way into
    D for the rollout and the rest for training, each split planned afresh (its strategies
    chosen on the training devices, as ``strategy=auto`` would), at the conf's
    ``rollout.max_staleness`` (at least 1 where D > 0); and each split the conf cannot run,
    with the one-line reason. Training groups are as large as divides both N and the node
    (``cluster.group_size``), so a node the rollout shares counts as smaller groups; its
    replicas there take intra links."""
    c, r = cfg.cluster, cfg.rollout
    total, k = c.num_devices + r.num_devices, max(1, r.max_staleness)
    rows, skipped = [], {}
    for d in range(total):
        n = total - d
        try:
            cluster = dataclasses.replace(c, num_devices=n, group_size=math.gcd(n, c.group_size),
                                          nodes=None, gpus_per_node=None)
            split = dataclasses.replace(cfg, cluster=cluster, rollout=dataclasses.replace(
                r, num_devices=d, max_staleness=k if d else 0))
            plan = make_plan(split, vocab_sizes)
        except ConfigError as e:
            skipped[d] = str(e)
            continue
        rows.append(Split(d, n, predict_step(split, plan, 0, c.group_size),
                          predict_step(split, plan, k, c.group_size) if d else None))
    return rows, skipped
