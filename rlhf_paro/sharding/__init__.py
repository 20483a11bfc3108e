"""PaRO sharding: strategies, the schedule, the engine and its cost model.

Names resolve on first use, so that ``sharding.strategy`` (plain arithmetic, which the config
validates with) imports without torch.
"""

import importlib

_EXPORTS = {
    "CheckpointError": "errors", "EngineError": "errors", "ShardedEngine": "engine",
    "shard": "engine", "TensorFiles": "source",
    "Level": "strategy", "Strategy": "strategy", "StrategyError": "strategy",
    "all_strategies": "strategy",
}
_FROM_COMM = {"Topology", "TopologyError"}  # the engine contract imports them from here
__all__ = sorted([*_EXPORTS, *_FROM_COMM])


def __getattr__(name: str) -> object:
    if name in _FROM_COMM:
        return getattr(importlib.import_module("rlhf_paro.comm.topology"), name)
    if name not in _EXPORTS:
        raise AttributeError(f"module 'rlhf_paro.sharding' has no attribute {name!r}")
    return getattr(importlib.import_module(f"rlhf_paro.sharding.{_EXPORTS[name]}"), name)
