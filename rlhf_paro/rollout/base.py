"""The rollout seam: the protocol every engine implements, its sampling settings, the registry."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterable, Iterator, Protocol

import torch
from torch import Tensor

from rlhf_paro.rollout.batch import PromptBatch, RolloutBatch


@dataclass(frozen=True)
class Sampling:
    """How one call samples: greedy (an evaluation) or at ``temperature`` from the ``top_k``
    most likely tokens (0: all of them), at most ``max_new_tokens`` per response."""

    max_new_tokens: int
    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0

    @classmethod
    def from_config(cls, ppo: Any, greedy: bool = False) -> Sampling:
        """The run's sampling (the ``ppo`` section); ``greedy`` for an evaluation."""
        return cls(ppo.max_new_tokens, greedy, ppo.temperature, ppo.top_k)


class Rollout(Protocol):
    """A rollout engine of one actor rank."""

    # Whether the engine holds its own copy of the weights, which the actor then syncs before
    # the next generation after each update; False: it reads the actor's own parameters.
    needs_sync: bool
    # Whether generation computes on the rows' padding too (a static batch runs every row as
    # wide as the longest); False: on the real tokens only (a continuous batch). What the actor
    # counts in ``perf/padding_fraction``.
    computes_padding: bool
    eos_token_id: int  # the token that ends a response (an action of an episode)
    # Whether the engine also takes one response at a time (``Requests``), so that episodes may
    # each run a loop of their own (``episodes.stream``); False: a batch of prompts at a time.
    takes_requests: bool
    # Whether episodes stream on it where ``rollout.streaming=auto`` (``RolloutConfig.streams``):
    # the engine's own measured choice, read only where it ``takes_requests``.
    streams_by_default: bool

    def generate(self, prompts: PromptBatch, sampling: Sampling) -> RolloutBatch:
        """One response per prompt; responses as wide as the longest, never padded out to
        ``sampling.max_new_tokens``. Tensors on the CPU, ready to travel."""

    def turns(self) -> ContextManager[None]:
        """Around the turns of multi-turn episodes (``rollout/episodes.py``): whatever the
        engine holds for all their ``generate`` calls at once (``hf``: the gathered weights,
        gathered once instead of once a turn)."""

    def sync(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Take the actor's updated weights: ``(Hugging Face name, tensor)`` pairs
        (``models.hf_name``) a unit at a time, each tensor valid only until the next is drawn
        ([Note: a unit at a time]). A LoRA actor's whole model, merged or, before
        ``sync_adapters``, its base weights (``models.hf_weights``)."""

    def sync_adapters(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Take a LoRA actor's updated adapters (``models.ADAPTERS``: each adapted linear's
        ``lora_A`` and ``lora_B``) over the base weights ``sync`` loaded: an engine whose
        ``ADAPTERS`` entry says it can (``lora_sync``)."""

    def sleep(self) -> None:
        """Give the device memory the engine holds back to training."""

    def wake(self) -> None:
        """Take it again before the next ``generate``."""


class Requests(Rollout, Protocol):
    """An engine that also takes one response at a time (vLLM's request-level loop; ``hf``'s
    rows joining and leaving its batch between steps), one whose ``takes_requests`` is true:
    what a multi-turn episode of its own needs (``episodes.stream``)."""

    def submit(self, context: list[int], sampling: Sampling, seed: int | None) -> Any:
        """Start a response to the token ids ``context``; returns the request's key. ``seed``:
        the request samples from a stream of its own seeded with it (None: greedy)."""

    def step(self) -> list[tuple[Any, list[int], list[float] | None]]:
        """Decode one step of every request in flight; (key, response tokens through the first
        <eos>, their log-probs or None when greedy) of each that ended."""

    def abort(self, keys: list[Any]) -> None:
        """Drop requests no one will collect (a rollout that failed)."""


class Interrupts(Requests, Protocol):
    """An engine that also gives requests back before they end, with what they have decoded:
    what partial rollouts need (``rollout/partial.py``), whose samples go on across weight
    updates as new requests continuing the old. Both engines take it: ``hf`` gives its rows
    back, ``vllm`` keeps what each request reported at each step."""

    def interrupt(self, keys: list[Any]) -> dict[Any, tuple[list[int], list[float] | None]]:
        """Take requests ``keys`` out of the engine (each one's tokens so far and their
        log-probs, None when greedy); the engine keeps nothing of them."""


def generation_seed(run_seed: int, step: int, shard: int) -> int:
    """The seed of the random stream that samples step ``step``'s rollout of prompt slice
    ``shard`` (an actor rank's, or a rollout replica's): a pure function of the three, so the
    same rollout comes from any process that generates that slice at that step, colocated or on a
    replica, straight or resumed (docs/design.md, "Asynchronous rollouts")."""
    return ((run_seed * 1_000_003 + step) * 1_000_003 + shard) & 0x7FFFFFFF


@contextlib.contextmanager
def seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Sample from a random stream of its own, seeded with ``seed``: the process's own streams
    (what shuffles mini-batches) are as they were afterwards."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        yield


@dataclass(frozen=True)
class EngineContext:
    """What an engine is built from on its actor rank."""

    cfg: Any  # the run's Config
    engine: Any  # the actor's TrainEngine (sharding.contract)
    pad_token_id: int
    eos_token_id: int
    device: torch.device


EngineFactory = Callable[[EngineContext], Rollout]
ENGINES: dict[str, EngineFactory] = {}
# rollout.engine=name -> check(cfg, actor_config): ConfigError for a run the engine cannot serve,
# before anything starts (``rlhf_paro.resolve``); ``actor_config`` is the actor's Hugging Face
# config, the model the engine would serve.
CHECKS: dict[str, Callable[[Any, Any], None]] = {}
# rollout.engine=name -> max_len(actor_config): (tokens, what) of the longest sequence the engine
# takes for that model where it has a limit of its own besides the model's positions, else None.
MAX_LENS: dict[str, Callable[[Any], tuple[int, str] | None]] = {}
# The engines whose ``needs_sync`` is true, for the planner, which builds no engine.
SYNCED: set[str] = set()
# rollout.engine=name -> adapters(cfg): None where the engine, holding a copy of its own, takes a
# LoRA actor's adapters over base weights it took once (``Rollout.sync_adapters``) on the run's
# device; else why not, in a few words. An engine without an entry takes merged weights only.
ADAPTERS: dict[str, Callable[[Any], str | None]] = {}


def register_engine(name: str, check: Callable[[Any, Any], None] | None = None,
                    needs_sync: bool = False,
                    max_len: Callable[[Any], tuple[int, str] | None] | None = None,
                    adapters: Callable[[Any], str | None] | None = None
                    ) -> Callable[[EngineFactory], EngineFactory]:
    """Register ``factory(context) -> Rollout`` as the engine ``rollout.engine=name``, with the
    ``check`` of a run's config it needs and its own ``max_len``; ``needs_sync``: its class's
    ``needs_sync``; ``adapters``: its ``ADAPTERS`` entry."""

    def add(factory: EngineFactory) -> EngineFactory:
        ENGINES[name] = factory
        if check is not None:
            CHECKS[name] = check
        if adapters is not None:
            ADAPTERS[name] = adapters
        if max_len is not None:
            MAX_LENS[name] = max_len
        if needs_sync:
            SYNCED.add(name)
        return factory

    return add


def needs_sync(name: str) -> bool:
    """Whether the engine ``name`` holds a copy of the weights that the actor syncs after every
    update (``Rollout.needs_sync``), without building it."""
    return name in SYNCED


def check(cfg: Any, actor_config: Any = None) -> None:
    """``ConfigError`` for an engine name not registered or, given ``actor_config`` (the actor's
    Hugging Face config), a run the engine cannot serve (its own check: what it needs installed
    on the machine that runs it, the models it serves; and ``check_lora_targets``)."""
    from rlhf_paro.config import ConfigError

    name = cfg.rollout.engine
    if name not in ENGINES:
        raise ConfigError("rollout.engine", f"got {name!r}; allowed: "
                                            f"{', '.join(sorted(ENGINES))}")
    if actor_config is not None and name in CHECKS:
        CHECKS[name](cfg, actor_config)
    if actor_config is not None:
        check_lora_targets(cfg, actor_config)


def keeps_copy(cfg: Any) -> bool:
    """Whether the run's rollout engines hold a copy of the actor's weights of their own, which
    the actor syncs: replicas on devices of their own, or an engine that ``needs_sync``."""
    return cfg.rollout.num_devices > 0 or needs_sync(cfg.rollout.engine)


def lora_sync(cfg: Any) -> tuple[str, str | None]:
    """What each sync sends engines that keep a copy of their own: ``models.ADAPTERS`` (the base
    weights once before, ``models.BASE``) or ``models.MERGED`` (the whole model, a LoRA actor's
    adapters merged in); and, where a LoRA actor's ``lora.sync=adapters`` falls back to merged
    because the engine cannot take adapters on the run's device, the one line that says so.
    Read from the config and the installed engine alone, so the actor's ranks, the replicas and
    the driver each find the same."""
    from rlhf_paro.models import ADAPTERS as PART, MERGED

    lora = cfg.actor.lora
    if not (lora.enabled and lora.sync == PART and keeps_copy(cfg)):
        return MERGED, None
    name = cfg.rollout.engine
    reason = ADAPTERS[name](cfg) if name in ADAPTERS else "it takes whole weights only"
    if reason is None:
        return PART, None
    return MERGED, (f"actor.lora.sync=adapters: rollout.engine={name} cannot take adapters "
                    f"on {cfg.cluster.device} ({reason}); each sync sends the whole model, "
                    "the adapters merged in")


def check_lora_targets(cfg: Any, actor_config: Any) -> None:
    """``ConfigError`` naming ``actor.lora.target_modules`` when a module it adapts is not a
    linear layer of the model's blocks (an embedding, the output head) and the rollout engines
    keep a copy of the weights of their own: a sync carries adapted linears only (a merged
    embedding or a head tied to it has no place in them). Checked on the model built on the
    meta device: nothing is allocated."""
    from transformers import AutoModelForCausalLM

    from rlhf_paro.config import ConfigError

    lora = cfg.actor.lora
    if not (lora.enabled and keeps_copy(cfg)):
        return
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            actor_config, trust_remote_code=cfg.actor.trust_remote_code)
    head = model.get_output_embeddings()
    linears = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                      if isinstance(module, torch.nn.Linear) and module is not head})
    for target in lora.target_modules:
        for name, module in model.named_modules():
            if not (name == target or name.endswith(f".{target}")):
                continue
            if module is head or not isinstance(module, torch.nn.Linear):
                what = ("the output head" if module is head
                        else f"{type(module).__name__}, not a linear layer")
                where = ("rollout.num_devices>0" if cfg.rollout.num_devices > 0
                         else f"rollout.engine={cfg.rollout.engine}")
                raise ConfigError("actor.lora.target_modules",
                                  f"a rollout engine with weights of its own ({where}) cannot "
                                  f"take an adapter on {target} ({what}); allowed: the model's "
                                  f"linear layers ({', '.join(linears)})")


def max_len(name: str, actor_config: Any) -> tuple[int, str] | None:
    """(tokens, what) of the engine ``name``'s own limit on a sequence of the actor's model
    (``register_engine``'s ``max_len``), or None."""
    return MAX_LENS[name](actor_config) if name in MAX_LENS else None


def build(name: str, context: EngineContext) -> Rollout:
    """The engine registered as ``name``; ``ValueError`` naming the registered ones."""
    try:
        factory = ENGINES[name]
    except KeyError:
        raise ValueError(f"unknown rollout engine {name!r}; allowed: "
                         f"{', '.join(sorted(ENGINES))}") from None
    return factory(context)

