"""The planner's search: the strategies of the run's models with the least predicted PPO-step time
that fit a device together (``make_plan``), and ``strategy=auto`` resolved by it.

[Note: the run's models share a device]
Every device holds the states (P + G + OS) of all the run's models; only the model that is
running holds activations, gathered parameters and gradient buffers. A combination fits when
their states plus the largest of those peaks stay within ``memory_gb`` x (1 -
``activation_reserve``). The planner searches every combination (14 x 14 x 3 x 3 for PPO's four
models, 14 x 3 x 3 without a critic) for the least predicted time that fits; where
``<role>.max_micro_batch_size`` allows, each model takes the largest micro-batch the memory left
by the states holds (fewer micro-batches, fewer collectives). A strategy is marked as fitting
when some combination that contains it fits. A run without a critic leaves the states a critic
would hold to the others: the printout says how much, from the critic PPO would build
(``algorithm.adv_estimator=gae``) at its leanest strategy.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass

from rlhf_paro.config import FROZEN_ROLES, Config, ConfigError
from rlhf_paro.plan.cost import GIB, ModelPlan, Option, Timed, model_plan
from rlhf_paro.plan.engine import resolve_engine_share
from rlhf_paro.ppo import algorithms
from rlhf_paro.ppo.data import vocab_sizes as read_vocab_sizes
from rlhf_paro.resolve import derive
from rlhf_paro.sharding.strategy import Strategy

# A count of the run's models in words ("the three hold ..."); ROLES has four.
COUNT = ("no", "one", "two", "three", "four")


@dataclass(frozen=True)
class Choice:
    """A model's strategy in the recommended combination, at its micro-batch."""

    option: Option
    micro_batch: int

    @property
    def strategy(self) -> Strategy:
        return self.option.strategy

    @property
    def timed(self) -> Timed:
        return self.option.by_micro[self.micro_batch]

    @property
    def seconds(self) -> float:
        return self.timed.seconds

    @property
    def memory_bytes(self) -> int:
        return self.option.memory_bytes


@dataclass
class Plan:
    models: dict[str, ModelPlan]  # the run's models (``algorithms.roles``), in ROLES order
    budget_bytes: float  # per device, for the models' states and the running one's peak
    device_bytes: float  # per device, for the models' setup peaks ([Note: setup peak])
    best: dict[str, Choice] | None  # least predicted time that fits; None when nothing fits
    fits: dict[str, set[Strategy]]  # per model, the strategies of some fitting combination
    # A run without a critic: the critic PPO would build, only to say what its absence frees.
    absent_critic: ModelPlan | None = None



def _budget(cfg: Config, reserve: float) -> float:
    if cfg.cluster.memory_gb is None:
        return math.inf
    return cfg.cluster.memory_gb * GIB * (1.0 - reserve)


def _search(models: dict[str, ModelPlan], budget: float, device: float,
            fixed: dict[str, Strategy]
            ) -> tuple[dict[str, Choice] | None, dict[str, set[Strategy]]]:
    """Least-time fitting combination (ties: less memory), and each model's fitting options."""
    roles = tuple(models)
    choices = [[models[r].option(fixed[r])] if r in fixed else models[r].options for r in roles]
    best, best_key = None, None
    fits: dict[str, set[Strategy]] = {r: set() for r in roles}
    for combo in itertools.product(*choices):
        states = sum(o.memory_bytes for o in combo)
        picked = [o.best_within(budget - states) for o in combo]
        if any(p is None for p in picked) or sum(o.setup_bytes for o in combo) > device:
            continue
        for role, option in zip(roles, combo):
            fits[role].add(option.strategy)
        key = (round(sum(t.seconds for _, t in picked), 6), states)
        if best_key is None or key < best_key:
            best_key = key
            best = {role: Choice(o, b) for role, o, (b, _) in zip(roles, combo, picked)}
    return best, fits


def make_plan(cfg: Config, vocab_sizes: dict[str, int] | None = None,
              fixed: dict[str, Strategy] | None = None) -> Plan:
    """Plan the run's models (``algorithms.roles``); ``fixed`` pins the strategies of some of
    them; ``vocab_sizes``: ``ppo.data.vocab_sizes`` (read here when not given). ``cfg`` is
    resolved (``rlhf_paro.resolve``): every model the run builds has its source."""
    if vocab_sizes is None:
        vocab_sizes = read_vocab_sizes(cfg)
    models = {role: model_plan(cfg, role, vocab_sizes[role]) for role in algorithms.roles(cfg)}
    budget, device = _budget(cfg, cfg.cluster.activation_reserve), _budget(cfg, 0.0)
    best, fits = _search(models, budget, device, fixed or {})
    return Plan(models, budget, device, best, fits, _absent_critic(cfg, vocab_sizes))


def _absent_critic(cfg: Config, vocab_sizes: dict[str, int]) -> ModelPlan | None:
    """The critic PPO would build for this run (``algorithm.adv_estimator=gae``); None when the
    run has a critic, or when PPO could not run this conf's critic section."""
    if "critic" in algorithms.roles(cfg):
        return None
    gae = dataclasses.replace(cfg, algorithm=dataclasses.replace(cfg.algorithm,
                                                                 adv_estimator="gae"))
    try:
        algorithms.check(gae)
        gae = derive(gae, say=lambda _: None)
    except ConfigError:  # e.g. its unused micro-batch does not tile the mini-batch
        return None
    return model_plan(gae, "critic", vocab_sizes["critic"])


def configured_strategies(cfg: Config) -> dict[str, Strategy]:
    """The strategies the conf sets for the run's models (roles left at ``auto`` are absent)."""
    return {role: Strategy.parse(cfg.model(role).strategy, frozen=role in FROZEN_ROLES)
            for role in algorithms.roles(cfg) if cfg.model(role).strategy != "auto"}


def _choose(cfg: Config, vocab_sizes: dict[str, int] | None) -> dict[str, Choice] | None:
    roles = algorithms.roles(cfg)
    fixed = configured_strategies(cfg)
    if len(fixed) == len(roles) and not any(cfg.model(r).max_micro_batch_size for r in roles):
        return None  # nothing to choose
    plan = make_plan(cfg, vocab_sizes, fixed)
    if plan.best is None:
        auto = [r for r in roles if r not in fixed] or list(roles)
        raise ConfigError(f"{auto[0]}.strategy", "auto found no strategy with which all "
                          f"{COUNT[len(roles)]} models fit in cluster.memory_gb="
                          f"{cfg.cluster.memory_gb}; allowed: more devices or memory, or see "
                          "python -m rlhf_paro.plan")
    return plan.best


def choose_strategies(cfg: Config, vocab_sizes: dict[str, int] | None = None
                      ) -> dict[str, Strategy]:
    """A strategy for each of the run's models: the conf's where it sets one, the planner's for
    ``auto``.

    The ``auto`` roles get the least predicted PPO-step time such that the run's models fit in
    ``cluster.memory_gb``; raises ``ConfigError`` when no choice fits.
    """
    best = _choose(cfg, vocab_sizes)
    if best is None:
        return configured_strategies(cfg)
    return {role: choice.strategy for role, choice in best.items()}


def resolve_auto(cfg: Config, vocab_sizes: dict[str, int] | None = None) -> Config:
    """``cfg`` with every ``auto`` strategy of the run's models replaced by the planner's
    choice, and every micro-batch that ``max_micro_batch_size`` lets grow set to the planner's
    size (a model the run does not build keeps its section as it is); then the vllm engine's
    ``rollout.gpu_memory_utilization=auto`` on CUDA set from what those leave of the device."""
    best = _choose(cfg, vocab_sizes)
    resolved = dataclasses.replace(cfg)
    for role, choice in (best or {}).items():
        setattr(resolved, role, dataclasses.replace(
            cfg.model(role), strategy=choice.strategy.name, micro_batch_size=choice.micro_batch))
    return resolve_engine_share(resolved, vocab_sizes, configured_strategies(resolved))
