"""PaRO sharding: strategies, topology, the engine and its cost model."""

from rlhf_paro.sharding.engine import EngineError, ShardedEngine, shard
from rlhf_paro.sharding.strategy import Level, Strategy, StrategyError, all_strategies
from rlhf_paro.sharding.topology import Topology, TopologyError

__all__ = [
    "EngineError", "Level", "ShardedEngine", "Strategy", "StrategyError", "Topology",
    "TopologyError", "all_strategies", "shard",
]
