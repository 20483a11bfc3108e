"""Planner: per-device memory, traffic and predicted time of every strategy of every model, and
what to pick.

    python -m rlhf_paro.plan [--help] [--cfg job] [-m] [conf=NAME] [override ...]
    python -m rlhf_paro.plan conf=ppo_llama7b cluster.nodes=16 cluster.gpus_per_node=8

Each model is built on the meta device (no weights, no GPU) and cut into units exactly as the
engine cuts it; ``sharding/cost.py`` gives the bytes held in P, G and OS (the paper's Table 2)
and sent on intra- and inter-group links (Table 3), and ``sharding/steptime.py`` predicts the
time: compute at ``cluster.tflops``, every collective of the strategy's schedule on the links'
bandwidths and latencies (``cluster.*_gbps``, ``cluster.*_latency_us``), what the engine
hides behind compute, and the activation memory of a micro-batch. Strategies are the 14
triples for actor and critic, the three P levels for reward and ref. The models are the run's
(``ppo/algorithms.roles``): PPO's four, three without a critic (grpo, rloo, ...), one fewer
without ref (``algorithm.kl_coef=0``).

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

[Note: the run's models share a device]
Every device holds the states (P + G + OS) of all the run's models; only the model that is
running holds activations, gathered parameters and gradient buffers. A combination fits when
their states plus the largest of those peaks stay within ``memory_gb`` x (1 -
``activation_reserve``). The planner searches every combination (14 x 14 x 3 x 3 for PPO's four
models, 14 x 3 x 3 without a critic) for the least predicted time that fits; where
``<role>.max_micro_batch_size`` allows, each model takes the largest micro-batch the memory left
by the states holds (fewer micro-batches, fewer collectives). A strategy is marked as fitting
when some combination that contains it fits. A run without a critic leaves the states a critic
would hold to the others: the printout says how much, from the critic PPO would build
(``algorithm.adv_estimator=gae``) at its leanest strategy.

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

[Note: the engine's share, auto]
``rollout.gpu_memory_utilization=auto`` (the default) gives a colocated CUDA engine what the
run's models leave. The planner first counts the engine at the least it needs (its weights and
the key/value cache of one sequence at the run's longest), so the strategies it chooses leave at
least that; then, at those strategies (``engine_share``), the engine takes the room of the two
moments it is awake beside the models. While it generates: the budget (``memory_gb`` x (1 -
``activation_reserve``)) less the states of the run's models and what the actor's sync holds
above its own (one unit gathered; under ``offload=params`` its parameters brought back), the
engine being asleep in every other model's peak. As it starts: ``memory_gb`` less the other
models' setup peaks and the actor's states ([Note: setup peak]). The margin is the activation
reserve, left free in the first, and the share rounded down to a hundredth; it is capped at
``ENGINE_SHARE_CAP``. A share below the least is a ``ConfigError``, as is ``auto`` without
``memory_gb``; engines on devices of their own (``rollout.num_devices``) take the cap. The
planner's table, before the strategies are chosen, shows the least and does not limit the
engine's concurrency by memory.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from rlhf_paro import cli
from rlhf_paro.config import FROZEN_ROLES, OFFLOAD_ALLOWED, TRAINED_ROLES, Config, ConfigError
from rlhf_paro.sharding.strategy import Level, Strategy, all_strategies

if TYPE_CHECKING:
    from rlhf_paro.sharding.steptime import Machine, StepTime, Workload

GIB = 2 ** 30
# The planner table's offload columns: device bytes between phases under each mode.
OFFLOAD_COLUMNS = {"none": "none", "optimizer": "opt", "params": "par"}
GB = 1e9
# A count of the run's models in words ("the three hold ..."); ROLES has four.
_COUNT = ("no", "one", "two", "three", "four")


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


@dataclass(frozen=True)
class Choice:
    """A model's strategy in the recommended combination, at its micro-batch."""

    option: Option
    micro_batch: int

    @property
    def strategy(self) -> Strategy:
        return self.option.strategy

    @property
    def timed(self) -> Timed:
        return self.option.by_micro[self.micro_batch]

    @property
    def seconds(self) -> float:
        return self.timed.seconds

    @property
    def memory_bytes(self) -> int:
        return self.option.memory_bytes


@dataclass
class Plan:
    models: dict[str, ModelPlan]  # the run's models (``algorithms.roles``), in ROLES order
    budget_bytes: float  # per device, for the models' states and the running one's peak
    device_bytes: float  # per device, for the models' setup peaks ([Note: setup peak])
    best: dict[str, Choice] | None  # least predicted time that fits; None when nothing fits
    fits: dict[str, set[Strategy]]  # per model, the strategies of some fitting combination
    # A run without a critic: the critic PPO would build, only to say what its absence frees.
    absent_critic: ModelPlan | None = None


def frozen_strategies() -> list[Strategy]:
    return [Strategy(level) for level in Level]


def machine(cfg: Config) -> Machine:
    """The device and links of ``cluster`` as the step-time model takes them."""
    from rlhf_paro.comm.simulate import Links
    from rlhf_paro.sharding.steptime import Machine

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


def _samples_per_device(cfg: Config) -> int:
    # Each prompt is sampled rollout.n times, its group on one rank.
    return cfg.ppo.rollout_batch_size * cfg.rollout.n // cfg.cluster.num_devices


def _optimizer_steps(cfg: Config) -> int:
    """A trained model's optimizer steps per PPO step: its mini-batches over the samples."""
    samples = cfg.ppo.rollout_batch_size * cfg.rollout.n
    return samples // cfg.ppo.mini_batch_size * cfg.ppo.ppo_epochs


def _inference_passes(cfg: Config, micro_batch: int) -> int:
    return math.ceil(_samples_per_device(cfg) / micro_batch)


def _sequence_tokens(cfg: Config, role: str, model_type: str | None) -> Tokens:
    """[Note: real tokens] for one model; ``model_type`` None: no model (a reward function)."""
    from rlhf_paro.models import packs

    longest = cfg.longest_sequence()[1]
    packed = model_type is not None and packs(cfg.model(role), model_type)
    return Tokens(longest, _expected_tokens(cfg) if packed else longest, packed)


def _expected_tokens(cfg: Config) -> int:
    """A sequence's expected real tokens: the prompt bound + ``ppo.expected_response_length``
    (an episode's actions and observations when an environment is set; null: the bound of a
    response, ``Config.response_bound``)."""
    response = cfg.ppo.expected_response_length or cfg.response_bound()[1]
    return cfg.prompt_bound()[1] + response


def _budget_split(cfg: Config, role: str, tokens: Tokens) -> tuple[int, int] | None:
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
    count = math.ceil(sequences * _expected_tokens(cfg) / budget)
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
    from rlhf_paro.sharding.steptime import transformer_workload

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
    from rlhf_paro.models import hf_config

    model_cfg = cfg.model(role)
    hf = hf_config(role, model_cfg, vocab_size) if model_cfg.runs_model else None
    t = _sequence_tokens(cfg, role, hf.model_type if hf is not None else None)
    split = _budget_split(cfg, role, t) if hf is not None else None
    budget = None if split is None else \
        (_workload(cfg, role, units, vocab_size, hf, split[0]), split[1])
    return _Work(_workload(cfg, role, units, vocab_size, hf, t.compute),
                 _workload(cfg, role, units, vocab_size, hf, t.longest), budget), t


def _kv_token_bytes(cfg: Config, vocab_size: int) -> int:
    """The actor's key/value cache of one token: a key and a value per layer."""
    from rlhf_paro.models import hf_config
    from rlhf_paro.sharding.cost import bytes_per_element

    hf = hf_config("actor", cfg.actor, vocab_size)
    kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
    width = kv_heads * (hf.hidden_size // hf.num_attention_heads)
    return 2 * hf.num_hidden_layers * width * bytes_per_element(cfg.actor.precision)


def _kv_cache_bytes(cfg: Config, vocab_size: int) -> float:
    """The actor's key/value cache while it generates all its samples at once, every row as
    long as it may get (generation runs padded)."""
    positions = _samples_per_device(cfg) * cfg.longest_sequence()[1]
    return _kv_token_bytes(cfg, vocab_size) * positions


def _timed(cfg: Config, role: str, strategy: Strategy, work: _Work, b: int,
           onload_bytes: int = 0, engine_bytes: float | None = None) -> Timed:
    """[Note: what a PPO step costs] for one strategy at micro-batch size ``b``;
    ``onload_bytes``: parameters parked between the model's phases ([Note: offload]);
    ``engine_bytes``: the actor's, when its rollout engine syncs ([Note: a rollout engine's
    memory]); None when it generates on the actor's parameters."""
    from rlhf_paro.comm.topology import Topology
    from rlhf_paro.sharding.steptime import forward_time, gather_seconds, peak_memory, step_time

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
    import torch

    from rlhf_paro import rollout
    from rlhf_paro.comm.meter import SYNC
    from rlhf_paro.comm.topology import Topology
    from rlhf_paro.models import build_model
    from rlhf_paro.sharding.cost import (DEVICE_KEYS, bytes_per_element, offload_memory,
                                         setup_memory, traffic)
    from rlhf_paro.sharding.layout import unit_sizes
    from rlhf_paro.sharding.steptime import gather_seconds, peak_memory

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
    from rlhf_paro.models import hf_config
    from rlhf_paro.rollout import vllm

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


def _budget(cfg: Config, reserve: float) -> float:
    if cfg.cluster.memory_gb is None:
        return math.inf
    return cfg.cluster.memory_gb * GIB * (1.0 - reserve)


def _search(models: dict[str, ModelPlan], budget: float, device: float,
            fixed: dict[str, Strategy]
            ) -> tuple[dict[str, Choice] | None, dict[str, set[Strategy]]]:
    """Least-time fitting combination (ties: less memory), and each model's fitting options."""
    roles = tuple(models)
    choices = [[models[r].option(fixed[r])] if r in fixed else models[r].options for r in roles]
    best, best_key = None, None
    fits: dict[str, set[Strategy]] = {r: set() for r in roles}
    for combo in itertools.product(*choices):
        states = sum(o.memory_bytes for o in combo)
        picked = [o.best_within(budget - states) for o in combo]
        if any(p is None for p in picked) or sum(o.setup_bytes for o in combo) > device:
            continue
        for role, option in zip(roles, combo):
            fits[role].add(option.strategy)
        key = (round(sum(t.seconds for _, t in picked), 6), states)
        if best_key is None or key < best_key:
            best_key = key
            best = {role: Choice(o, b) for role, o, (b, _) in zip(roles, combo, picked)}
    return best, fits


def make_plan(cfg: Config, vocab_sizes: dict[str, int] | None = None,
              fixed: dict[str, Strategy] | None = None) -> Plan:
    """Plan the run's models (``algorithms.roles``); ``fixed`` pins the strategies of some of
    them; ``vocab_sizes``: ``ppo.data.vocab_sizes`` (read here when not given). ``cfg`` is
    resolved (``rlhf_paro.resolve``): every model the run builds has its source."""
    from rlhf_paro.ppo import algorithms

    if vocab_sizes is None:
        from rlhf_paro.ppo.data import vocab_sizes as read_vocab_sizes

        vocab_sizes = read_vocab_sizes(cfg)
    models = {role: model_plan(cfg, role, vocab_sizes[role]) for role in algorithms.roles(cfg)}
    budget, device = _budget(cfg, cfg.cluster.activation_reserve), _budget(cfg, 0.0)
    best, fits = _search(models, budget, device, fixed or {})
    return Plan(models, budget, device, best, fits, _absent_critic(cfg, vocab_sizes))


def _absent_critic(cfg: Config, vocab_sizes: dict[str, int]) -> ModelPlan | None:
    """The critic PPO would build for this run (``algorithm.adv_estimator=gae``); None when the
    run has a critic, or when PPO could not run this conf's critic section."""
    from rlhf_paro.ppo import algorithms
    from rlhf_paro.resolve import derive

    if "critic" in algorithms.roles(cfg):
        return None
    gae = dataclasses.replace(cfg, algorithm=dataclasses.replace(cfg.algorithm,
                                                                 adv_estimator="gae"))
    try:
        algorithms.check(gae)
        gae = derive(gae, say=lambda _: None)
    except ConfigError:  # e.g. its unused micro-batch does not tile the mini-batch
        return None
    return model_plan(gae, "critic", vocab_sizes["critic"])


def configured_strategies(cfg: Config) -> dict[str, Strategy]:
    """The strategies the conf sets for the run's models (roles left at ``auto`` are absent)."""
    from rlhf_paro.ppo import algorithms

    return {role: Strategy.parse(cfg.model(role).strategy, frozen=role in FROZEN_ROLES)
            for role in algorithms.roles(cfg) if cfg.model(role).strategy != "auto"}


def _choose(cfg: Config, vocab_sizes: dict[str, int] | None) -> dict[str, Choice] | None:
    from rlhf_paro.ppo import algorithms

    roles = algorithms.roles(cfg)
    fixed = configured_strategies(cfg)
    if len(fixed) == len(roles) and not any(cfg.model(r).max_micro_batch_size for r in roles):
        return None  # nothing to choose
    plan = make_plan(cfg, vocab_sizes, fixed)
    if plan.best is None:
        auto = [r for r in roles if r not in fixed] or list(roles)
        raise ConfigError(f"{auto[0]}.strategy", "auto found no strategy with which all "
                          f"{_COUNT[len(roles)]} models fit in cluster.memory_gb="
                          f"{cfg.cluster.memory_gb}; allowed: more devices or memory, or see "
                          "python -m rlhf_paro.plan")
    return plan.best


def choose_strategies(cfg: Config, vocab_sizes: dict[str, int] | None = None
                      ) -> dict[str, Strategy]:
    """A strategy for each of the run's models: the conf's where it sets one, the planner's for
    ``auto``.

    The ``auto`` roles get the least predicted PPO-step time such that the run's models fit in
    ``cluster.memory_gb``; raises ``ConfigError`` when no choice fits.
    """
    best = _choose(cfg, vocab_sizes)
    if best is None:
        return configured_strategies(cfg)
    return {role: choice.strategy for role, choice in best.items()}


def resolve_auto(cfg: Config, vocab_sizes: dict[str, int] | None = None) -> Config:
    """``cfg`` with every ``auto`` strategy of the run's models replaced by the planner's
    choice, and every micro-batch that ``max_micro_batch_size`` lets grow set to the planner's
    size (a model the run does not build keeps its section as it is); then the vllm engine's
    ``rollout.gpu_memory_utilization=auto`` on CUDA set from what those leave of the device."""
    best = _choose(cfg, vocab_sizes)
    resolved = dataclasses.replace(cfg)
    for role, choice in (best or {}).items():
        setattr(resolved, role, dataclasses.replace(
            cfg.model(role), strategy=choice.strategy.name, micro_batch_size=choice.micro_batch))
    return _resolve_engine_share(resolved, vocab_sizes)


# The most of a device ``rollout.gpu_memory_utilization=auto`` gives the engine: vLLM's own
# default, which leaves the rest to the CUDA context and other processes on the device.
ENGINE_SHARE_CAP = 0.9


def engine_share(memory_bytes: float, reserve: float, states_bytes: float, sync_bytes: float,
                 setup_bytes: float, least_bytes: float) -> float:
    """[Note: the engine's share, auto]: the share of a device of ``memory_bytes`` the vllm
    engine takes beside the run's models: while it generates, their ``states_bytes`` and the
    actor's ``sync_bytes`` above them, within the planner's budget (``reserve`` of the device
    kept free); as it starts, ``setup_bytes`` (the other models' setup peaks and the actor's
    states), within the device. ``ConfigError`` when the share is less than ``least_bytes``,
    the engine's weights and the key/value cache of one sequence at the run's longest."""
    room = min(memory_bytes * (1.0 - reserve) - states_bytes - sync_bytes,
               memory_bytes - setup_bytes)
    share = min(ENGINE_SHARE_CAP, math.floor(max(room, 0.0) / memory_bytes * 100) / 100)
    if share * memory_bytes < least_bytes:
        raise ConfigError("rollout.gpu_memory_utilization", (
            f"auto: the run's models leave {max(room, 0.0) / GIB:.2f} GiB of "
            f"cluster.memory_gb={memory_bytes / GIB:g} to the vllm engine, less than its weights "
            f"and the key/value cache of one sequence ({least_bytes / GIB:.2f} GiB); allowed: "
            f"auto with more devices or memory, or a number in (0, 1]"))
    return share


def _resolve_engine_share(cfg: Config, vocab_sizes: dict[str, int] | None) -> Config:
    """``cfg`` with ``rollout.gpu_memory_utilization=auto`` set where a CUDA vllm engine reads
    it ([Note: the engine's share, auto]); its strategies are all set."""
    from rlhf_paro.rollout import vllm

    r, c = cfg.rollout, cfg.cluster
    if r.gpu_memory_utilization != "auto" or r.engine != vllm.NAME or c.device != "cuda":
        return cfg
    if r.num_devices:  # each replica holds a device of its own alone
        share = ENGINE_SHARE_CAP
    elif c.memory_gb is None:
        raise ConfigError("rollout.gpu_memory_utilization", "auto sizes the vllm engine on CUDA "
                                                            "from cluster.memory_gb, which is "
                                                            "null; allowed: a number in (0, 1], "
                                                            "or auto with cluster.memory_gb set")
    else:
        if vocab_sizes is None:
            from rlhf_paro.ppo.data import vocab_sizes as read_vocab_sizes

            vocab_sizes = read_vocab_sizes(cfg)
        strategies = configured_strategies(cfg)
        models = {role: model_plan(cfg, role, vocab_sizes[role]) for role in strategies}
        chosen = {role: models[role].option(s) for role, s in strategies.items()}
        actor = chosen.pop("actor")
        share = engine_share(c.memory_gb * GIB, c.activation_reserve,
                             actor.memory_bytes + sum(o.memory_bytes for o in chosen.values()),
                             actor.sync_bytes,
                             actor.memory_bytes + sum(o.setup_bytes for o in chosen.values()),
                             models["actor"].engine_bytes)
    return dataclasses.replace(cfg, rollout=dataclasses.replace(r, gpu_memory_utilization=share))


# --- generation and the order of a step ---------------------------------------------------------

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
    from rlhf_paro.rollout import vllm as vllm_engine

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
    from rlhf_paro.ppo import pipeline

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


# --- report -------------------------------------------------------------------------------------

def _time_key(seconds: float, memory_bytes: int) -> tuple[float, int]:
    # Times within a microsecond are a tie (float noise of equal work): less memory wins.
    return round(seconds, 6), memory_bytes


def _alone(plan: Plan, model: ModelPlan) -> list[Option]:
    """The model's options that fit the device with the device to itself, fastest first."""
    fitting = [o for o in model.options
               if o.memory_bytes + o.configured.peak_bytes <= plan.budget_bytes]
    return sorted(fitting, key=lambda o: _time_key(o.seconds, o.memory_bytes))


def _why(plan: Plan, role: str) -> str:
    """One line: why this model got its recommended strategy, in predicted times."""
    chosen = plan.best[role]
    model = plan.models[role]
    t = chosen.timed
    grown = "" if chosen.micro_batch == next(iter(chosen.option.by_micro)) else \
        f", micro-batch grown to {chosen.micro_batch}"
    sync = model.sync.get(chosen.strategy.params)
    synced = "" if sync is None else f", of which the sync {sync.seconds:.3g} s" \
        if sync.seconds else f", the sync nothing at P={chosen.strategy.params.name}"
    head = (f"{chosen.strategy}: {t.seconds:.4g} s/PPO step predicted (compute "
            f"{t.compute:.3g} s, exposed communication {t.exposed:.3g} s{synced}{grown})")
    faster = [o for o in model.options
              if _time_key(o.seconds, o.memory_bytes) < _time_key(t.seconds, chosen.memory_bytes)
              and o.strategy != chosen.strategy]
    if not faster:
        return f"{head}; the least of its {len(model.options)} strategies"
    fastest = min(faster, key=lambda o: _time_key(o.seconds, o.memory_bytes))
    extra = fastest.memory_bytes - chosen.memory_bytes
    if extra <= 0:  # offload=params: the same resident states, but more brought back to run
        extra = fastest.configured.peak_bytes - t.peak_bytes
        return (f"{head}; {fastest.strategy} would take {fastest.seconds:.4g} s but needs "
                f"{extra / GIB:+.2f} GiB more while it runs: the {_COUNT[len(plan.models)]} "
                "would not fit")
    return (f"{head}; {fastest.strategy} would take {fastest.seconds:.4g} s but holds "
            f"{extra / GIB:+.2f} GiB of states: the {_COUNT[len(plan.models)]} would not fit")


def _engine_lines(cfg: Config, model: ModelPlan, mem_unit: str, mem_scale: float,
                  net_unit: str, net_scale: float) -> list[str]:
    """What the actor's syncing rollout engine costs: the sync by P level ([Note: what a PPO
    step costs]) and its memory ([Note: a rollout engine's memory])."""
    by_level = "; ".join(
        f"P={level.name} " + ("nothing" if not (s.intra_bytes or s.inter_bytes) else
                              f"{s.intra_bytes / net_scale:.3f} {net_unit} intra + "
                              f"{s.inter_bytes / net_scale:.3f} {net_unit} inter, "
                              f"{s.seconds:.3g} s")
        for level, s in model.sync.items())
    engine, c = cfg.rollout.engine, cfg.cluster
    weights = f"{model.engine_weights / mem_scale:.2f} {mem_unit} of weights"
    share = cfg.rollout.gpu_memory_utilization
    if model.engine_bytes:
        taken = (f"at least {model.engine_bytes / mem_scale:.2f} {mem_unit} (rollout."
                 "gpu_memory_utilization=auto: what the chosen strategies leave, set as the run "
                 "starts)" if share == "auto" else
                 f"{model.engine_bytes / mem_scale:.2f} {mem_unit} (rollout."
                 f"gpu_memory_utilization={share:g} x cluster.memory_gb={c.memory_gb:g})")
        memory = (f"  the {engine} engine takes {taken}, {weights} and the rest for its "
                  "key/value cache, while the actor syncs and generates (in its peak and "
                  "setup); asleep in host memory while the models score and train")
    else:
        memory = (f"  the {engine} engine's {weights} and its key/value cache are not counted "
                  + ("(a CPU device)" if c.device != "cuda" else "(no cluster.memory_gb)"))
    return [f"  sync into the {engine} engine once per PPO step, every unit gathered at P's "
            f"scope, in place of generation's gather (in intra, inter and s/step): {by_level}",
            memory]


def _absent_critic_line(cfg: Config, plan: Plan, mem_unit: str, mem_scale: float) -> str:
    """What a run without a critic leaves to its models: the states of the critic PPO would
    build, at its leanest strategy (of those that fit the device alone, if any does)."""
    critic = plan.absent_critic
    fitting = _alone(plan, critic)
    leanest = min(fitting or critic.options, key=lambda o: (o.memory_bytes, round(o.seconds, 6)))
    return (f"no critic (algorithm.adv_estimator={cfg.algorithm.adv_estimator}): frees "
            f"{leanest.memory_bytes / mem_scale:.2f} {mem_unit} per device that a critic under "
            f"{leanest.strategy} (its leanest strategy{' that fits' if fitting else ''}) would "
            f"hold; the {_COUNT[len(plan.models)]} models use it")


def _tokens_line(cfg: Config, plan: Plan) -> str:
    """One line: the sequence lengths the planner sized memory and compute by
    ([Note: real tokens])."""
    key, prompt = cfg.prompt_bound()
    ppo = cfg.ppo
    bound, longest = cfg.longest_sequence()
    running = [r for r in plan.models if cfg.model(r).runs_model]
    packed = [r for r in running if plan.models[r].tokens.packed]
    padded = [r for r in running if r not in packed]
    response_key, response_bound = cfg.response_bound()
    response = (f"ppo.expected_response_length={ppo.expected_response_length}"
                if ppo.expected_response_length is not None else
                f"{response_key}={response_bound}: expected_response_length null")
    compute = []
    if packed:
        compute.append(f"the expected {_expected_tokens(cfg)} ({key}={prompt} + {response}) for "
                       f"{', '.join(packed)} (packed)")
    if padded:
        compute.append(f"the padded {longest} for {', '.join(padded)} (packing off)")
    episode = " (an episode: actions and observations)" if cfg.env.enabled else ""
    return (f"tokens per sequence{episode}: memory by the longest, {longest} ({bound}); "
            "compute by " + "; ".join(compute))


def _step_lines(cfg: Config, plan: Plan, mem_unit: str, mem_scale: float) -> list[str]:
    """The rollout's generation ([Note: generation time]) and the step in the order of its
    stages (``ppo/pipeline.py``)."""
    step = predict_step(cfg, plan)
    if step is None:
        return []
    actor, c, r = plan.models["actor"], cfg.cluster, cfg.rollout
    gen = generation(cfg, actor.num_params, actor.engine_weights, actor.kv_token_bytes)
    where = (f"on {r.num_devices} device(s) of its own" if r.num_devices else
             f"on the {c.num_devices} training devices")
    bound = "memory-bound" if gen.memory_bound else "compute-bound"
    lines = [f"generation ({r.engine}, {where}): {gen.engines} engine(s) of {gen.devices} "
             f"device(s), {gen.sequences} sequences each, {gen.concurrent} at a time: "
             f"{gen.steps} decoding steps of {gen.step_seconds * 1e3:.3g} ms ({bound}: "
             f"{actor.engine_weights / mem_scale:.2f} {mem_unit} of weights and the cache read "
             f"per step at "
             f"cluster.memory_gbps={c.memory_gbps:g}) + prefill {gen.prefill_seconds:.3g} s = "
             f"{gen.seconds:.4g} s"]
    sync = f"sync {step.sync:.3g} s" + (f" (of which the transfer to {r.num_devices} "
                                        f"replica(s) {step.transfer:.3g} s)" if r.num_devices
                                        else "")
    parts = (f"{sync} + max(generation {step.generate:.4g} s, training {step.train:.4g} s)"
             if r.max_staleness else
             f"{sync} + generation {step.generate:.4g} s + training {step.train:.4g} s")
    lines.append(f"step ({step.order}, rollout.max_staleness={r.max_staleness}): {parts} = "
                 f"{step.seconds:.4g} s predicted")
    return lines


def _splits_lines(cfg: Config, splits: tuple[list[Split], dict[int, str]]) -> list[str]:
    """The table over the devices given to the rollout (``rollout_splits``)."""
    rows, skipped = splits
    total = cfg.cluster.num_devices + cfg.rollout.num_devices
    k = max(1, cfg.rollout.max_staleness)
    lines = ["", f"devices for the rollout, of {total}: D for the rollout, N for training (its "
                 "strategies planned on N), seconds predicted per step",
             f"  {'D':>4} {'N':>4} {'generate':>9} {'train':>9} {'sync':>7} {'step K=0':>9} "
             f"{'step K=' + str(k):>9}"]
    fastest = None
    for row in rows:
        if row.synchronous is None:
            lines.append(f"  {row.rollout_devices:>4} {row.training_devices:>4}  no "
                         "combination fits")
            continue
        s, o = row.synchronous, row.overlapped
        best = min(s.seconds, o.seconds if o else math.inf)
        if fastest is None or best < fastest[1]:
            fastest = (row.rollout_devices, best)
        lines.append(f"  {row.rollout_devices:>4} {row.training_devices:>4} {s.generate:9.4g} "
                     f"{s.train:9.4g} {s.sync:7.3g} {s.seconds:9.4g} "
                     + (f"{o.seconds:9.4g}" if o else f"{'-':>9}"))
    if skipped:
        first = next(iter(skipped))
        lines.append(f"  D={', '.join(map(str, skipped))}: not runnable with this conf (D={first}: "
                     f"{skipped[first]})")
    if fastest is not None:
        lines.append(f"  fastest: D={fastest[0]} ({fastest[1]:.4g} s per step)")
    return lines


def format_plan(cfg: Config, plan: Plan,
                splits: tuple[list[Split], dict[int, str]] | None = None) -> str:
    c = cfg.cluster
    roles = tuple(plan.models)
    budget = "unlimited" if math.isinf(plan.budget_bytes) else (
        f"{plan.budget_bytes / GIB:.1f} GiB of {c.memory_gb:g} GiB (reserve "
        f"{c.activation_reserve:.0%} beyond modelled activations and buffers)")
    lines = [
        f"cluster: N={c.num_devices} devices, M={c.group_size} per group, g={c.num_groups} "
        f"groups, {c.device}; links {c.intra_gbps:g} GB/s + {c.intra_latency_us:g} us intra, "
        f"{c.inter_gbps:g} GB/s + {c.inter_latency_us:g} us inter; {c.tflops:g} TFLOP/s; "
        f"comm {cfg.comm.algorithm}",
        f"memory per device: {budget}",
        f"PPO step: rollout {cfg.ppo.rollout_batch_size} prompts x {cfg.rollout.n} samples, "
        f"mini-batch {cfg.ppo.mini_batch_size}, {cfg.ppo.ppo_epochs} epoch(s); models "
        f"{', '.join(roles)} (algorithm.adv_estimator={cfg.algorithm.adv_estimator}); traffic "
        "is bytes one device sends per PPO step, time is predicted per PPO step (generation's "
        "decoding apart: see step)",
        _tokens_line(cfg, plan),
        "P, G, OS, sum, peak and setup are device bytes under each model's offload; columns "
        + "/".join(OFFLOAD_COLUMNS.values()) + ": device bytes between the model's phases under "
        + "/".join(OFFLOAD_COLUMNS) + " ('-': not for this model)",
    ]
    configured = configured_strategies(cfg)
    # Tiny models read better in MiB/MB, real ones in GiB/GB.
    big = max(o.memory_bytes for m in plan.models.values() for o in m.options) >= GIB
    mem_unit, mem_scale = ("GiB", GIB) if big else ("MiB", 2 ** 20)
    net_unit, net_scale = ("GB", GB) if big else ("MB", 1e6)
    for role, model in plan.models.items():
        m_cfg = cfg.model(role)
        split = _budget_split(cfg, role, model.tokens)
        steps = "" if role not in TRAINED_ROLES else f", s={cfg.grad_accum_steps(role)}" \
            if split is None else (f", s={split[1]} expected under max_tokens_per_micro_batch="
                                   f"{m_cfg.max_tokens_per_micro_batch}")
        alone = _alone(plan, model)
        rank = {o.strategy: k + 1 for k, o in enumerate(alone)}
        modes = OFFLOAD_ALLOWED[role][0]
        lines += ["", f"{role}: Psi={model.num_params:,} Psi'={model.num_trainable:,} "
                      f"{m_cfg.precision}{steps}, micro-batch {m_cfg.micro_batch_size}, conf "
                      f"strategy {m_cfg.strategy}{' (deepspeed)' if m_cfg.backend == 'deepspeed' else ''}, "
                      f"offload {cfg.offload(role)}; fastest first "
                      "(rank: alone on the device)",
                  f"  rank strategy {'P':>7} {'G':>8} {'OS':>8} {'sum':>8} {'peak':>8} "
                  f"{'setup':>8} "
                  + "".join(f"{OFFLOAD_COLUMNS[mode]:>8} " for mode in OFFLOAD_COLUMNS)
                  + f"{'intra':>9} {'inter':>9} {'s/step':>9} {'compute':>8} {'exposed':>8}  fits",
                  f"                {mem_unit:>7} {mem_unit:>8} {mem_unit:>8} {mem_unit:>8} "
                  f"{mem_unit:>8} {mem_unit:>8} "
                  + "".join(f"{mem_unit if mode in modes else '':>8} " for mode in OFFLOAD_COLUMNS)
                  + f"{net_unit:>9} {net_unit:>9}"]
        for o in sorted(model.options, key=lambda o: _time_key(o.seconds, o.memory_bytes)):
            marks = "yes" if o.strategy in plan.fits[role] else "no"
            if plan.best is not None and plan.best[role].strategy == o.strategy:
                marks += "  <- recommended"
            if configured.get(role) == o.strategy:
                marks += "  (conf)"
            held = [o.params_bytes, o.grads_bytes, o.optim_bytes, o.memory_bytes,
                    o.memory_bytes + o.configured.peak_bytes, o.setup_bytes]
            cells = " ".join(f"{b / mem_scale:8.2f}" for b in held)
            cells += "".join(f" {o.device_by_offload[mode] / mem_scale:8.2f}"
                             if mode in o.device_by_offload else f" {'-':>8}"
                             for mode in OFFLOAD_COLUMNS)
            sent = " ".join(f"{b / net_scale:9.3f}" for b in (o.intra_bytes, o.inter_bytes))
            t = o.configured
            lines.append(f"  {rank.get(o.strategy, '-')!s:>4} {o.strategy.name:<7}{cells} {sent} "
                         f"{t.seconds:9.4g} {t.compute:8.3g} {t.exposed:8.3g}  {marks}")
        if m_cfg.offload != "none":
            shown = plan.best[role].option if plan.best is not None else min(
                model.options, key=lambda o: o.memory_bytes)
            lines.append(f"  offload={m_cfg.offload}: {shown.strategy} also holds "
                         f"{shown.host_bytes / mem_scale:.2f} {mem_unit} in host memory per "
                         "device")
        if model.sync:
            lines += _engine_lines(cfg, model, mem_unit, mem_scale, net_unit, net_scale)
        elif model.kv_cache_bytes:
            lines.append(f"  generation also holds a key/value cache of "
                         f"{model.kv_cache_bytes / mem_scale:.1f} {mem_unit} for the device's "
                         f"{_samples_per_device(cfg)} samples at once, not counted in any peak")
    lines.append("")
    if plan.absent_critic is not None:
        lines.append(_absent_critic_line(cfg, plan, mem_unit, mem_scale))
    count = _COUNT[len(roles)]
    if plan.best is None:
        leanest = sum(min(o.memory_bytes for o in m.options) for m in plan.models.values())
        engine = plan.models["actor"].engine_bytes
        lines.append(f"no combination fits: the leanest states need {leanest / GIB:.1f} GiB "
                     "per device" + (f", the rollout engine {engine / GIB:.1f} GiB more while "
                                     "it generates" if engine else "")
                     + "; add devices or memory, or use LoRA for the actor"
                     + (", or lower rollout.gpu_memory_utilization" if engine else ""))
    else:
        states = sum(ch.memory_bytes for ch in plan.best.values())
        peak = max(ch.timed.peak_bytes for ch in plan.best.values())
        total = sum(ch.seconds for ch in plan.best.values())
        room = "" if math.isinf(plan.budget_bytes) else \
            (f"; the {count} hold {states / GIB:.1f} GiB of states, {(states + peak) / GIB:.1f} "
             f"GiB at the peak, of {plan.budget_bytes / GIB:.1f} GiB")
        lines.append(f"recommended ({total:.4g} s per PPO step predicted{room}):")
        lines += [f"  {role:<7}{_why(plan, role)}" for role in roles]
        setup = sum(ch.option.setup_bytes for ch in plan.best.values())
        engine = ", and the actor's rollout engine its share" if \
            plan.models["actor"].engine_bytes else ""
        lines.append(f"setup peak: {setup / mem_scale:.2f} {mem_unit} per device while the "
                     f"{count} models set up at once (each its P + G + OS and one unit "
                     f"gathered{engine})")
        if len(configured) == len(roles):
            picked = [plan.models[r].option(configured[r]) for r in roles]
            states = sum(o.memory_bytes for o in picked)
            fits = all(o.best_within(plan.budget_bytes - states) for o in picked)
            seconds = sum(o.seconds for o in picked)
            setup = sum(o.setup_bytes for o in picked)
            during = "fits" if setup <= plan.device_bytes else "does NOT fit"
            lines.append(f"the conf's strategies: {seconds:.4g} s per PPO step predicted, "
                         f"{states / GIB:.1f} GiB of states per device: "
                         f"{'fits' if fits else 'does NOT fit'}; setup peak "
                         f"{setup / mem_scale:.2f} {mem_unit}: {during}")
        lines += _step_lines(cfg, plan, mem_unit, mem_scale)
    if splits is not None:
        lines += _splits_lines(cfg, splits)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    cli.main(sys.argv[1:] if argv is None else argv, prog="rlhf_paro.plan", about=_ABOUT,
             prepare=_prepare, execute=lambda cfg, _: print(_report(cfg)))


def _report(cfg: Config) -> str:
    from rlhf_paro.ppo.data import vocab_sizes

    sizes = vocab_sizes(cfg)
    return format_plan(cfg, make_plan(cfg, sizes), rollout_splits(cfg, sizes))


# --help: the first paragraph of the module docstring.
_ABOUT = __doc__.split("\n\n")[0]


def _prepare(cfg: Config, conf: str) -> Config:
    """The run's config resolved (``rlhf_paro.resolve``: which models, their sources, the files
    they name), and its model sections checked."""
    from rlhf_paro.models import check_model_configs
    from rlhf_paro.ppo.data import vocab_sizes
    from rlhf_paro.resolve import resolve

    cfg = resolve(cfg, engine_check=False)  # the engine is the run's to check, where it runs
    check_model_configs(cfg, vocab_sizes(cfg))
    return cfg


if __name__ == "__main__":
    cli.exit_when_done(main)
