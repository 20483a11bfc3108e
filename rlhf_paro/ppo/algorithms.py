"""Algorithms as data: the models a run needs, its advantage estimator, its loss terms, its keys.

``algorithm.adv_estimator`` names an ``Algorithm``; everything above the math reads the run's
models from ``roles(cfg)`` (the trainer starts those worker groups and no others, the planner
plans them, metrics, report, checkpoints and exports iterate over them):

    gae            actor, critic, reward, ref   PPO: GAE on the critic's values
    grpo           actor, reward, ref           group-normalised outcome reward
    dr_grpo        actor, reward, ref           group-centred outcome, token sums / budget
    rloo           actor, reward, ref           leave-one-out group baseline
    reinforce_pp   actor, reward, ref           return-to-go whitened over the global batch

``ref`` is dropped when nothing reads it: ``algorithm.kl_coef=0`` (a fixed coefficient of 0
stays 0, adaptive or not). The estimator itself is the function of the same name registered in
``ppo/core.py``; an estimator registered there without a spec here runs critic-free with the
token-mean loss (``spec``), so adding one is one registered function.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlhf_paro.config import ROLES, Config, ConfigError
from rlhf_paro.ppo import core


@dataclass(frozen=True)
class Algorithm:
    """What a registered advantage estimator asks of a run."""

    name: str  # the algorithm.adv_estimator value and the estimator's name in ppo/core.py
    critic: bool = False  # trains a value model, whose values the estimator reads
    # The baseline comes from the other samples of the prompt: needs rollout.n >= 2.
    group_baseline: bool = False
    loss_agg_mode: str = "token_mean"  # the policy loss's aggregation unless the config says
    # Dr. GRPO: each sequence's token sum is divided by the response budget (ppo.max_new_tokens),
    # a constant, instead of by the sequence's length.
    token_sum_norm: bool = False


ALGORITHMS: dict[str, Algorithm] = {}


def register_algorithm(spec: Algorithm) -> Algorithm:
    ALGORITHMS[spec.name] = spec
    return spec


register_algorithm(Algorithm("gae", critic=True))
register_algorithm(Algorithm("grpo", group_baseline=True))
register_algorithm(Algorithm("dr_grpo", group_baseline=True, loss_agg_mode="seq_mean_token_sum",
                             token_sum_norm=True))
register_algorithm(Algorithm("rloo", group_baseline=True))
register_algorithm(Algorithm("reinforce_pp"))


def spec(cfg: Config) -> Algorithm:
    """The run's algorithm; ``ConfigError`` for an estimator ``ppo/core.py`` does not know."""
    name = cfg.algorithm.adv_estimator
    if name not in core.ADV_ESTIMATORS:
        raise ConfigError("algorithm.adv_estimator", f"got {name!r}; allowed: "
                                                     f"{', '.join(core.ADV_ESTIMATORS)}")
    return ALGORITHMS.get(name, Algorithm(name))


def uses_ref(cfg: Config) -> bool:
    """Whether anything reads the reference policy: the KL, in the reward or in the loss."""
    return cfg.algorithm.kl_coef > 0


def roles(cfg: Config) -> tuple[str, ...]:
    """The models this run builds, in ``ROLES`` order."""
    algo = spec(cfg)
    return tuple(role for role in ROLES
                 if (role != "critic" or algo.critic) and (role != "ref" or uses_ref(cfg)))


def trained_roles(cfg: Config) -> tuple[str, ...]:
    return tuple(role for role in roles(cfg) if role in ("actor", "critic"))


def loss_agg_mode(cfg: Config) -> str:
    return cfg.algorithm.loss_agg_mode or spec(cfg).loss_agg_mode


def kl_estimator(cfg: Config) -> str:
    """The run's KL estimator: ``algorithm.kl_estimator``, or by where the KL goes (null): k1 as
    the penalty in the reward, k3 as the loss term (veRL's low_var_kl, GRPO's)."""
    alg = cfg.algorithm
    return alg.kl_estimator or ("k3" if alg.kl_in_loss else "k1")


def old_logprobs_from_update(cfg: Config) -> bool:
    """Whether the update's own forwards give the old log-probs, so that the actor skips their
    separate forward (TRL's GRPOTrainer does the same when it updates once per rollout).

    They are the same numbers when every training forward runs with the weights the separate
    one would use and computes the same network: one pass (``ppo.ppo_epochs=1``) over one
    mini-batch (``ppo.mini_batch_size`` = the step's samples), so no optimizer step comes
    between two micro-batches; no dropout in the training forward (``actor.disable_dropout``,
    and no LoRA dropout, which that key leaves as given). And nothing may read them before the
    update: no KL penalty in the reward (``algorithm.kl_in_loss``, or no reference). The
    update's ratio is then exactly 1, as it is in exact arithmetic."""
    ppo, actor = cfg.ppo, cfg.actor
    samples = ppo.rollout_batch_size * cfg.rollout.n
    one_pass = ppo.ppo_epochs == 1 and ppo.mini_batch_size == samples
    no_dropout = actor.disable_dropout and not (actor.lora.enabled and actor.lora.dropout > 0)
    return one_pass and no_dropout and (cfg.algorithm.kl_in_loss or not uses_ref(cfg))


def check(cfg: Config) -> None:
    """``ConfigError`` in one line for a combination the algorithm cannot run: names the math
    does not know, k1 as a loss term, a critic given to a critic-free algorithm, a group
    baseline with one sample per prompt, micro-batches of a trained model that do not tile a
    mini-batch. Reads the config as the user wrote it, before ``rlhf_paro.resolve`` gives the
    critic its source and a null KL estimator its value."""
    algo, alg = spec(cfg), cfg.algorithm
    if alg.kl_estimator is not None and alg.kl_estimator not in core.KL_ESTIMATORS:
        raise ConfigError("algorithm.kl_estimator", f"got {alg.kl_estimator!r}; allowed: null, "
                                                    f"{', '.join(core.KL_ESTIMATORS)}")
    if alg.kl_in_loss and alg.kl_estimator == "k1":
        # d/dtheta E_pi[log pi - log ref] = E_pi[grad log pi] = 0: only noise in the gradient.
        raise ConfigError("algorithm.kl_estimator", "k1 as a loss term (kl_in_loss=true) has "
                                                    "zero expected gradient: it never pulls the "
                                                    "policy towards ref; allowed: k3 or k2 (null: "
                                                    "k3), or k1 with kl_in_loss=false")
    if alg.loss_agg_mode is not None and alg.loss_agg_mode not in core.LOSS_AGG_MODES:
        raise ConfigError("algorithm.loss_agg_mode", f"got {alg.loss_agg_mode!r}; allowed: "
                                                     f"null, {', '.join(core.LOSS_AGG_MODES)}")
    if cfg.rollout.mask is not None and cfg.rollout.mask not in core.MASK_LEVELS:
        raise ConfigError("rollout.mask", f"got {cfg.rollout.mask!r}; allowed: null, "
                                          f"{', '.join(core.MASK_LEVELS)}")
    if alg.kl_in_loss and alg.adaptive_kl:
        raise ConfigError("algorithm.adaptive_kl", "the adaptive controller steers the KL "
                                                   "penalty in the reward; allowed: false with "
                                                   "kl_in_loss=true")
    if algo.group_baseline and cfg.rollout.n < 2:
        raise ConfigError("rollout.n", f"{algo.name} takes its baseline from the other "
                                       f"samples of a prompt; allowed: 2 or more, got "
                                       f"{cfg.rollout.n}")
    if not algo.critic and (cfg.critic.path is not None or cfg.critic.config is not None):
        raise ConfigError("critic", f"algorithm.adv_estimator={algo.name} trains no "
                                    "critic; allowed: no critic.path or critic.config "
                                    "(unset them with ~critic.path), or adv_estimator=gae")
    for role in trained_roles(cfg):
        cfg.check_micro_batches(role)
