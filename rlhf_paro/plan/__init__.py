"""Planner: per-device memory, traffic and predicted time of every strategy of every model, and
what to pick (``python -m rlhf_paro.plan``, ``strategy=auto``).

Each model is built on the meta device (no weights, no GPU) and cut into units exactly as the
engine cuts it; ``sharding/cost.py`` gives the bytes held in P, G and OS (the paper's Table 2)
and sent on intra- and inter-group links (Table 3), and ``sharding/steptime.py`` predicts the
time: compute at ``cluster.tflops``, every collective of the strategy's schedule on the links'
bandwidths and latencies (``cluster.*_gbps``, ``cluster.*_latency_us``), what the engine
hides behind compute, and the activation memory of a micro-batch. Strategies are the 14
triples for actor and critic, the three P levels for reward and ref. The models are the run's
(``ppo/algorithms.roles``): PPO's four, three without a critic (grpo, rloo, ...), one fewer
without ref (``algorithm.kl_coef=0``).

One way down, each module importing only those below it:

    command   the command line: the config resolved, the plan printed
    printout  ``format_plan``: the tables, the recommendation and why, the step
    step      a step's generation, transfer and order of stages; the table over the rollout's
              devices
    search    the least-time combination that fits (``make_plan``), ``strategy=auto``
    engine    a colocated vllm engine's share of the device under ``auto``
    cost      one model's memory, traffic and time under every strategy (``model_plan``)
"""

from rlhf_paro.plan.command import main
from rlhf_paro.plan.cost import GIB, machine, model_plan
from rlhf_paro.plan.engine import ENGINE_SHARE_CAP, engine_share
from rlhf_paro.plan.printout import format_plan
from rlhf_paro.plan.search import (choose_strategies, configured_strategies, make_plan,
                                   resolve_auto)
from rlhf_paro.plan.step import generation, predict_step, rollout_splits, transfer_seconds

__all__ = ["ENGINE_SHARE_CAP", "GIB", "choose_strategies", "configured_strategies", "engine_share",
           "format_plan", "generation", "machine", "main", "make_plan", "model_plan",
           "predict_step", "resolve_auto", "rollout_splits", "transfer_seconds"]
