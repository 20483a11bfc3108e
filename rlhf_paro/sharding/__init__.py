"""PaRO sharding: strategies, topology, the engine and its cost model.

Only the strategy names load with the package; the others (which need torch) load on first use,
so that ``rlhf_paro.sharding.strategy`` (and the config that checks strategies with it) imports
without torch.
"""

import importlib
from typing import Any

from rlhf_paro.sharding.strategy import Level, Strategy, StrategyError, all_strategies

_LAZY = {"EngineError": "engine", "ShardedEngine": "engine", "shard": "engine",
         "Topology": "topology", "TopologyError": "topology"}

__all__ = [
    "EngineError", "Level", "ShardedEngine", "Strategy", "StrategyError", "Topology",
    "TopologyError", "all_strategies", "shard",
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
