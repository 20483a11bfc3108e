"""Typed configuration: one dataclass per component, YAML confs, dotted overrides, validation.

``load_config(["conf=ppo_tiny", "actor.strategy=IGG", ...])`` reads ``conf/ppo_tiny.yaml`` (or a
``.yaml`` path), merges the confs named in its ``defaults:`` list first, applies the ``key=value``
overrides (values parsed like YAML) and builds a ``Config``. Every key is checked against the
dataclasses below; a user mistake raises ``ConfigError`` whose message is one line naming the key
and what is allowed. Entry points wrap their body in ``cli_errors()`` to turn it into ``error: ...``
on stderr and exit status 2.

This module does not import transformers, so a bad command line fails fast. Checks that need it
(the keys of an inline model config) live in ``rlhf_paro.models.check_model_configs``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import difflib
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Literal

import yaml

from rlhf_paro.comm.meter import ALGORITHM_NAMES
from rlhf_paro.sharding.strategy import Strategy, StrategyError

# conf/ sits next to the package in the repository (and in an editable install).
CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
DEFAULT_CONF = "ppo_tiny"

ROLES = ("actor", "critic", "reward", "ref")
TRAINED_ROLES = ("actor", "critic")
FROZEN_ROLES = ("reward", "ref")


class ConfigError(ValueError):
    """A configuration mistake; ``str()`` is one line: ``<key>: <problem and what is allowed>``."""

    def __init__(self, key: str, problem: str) -> None:
        self.key = key
        self.problem = problem
        super().__init__(f"{key}: {problem}" if key else problem)

    def under(self, prefix: str) -> ConfigError:
        """The same error with its key qualified by the section it was found in."""
        return ConfigError(_join(prefix, self.key), self.problem)


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

    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0
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

    enabled: bool = False
    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])

    def __post_init__(self) -> None:
        _positive("r", self.r)
        _positive("alpha", self.alpha)
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError("dropout", f"must be in [0, 1), got {self.dropout}")
        if self.enabled and not self.target_modules:
            raise ConfigError("target_modules", "must name at least one module, e.g. [q_proj]")


@dataclass
class ModelConfig:
    """One of the four PPO models. The same schema serves actor, critic, reward and ref.

    Source: ``path`` (a local Hugging Face model directory; never downloaded) or ``config`` (an
    inline Hugging Face config for random init, ``model_type`` defaulting to llama). A critic,
    reward or ref with neither inherits the actor's source, so ref starts from the actor's weights.
    """

    path: str | None = None
    config: dict[str, Any] | None = None
    # A triple or preset for trained models, one P level for frozen ones, or ``auto`` (the planner).
    strategy: str = "auto"
    precision: Literal["fp32", "bf16"] = "fp32"
    optim: OptimConfig = field(default_factory=OptimConfig)
    # Sequences per forward/backward on one device; gradient accumulation makes up the rest.
    micro_batch_size: int = 4
    gradient_checkpointing: bool = False
    lora: LoraConfig = field(default_factory=LoraConfig)

    def __post_init__(self) -> None:
        _positive("micro_batch_size", self.micro_batch_size)
        if self.path is not None and self.config is not None:
            raise ConfigError("path", "set either path (a local model directory) or config "
                                      "(an inline model config), not both; unset one with =null")
        if self.path is not None:
            model_dir = Path(self.path).expanduser()
            if not (model_dir / "config.json").is_file():
                raise ConfigError("path", f"no Hugging Face model directory at {self.path!r} "
                                          "(needs config.json); allowed: an existing local "
                                          "directory, models are never downloaded")


# --- the other components -------------------------------------------------------------------------

@dataclass
class ClusterConfig:
    """Devices of one run: N devices in groups of M (a group is a node or a switch).

    Give ``num_devices``/``group_size`` directly, or ``nodes``/``gpus_per_node`` (N = nodes x
    gpus_per_node, M = gpus_per_node). After construction ``num_devices`` and ``group_size`` are
    always set.
    """

    num_devices: int | None = None
    group_size: int | None = None
    nodes: int | None = None
    gpus_per_node: int | None = None
    device: Literal["cpu", "cuda"] = "cpu"
    # Memory of one device, for the planner and strategy=auto; None: no limit.
    memory_gb: float | None = None
    # Fraction of memory_gb the planner keeps free for activations, buffers and fragmentation.
    activation_reserve: float = 0.2
    # Per-device link bandwidths (GB/s) with which the planner ranks strategies by traffic time.
    intra_gbps: float = 100.0
    inter_gbps: float = 12.5

    def __post_init__(self) -> None:
        for key in ("num_devices", "group_size", "nodes", "gpus_per_node", "memory_gb",
                    "intra_gbps", "inter_gbps"):
            _positive(key, getattr(self, key))
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
    """Algorithm for world-scope all-gather and reduce-scatter (DESIGN section 6)."""

    algorithm: str = "native"

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHM_NAMES:
            raise ConfigError("algorithm", f"got {self.algorithm!r}; allowed: "
                                           f"{', '.join(ALGORITHM_NAMES)}")


@dataclass
class PPOConfig:
    """Rollout, advantage and loss settings. Batch sizes count sequences over all devices."""

    rollout_batch_size: int = 32  # prompts generated per PPO step
    mini_batch_size: int = 16  # sequences per optimizer step
    ppo_epochs: int = 1  # passes over the rollout per PPO step
    max_prompt_len: int = 16
    max_new_tokens: int = 8
    temperature: float = 1.0
    top_k: int = 0  # 0: sample from the full distribution
    gamma: float = 1.0
    lam: float = 0.95
    clip_eps: float = 0.2
    value_clip_eps: float = 0.2
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    kl_coef: float = 0.05
    adaptive_kl: bool = False
    kl_target: float = 6.0
    kl_horizon: int = 10000
    whiten_advantages: bool = True

    def __post_init__(self) -> None:
        for key in ("rollout_batch_size", "mini_batch_size", "ppo_epochs", "max_prompt_len",
                    "max_new_tokens", "temperature", "clip_eps", "value_clip_eps", "kl_target",
                    "kl_horizon"):
            _positive(key, getattr(self, key))
        _unit_interval("gamma", self.gamma)
        _unit_interval("lam", self.lam)
        if self.top_k < 0:
            raise ConfigError("top_k", f"must be >= 0 (0 disables it), got {self.top_k}")
        if self.kl_coef < 0:
            raise ConfigError("kl_coef", f"must be >= 0, got {self.kl_coef}")
        if self.rollout_batch_size % self.mini_batch_size:
            raise ConfigError("mini_batch_size", f"{self.mini_batch_size} must divide "
                              f"ppo.rollout_batch_size={self.rollout_batch_size}")


@dataclass
class TrainerConfig:
    steps: int = 20  # PPO steps (rollout + update)
    seed: int = 0
    output_dir: str = "outputs/run"  # metrics.jsonl, the dashboard and the wandb run land here

    def __post_init__(self) -> None:
        _positive("steps", self.steps)


@dataclass
class WandbConfig:
    mode: Literal["offline", "online", "disabled"] = "offline"
    project: str = "rlhf_paro"
    entity: str | None = None
    name: str | None = None  # None: the name of the output directory
    tags: list[str] = field(default_factory=list)


@dataclass
class LoggerConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    progress: bool = True  # console progress bar (off for plain logs, e.g. in CI)


@dataclass
class TaskConfig:
    """The synthetic task (``rlhf_paro.ppo.data``) and the training of its reward model."""

    num_symbols: int = 16  # the alphabet the counting task runs over
    prompt_len: int = 4  # prompt tokens, <bos> included
    reward_pairs: int = 4096  # preference pairs to train the reward model on
    reward_eval_pairs: int = 512  # held-out pairs for its accuracy
    reward_steps: int = 300
    reward_batch_size: int = 64
    reward_lr: float = 1e-3
    cache_dir: str | None = None  # None: ~/.cache/rlhf_paro

    def __post_init__(self) -> None:
        for key in ("num_symbols", "reward_pairs", "reward_eval_pairs", "reward_steps",
                    "reward_batch_size", "reward_lr"):
            _positive(key, getattr(self, key))
        if self.num_symbols < 2:
            raise ConfigError("num_symbols", f"must be at least 2, got {self.num_symbols}")
        if self.prompt_len < 2:
            raise ConfigError("prompt_len", f"must be at least 2 (<bos> and one symbol), "
                                            f"got {self.prompt_len}")


@dataclass
class RayConfig:
    address: str | None = None  # None: start a local Ray; "auto" or host:port: join a cluster
    num_cpus: int | None = None  # CPUs of the local Ray (None: all)

    def __post_init__(self) -> None:
        _positive("num_cpus", self.num_cpus)


@dataclass
class Config:
    actor: ModelConfig = field(default_factory=ModelConfig)
    critic: ModelConfig = field(default_factory=ModelConfig)
    reward: ModelConfig = field(default_factory=ModelConfig)
    ref: ModelConfig = field(default_factory=ModelConfig)
    cluster: ClusterConfig = field(default_factory=lambda: ClusterConfig(num_devices=1))
    comm: CommConfig = field(default_factory=CommConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    ray: RayConfig = field(default_factory=RayConfig)

    def __post_init__(self) -> None:
        if self.actor.path is None and self.actor.config is None:
            raise ConfigError("actor", "needs a model: set actor.path (a local Hugging Face "
                                       "model directory) or actor.config (an inline config)")
        for role in ROLES:
            model = self.model(role)
            if model.path is None and model.config is None:
                model.path, model.config = self.actor.path, copy.deepcopy(self.actor.config)
            model.strategy = _normalise_strategy(role, model.strategy)
            if model.lora.enabled and role in FROZEN_ROLES:
                raise ConfigError(f"{role}.lora.enabled", "LoRA trains adapters; allowed only "
                                                          "for actor and critic")
        n = self.cluster.num_devices
        if self.ppo.rollout_batch_size % n:
            raise ConfigError("ppo.rollout_batch_size", f"{self.ppo.rollout_batch_size} must be "
                              f"a multiple of cluster.num_devices={n}")
        for role in TRAINED_ROLES:
            per_step = n * self.model(role).micro_batch_size
            if self.ppo.mini_batch_size % per_step:
                raise ConfigError("ppo.mini_batch_size", f"{self.ppo.mini_batch_size} must be a "
                                  f"multiple of cluster.num_devices x {role}.micro_batch_size = "
                                  f"{n} x {self.model(role).micro_batch_size}")
        if self.task.prompt_len > self.ppo.max_prompt_len:
            raise ConfigError("task.prompt_len", f"{self.task.prompt_len} exceeds "
                              f"ppo.max_prompt_len={self.ppo.max_prompt_len}")

    def model(self, role: str) -> ModelConfig:
        if role not in ROLES:
            raise ValueError(f"unknown model role {role!r}; allowed: {', '.join(ROLES)}")
        return getattr(self, role)

    def grad_accum_steps(self, role: str) -> int:
        """Micro-batches per optimizer step on one device (the paper's s) of a trained role."""
        per_device = self.ppo.mini_batch_size // self.cluster.num_devices
        return per_device // self.model(role).micro_batch_size

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


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
    return _build(Config, data, "")


def _build(cls: type, data: Any, prefix: str) -> Any:
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(prefix, f"expected a section with keys {', '.join(names)}, "
                                  f"got {data!r}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(_join(prefix, str(key)),
                              f"unknown key{hint}; allowed: {', '.join(names)}")
        kwargs[key] = _coerce(hints[key], value, _join(prefix, key))
    try:
        return cls(**kwargs)
    except ConfigError as err:
        raise err.under(prefix) from None


_TYPE_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _coerce(tp: Any, value: Any, key: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:
            return _coerce(options[0], value, key)
        raise TypeError(f"unsupported schema type {tp}")  # internal: schema authors only
    if origin is Literal:
        if value not in args:
            raise ConfigError(key, f"got {value!r}; allowed: {', '.join(map(str, args))}")
        return value
    if tp is Any:
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(key, f"expected a list such as [a, b], got {value!r}")
        if origin is tuple:
            if len(value) != len(args):
                raise ConfigError(key, f"expected a list of {len(args)}, got {list(value)}")
            return tuple(_coerce(a, v, key) for a, v in zip(args, value))
        return [_coerce(args[0], v, key) for v in value]
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
    if tp is float and isinstance(value, str):
        # YAML 1.1 reads 1e-5 (no dot) as a string; a user writing lr=1e-5 means the number.
        with contextlib.suppress(ValueError):
            return float(value)
    if tp not in ok:
        raise TypeError(f"unsupported schema type {tp}")
    if not ok[tp]:
        raise ConfigError(key, f"expected {_TYPE_WORDS[tp]}, got {value!r}")
    return tp(value)


# --- conf files and the command line --------------------------------------------------------------

def conf_path(name: str) -> Path:
    """``conf=NAME`` -> ``conf/NAME.yaml``; a value ending in .yaml/.yml is a path."""
    if name.endswith((".yaml", ".yml")):
        return Path(name).expanduser()
    return CONF_DIR / f"{name}.yaml"


def available_confs() -> list[str]:
    return sorted(p.stem for p in CONF_DIR.glob("*.yaml"))


def _read_conf(path: Path, chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The conf at ``path`` with its ``defaults`` merged underneath, in order."""
    if not path.is_file():
        allowed = ", ".join(available_confs()) or "none found"
        name = path.stem if path.parent == CONF_DIR else str(path)
        raise ConfigError("conf", f"no conf {name!r}; allowed: a .yaml path or one of {allowed}")
    if path.resolve() in chain:
        raise ConfigError("defaults", f"{path.name} includes itself through its defaults")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError("conf", f"{path.name}{where} is not valid YAML") from None
    if not isinstance(data, dict):
        raise ConfigError("conf", f"{path.name} must be a mapping of sections")
    defaults = data.pop("defaults", []) or []
    if not isinstance(defaults, list):
        raise ConfigError("defaults", f"expected a list of conf names, got {defaults!r}")
    merged: dict[str, Any] = {}
    for name in defaults:
        sibling = path.parent / f"{name}.yaml"
        base = sibling if sibling.is_file() else conf_path(str(name))
        _merge(merged, _read_conf(base, chain + (path.resolve(),)))
    _merge(merged, data)
    return merged


def _merge(into: dict[str, Any], update: dict[str, Any]) -> None:
    """Recursive merge: mappings merge key by key, anything else (lists too) replaces."""
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = copy.deepcopy(value)


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = data
    for depth, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(".".join(parts[:depth + 1]),
                              f"is {child!r}, not a section, so it has no key {parts[depth + 1]!r}")
        node = child
    node[parts[-1]] = value


def parse_overrides(argv: list[str]) -> tuple[str, list[tuple[str, Any]]]:
    """``conf=NAME`` and ``key=value`` arguments -> (conf name, [(dotted key, parsed value)])."""
    conf = DEFAULT_CONF
    overrides = []
    for arg in argv:
        key, sep, text = arg.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(arg, "expected key=value with a dotted key, e.g. "
                                   "actor.strategy=IGG or conf=ppo_tiny")
        if key == "conf":
            conf = text.strip()
            continue
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            raise ConfigError(key, f"cannot parse {text!r} as a value") from None
        overrides.append((key, value))
    return conf, overrides


def load_config(argv: list[str]) -> Config:
    """Build the ``Config`` of a command line: ``[conf=NAME|conf=path.yaml] [key=value ...]``."""
    conf, overrides = parse_overrides(argv)
    data = _read_conf(conf_path(conf))
    for key, value in overrides:
        _set_dotted(data, key, value)
    return build_config(data)


@contextlib.contextmanager
def cli_errors() -> Iterator[None]:
    """Turn a user mistake into ``error: <message>`` on stderr and exit status 2, no traceback."""
    try:
        yield
    except (ConfigError, StrategyError) as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
