"""PaRO strategies: a sharding level for parameters (P), gradients (G) and optimizer state (OS).

A level says over how many ranks a state is cut: ``N`` keeps a full replica on every rank, ``I``
shards it inside a group of M ranks (and replicates it over the g groups), ``G`` shards it over
all N ranks. The paper's Principle 1 (section 3.1.3) keeps the 14 triples in which OS is at least
as fine as P and as G; the other 13 cost more memory for no less traffic.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass


class StrategyError(ValueError):
    """A strategy string that cannot be used; the message says why and what would work."""


class Level(enum.IntEnum):
    """Sharding level, ordered by fineness: N (replicated) < I (intra-group) < G (global)."""

    N = 0
    I = 1  # noqa: E741 - the paper's name
    G = 2


PRESETS: dict[str, str] = {
    "ddp": "NNN",
    "zero1": "NNG",
    "zero2": "NGG",
    "zero3": "GGG",
    "mics": "III",
    "fsdp-hybrid": "III",
}


@dataclass(frozen=True)
class Strategy:
    """P/G/OS levels of one model; ``grads`` and ``optim`` are None for frozen (inference) models."""

    params: Level
    grads: Level | None = None
    optim: Level | None = None

    def __post_init__(self) -> None:
        if (self.grads is None) != (self.optim is None):
            raise StrategyError("a strategy has either both G and OS levels or neither (frozen)")
        if self.grads is not None and self.optim < max(self.params, self.grads):
            raise StrategyError(
                f"strategy {self.name} breaks Principle 1 (OS must be at least as finely sharded as "
                f"P and as G); nearest valid strategy: {nearest_valid(self).name}"
            )

    @property
    def frozen(self) -> bool:
        return self.grads is None

    @property
    def name(self) -> str:
        levels = (self.params, self.grads, self.optim)
        return "".join(level.name for level in levels if level is not None)

    def __str__(self) -> str:
        return self.name

    @classmethod
    def parse(cls, text: str | Strategy, *, frozen: bool = False) -> Strategy:
        """Parse ``IGG``, a preset (``zero3``, ``mics``, ...) or, for frozen models, one P level.

        A trained model needs a triple; a frozen one takes one level (a triple's P level is
        accepted too, since only P exists for a model that is not trained).
        """
        if isinstance(text, Strategy):
            strategy = text
        else:
            key = str(text).strip()
            key = PRESETS.get(key.lower(), key).upper()
            if not key or any(ch not in "NIG" for ch in key) or len(key) not in (1, 3):
                allowed = ", ".join(list(PRESETS) + ["a triple of N/I/G such as IGG"])
                if frozen:
                    allowed = "N, I, G (or a preset/triple, whose P level is used)"
                raise StrategyError(f"unknown strategy {text!r}; allowed: {allowed}")
            if len(key) == 1:
                if not frozen:
                    raise StrategyError(
                        f"strategy {text!r} gives only a P level, which is for frozen models; "
                        "a trained model needs P, G and OS levels such as IGG"
                    )
                return cls(Level[key])
            strategy = cls(Level[key[0]], Level[key[1]], Level[key[2]])
        if frozen and not strategy.frozen:
            return cls(strategy.params)
        if not frozen and strategy.frozen:
            raise StrategyError(
                f"strategy {strategy.name!r} has no G and OS levels; a trained model needs a triple"
            )
        return strategy


def all_strategies() -> list[Strategy]:
    """The 14 valid triples, in the order of the paper's Table 1."""
    order = ["NNN", "NNI", "NNG", "NII", "NIG", "NGG", "INI", "ING", "III", "IIG", "IGG",
             "GNG", "GIG", "GGG"]
    return [Strategy.parse(name) for name in order]


def nearest_valid(strategy: Strategy) -> Strategy:
    """The valid triple closest in summed level distance; ties go to the finer (smaller) one."""
    best = None
    for p, g, os in itertools.product(Level, repeat=3):
        if os < max(p, g):
            continue
        distance = (abs(p - strategy.params) + abs(g - strategy.grads) + abs(os - strategy.optim))
        key = (distance, -(p + g + os))
        if best is None or key < best[0]:
            best = (key, (p, g, os))
    p, g, os = best[1]
    return Strategy(p, g, os)
