"""The rollout seam: the protocol every engine implements, its sampling settings, the registry."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterable, Protocol

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
        ([Note: a unit at a time])."""

    def sleep(self) -> None:
        """Give the device memory the engine holds back to training."""

    def wake(self) -> None:
        """Take it again before the next ``generate``."""


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
# rollout.engine=name -> check(cfg): ConfigError for a run the engine cannot serve, before
# anything starts (``rlhf_paro.resolve``).
CHECKS: dict[str, Callable[[Any], None]] = {}
# The engines whose ``needs_sync`` is true, for the planner, which builds no engine.
SYNCED: set[str] = set()


def register_engine(name: str, check: Callable[[Any], None] | None = None,
                    needs_sync: bool = False) -> Callable[[EngineFactory], EngineFactory]:
    """Register ``factory(context) -> Rollout`` as the engine ``rollout.engine=name``, with the
    ``check`` of a run's config it needs; ``needs_sync``: its class's ``needs_sync``."""

    def add(factory: EngineFactory) -> EngineFactory:
        ENGINES[name] = factory
        if check is not None:
            CHECKS[name] = check
        if needs_sync:
            SYNCED.add(name)
        return factory

    return add


def needs_sync(name: str) -> bool:
    """Whether the engine ``name`` holds a copy of the weights that the actor syncs after every
    update (``Rollout.needs_sync``), without building it."""
    return name in SYNCED


def check(cfg: Any, engine: bool = True) -> None:
    """``ConfigError`` for an engine name not registered or, with ``engine``, a run the engine
    cannot serve (its own check: what it needs installed on the machine that runs it)."""
    from rlhf_paro.config import ConfigError

    name = cfg.rollout.engine
    if name not in ENGINES:
        raise ConfigError("rollout.engine", f"got {name!r}; allowed: "
                                            f"{', '.join(sorted(ENGINES))}")
    if engine and name in CHECKS:
        CHECKS[name](cfg)


def build(name: str, context: EngineContext) -> Rollout:
    """The engine registered as ``name``; ``ValueError`` naming the registered ones."""
    try:
        factory = ENGINES[name]
    except KeyError:
        raise ValueError(f"unknown rollout engine {name!r}; allowed: "
                         f"{', '.join(sorted(ENGINES))}") from None
    return factory(context)

