"""The planner's cost model: per-device memory, traffic and predicted time of every strategy of
one model (``model_plan``).

[Note: what a PPO step costs]
Per PPO step on one device: every model runs its inference forwards over the device's share of
the step's samples (``ppo.rollout_batch_size`` x ``rollout.n`` sequences, / N per device, in
micro-batches), the actor also gathers its parameters once, and the trained models each run
(samples / mini-batch) x epochs optimizer steps of s micro-batches. The actor's one gather is
its generation's (``rollout.engine=hf`` generates on its parameters, phase ``generate``) or,
for an engine with a copy of its own (``rollout.needs_sync``: vllm), the sync of that copy
after the update (phase ``sync``, a unit at a time, ``engine.unit_parameters``), which then
generates without gathering: the same gathers of every unit at P's scope, so the same bytes
and time, reported by P level under the actor's table. The predicted time is the sum of those
(the models run one after another); generation's decoding is the same for every strategy and
is left out of it: the step adds it ([Note: generation time]).

[Note: real tokens]
A packed model (``models.packs``) computes on the real tokens of its sequences only
(docs/design.md, "Batching"), so its FLOPs and time follow the expected length of a sequence:
the prompt bound (``Config.prompt_bound``; a mean of the prompts is not known before they are
read, so the bound stands for it) plus ``ppo.expected_response_length`` (null:
``ppo.max_new_tokens``; with an environment, an episode's actions and observations, null: the
episode's budget ``env.max_total_tokens`` less the prompt bound). A padded model computes on its rank's width, the rank's longest prompt
and longest response, which nothing in the config predicts better than their bounds: it keeps
the worst case. Memory is never sized by the expected length, since a plan that fits must fit
whatever the rollout: a forward of b sequences holds at most b x the longest sequence
(prompt bound + max_new_tokens, or an episode's ``env.max_total_tokens``) positions, packed (at most b rows as wide as the longest) or padded. Under
``max_tokens_per_micro_batch`` = B a training micro-batch holds at most B real tokens but any
number of sequences. Packed, its first-fit rows are as wide as its longest sequence W, and any
two rows hold more than W real tokens between them (the later one's first sequence did not fit
the earlier one), so K rows hold more than (K - 1) W / 2 and K W < 2 B + W: the planner takes
2 B + the longest possible sequence, at most the rank's mini-batch x the longest. Padded, a
micro-batch of short sequences may be the rank's whole mini-batch at the rank's width: the
planner takes that. The micro-batches of a mini-batch under B are then its expected real
tokens / B (at least one, at most its sequences); the fillers of the ranks with fewer are left
out.

[Note: setup peak]
The run's models set up at the same time, each rank reading only its shards from the model's
files one unit at a time; a model then holds at most its P + G + OS plus its largest unit
gathered (``cost.setup_memory``, the engine's [Note: setup memory]). A fitting combination's
setup peaks must also fit in ``memory_gb`` (no activations exist yet, so the reserve is
free then).

[Note: offload]
``<role>.offload`` (docs/design.md, "Offload") places states in host memory: ``optimizer`` the OS
level (12 bytes per trainable element: an fp32 master of its own and the moments, plus 4 for a
copy of the OS gradient), ``params`` the P level between the model's own phases. So a model's
resident states on the device are what its offload leaves there, and under ``params`` its P comes
back on top of them while it runs (in its peak). The table prints, for every strategy, the
device bytes between phases under each offload mode the role takes (``none``, ``opt``,
``par``), whatever the conf picks; P, G, OS, sum, peak and setup follow the conf's mode. The
planner's one-model-at-a-time view ([Note: the run's models share a device]) is kinder to
``params`` than the trainer is: ref, reward and critic score a rollout at the same time, so
their parameters are on the device together then.

[Note: a rollout engine's memory]
On CUDA, ``rollout.engine=vllm`` takes ``rollout.gpu_memory_utilization`` x ``memory_gb`` of
the device as it starts: its copy of the weights (the actor's parameters in the actor's
precision) and, in the rest, its key/value cache and its own activations. It is awake while the
actor syncs and generates and asleep while the models score and train (level 1: the weights go
to host memory, the cache is dropped). So that share is in the actor's generation peak, on top
of the run's states and of the one unit the sync holds gathered, and in no scoring or training
peak; and in the actor's setup peak, since the engine starts once the actor's states are on the
device. An engine whose weights and the cache of one sequence at the longest do not fit in its
share does not start: the planner refuses it with a ``ConfigError`` naming
``rollout.gpu_memory_utilization`` (the engine's activations come on top: that is the least it
needs). Without ``memory_gb`` the share is unknown, and on a CPU device the engine sizes its
cache from the run and never sleeps: the planner then counts none of it, and says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from rlhf_paro import rollout
from rlhf_paro.comm.meter import SYNC
from rlhf_paro.comm.simulate import Links
from rlhf_paro.comm.topology import Topology
from rlhf_paro.config import FROZEN_ROLES, OFFLOAD_ALLOWED, TRAINED_ROLES, Config, ConfigError
from rlhf_paro.models import build_model, hf_config, packs
from rlhf_paro.rollout import vllm
from rlhf_paro.sharding.cost import (DEVICE_KEYS, bytes_per_element, offload_memory, setup_memory,
                                     traffic)
from rlhf_paro.sharding.layout import unit_sizes
from rlhf_paro.sharding.steptime import (Machine, StepTime, Workload, forward_time, gather_seconds,
                                         peak_memory, step_time, transformer_workload)
from rlhf_paro.sharding.strategy import Level, Strategy, all_strategies

GIB = 2 ** 30
GB = 1e9


@dataclass(frozen=True)
class Timed:
    """A model's predicted PPO-step time with one strategy at one micro-batch size."""

    seconds: float
    compute: float  # of which compute
    exposed: float  # of which communication that nothing hides
    # The model's own peak above its resident states (activations, buffers, and under
    # offload=params its parameters brought back for its phases).
    peak_bytes: float


@dataclass(frozen=True)
class Option:
    """One strategy of one model on one device."""

    strategy: Strategy
    params_bytes: int
    grads_bytes: int
    optim_bytes: int
    intra_bytes: float  # sent per PPO step, at the configured micro-batch
    inter_bytes: float
    # Micro-batch size -> prediction, for every size the model may take (the configured one
    # first); see [Note: the run's models share a device].
    by_micro: dict[int, Timed] = field(default_factory=dict)
    # Held at most while setting up: P + G + OS + one unit gathered, or the states and the
    # share of the actor's rollout engine ([Note: a rollout engine's memory]).
    setup_bytes: int = 0
    # [Note: offload] Under the conf's <role>.offload: host bytes per device, and each mode the
    # role takes -> device bytes between the model's phases (the planner's table shows them all).
    host_bytes: int = 0
    device_by_offload: dict[str, int] = field(default_factory=dict)
    # The actor's, when its rollout engine syncs: what the sync holds above the states beside
    # the engine (one unit gathered; under offload=params, the parameters brought back).
    sync_bytes: float = 0.0

    @property
    def memory_bytes(self) -> int:  # P + G + OS on the device between the model's phases
        return self.params_bytes + self.grads_bytes + self.optim_bytes

    @property
    def configured(self) -> Timed:
        return next(iter(self.by_micro.values()))

    @property
    def seconds(self) -> float:  # predicted per PPO step at the configured micro-batch
        return self.configured.seconds

    def best_within(self, room: float) -> tuple[int, Timed] | None:
        """The largest micro-batch whose peak fits in ``room`` bytes above the states."""
        fitting = [(b, t) for b, t in self.by_micro.items() if t.peak_bytes <= room]
        return max(fitting, key=lambda bt: bt[0]) if fitting else None


@dataclass(frozen=True)
class Tokens:
    """Token positions the planner sizes one model's work by ([Note: real tokens])."""

    longest: int  # a sequence at its longest: prompt bound + ppo.max_new_tokens (memory)
    compute: int  # a sequence as the model computes on it (FLOPs and time)
    packed: bool  # whether the model runs packed (compute is then the expected real length)


class Sync(NamedTuple):
    """The actor's sync into a rollout engine with a copy of its own, per PPO step, at one P
    level ([Note: what a PPO step costs])."""

    intra_bytes: float
    inter_bytes: float
    seconds: float


@dataclass
class ModelPlan:
    role: str
    num_params: int  # Psi
    num_trainable: int  # Psi'
    options: list[Option]
    tokens: Tokens
    kv_cache_bytes: float = 0.0  # the actor's generation cache, not in any peak (see format)
    # The actor's, when its rollout engine syncs: per P level (N, I, G), what the sync costs.
    sync: dict[Level, Sync] = field(default_factory=dict)
    # [Note: a rollout engine's memory] The share of the device the actor's rollout engine
    # takes while it runs, in the actor's generation and setup peaks (0: not counted), and
    # the weights it holds in it.
    engine_bytes: float = 0.0
    # The actor's: its weights as an engine holds them (LoRA merged), every unit's gather at
    # each P level's scope (to generate on, or to sync), and a token's key/value cache.
    engine_weights: float = 0.0
    gather: dict[Level, float] = field(default_factory=dict)
    kv_token_bytes: int = 0

    def option(self, strategy: Strategy) -> Option:
        return next(o for o in self.options if o.strategy == strategy)



def frozen_strategies() -> list[Strategy]:
    return [Strategy(level) for level in Level]


def machine(cfg: Config) -> Machine:
    """The device and links of ``cluster`` as the step-time model takes them."""
    c = cfg.cluster
    return Machine(Links(c.intra_gbps * GB, c.inter_gbps * GB, c.intra_latency_us * 1e-6,
                         c.inter_latency_us * 1e-6), c.tflops * 1e12)


def micro_batch_sizes(cfg: Config, role: str) -> list[int]:
    """The configured micro-batch size first, then the larger ones the model may take: up to
    ``max_micro_batch_size``, and for trained models only sizes that divide the mini-batch
    (``ppo.mini_batch_size`` = N x micro-batch x s)."""
    model_cfg = cfg.model(role)
    top = model_cfg.max_micro_batch_size or model_cfg.micro_batch_size
    n = cfg.cluster.num_devices
    return [b for b in range(model_cfg.micro_batch_size, top + 1)
            if role in FROZEN_ROLES or cfg.ppo.mini_batch_size % (n * b) == 0]


def samples_per_device(cfg: Config) -> int:
    # Each prompt is sampled rollout.n times, its group on one rank.
    return cfg.ppo.rollout_batch_size * cfg.rollout.n // cfg.cluster.num_devices


def _optimizer_steps(cfg: Config) -> int:
    """A trained model's optimizer steps per PPO step: its mini-batches over the samples."""
    samples = cfg.ppo.rollout_batch_size * cfg.rollout.n
    return samples // cfg.ppo.mini_batch_size * cfg.ppo.ppo_epochs


def _inference_passes(cfg: Config, micro_batch: int) -> int:
    return math.ceil(samples_per_device(cfg) / micro_batch)


def _sequence_tokens(cfg: Config, role: str, model_type: str | None) -> Tokens:
    """[Note: real tokens] for one model; ``model_type`` None: no model (a reward function)."""
    longest = cfg.longest_sequence()[1]
    packed = model_type is not None and packs(cfg.model(role), model_type)
    return Tokens(longest, expected_tokens(cfg) if packed else longest, packed)


def expected_tokens(cfg: Config) -> int:
    """A sequence's expected real tokens: the prompt bound + ``ppo.expected_response_length``
    (an episode's actions and observations when an environment is set; null: the bound of a
    response, ``Config.response_bound``)."""
    response = cfg.ppo.expected_response_length or cfg.response_bound()[1]
    return cfg.prompt_bound()[1] + response


def budget_split(cfg: Config, role: str, tokens: Tokens) -> tuple[int, int] | None:
    """Under a trained model's ``max_tokens_per_micro_batch``: the most positions a training
    micro-batch holds, and the micro-batches a rank's mini-batch splits into, expected
    ([Note: real tokens]); None without a budget."""
    budget = cfg.model(role).max_tokens_per_micro_batch
    if budget is None or role not in TRAINED_ROLES:
        return None
    sequences = cfg.ppo.mini_batch_size // cfg.cluster.num_devices
    positions = sequences * tokens.longest
    if tokens.packed:
        positions = min(positions, 2 * budget + tokens.longest)
    count = math.ceil(sequences * expected_tokens(cfg) / budget)
    return positions, min(sequences, max(1, count))


class _Work(NamedTuple):
    """One model's workloads ([Note: real tokens])."""

    time: Workload  # sequences as the model computes on them
    memory: Workload  # sequences at their longest
    # Under a token budget: a training micro-batch's most positions as one sequence, and the
    # micro-batches of a rank's mini-batch; None: micro_batch_size sequences each.
    budget: tuple[Workload, int] | None


def _workload(cfg: Config, role: str, units: list, vocab_size: int, hf: Any,
              seq_len: int) -> Workload:
    model_cfg = cfg.model(role)
    if hf is None:  # a reward function or server: no model, no FLOPs to speak of
        return transformer_workload(units, hidden=1, ffn=1, vocab=1, seq_len=1,
                                    precision=model_cfg.precision,
                                    reduce_dtype=model_cfg.reduce_dtype, checkpointing=False)
    hidden = hf.hidden_size
    head = vocab_size if role in ("actor", "ref") else 1
    return transformer_workload(units, hidden=hidden,
                                ffn=getattr(hf, "intermediate_size", None) or 4 * hidden,
                                vocab=head, seq_len=seq_len,
                                precision=model_cfg.precision,
                                reduce_dtype=model_cfg.reduce_dtype,
                                checkpointing=model_cfg.gradient_checkpointing)


def _work(cfg: Config, role: str, units: list, vocab_size: int) -> tuple[_Work, Tokens]:
    model_cfg = cfg.model(role)
    hf = hf_config(role, model_cfg, vocab_size) if model_cfg.runs_model else None
    t = _sequence_tokens(cfg, role, hf.model_type if hf is not None else None)
    split = budget_split(cfg, role, t) if hf is not None else None
    budget = None if split is None else \
        (_workload(cfg, role, units, vocab_size, hf, split[0]), split[1])
    return _Work(_workload(cfg, role, units, vocab_size, hf, t.compute),
                 _workload(cfg, role, units, vocab_size, hf, t.longest), budget), t


def _kv_token_bytes(cfg: Config, vocab_size: int) -> int:
    """The actor's key/value cache of one token: a key and a value per layer."""
    hf = hf_config("actor", cfg.actor, vocab_size)
    kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
    width = kv_heads * (hf.hidden_size // hf.num_attention_heads)
    return 2 * hf.num_hidden_layers * width * bytes_per_element(cfg.actor.precision)


def _kv_cache_bytes(cfg: Config, vocab_size: int) -> float:
    """The actor's key/value cache while it generates all its samples at once, every row as
    long as it may get (generation runs padded)."""
    positions = samples_per_device(cfg) * cfg.longest_sequence()[1]
    return _kv_token_bytes(cfg, vocab_size) * positions


def _timed(cfg: Config, role: str, strategy: Strategy, work: _Work, b: int,
           onload_bytes: int = 0, engine_bytes: float | None = None) -> Timed:
    """[Note: what a PPO step costs] for one strategy at micro-batch size ``b``;
    ``onload_bytes``: parameters parked between the model's phases ([Note: offload]);
    ``engine_bytes``: the actor's, when its rollout engine syncs ([Note: a rollout engine's
    memory]); None when it generates on the actor's parameters."""
    topo = Topology(cfg.cluster.num_devices, cfg.cluster.group_size)
    m, algorithm = machine(cfg), cfg.comm.algorithm
    parts: list[StepTime] = [forward_time(strategy, work.time, topo, m, b, algorithm)] * \
        _inference_passes(cfg, b)
    seconds = sum(t.total for t in parts)
    compute = sum(t.compute for t in parts)
    mem = peak_memory(strategy, work.memory, topo, b)
    peak = mem.inference
    if role == "actor":  # for generation, or to sync the rollout engine's copy
        seconds += gather_seconds(strategy, work.time, topo, m, algorithm)
        peak = max(peak, mem.gathered if engine_bytes is None else mem.unit + engine_bytes)
    if role in TRAINED_ROLES:
        optimizer_steps = _optimizer_steps(cfg)
        sequences = cfg.ppo.mini_batch_size // cfg.cluster.num_devices
        if work.budget is None:
            per_micro, num_micro, train_peak = b, sequences // b, mem.train
        else:  # sequences per micro-batch on average, and the peak of the most positions
            budget_work, num_micro = work.budget
            per_micro = sequences / num_micro
            train_peak = peak_memory(strategy, budget_work, topo, 1).train
        step = step_time(strategy, work.time, topo, m, per_micro, num_micro, algorithm)
        seconds += optimizer_steps * step.total
        compute += optimizer_steps * step.compute
        peak = max(peak, train_peak)
    return Timed(seconds, compute, seconds - compute, peak - mem.states + onload_bytes)


def model_plan(cfg: Config, role: str, vocab_size: int) -> ModelPlan:
    """Memory, per-PPO-step traffic and predicted time of every strategy of one model (see the
    module notes)."""
    model_cfg = cfg.model(role)
    # A reward function has no model: it holds and sends nothing.
    model = (torch.nn.Module() if not model_cfg.runs_model else
             build_model(role, model_cfg, vocab_size, meta=True))
    units = unit_sizes(model)
    num_params = sum(p.numel() for p in model.parameters())
    num_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    del model
    work, tokens = _work(cfg, role, units, vocab_size)
    n, m, precision = cfg.cluster.num_devices, cfg.cluster.group_size, model_cfg.precision
    algorithm = cfg.comm.algorithm
    trained = role in TRAINED_ROLES
    optimizer_steps = _optimizer_steps(cfg)
    # Micro-batches per optimizer step: by sequences, or as many as a token budget makes.
    accum = cfg.grad_accum_steps(role) if work.budget is None else work.budget[1]
    # The actor gathers once more per PPO step: to generate, or to sync its rollout engine (or
    # the replicas on devices of their own, whatever their engine).
    replicas = cfg.rollout.num_devices
    syncs = int(role == "actor" and (rollout.needs_sync(cfg.rollout.engine) or replicas > 0))
    passes = _inference_passes(cfg, model_cfg.micro_batch_size) + (role == "actor") - syncs
    inference = {}  # P level -> per-step bytes of the inference forwards, shared by triples
    sync, gather = {}, {}
    for level in Level:
        if role == "actor":
            gather[level] = gather_seconds(Strategy(level), work.time, Topology(n, m),
                                           machine(cfg), algorithm)
        phases = traffic(Strategy(level), units, n, m, passes, precision, algorithm,
                         syncs=syncs)
        inference[level] = (sum(p.intra for p in phases.values()),
                            sum(p.inter for p in phases.values()))
        if syncs:
            sync[level] = Sync(*phases[SYNC], gather[level])
    weights, engine = 0, None  # the engine's weights, and what a syncing one takes as it runs
    if role == "actor":
        # The engine holds the plain model: a LoRA actor's adapters come merged into it.
        weights = (num_params - num_trainable if model_cfg.lora.enabled else num_params) * \
            bytes_per_element(precision)
    if syncs:
        engine = _engine_bytes(cfg, weights, vocab_size)
        if replicas:  # the engines live on the rollout's own devices: none on the actor's
            engine = 0.0
    options = []
    offload, modes = cfg.offload(role), OFFLOAD_ALLOWED[role][0]
    for strategy in all_strategies() if trained else frozen_strategies():
        placed = {mode: offload_memory(strategy, units, n, m, precision, mode) for mode in modes}
        held = placed[offload]
        intra, inter = inference[strategy.params]
        if trained:
            phases = traffic(strategy, units, n, m, accum, precision, algorithm,
                             reduce_dtype=model_cfg.reduce_dtype)
            intra += optimizer_steps * sum(p.intra for p in phases.values())
            inter += optimizer_steps * sum(p.inter for p in phases.values())
        by_micro = {b: _timed(cfg, role, strategy, work, b, held["host_params"], engine)
                    for b in micro_batch_sizes(cfg, role)}
        setup = setup_memory(strategy, units, n, m, precision, offload)
        sync_bytes = 0.0
        if engine:  # [Note: a rollout engine's memory]: it starts beside the states
            setup = max(setup, sum(held[k] for k in DEVICE_KEYS) + math.ceil(engine))
            mem = peak_memory(strategy, work.memory, Topology(n, m), 1)
            sync_bytes = mem.unit - mem.states + held["host_params"]
        options.append(Option(
            strategy, held["params"], held["grads"], held["optim"], intra, inter, by_micro,
            setup, host_bytes=sum(v for k, v in held.items() if k not in DEVICE_KEYS),
            device_by_offload={mode: sum(p[k] for k in DEVICE_KEYS)
                               for mode, p in placed.items()}, sync_bytes=sync_bytes))
    kv = _kv_cache_bytes(cfg, vocab_size) if role == "actor" and not replicas else 0.0
    return ModelPlan(role, num_params, num_trainable, options, tokens, kv, sync, engine or 0.0,
                     weights, gather,
                     _kv_token_bytes(cfg, vocab_size) if role == "actor" else 0)


def _engine_bytes(cfg: Config, weights: int, vocab_size: int) -> float:
    """[Note: a rollout engine's memory]: the device bytes the actor's syncing rollout engine,
    holding ``weights`` bytes of weights, takes while it runs (0: not counted); ``ConfigError``
    when it could not start in them."""
    memory_gb = cfg.cluster.memory_gb
    if cfg.rollout.engine != vllm.NAME or cfg.cluster.device != "cuda" or memory_gb is None:
        return 0.0
    least = weights + vllm.min_kv_cache_bytes(cfg, hf_config("actor", cfg.actor, vocab_size))
    if cfg.rollout.gpu_memory_utilization == "auto":  # [Note: the engine's share, auto]
        return float(least)
    share = cfg.rollout.gpu_memory_utilization * memory_gb * GIB
    if least > share:
        raise ConfigError("rollout.gpu_memory_utilization", (
            f"{cfg.rollout.gpu_memory_utilization} of cluster.memory_gb={memory_gb:g} is "
            f"{share / GIB:.2f} GiB, less than the engine's weights and the key/value cache of "
            f"one sequence ({least / GIB:.2f} GiB); allowed: at least "
            f"{math.ceil(least / (memory_gb * GIB) * 100) / 100:g}"))
    return share
