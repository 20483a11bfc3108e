"""Typed configuration, the schema: one dataclass per component, and the builder that makes them
from plain data.

The config is made in three parts, each run by the one before it:

1. the schema (this module): the dataclasses, each checking its own values on construction
   (``__post_init__``) and ``Config`` checking how sections agree. Pure: no file is read, no
   environment variable, no sibling section rewritten; the same data always builds the same
   config or raises the same error;
2. composition (``rlhf_paro/compose.py``): conf files, their ``defaults:``, the command line's
   overrides and the keys that replace one another, interpolations, then ``build_config``, then
   the ``~`` that starts a path expanded (``PATH_KEYS``, ``map_paths``);
3. ``resolve()`` (``rlhf_paro/resolve.py``), run once by the entry points before anything runs:
   the demo's assets made, every file the config names checked, the values derived from other
   sections set (a model's source, a DeepSpeed model's strategy, the critic's source).

A user mistake raises ``ConfigError``: one line naming the key and what is allowed. Entry points
turn it into ``error: ...`` on stderr and exit status 2 (``cli_errors``).

The dataclasses are built here rather than by OmegaConf's structured configs because OmegaConf
converts loosely (2 becomes true for a bool, true becomes "True" for a string), has no Literal,
and reports on several lines; the builder below is strict and names the key in one line.

This module imports neither torch nor transformers nor anything above it, so a bad command line
fails fast. Checks that need transformers (an inline model config) live in ``rlhf_paro.models``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
import sys
import types
import typing
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterator, Literal

from rlhf_paro.comm.meter import ALGORITHM_CHOICES
from rlhf_paro.sharding.strategy import Strategy, StrategyError

ROLES = ("actor", "critic", "reward", "ref")
TRAINED_ROLES = ("actor", "critic")
FROZEN_ROLES = ("reward", "ref")
# <role>.offload modes each role takes, and why the others are refused.
OFFLOAD_ALLOWED = {
    "actor": (("none", "optimizer"), "the actor runs in every phase of a PPO step (generation, "
              "inference, training): there is no phase to park its parameters in"),
    "critic": (("none", "optimizer", "params"), ""),
    "reward": (("none", "params"), "a frozen model has no optimizer state"),
    "ref": (("none", "params"), "a frozen model has no optimizer state"),
}


class ConfigError(ValueError):
    """A configuration mistake; ``str()`` is one line: ``<key>: <problem and what is allowed>``."""

    def __init__(self, key: str, problem: str) -> None:
        self.key = key
        self.problem = problem
        message = f"{key}: {problem}" if key else problem
        # Keys and values come from the command line: a newline in one must not break the line.
        super().__init__("".join(c if c.isprintable() else ascii(c)[1:-1] for c in message))

    def __reduce__(self) -> tuple:
        # A worker's ConfigError reaches the driver pickled: rebuild it from its two parts.
        return ConfigError, (self.key, self.problem)

    def under(self, prefix: str) -> ConfigError:
        """The same error with its key qualified by the section it was found in."""
        return ConfigError(_join(prefix, self.key), self.problem)


class NothingToRun(Exception):
    """Not a mistake: a job that has nothing left to do (a finished run asked for no more
    steps); ``str()`` is the one line the entry point prints before it goes on, exit 0."""


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix and key else prefix or key


def _positive(key: str, value: float | None) -> None:
    if value is not None and value <= 0:
        raise ConfigError(key, f"must be positive, got {value}")


def _unit_interval(key: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ConfigError(key, f"must be in [0, 1], got {value}")


# --- model sections -------------------------------------------------------------------------------

@dataclass
class OptimConfig:
    """AdamW and gradient clipping of a trained model."""

    lr: float = 1e-5  # learning rate
    betas: tuple[float, float] = (0.9, 0.95)  # Adam moment decay rates
    eps: float = 1e-8  # Adam denominator epsilon
    weight_decay: float = 0.0  # decoupled weight decay
    max_grad_norm: float = 1.0  # clip by global norm; every element counted once across shards

    def __post_init__(self) -> None:
        _positive("lr", self.lr)
        _positive("eps", self.eps)
        _positive("max_grad_norm", self.max_grad_norm)
        if self.weight_decay < 0:
            raise ConfigError("weight_decay", f"must be >= 0, got {self.weight_decay}")
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError("betas", f"must be two numbers in [0, 1), got {list(self.betas)}")

    def adamw(self) -> dict[str, Any]:
        """Keyword arguments for AdamW (and for the engine's ``optim=``)."""
        return {"lr": self.lr, "betas": self.betas, "eps": self.eps,
                "weight_decay": self.weight_decay}


@dataclass
class LoraConfig:
    """Low-rank adapters (PEFT) on the backbone; only the adapters are trained."""

    enabled: bool = False  # train adapters instead of the whole model (actor and critic only)
    # Export the base model with the adapters merged in, next to the adapter itself.
    merge_on_export: bool = False
    r: int = 8  # adapter rank
    alpha: float = 16.0  # adapter scale numerator (scale = alpha / r)
    dropout: float = 0.0  # dropout on the adapter input
    target_modules: list[str] = field(  # linear layers that get adapters
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    # What a rollout engine with a copy of its own (vllm, a replica's) takes at each sync:
    # the adapters alone, over the base weights it took once (at setup, after a resume), or
    # the whole model with them merged in: the full model's bytes a sync, and no LoRA
    # kernels in the engine's decoding.
    sync: Literal["adapters", "merged"] = "adapters"

    def __post_init__(self) -> None:
        _positive("r", self.r)
        _positive("alpha", self.alpha)
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError("dropout", f"must be in [0, 1), got {self.dropout}")
        if self.enabled and not self.target_modules:
            raise ConfigError("target_modules", "must name at least one module, e.g. [q_proj]")


@dataclass
class DeepSpeedOptions:
    """A model on DeepSpeed ZeRO (``backend=deepspeed``) instead of a PaRO strategy."""

    zero_stage: int = 3  # 0 (data parallel), 1, 2 or 3: what DeepSpeed partitions
    # ZeRO++ hpZ: a secondary copy of the parameters partitioned over this many ranks (a
    # node's devices, cluster.group_size), so backward gathers stay inside it; 1 is off.
    hpz_partition_size: int = 1
    # Adam's state and the fp32 master in host memory, stepped by DeepSpeedCPUAdam.
    offload_optimizer: bool = False
    # Any other DeepSpeed setting, merged over the generated config key by key, e.g.
    # {zero_optimization: {stage3_param_persistence_threshold: 0}}.
    config: dict[str, Any] = field(default_factory=dict)

    def strategy(self, frozen: bool, group_size: int) -> str:
        """The PaRO strategy that keeps what this stage keeps (for the planner and the report):
        ZeRO-1 = NNG, ZeRO-2 = NGG, ZeRO-3 = GGG, ZeRO-3 with hpZ over a node = IGG."""
        params = ("I" if self.hpz_partition_size == group_size > 1 else "G") \
            if self.zero_stage == 3 else "N"
        if frozen:
            return params
        return params + {0: "NN", 1: "NG", 2: "GG", 3: "GG"}[self.zero_stage]


@dataclass
class ModelConfig:
    """One of the four PPO models. The same schema serves actor, critic, reward and ref.

    Source: ``path`` (a local Hugging Face model directory; never downloaded) or ``config`` (an
    inline Hugging Face config for random init, ``model_type`` defaulting to llama). A critic,
    reward or ref with neither inherits the actor's source, so ref starts from the actor's weights
    (set by ``resolve``; here it stays unset).
    """

    # A model has one source: a key of these given replaces the others (``compose``), and
    # more than one set is refused below.
    SOURCES: ClassVar[tuple[str, ...]] = ("path", "config", "function", "url")
    # Keys of one role only: another role's section neither lists nor suggests them, and refuses
    # them set (``Config``).
    ROLE_ONLY: ClassVar[dict[str, str]] = {
        "tokenizer": "actor", **{key: "reward" for key in ("function", "score_function", "url",
                                                           "timeout_s", "token_env",
                                                           "env_score")}}
    # Names users bring from other frameworks' configs: what an unknown key suggests first.
    ALIASES: ClassVar[dict[str, str]] = {
        "learning_rate": "optim.lr", "grad_clip": "optim.max_grad_norm",
        "clip_grad_norm": "optim.max_grad_norm", "batch_size": "micro_batch_size",
        "micro_batch": "micro_batch_size", "model": "path", "model_path": "path",
        "pretrain": "path", "name_or_path": "path", "dtype": "precision",
        "zero_stage": "deepspeed.zero_stage", "use_lora": "lora.enabled",
        "lora_rank": "lora.r", "lora_r": "lora.r", "lora_alpha": "lora.alpha",
        "gradient_checkpointing_enable": "gradient_checkpointing"}

    path: str | None = None  # a local Hugging Face model directory, never downloaded
    # An inline Hugging Face config (random init); transformers checks its keys. A critic, reward
    # or ref with neither path nor config takes the actor's.
    config: dict[str, Any] | None = None
    # A triple or preset for trained models, one P level for frozen ones, or ``auto`` (the planner).
    strategy: str = "auto"
    # paro: the PaRO engine under ``strategy``; deepspeed: DeepSpeed ZeRO under ``deepspeed``
    # (the strategy is then the stage's equivalent, DeepSpeedOptions.strategy).
    backend: Literal["paro", "deepspeed"] = "paro"
    deepspeed: DeepSpeedOptions = field(default_factory=DeepSpeedOptions)
    # bf16 keeps an fp32 master copy in the optimizer state (K = 12 bytes per parameter).
    precision: Literal["fp32", "bf16"] = "fp32"
    # Precision of gradient reductions between ranks (trained models; gradients always add up
    # in fp32): fp32 keeps the summed gradient exact to fp32 rounding in any order, bf16 halves
    # the gradient traffic.
    reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    # Host memory for states the device need not hold (docs/design.md, "Offload"): optimizer
    # (trained models) keeps the fp32 masters and Adam moments there and steps them on the CPU;
    # params (critic, reward, ref) parks the parameters there between the model's phases.
    offload: Literal["none", "optimizer", "params"] = "none"
    optim: OptimConfig = field(default_factory=OptimConfig)
    # Sequences per forward/backward on one device; gradient accumulation makes up the rest.
    micro_batch_size: int = 4
    # The planner may raise micro_batch_size up to this when the memory its strategies leave
    # holds the activations (fewer micro-batches, fewer per-micro-batch collectives); None
    # keeps micro_batch_size.
    max_micro_batch_size: int | None = None
    gradient_checkpointing: bool = False  # recompute block activations in the backward pass
    # Dropout off: the model's dropout probabilities set to 0 when it is built (lora.dropout is
    # left as given). With dropout on, the training forward is another network than the one that
    # sampled: at step 0 the ratio is not 1 nor the KL 0 (TRL's disable_dropout). false: keep it.
    disable_dropout: bool = True
    # Forward and backward on the real tokens only, a micro-batch's sequences packed into one
    # row (docs/design.md, "Batching"); null: packed wherever the architecture supports it.
    packing: bool | None = None
    # Trained models: each mini-batch of a rank split into micro-batches of up to this many real
    # tokens (attention_mask), the count agreed over ranks (docs/design.md, "Batching"); null:
    # micro_batch_size sequences per micro-batch.
    max_tokens_per_micro_batch: int | None = None
    lora: LoraConfig = field(default_factory=LoraConfig)
    # Actor only: a local tokenizer directory (None: the actor's path); AutoTokenizer loads it.
    tokenizer: str | None = None
    # Run code that ships with a model or tokenizer directory (off: such a model is refused).
    trust_remote_code: bool = False
    # Reward only: ``file.py:name``, a Python function (prompts, responses, **columns) ->
    # list[float] run on the reward workers instead of a reward model.
    function: str | None = None
    # Reward only: ``file.py:name`` like ``function``, logged as ppo/task_score and
    # eval/score_mean and never trained on (None: the reward itself is the score).
    score_function: str | None = None
    # Reward only: a reward server (http:// or https://) that gets each step's decoded prompts,
    # responses and columns and answers their rewards (``python -m rlhf_paro.reward_server``);
    # no model, like ``function``.
    url: str | None = None
    # Reward only: seconds the reward server has for each answer, whole (connecting, sending,
    # the answer's last byte), before the run stops.
    timeout_s: float = 60.0
    # Reward only: the NAME of an environment variable holding the reward server's bearer
    # token; the token itself stays out of the config, which is printed and saved.
    token_env: str | None = None
    # Reward only: the environment's episode score is the reward (``env.reward``; set when the
    # config is resolved): no model, like ``function``.
    env_score: bool = False

    @property
    def runs_model(self) -> bool:
        """False for a reward that is a function, a server or an environment's score: no
        weights, no engine."""
        return self.function is None and self.url is None and not self.env_score

    def reward_sources(self) -> list[str]:
        """The keys of this section that name a model, function or server."""
        return [key for key in self.SOURCES if getattr(self, key) is not None]

    def __post_init__(self) -> None:
        _positive("micro_batch_size", self.micro_batch_size)
        if self.max_tokens_per_micro_batch is not None:
            _positive("max_tokens_per_micro_batch", self.max_tokens_per_micro_batch)
        if self.max_micro_batch_size is not None and \
                self.max_micro_batch_size < self.micro_batch_size:
            raise ConfigError("max_micro_batch_size", f"{self.max_micro_batch_size} is below "
                              f"micro_batch_size={self.micro_batch_size}; allowed: null or at "
                              "least micro_batch_size")
        if self.path is not None and self.config is not None:
            raise ConfigError("path", "set either path (a local model directory) or config "
                                      "(an inline model config), not both; unset one with ~ (e.g. "
                                      "~actor.config) or =null")
        if self.function is not None and (self.path is not None or self.config is not None):
            raise ConfigError("function", "set either function (a reward function) or a model "
                                          "(path or config), not both; unset one with ~")
        for key in ("function", "score_function"):
            check_function_spec(key, getattr(self, key))
        _check_reward_server(self)


_MODEL_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ModelConfig)}


def check_function_spec(key: str, spec: str | None) -> None:
    """``file.py:name`` in form (whether the file exists is ``resolve``'s to check)."""
    if spec is None:
        return
    file, sep, name = spec.rpartition(":")
    if not sep or not file.endswith(".py") or not name.isidentifier():
        raise ConfigError(key, f"got {spec!r}; allowed: path/to/file.py:function_name")


def _check_reward_server(model: ModelConfig) -> None:
    if not (math.isfinite(model.timeout_s) and model.timeout_s > 0):
        raise ConfigError("timeout_s", f"must be a positive number of seconds, got "
                                       f"{model.timeout_s}")
    if model.url is None:
        if model.token_env is not None:  # a token for no server: a forgotten url
            raise ConfigError("token_env", "names a reward server's token, and url (the "
                                           "server) is not set; allowed: with url, or null")
        return
    try:
        parts = urllib.parse.urlsplit(model.url)
        # Reading the port checks it: a port that is not a number fails only then.
        valid = parts.scheme in ("http", "https") and bool(parts.hostname) and parts.port != 0
    except ValueError:
        valid = False
    if not valid or any(c.isspace() or not c.isprintable() for c in model.url):
        raise ConfigError("url", f"got {model.url!r}; allowed: an http:// or https:// URL such "
                                 "as http://127.0.0.1:8000/score")
    given = [key for key in ("path", "config", "function") if getattr(model, key) is not None]
    if given:
        raise ConfigError("url", f"set either url (a reward server) or {' or '.join(given)}, "
                                 "not both; unset one with ~")


# --- the other components -------------------------------------------------------------------------

@dataclass
class ClusterConfig:
    """Devices of one run: N devices in groups of M (a group is a node or a switch).

    Give ``num_devices``/``group_size`` directly, or ``nodes``/``gpus_per_node`` (N = nodes x
    gpus_per_node, M = gpus_per_node). After construction ``num_devices`` and ``group_size`` are
    always set.
    """

    num_devices: int | None = None  # N: devices in all, each hosting all four models
    group_size: int | None = None  # M: devices per group; divides N (None: N)
    nodes: int | None = None  # with gpus_per_node: N = nodes x gpus_per_node
    gpus_per_node: int | None = None  # with nodes: M = gpus_per_node
    device: Literal["cpu", "cuda"] = "cpu"  # cpu runs on gloo, cuda on NCCL (one GPU a device)
    # Memory of one device, for the planner and strategy=auto; None: no limit.
    memory_gb: float | None = None
    # Fraction of memory_gb the planner keeps free beyond what it models (it models
    # activations, gathered parameters and gradient buffers): fragmentation, runtime buffers.
    activation_reserve: float = 0.2
    # Per-device link bandwidths (GB/s) of the planner's step-time model: inside a group, and
    # between groups (inter_gbps).
    intra_gbps: float = 100.0
    inter_gbps: float = 12.5  # GB/s of a device's links to other groups (see intra_gbps)
    # Per-step latency (us) of a device's link inside a group, for the planner's model.
    intra_latency_us: float = 5.0
    inter_latency_us: float = 10.0  # us, the same between groups (see intra_latency_us)
    # Achieved TFLOP/s of one device on the models' arithmetic (A100 bf16: 312 peak).
    tflops: float = 150.0
    # Achieved GB/s of one device's memory, for the planner's generation time: decoding a token
    # reads the weights and the key/value cache (A100 80 GB: 2039 peak).
    memory_gbps: float = 1500.0
    # Torch threads of each worker on a CPU device. None: per phase, the cores a device owns
    # (this machine's cores / every device of the run, rollout devices included) shared by the
    # models that compute at once in that phase (actor.generate alone; the forwards of the
    # experience together; the actor's and critic's updates together). An integer: that many
    # in every phase (1: one per worker, whatever the machine).
    cpu_threads: int | None = None

    def __post_init__(self) -> None:
        for key in ("num_devices", "group_size", "nodes", "gpus_per_node", "memory_gb",
                    "intra_gbps", "inter_gbps", "tflops", "memory_gbps", "cpu_threads"):
            _positive(key, getattr(self, key))
        for key in ("intra_latency_us", "inter_latency_us"):
            if getattr(self, key) < 0:
                raise ConfigError(key, f"must be >= 0, got {getattr(self, key)}")
        if not 0.0 <= self.activation_reserve < 1.0:
            raise ConfigError("activation_reserve",
                              f"must be in [0, 1), got {self.activation_reserve}")
        if (self.nodes is None) != (self.gpus_per_node is None):
            raise ConfigError("nodes", "set nodes and gpus_per_node together (or neither)")
        if self.nodes is not None:
            total = self.nodes * self.gpus_per_node
            if self.num_devices is not None and self.num_devices != total:
                raise ConfigError("num_devices", f"{self.num_devices} disagrees with nodes x "
                                  f"gpus_per_node = {total}; set one or the other")
            self.num_devices = total
            if self.group_size is None:
                self.group_size = self.gpus_per_node
        if self.num_devices is None:
            raise ConfigError("num_devices", "missing; allowed: a positive integer (or set "
                                             "nodes and gpus_per_node)")
        if self.group_size is None:
            self.group_size = self.num_devices
        if self.num_devices % self.group_size:
            divisors = [d for d in range(1, self.num_devices + 1) if self.num_devices % d == 0]
            raise ConfigError("group_size", f"M={self.group_size} must divide num_devices "
                              f"N={self.num_devices}; allowed: {', '.join(map(str, divisors))}")

    @property
    def num_groups(self) -> int:  # g
        return self.num_devices // self.group_size


@dataclass
class CommConfig:
    """Algorithm for world-scope all-gather and reduce-scatter (docs/design.md, "Collectives")."""

    # auto (per collective, by size and topology: comm/auto.py), native, or a ring schedule of
    # comm/rings.py
    algorithm: str = "auto"

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHM_CHOICES:
            raise ConfigError("algorithm", f"got {self.algorithm!r}; allowed: "
                                           f"{', '.join(ALGORITHM_CHOICES)}")


@dataclass
class PPOConfig:
    """Rollout, advantage and loss settings. Batch sizes count sequences over all devices."""

    ALIASES: ClassVar[dict[str, str]] = {  # ModelConfig.ALIASES
        "batch_size": "rollout_batch_size", "train_batch_size": "rollout_batch_size",
        "epochs": "ppo_epochs", "num_epochs": "ppo_epochs", "mini_batch": "mini_batch_size",
        "max_length": "max_new_tokens", "response_length": "max_new_tokens",
        "max_response_length": "max_new_tokens",
        "cliprange": "clip_eps", "clip_ratio": "clip_eps", "cliprange_value": "value_clip_eps",
        "gae_lambda": "lam", "lambda": "lam", "discount": "gamma"}
    # Keys that went to another section: typed here, a line naming the one to type.
    MOVED: ClassVar[dict[str, str]] = {"max_prompt_len": "data.max_prompt_length",
                                       "max_prompt_length": "data.max_prompt_length"}

    rollout_batch_size: int = 32  # prompts generated per PPO step (each rollout.n times)
    mini_batch_size: int = 16  # sequences per optimizer step
    ppo_epochs: int = 1  # passes over the rollout per PPO step
    max_new_tokens: int = 8  # response length limit in tokens
    # Mean response length the planner sizes packed models' compute by (null: max_new_tokens,
    # the worst case); memory is always sized by max_new_tokens (docs/design.md, "Batching").
    # With an environment, an episode's response: its actions and observations (null: the
    # episode's budget less the prompt bound).
    expected_response_length: int | None = None
    temperature: float = 1.0  # sampling temperature (log-probs use the same one)
    top_k: int = 0  # 0: sample from the full distribution
    gamma: float = 1.0  # discount of future rewards
    lam: float = 0.95  # GAE lambda: bias (0) versus variance (1) of the advantage estimate
    clip_eps: float = 0.2  # PPO ratio clip
    value_clip_eps: float = 0.2  # how far the critic may move from its rollout-time values
    whiten_advantages: bool = True  # gae: normalise advantages over the whole rollout
    # Deal the step's sequences to ranks and mini-batches by real tokens, groups of rollout.n
    # whole (docs/design.md, "Batching"); false: each rank trains on what it generated.
    balance_batch: bool = True

    def __post_init__(self) -> None:
        for key in ("rollout_batch_size", "mini_batch_size", "ppo_epochs", "max_new_tokens",
                    "temperature", "clip_eps", "value_clip_eps"):
            _positive(key, getattr(self, key))
        _unit_interval("gamma", self.gamma)
        _unit_interval("lam", self.lam)
        if self.top_k < 0:
            raise ConfigError("top_k", f"must be >= 0 (0 disables it), got {self.top_k}")


@dataclass
class AlgorithmConfig:
    """Which RL algorithm trains the actor: its advantage estimator, where the KL to the
    reference goes and how the policy loss is aggregated. The names are checked against the
    registries of ``ppo/core.py`` and ``ppo/algorithms.py`` when the run is resolved
    (``algorithms.check``, from ``rlhf_paro.resolve``): this module stays free of the math."""

    ALIASES: ClassVar[dict[str, str]] = {  # ModelConfig.ALIASES
        "advantage_estimator": "adv_estimator", "estimator": "adv_estimator",
        "kl": "kl_coef", "beta": "kl_coef", "init_kl_coef": "kl_coef", "kl_penalty":
        "kl_estimator", "target_kl": "kl_target"}

    # gae (PPO with a critic), grpo, dr_grpo, rloo or reinforce_pp (critic-free).
    adv_estimator: str = "gae"
    # Per-token KL estimator against ref: k1, k2 or k3; null: by where the KL goes, k1 as the
    # penalty in the reward (unbiased), k3 as the loss term (k1 there has zero expected gradient).
    kl_estimator: str | None = None
    # KL coefficient (the start value when adaptive); 0: no KL anywhere and no ref model.
    kl_coef: float = 0.05
    # The KL as a loss term of the actor (GRPO) instead of a penalty in the token rewards.
    kl_in_loss: bool = False
    adaptive_kl: bool = False  # adapt kl_coef towards kl_target (Ziegler et al. 2019)
    kl_target: float = 6.0  # target KL per sequence of the adaptive controller
    kl_horizon: int = 10000  # samples over which the controller closes the gap to the target
    # token_mean, seq_mean_token_sum or seq_mean_token_mean (None: the estimator's own).
    loss_agg_mode: str | None = None

    def __post_init__(self) -> None:
        for key in ("kl_target", "kl_horizon"):
            _positive(key, getattr(self, key))
        if self.kl_coef < 0:
            raise ConfigError("kl_coef", f"must be >= 0, got {self.kl_coef}")


HF_CACHES = ("auto", "dynamic", "static")


@dataclass
class RolloutConfig:
    """How rollouts are sampled."""

    ALIASES: ClassVar[dict[str, str]] = {  # ModelConfig.ALIASES
        "num_samples": "n", "num_generations": "n", "samples_per_prompt": "n",
        "n_samples_per_prompt": "n", "backend": "engine", "name": "engine",
        "rollout_rs": "mask", "sequence_mask_metric": "mask", "rollout_rs_threshold": "mask_high",
        "rollout_rs_threshold_lower": "mask_low", "geo_mask_high": "mask_high",
        "geo_mask_low": "mask_low"}

    # Responses sampled per prompt; they form a group on one rank (the group baseline of grpo,
    # dr_grpo and rloo needs at least 2).
    n: int = 1
    # The engine that generates on each actor rank (``rlhf_paro/rollout``; checked against its
    # registry when the config is resolved): hf is Hugging Face generate on the actor's weights.
    engine: str = "hf"
    # Prompts generated at once on a rank (a bounded key/value cache); null: all of the rank's.
    micro_batch_size: int | None = None
    # Truncated importance sampling for the engine's mismatch: each token's policy-loss term is
    # weighted by min(exp(trainer's old log-prob - engine's), tis_cap); null: off.
    tis_cap: float | None = None
    # A mask for the engine's mismatch (docs/design.md, "Rollout"): a sample whose ratio
    # trainer / engine lies outside [mask_low, mask_high] is left out of the policy loss.
    # sequence: the ratio of the sample's probabilities, the product of its action tokens'
    # ratios; geometric: that product's geometric mean, per token; null: off. The names are
    # the field's: veRL's rejection levels (rollout_rs=sequence, geometric), TRL's
    # sequence_mask, SkyRL's geo_mask_low/high. The level is checked when the run is resolved
    # (``algorithms.check``); with tis_cap the kept samples' tokens keep their TIS weights.
    mask: str | None = None
    # The band's bounds, ratios > 0: mask_high is needed with a mask; mask_low null is
    # 1 / mask_high (veRL's rule, a band symmetric in log space). The geometric mean is a
    # per-token ratio, near 1: a SkyRL example's band is [0.99, 1.01].
    mask_low: float | None = None
    # The band's upper bound, a ratio > 0 above mask_low; needed with a mask.
    mask_high: float | None = None
    # hf only: its key/value cache while decoding. dynamic grows with the sequence; static is
    # Hugging Face's cache of fixed size with its decoding step compiled (torch.compile, once a
    # run: the weights change in place); auto: static on CUDA where the model takes it, else
    # (and for episodes, whose keys and values the dynamic cache keeps across turns) dynamic.
    hf_cache: str = "auto"
    # vllm only (docs/design.md, "Rollout"). The share of a device's memory the engine may hold,
    # its weights and key/value cache (on CUDA; on a CPU device its key/value cache is sized
    # from the run's longest sequences and max_num_seqs instead). auto: what the run's models
    # leave of cluster.memory_gb on CUDA (plan.engine_share).
    gpu_memory_utilization: float | Literal["auto"] = "auto"
    max_num_seqs: int = 256  # sequences the engine decodes at once (continuous batching)
    tensor_parallel_size: int = 1  # devices one engine spans; must divide cluster.group_size
    enforce_eager: bool = True  # no CUDA graphs: an engine built every run starts sooner
    enable_prefix_caching: bool = True  # rollout.n samples of a prompt share its prefill
    # Multi-turn episodes on an engine that takes requests (vllm; hf on its dynamic cache): each
    # episode a loop of its own, its next action submitted the moment its environment answers
    # while the engine decodes the others' (docs/design.md, "Multi-turn episodes"); false: turn
    # by turn, each turn's actions one batched call after the slowest environment step of the
    # turn before; auto: vllm streams, hf goes turn by turn (measured faster where environments
    # answer at once; streaming where they take time).
    streaming: bool | Literal["auto"] = "auto"
    # Devices of their own for the rollout (docs/design.md, "Asynchronous rollouts"): 0, the
    # engines live in the actor's ranks and share their devices; D > 0, D more devices each
    # host one engine replica, which takes the actor's weights after every update.
    num_devices: int = 0
    # Steps the rollout may lag behind training, exactly: the rollout of step t comes from the
    # policy after update t - K (or the initial one), generated while step t - 1 trains; 0: the
    # synchronous order. K > 0 needs rollout.num_devices > 0.
    max_staleness: int = 0

    @property
    def mask_band(self) -> tuple[float, float]:
        """The mask's band (``mask_low``, ``mask_high``), ``mask_low`` null read as
        1 / ``mask_high``; only with a mask."""
        assert self.mask_high is not None, "no band without rollout.mask"
        low = 1.0 / self.mask_high if self.mask_low is None else self.mask_low
        return low, self.mask_high

    def streams(self, by_default: bool) -> bool:
        """Whether episodes stream on an engine that takes requests (``streaming``); where
        auto, the engine's own choice ``by_default`` (``Rollout.streams_by_default``)."""
        return by_default if self.streaming == "auto" else bool(self.streaming)

    def __post_init__(self) -> None:
        _positive("n", self.n)
        for key in ("num_devices", "max_staleness"):
            if getattr(self, key) < 0:
                raise ConfigError(key, f"must be >= 0, got {getattr(self, key)}")
        if self.max_staleness and not self.num_devices:
            raise ConfigError("max_staleness", f"{self.max_staleness} overlaps generation with "
                              "training, which needs devices of its own for the rollout "
                              "(colocated, both would share the same devices and only "
                              "queue behind each other); allowed: 0, or with "
                              "rollout.num_devices >= 1")
        if self.num_devices and self.num_devices % self.tensor_parallel_size:
            raise ConfigError("tensor_parallel_size", f"{self.tensor_parallel_size} does not "
                              f"divide rollout.num_devices={self.num_devices}; allowed: a "
                              f"divisor of it")
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        if self.gpu_memory_utilization != "auto" and not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError("gpu_memory_utilization", f"must be in (0, 1] or auto, got "
                                                        f"{self.gpu_memory_utilization}")
        if self.streaming not in (True, False, "auto"):
            raise ConfigError("streaming", f"got {self.streaming!r}; allowed: true, false, auto")
        if self.hf_cache not in HF_CACHES:
            raise ConfigError("hf_cache", f"got {self.hf_cache!r}; allowed: "
                                          f"{', '.join(HF_CACHES)}")
        if self.hf_cache == "static" and self.engine != "hf":
            raise ConfigError("hf_cache", f"static is the hf engine's cache and rollout.engine="
                                          f"{self.engine}; allowed: auto, dynamic (or "
                                          f"rollout.engine=hf)")
        if self.tis_cap is not None and not self.tis_cap > 0:
            raise ConfigError("tis_cap", f"must be > 0 or null (off), got {self.tis_cap}")
        self._check_mask_band()
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            raise ConfigError("micro_batch_size", f"must be >= 1 or null (all of a "
                                                  f"rank's prompts at once), got "
                                                  f"{self.micro_batch_size}")

    def _check_mask_band(self) -> None:
        """A band that keeps no sample, or bounds that nothing reads, is one line."""
        bounds = {k: getattr(self, k) for k in ("mask_low", "mask_high")
                  if getattr(self, k) is not None}
        if self.mask is None:
            if bounds:  # a bound without its mask would silently change nothing
                key, value = next(iter(bounds.items()))
                raise ConfigError(key, f"{value} bounds no mask: rollout.mask is null (off); "
                                       f"allowed: null, or with a rollout.mask")
            return
        if self.mask_high is None:
            raise ConfigError("mask_high", f"rollout.mask={self.mask} needs the band's upper "
                                           f"bound; allowed: a ratio > 0 (mask_low below it; "
                                           f"null: 1 / mask_high)")
        for key, value in bounds.items():
            if not value > 0:
                raise ConfigError(key, f"must be > 0 (a ratio of probabilities), got {value}")
        low, high = self.mask_band
        if low >= high:
            key, low_is = (("mask_low", f"mask_low={low}") if self.mask_low is not None else
                           ("mask_high", f"mask_low null, 1 / mask_high = {low:.6g}"))
            raise ConfigError(key, f"the band [{low:.6g}, {high:.6g}] ({low_is}) keeps no "
                                   f"sample; allowed: mask_low < mask_high")


ENV_REWARDS = ("env", "reward")


@dataclass
class EnvConfig:
    """Multi-turn episodes (docs/design.md, "Multi-turn episodes"): an environment answers each
    action until the episode ends; the policy trains on its own tokens only."""

    # file.py:NAME, a class (or factory) built per sample as NAME(**row) from its prompt row's
    # columns: reset() -> observation | None, step(action) -> (observation | None, reward, done).
    function: str | None = None
    # file.py:a,b: plain Python functions the model calls in its chat template's tool-call format
    # (a built-in environment; the episode ends with an answer that calls no tool).
    tools: str | None = None
    max_turns: int = 4  # actions an episode takes at most (each at most ppo.max_new_tokens)
    # The episode's context budget in tokens, prompt and observations included (null: the
    # actor's max_position_embeddings).
    max_total_tokens: int | None = None
    timeout_s: float = 60.0  # seconds one reset() or step() may take before the run stops
    num_workers: int = 8  # environment calls (reset, step) a rank runs at once, in threads
    # Whether an observation's text may hold the tokenizer's special tokens (<|im_end|> read as
    # the control token); false: they are plain text, as chat templates treat tool output.
    observation_special_tokens: bool = False
    # What scores an episode: env (the sum of its step rewards) or reward (the reward section's
    # function, model or server scores the finished trajectory); null: env, unless the reward
    # section names a source, which is ambiguous and refused.
    reward: Literal["env", "reward"] | None = None

    @property
    def enabled(self) -> bool:
        return self.function is not None or self.tools is not None

    def __post_init__(self) -> None:
        check_function_spec("function", self.function)
        if self.tools is not None:
            file, sep, names = self.tools.rpartition(":")
            if not sep or not file.endswith(".py") or not all(
                    name.strip().isidentifier() for name in names.split(",")):
                raise ConfigError("tools", f"got {self.tools!r}; allowed: path/to/file.py:"
                                           "function_a,function_b")
        if self.function is not None and self.tools is not None:
            raise ConfigError("tools", "set either env.function (your environment) or "
                                       "env.tools (the built-in tool environment), not both")
        for key in ("max_turns", "max_total_tokens", "num_workers"):
            _positive(key, getattr(self, key))
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ConfigError("timeout_s", f"must be a positive number of seconds, got "
                                           f"{self.timeout_s}")
        if not self.enabled:
            defaults = EnvConfig.__dataclass_fields__
            for key in ("max_turns", "max_total_tokens", "timeout_s", "num_workers", "reward",
                        "observation_special_tokens"):
                if getattr(self, key) != defaults[key].default:
                    raise ConfigError(key, "sets an environment's episodes; allowed only with "
                                           "env.function or env.tools")
        if self.tools is not None and self.reward == "env":
            raise ConfigError("reward", "env.tools rewards nothing (a tool only answers); "
                                        "allowed: reward (the reward section scores the "
                                        "finished trajectory)")


RESUME_CHOICES = ("auto", "none")
# What marks a complete checkpoint directory: written last (docs/design.md, "Checkpoints").
MANIFEST = "manifest.json"


@dataclass
class TrainerConfig:
    ALIASES: ClassVar[dict[str, str]] = {  # ModelConfig.ALIASES
        "total_steps": "steps", "num_steps": "steps", "max_steps": "steps",
        "total_training_steps": "steps", "out_dir": "output_dir", "save_dir": "output_dir",
        "default_local_dir": "output_dir", "save_steps": "save_every", "save_freq": "save_every",
        "eval_steps": "eval_every", "test_freq": "eval_every", "resume_mode": "resume"}

    steps: int = 20  # PPO steps (rollout + update)
    seed: int = 0  # seeds model init, prompts and sampling
    output_dir: str = "outputs/run"  # metrics.jsonl, the dashboard and the wandb run land here
    # Write a checkpoint every this many steps to <output_dir>/checkpoints/step_<k>/ (0: never).
    save_every: int = 0
    # auto: go on from the newest complete checkpoint in output_dir (none there: a fresh start)
    # when output_dir holds the same run (its definition.yaml; another run is refused, a finished
    # one said so); none: start fresh; or the path of a checkpoint directory, even another run's.
    resume: str = "auto"
    keep_checkpoints: int = 2  # newest complete checkpoints kept, older ones deleted (0: all)
    # Stop the run when a trained model skips more than this many optimizer steps in a row
    # (a non-finite loss or gradient norm skips the update).
    max_skipped_steps: int = 5
    # Export the actor in Hugging Face format every K steps to <output_dir>/hf/step_<k>/ (0:
    # only at the end, to <output_dir>/hf/actor/ and hf/critic/).
    export_every: int = 0
    # Greedy responses to data.val_files every K steps, logged as eval/* (0: never).
    eval_every: int = 0
    # Seconds the driver waits for the workers in any one wait (a phase of a step, a checkpoint,
    # an export, the start) before it stops the run naming the model, rank and phase that did
    # not answer (a stopped process, a reward function that never returns). None: no limit.
    step_timeout_s: float | None = 1800.0
    # SIGTERM (a scheduler's preemption) stops the run after the step in progress; save a
    # checkpoint there first (false: keep the newest one trainer.save_every wrote).
    save_on_preempt: bool = True

    def __post_init__(self) -> None:
        _positive("steps", self.steps)
        if self.step_timeout_s is not None and not (math.isfinite(self.step_timeout_s)
                                                    and self.step_timeout_s > 0):
            raise ConfigError("step_timeout_s", "must be a positive number of seconds or null "
                                                f"(no limit), got {self.step_timeout_s}")
        for key in ("save_every", "keep_checkpoints", "max_skipped_steps", "export_every",
                    "eval_every"):
            if getattr(self, key) < 0:
                raise ConfigError(key, f"must be >= 0 (0: off), got {getattr(self, key)}")


@dataclass
class WandbConfig:
    mode: Literal["offline", "online", "disabled"] = "offline"  # offline: `wandb sync` later
    project: str = "rlhf_paro"  # wandb project
    entity: str | None = None  # wandb team or user (None: wandb's default)
    name: str | None = None  # None: the name of the output directory
    tags: list[str] = field(default_factory=list)  # wandb run tags


@dataclass
class LoggerConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    progress: bool = True  # console progress bar (off for plain logs, e.g. in CI)


def _demo_model() -> dict[str, Any]:
    # Two heads of 32: vLLM's CPU attention takes no head size below 32 (rollout.engine=vllm).
    return {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
            "max_position_embeddings": 64}


@dataclass
class TaskConfig:
    """The synthetic counting task (``rlhf_paro.ppo.task``) and the default run's assets made
    from it (``rlhf_paro.ppo.demo``, ``${demo:NAME}`` in a conf)."""

    num_symbols: int = 16  # the alphabet the counting task runs over
    prompt_len: int = 4  # prompt tokens, <bos> included
    # Inline Hugging Face config of the demo's actor and reward model.
    model: dict[str, Any] = field(default_factory=_demo_model)
    sft_steps: int = 60  # supervised fine-tuning steps of the demo's actor
    sft_batch_size: int = 64  # demonstrations per SFT step
    sft_lr: float = 3e-3  # AdamW learning rate of the SFT
    train_prompts: int = 2048  # rows of the demo's training prompt file
    val_prompts: int = 64  # rows of its validation prompt file
    reward_pairs: int = 4096  # preference pairs to train the reward model on
    reward_eval_pairs: int = 512  # held-out pairs for its accuracy
    reward_steps: int = 300  # optimizer steps of the reward model's Bradley-Terry training
    reward_batch_size: int = 64  # preference pairs per step
    reward_lr: float = 1e-3  # its AdamW learning rate
    cache_dir: str | None = None  # None: ~/.cache/rlhf_paro

    def __post_init__(self) -> None:
        for key in ("num_symbols", "reward_pairs", "reward_eval_pairs", "reward_steps",
                    "reward_batch_size", "reward_lr", "sft_steps", "sft_batch_size", "sft_lr",
                    "train_prompts", "val_prompts"):
            _positive(key, getattr(self, key))
        if self.num_symbols < 2:
            raise ConfigError("num_symbols", f"must be at least 2, got {self.num_symbols}")
        if self.prompt_len < 2:
            raise ConfigError("prompt_len", f"must be at least 2 (<bos> and one symbol), "
                                            f"got {self.prompt_len}")


RAY_ADDRESS_ALLOWED = ("allowed: null (the cluster at RAY_ADDRESS if set, else a private Ray on "
                       "this machine) or the address of a running cluster (ray start --head)")


@dataclass
class DataConfig:
    """Prompts from files (``rlhf_paro.ppo.data``); without ``train_files`` the task makes them."""

    ALIASES: ClassVar[dict[str, str]] = {  # ModelConfig.ALIASES
        "train_file": "train_files", "prompt_data": "train_files", "prompts": "train_files",
        "val_file": "val_files", "eval_files": "val_files", "input_key": "prompt_key"}

    # Comma-separated local .json, .jsonl or .parquet files of prompts (None: the task's).
    train_files: str | None = None
    # Comma-separated files of validation prompts for trainer.eval_every (None: no evaluation).
    val_files: str | None = None
    # Column holding each prompt: a string, or a list of chat messages ({role, content}).
    prompt_key: str = "prompt"
    # Render prompts with the tokenizer's chat template (needed for chat messages).
    apply_chat_template: bool = False
    # The longest prompt in tokens, files' and the task's alike: longer ones in files are skipped
    # and counted; the planner and the check of the models' positions size by it.
    max_prompt_length: int = 256
    shuffle: bool = True  # a new permutation of the prompts every epoch, seeded by trainer.seed

    def __post_init__(self) -> None:
        _positive("max_prompt_length", self.max_prompt_length)
        if self.val_files is not None and self.train_files is None:
            raise ConfigError("val_files", "needs data.train_files")


def data_files(text: str | None) -> list[str]:
    """The files of a comma-separated ``data.*_files`` value."""
    return [part.strip() for part in (text or "").split(",") if part.strip()]


# Keys whose value is a comma-separated list of files, never a sweep.
FILE_LIST_KEYS = ("data.train_files", "data.val_files")

# Every key that names a local file or directory, and how its value holds it: a ``path``, a
# comma-separated list of ``files``, or a ``spec`` (``file.py:NAME``, the file before the last
# ``:``). Composition expands a ``~`` that starts one (``compose.load_config``), ``resolve`` makes
# each absolute (``resolve.absolute_paths``); both through ``map_paths``.
PATH_KEYS: dict[str, Literal["path", "files", "spec"]] = {
    **{f"{role}.{key}": "path" for role in ROLES for key in ("path", "tokenizer")},
    **{f"{role}.{key}": "spec" for role in ROLES for key in ("function", "score_function")},
    "env.function": "spec", "env.tools": "spec",
    **{key: "files" for key in FILE_LIST_KEYS},
    "trainer.output_dir": "path", "trainer.resume": "path", "task.cache_dir": "path",
}


@dataclass
class RayConfig:
    # None: the cluster at RAY_ADDRESS if set, else a private Ray on this machine; "auto" or
    # host:port: join a running cluster.
    address: str | None = None
    num_cpus: int | None = None  # CPUs of the local Ray (None: all)
    # Seconds the run waits for its devices to be free (other jobs may hold them) before it
    # stops, saying what it waited for. None: no limit.
    placement_timeout_s: float | None = 600.0

    def __post_init__(self) -> None:
        _positive("num_cpus", self.num_cpus)
        if self.placement_timeout_s is not None and not (
                math.isfinite(self.placement_timeout_s) and self.placement_timeout_s > 0):
            raise ConfigError("placement_timeout_s", "must be a positive number of seconds or "
                                                     f"null (no limit), got "
                                                     f"{self.placement_timeout_s}")


@dataclass
class Config:
    actor: ModelConfig = field(default_factory=ModelConfig)
    critic: ModelConfig = field(default_factory=ModelConfig)
    reward: ModelConfig = field(default_factory=ModelConfig)
    ref: ModelConfig = field(default_factory=ModelConfig)
    cluster: ClusterConfig = field(default_factory=lambda: ClusterConfig(num_devices=1))
    comm: CommConfig = field(default_factory=CommConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    data: DataConfig = field(default_factory=DataConfig)

    # Keys of a section typed at the top (ModelConfig.ALIASES).
    ALIASES: ClassVar[dict[str, str]] = {
        "lr": "actor.optim.lr", "learning_rate": "actor.optim.lr", "seed": "trainer.seed",
        "steps": "trainer.steps", "output_dir": "trainer.output_dir", "model": "actor.path",
        "epochs": "ppo.ppo_epochs", "batch_size": "ppo.rollout_batch_size",
        "strategy": "actor.strategy", "num_devices": "cluster.num_devices",
        "engine": "rollout.engine", "adv_estimator": "algorithm.adv_estimator",
        "train_files": "data.train_files"}

    # Keys given on the command line (or by a conf over its defaults) replace the keys that
    # compete with them (``compose``), besides a model's sources (``ModelConfig.SOURCES``): your
    # own prompts are not the conf's, so neither are its validation prompts nor a score that
    # reads the conf's prompt columns.
    REPLACES: ClassVar[dict[str, tuple[str, ...]]] = {
        "data.train_files": ("data.val_files", "reward.score_function")}
    # What goes with a key that is replaced: no validation files, nothing to evaluate on.
    GOES_WITH: ClassVar[dict[str, tuple[str, ...]]] = {"data.val_files": ("trainer.eval_every",)}

    def __post_init__(self) -> None:
        for role in ROLES:
            for key, owner in ModelConfig.ROLE_ONLY.items():
                if owner != role and getattr(self.model(role), key) != _MODEL_DEFAULTS[key]:
                    raise ConfigError(f"{role}.{key}", f"is a key of {owner}.* only; allowed: "
                                                       f"{owner}.{key}, or {role}.{key} unset")
        if self.actor.path is None and self.actor.config is None:
            raise ConfigError("actor", "needs a model: set actor.path (a local Hugging Face "
                                       "model directory) or actor.config (an inline config)")
        for role in ROLES:
            model = self.model(role)
            self._check_deepspeed(role, model)
            model.strategy = _normalise_strategy(role, model.strategy)
            if model.lora.enabled and role in FROZEN_ROLES:
                raise ConfigError(f"{role}.lora.enabled", "LoRA trains adapters; allowed only "
                                                          "for actor and critic")
            self._check_token_budget(role, model)
            allowed, why = OFFLOAD_ALLOWED[role]
            if model.offload not in allowed:
                raise ConfigError(f"{role}.offload", f"{model.offload!r}: {why}; allowed: "
                                                     f"{', '.join(allowed)}")
        n = self.cluster.num_devices
        if self.ppo.rollout_batch_size % n:
            raise ConfigError("ppo.rollout_batch_size", f"{self.ppo.rollout_batch_size} must be "
                              f"a multiple of cluster.num_devices={n}")
        samples = self.ppo.rollout_batch_size * self.rollout.n
        if samples % self.ppo.mini_batch_size:
            raise ConfigError("ppo.mini_batch_size", f"{self.ppo.mini_batch_size} must divide "
                              f"the samples of a step, ppo.rollout_batch_size x rollout.n = "
                              f"{samples}")
        self.check_micro_batches("actor")  # the critic's, where there is one: algorithms.check
        replicas = self.rollout.num_devices
        if replicas and self.ppo.rollout_batch_size % replicas:
            raise ConfigError("rollout.num_devices", f"{replicas} replicas do not share "
                              f"ppo.rollout_batch_size={self.ppo.rollout_batch_size} prompts "
                              "evenly; allowed: a divisor of it")
        self._check_env()
        expected, (bound_key, bound) = self.ppo.expected_response_length, self.response_bound()
        if expected is not None and not 1 <= expected <= bound:
            raise ConfigError("ppo.expected_response_length", f"got {expected}; allowed: null or "
                              f"an integer from 1 to {bound_key}={bound}")
        if self.task.prompt_len > self.data.max_prompt_length:
            raise ConfigError("task.prompt_len", f"{self.task.prompt_len} exceeds "
                              f"data.max_prompt_length={self.data.max_prompt_length}")

    @property
    def deals_rollouts(self) -> bool:
        """Whether the driver deals each step's rollout to the ranks (``ppo.balance_batch``): a
        single rank has no other to wait for, and the round trip would only cost it time."""
        return self.ppo.balance_batch and self.cluster.num_devices > 1

    def _check_env(self) -> None:
        """An environment's episodes: rows to build it from, a budget longer than a prompt, and
        one source of the episode's score (``env.reward``)."""
        env = self.env
        if not env.enabled:
            return
        key = "env.function" if env.function is not None else "env.tools"
        if self.data.train_files is None:
            raise ConfigError(key, "needs prompt files (data.train_files): each sample's "
                                   "environment is built from the columns of its prompt's row")
        prompt_key, prompt = self.prompt_bound()
        if env.max_total_tokens is not None and env.max_total_tokens <= prompt:
            raise ConfigError("env.max_total_tokens", f"{env.max_total_tokens} leaves no room "
                              f"for an action after a prompt of {prompt_key}={prompt} tokens; "
                              f"allowed: more than {prompt}")
        if env.tools is not None and not self.data.apply_chat_template:
            raise ConfigError("env.tools", "the tools reach the model through its chat template "
                                           "(their schemas, its tool-call format); allowed: "
                                           "with data.apply_chat_template=true")
        sources = self.reward.reward_sources()
        if env.tools is not None and not sources and env.reward != "reward":
            raise ConfigError("env.tools", "a tool scores nothing: the finished trajectory needs "
                                           "a reward (reward.function, reward.path or "
                                           "reward.url)")
        if env.reward is None and env.function is not None and sources \
                and not self.reward.env_score:
            given = f"reward.{sources[0]}"
            raise ConfigError("env.reward", f"both the environment and {given} can score an "
                                            "episode; allowed: env (the sum of its step "
                                            f"rewards; {given} is then not used) or reward "
                                            f"({given} scores the finished trajectory)")

    @property
    def env_scores(self) -> bool:
        """Whether an episode's score is its environment's (``env.reward``)."""
        return self.env.function is not None and (
            self.env.reward == "env" or (self.env.reward is None
                                         and not self.reward.reward_sources()))

    def longest_sequence(self) -> tuple[str, int]:
        """(what bounds it, tokens) of the longest sequence a step can hold: an episode's budget
        (``env.max_total_tokens``, once resolved), else the prompt bound + ppo.max_new_tokens."""
        if self.env.enabled and self.env.max_total_tokens is not None:
            return "env.max_total_tokens", self.env.max_total_tokens
        prompt_key, prompt = self.prompt_bound()
        return (f"{prompt_key}={prompt} + ppo.max_new_tokens={self.ppo.max_new_tokens}",
                prompt + self.ppo.max_new_tokens)

    def response_bound(self) -> tuple[str, int]:
        """(what bounds it, tokens) of the longest response a step can hold: an episode's
        actions and observations within its budget (``env.max_total_tokens`` less the prompt
        bound), else ``ppo.max_new_tokens``."""
        if self.env.enabled and self.env.max_total_tokens is not None:
            return ("env.max_total_tokens - " + self.prompt_bound()[0],
                    self.env.max_total_tokens - self.prompt_bound()[1])
        return "ppo.max_new_tokens", self.ppo.max_new_tokens

    def prompt_bound(self) -> tuple[str, int]:
        """(key, value) of the longest prompt a step can hold: ``data.max_prompt_length``, the
        one key, for prompts from files and the task's alike."""
        return "data.max_prompt_length", self.data.max_prompt_length

    def _check_token_budget(self, role: str, model: ModelConfig) -> None:
        """``max_tokens_per_micro_batch``: trained models on the PaRO engine, and room for the
        longest sequence a step can hold (``longest_sequence``)."""
        budget, key = model.max_tokens_per_micro_batch, f"{role}.max_tokens_per_micro_batch"
        if budget is None:
            return
        if role in FROZEN_ROLES:
            raise ConfigError(key, "splits a trained model's mini-batches; allowed: null")
        if model.backend == "deepspeed":
            raise ConfigError(key, "needs a micro-batch count per step, which DeepSpeed fixes "
                                   "at initialize; allowed: null on backend=deepspeed")
        bound, longest = self.longest_sequence()
        if budget < longest:
            raise ConfigError(key, f"{budget} is smaller than the longest sequence a step can "
                                   f"hold, {longest} tokens ({bound}); allowed: null or at "
                                   f"least {longest}")

    def _check_deepspeed(self, role: str, model: ModelConfig) -> None:
        """Every rule of a model's ``deepspeed`` section: its own values on any backend, how
        they fit the role and the cluster on backend=deepspeed. (The strategy a DeepSpeed model
        stands for is ``resolve``'s to set.)"""
        ds, n, key = model.deepspeed, self.cluster.num_devices, f"{role}.deepspeed"
        if ds.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"{key}.zero_stage", f"got {ds.zero_stage}; allowed: 0, 1, 2, 3")
        _positive(f"{key}.hpz_partition_size", ds.hpz_partition_size)
        if ds.hpz_partition_size > 1 and ds.zero_stage != 3:
            raise ConfigError(f"{key}.hpz_partition_size", f"{ds.hpz_partition_size} needs "
                              f"zero_stage=3 (got {ds.zero_stage}); allowed: 1 below stage 3")
        if ds.offload_optimizer and ds.zero_stage == 0:
            raise ConfigError(f"{key}.offload_optimizer", "needs zero_stage 1, 2 or 3 "
                                                          "(DeepSpeed offloads the partitioned "
                                                          "optimizer)")
        if model.backend != "deepspeed":
            return
        if n % ds.hpz_partition_size:
            raise ConfigError(f"{role}.deepspeed.hpz_partition_size", f"{ds.hpz_partition_size} "
                              f"must divide cluster.num_devices={n}")
        if ds.hpz_partition_size > 1 and role in FROZEN_ROLES:
            # DeepSpeed's inference-only ZeRO-3 fails to set up hpZ's groups.
            raise ConfigError(f"{role}.deepspeed.hpz_partition_size", "DeepSpeed runs hpZ only "
                                                                      "for trained models; "
                                                                      "allowed: 1")
        if ds.offload_optimizer and role in FROZEN_ROLES:
            raise ConfigError(f"{role}.deepspeed.offload_optimizer", "a frozen model has no "
                                                                     "optimizer; allowed: false")
        if not model.runs_model:
            raise ConfigError(f"{role}.backend", "a reward function or server runs no model; "
                                                 "allowed: paro")
        if model.offload != "none":
            raise ConfigError(f"{role}.offload", "is the PaRO engine's; on backend=deepspeed "
                                                 f"set {role}.deepspeed.offload_optimizer; "
                                                 "allowed: none")

    def offload(self, role: str) -> str:
        """What of ``role`` lives in host memory: ``<role>.offload`` on the PaRO engine, the
        optimizer under ``deepspeed.offload_optimizer`` on DeepSpeed (for the planner)."""
        model = self.model(role)
        if model.backend == "deepspeed":
            return "optimizer" if model.deepspeed.offload_optimizer else "none"
        return model.offload

    def model(self, role: str) -> ModelConfig:
        if role not in ROLES:
            raise ValueError(f"unknown model role {role!r}; allowed: {', '.join(ROLES)}")
        return getattr(self, role)

    def check_micro_batches(self, role: str) -> None:
        """A trained ``role``'s micro-batches tile each device's share of a mini-batch (checked
        for the roles a run trains, ``ppo/algorithms.check``)."""
        n, micro = self.cluster.num_devices, self.model(role).micro_batch_size
        if self.ppo.mini_batch_size % (n * micro):
            raise ConfigError("ppo.mini_batch_size", f"{self.ppo.mini_batch_size} must be a "
                              f"multiple of cluster.num_devices x {role}.micro_batch_size = "
                              f"{n} x {micro}")

    def grad_accum_steps(self, role: str) -> int:
        """Micro-batches per optimizer step on one device (the paper's s) of a trained role."""
        per_device = self.ppo.mini_batch_size // self.cluster.num_devices
        return per_device // self.model(role).micro_batch_size

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def map_paths(cfg: Config, change: Callable[[str, str], str]) -> Config:
    """``cfg`` with ``change(key, path)`` applied to every local path its ``PATH_KEYS`` name: each
    file of a list, the file of a ``file.py:NAME``; ``trainer.resume``'s words are not paths."""
    def mapped(key: str, kind: str, value: str) -> str:
        if kind == "spec":
            file, _, names = value.rpartition(":")
            return f"{change(key, file)}:{names}"
        if kind == "files":
            files = data_files(value)
            changed = [change(key, file) for file in files]
            return value if changed == files else ",".join(changed)
        return value if key == "trainer.resume" and value in RESUME_CHOICES else change(key, value)

    sections: dict[str, Any] = {}
    for key, kind in PATH_KEYS.items():
        name, _, field_name = key.partition(".")
        section = sections.get(name, getattr(cfg, name))
        value = getattr(section, field_name)
        if value is not None:
            sections[name] = dataclasses.replace(section, **{field_name: mapped(key, kind, value)})
    return dataclasses.replace(cfg, **sections)


def _normalise_strategy(role: str, text: str) -> str:
    """Canonical name (``zero3`` -> ``GGG``; a triple's P level for a frozen model) or ``auto``."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return Strategy.parse(text, frozen=role in FROZEN_ROLES).name
    except StrategyError as err:
        raise ConfigError(f"{role}.strategy", str(err)) from None


# --- building dataclasses from plain data, with type checks ---------------------------------------

def build_config(data: dict[str, Any]) -> Config:
    """A validated ``Config`` from nested plain data (what YAML gives)."""
    return build(Config, data, "")


def section_keys(cls: type, prefix: str) -> list[str]:
    """The keys of the section ``cls`` at ``prefix``: its fields, less those of another role
    (``ModelConfig.ROLE_ONLY``: ``actor.function`` is not a key a user should be offered)."""
    only = getattr(cls, "ROLE_ONLY", {})
    return [f.name for f in dataclasses.fields(cls)
            if f.init and only.get(f.name, prefix) == prefix]


def suggested_key(cls: type, prefix: str, key: str) -> str | None:
    """The key of section ``cls`` (at ``prefix``) that ``key``, unknown there, most likely
    means, relative to the section: an alias users type (``ALIASES``: lr -> optim.lr), the
    same name in a subsection (eps -> optim.eps), or a close spelling of a key (lora_r ->
    lora); None without one."""
    aliases = getattr(cls, "ALIASES", {})
    if key.lower() in aliases:
        return aliases[key.lower()]
    names = section_keys(cls, prefix)
    hints = typing.get_type_hints(cls)
    for name in names:
        sub = _optional(hints[name])
        if dataclasses.is_dataclass(sub) and key in section_keys(sub, _join(prefix, name)):
            return f"{name}.{key}"
    close = difflib.get_close_matches(key, names, n=1)
    return close[0] if close else None


def _field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.init]


def _unknown_key(cls: type, prefix: str, key: str) -> ConfigError:
    moved = getattr(cls, "MOVED", {}).get(key)
    if moved is not None:
        return ConfigError(_join(prefix, key), f"is gone: {moved} is the one key for it; "
                                               f"allowed: {moved}")
    found = suggested_key(cls, prefix, key)
    hint = f" (did you mean {_join(prefix, found)}?)" if found else ""
    return ConfigError(_join(prefix, key), f"unknown key{hint}; allowed: "
                                           f"{', '.join(section_keys(cls, prefix))}")


def build(cls: type, data: Any, prefix: str) -> Any:
    """A validated ``cls`` (a section of the schema) from plain data; keys named under
    ``prefix``."""
    names = _field_names(cls)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(prefix, f"expected a section with keys {', '.join(names)}, "
                                  f"got {data!r}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            raise _unknown_key(cls, prefix, str(key))
        kwargs[key] = coerce(hints[key], value, _join(prefix, key))
    try:
        return cls(**kwargs)
    except ConfigError as err:
        raise err.under(prefix) from None


_TYPE_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _optional(tp: Any) -> Any:
    """``X | None`` -> X; anything else as it is (``X | Literal[...]`` included)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in \
            typing.get_args(tp):
        options = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(options) != 1:
            raise TypeError(f"unsupported schema type {tp}")  # internal: schema authors only
        return options[0]
    return tp


def coerce(tp: Any, value: Any, key: str) -> Any:
    """``value`` as a value of the schema type ``tp``, or ``ConfigError`` naming ``key``."""
    inner = _optional(tp)
    optional = inner is not tp
    if value is None and optional:
        return None
    tp = inner
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return build(tp, value, key)
    if origin is Literal:
        if value not in args:
            raise ConfigError(key, f"got {value!r}; allowed: {', '.join(map(str, args))}")
        return value
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):  # X | Literal[words]: a word, or an X
        word, = (a for a in args if typing.get_origin(a) is Literal)
        other, = (a for a in args if a is not word)
        if value in typing.get_args(word):
            return value
        try:
            return coerce(other, value, key)
        except ConfigError:
            raise ConfigError(key, f"got {value!r}; allowed: "
                              f"{', '.join(map(str, typing.get_args(word)))} or "
                              f"{_TYPE_WORDS[other]}") from None
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(key, f"expected a list such as [a, b], got {value!r}")
        if origin is tuple:
            if len(value) != len(args):
                raise ConfigError(key, f"expected a list of {len(args)}, got {list(value)}")
            return tuple(coerce(a, v, key) for a, v in zip(args, value))
        return [coerce(args[0], v, key) for v in value]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(key, f"expected a mapping such as {{a: 1}}, got {value!r}")
        return dict(value)
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        # Numbers are fine as strings (a run name "1"), booleans and lists are not.
        str: isinstance(value, (str, int, float)) and not isinstance(value, bool),
    }
    if tp not in ok:
        raise TypeError(f"unsupported schema type {tp}")
    if not ok[tp]:
        raise ConfigError(key, f"expected {_TYPE_WORDS[tp]}, got {value!r}")
    if tp is float and not _finite(value):
        # Every float key, here once: nan passes every range check (all comparisons are false)
        # and inf every lower bound, and either spoils a run only steps later. A key without a
        # limit takes null where the schema says so (inf is never that word).
        raise ConfigError(key, f"got {value!r}; allowed: a finite number"
                               f"{' or null' if optional else ''}")
    return tp(value)


def _finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer past float's range
        return False


@contextlib.contextmanager
def cli_errors() -> Iterator[None]:
    """Turn a user mistake into ``error: <message>`` on stderr and exit status 2, no traceback."""
    try:
        yield
    except (ConfigError, StrategyError) as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
