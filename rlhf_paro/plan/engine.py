"""The share of a device a colocated vllm engine takes under
``rollout.gpu_memory_utilization=auto``: what the run's models leave at their strategies.

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
import math

from rlhf_paro.config import Config, ConfigError
from rlhf_paro.plan.cost import GIB, model_plan
from rlhf_paro.ppo.data import vocab_sizes as read_vocab_sizes
from rlhf_paro.rollout import vllm
from rlhf_paro.sharding.strategy import Strategy

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


def resolve_engine_share(cfg: Config, vocab_sizes: dict[str, int] | None,
                         strategies: dict[str, Strategy]) -> Config:
    """``cfg`` with ``rollout.gpu_memory_utilization=auto`` set where a CUDA vllm engine reads
    it ([Note: the engine's share, auto]); ``strategies``: those of the run's models, all set
    (``search.configured_strategies``: the search imports this module, not the other way)."""
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
            vocab_sizes = read_vocab_sizes(cfg)
        models = {role: model_plan(cfg, role, vocab_sizes[role]) for role in strategies}
        chosen = {role: models[role].option(s) for role, s in strategies.items()}
        actor = chosen.pop("actor")
        share = engine_share(c.memory_gb * GIB, c.activation_reserve,
                             actor.memory_bytes + sum(o.memory_bytes for o in chosen.values()),
                             actor.sync_bytes,
                             actor.memory_bytes + sum(o.setup_bytes for o in chosen.values()),
                             models["actor"].engine_bytes)
    return dataclasses.replace(cfg, rollout=dataclasses.replace(r, gpu_memory_utilization=share))
