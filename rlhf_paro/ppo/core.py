"""PPO math as pure functions on right-padded response tensors.

Shape legend (every tensor here is about the response part of a rollout, never the prompt):

    B   number of sequences in the (micro-)batch
    T   response length after right padding
    mask (B, T) float 0/1: 1 on the policy's own tokens (actions), 0 on padding after the end of
        a response and, in a multi-turn episode, on the environment's tokens between two actions
        (observations: attended, never trained; docs/design.md, "Multi-turn episodes")

Conventions are those OpenRLHF and veRL share. References: PPO is Schulman et al. 2017 ("Proximal
Policy Optimization Algorithms", eq. 7 for the clipped surrogate), GAE is Schulman et al. 2016
("High-Dimensional Continuous Control Using Generalized Advantage Estimation", eq. 16), the KL
penalty and its adaptive coefficient are Ziegler et al. 2019 ("Fine-Tuning Language Models from
Human Preferences", section 2.2), the k1/k2/k3 estimators are Schulman's "Approximating KL
Divergence" note. The critic-free advantage estimators: GRPO is Shao et al. 2024 ("DeepSeekMath",
section 4.1.2, outcome supervision; its eq. 3-4 also put the KL in the loss, ``kl_loss``), Dr. GRPO
is Liu et al. 2025 ("Understanding R1-Zero-Like Training: A Critical Perspective"), RLOO is
Ahmadian et al. 2024 ("Back to Basics: Revisiting REINFORCE Style Optimization for Learning from
Human Feedback in LLMs") after Kool et al. 2019, REINFORCE++ is Hu 2025.

[Note: loss aggregation and data parallelism]
Losses are the token-mean over the whole mini-batch of the optimizer step, across all data-parallel
ranks and all micro-batches: sum over every valid token of the step / number of valid tokens of the
step. The sharding engine averages gradients over ranks and micro-batches (it divides by N*s), so
each micro-batch computes ``masked_sum / num_tokens`` with ``num_tokens`` = the step's valid tokens
divided by N*s (the mean number of valid tokens per micro-batch). The N*s factors cancel and the
step's gradient is the gradient of the global token-mean whatever way tokens are spread over ranks
and micro-batches. ``num_tokens=None`` divides by this micro-batch's own valid tokens, which equals
the global token-mean only when every micro-batch holds the same number of valid tokens.
That is ``token_mean``, the default aggregation. The sequence modes (``seq_mean_token_sum``,
``seq_mean_token_mean``) are the same argument one level up: each sequence contributes one number
(its token sum or token mean), a micro-batch adds its sequences' numbers and divides by the step's
sequences / (N*s) (``agg_count`` says what a rank counts), and the step is the mean over all
sequences of the global mini-batch under any split.
Statistics that normalise (``masked_whiten``) take global moments (sums and a count) that the
caller all-reduces, so they are exact under any split too; the group estimators need no
collective because a group never spans ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

Tensor = torch.Tensor

# ``exp`` of a log-ratio beyond this overflows float32 long before it means anything; clamping it
# keeps k3 and the importance ratio finite when a policy has drifted far (OpenRLHF clamps to 10,
# we clamp wider so moderate drift is not distorted).
_MAX_LOG_RATIO = 20.0

KLEstimator = Callable[[Tensor, Tensor], Tensor]
KL_ESTIMATORS: dict[str, KLEstimator] = {}


def register_kl_estimator(name: str) -> Callable[[KLEstimator], KLEstimator]:
    """Register a per-token KL estimator ``f(logp, ref_logp) -> (B, T)`` under ``name``."""

    def wrap(fn: KLEstimator) -> KLEstimator:
        KL_ESTIMATORS[name] = fn
        return fn

    return wrap


@register_kl_estimator("k1")
def _kl_k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    # Unbiased for KL(pi || ref) when tokens are sampled from pi; can be negative per token.
    return logp - ref_logp


@register_kl_estimator("k2")
def _kl_k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    # Biased but low variance and never negative.
    return 0.5 * (logp - ref_logp).square()


@register_kl_estimator("k3")
def _kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    # Unbiased and never negative: e^r - 1 - r with r = ref_logp - logp (the veRL "low_var_kl").
    log_ratio = (ref_logp - logp).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return log_ratio.exp() - 1 - log_ratio


def kl_estimate(logp: Tensor, ref_logp: Tensor, kind: str = "k1") -> Tensor:
    """Per-token estimate of KL(pi || ref) from the log-probs of the sampled tokens.

    logp, ref_logp: (B, T) log-probs of the generated tokens under the policy and the reference.
    Returns (B, T); padding positions hold whatever the inputs hold there (mask them downstream).
    Elementwise, so trivially invariant to any split of the batch.
    """
    try:
        estimator = KL_ESTIMATORS[kind]
    except KeyError:
        raise ValueError(
            f"unknown KL estimator {kind!r}; allowed: {', '.join(sorted(KL_ESTIMATORS))}"
        ) from None
    return estimator(logp, ref_logp)


def last_token_index(mask: Tensor) -> Tensor:
    """(B,) index of the last valid token of each row (its last action: the mask may have holes
    where observations lie); every row needs one."""
    if bool((mask.sum(dim=-1) == 0).any()):
        raise ValueError("every response needs at least one valid token (mask row of zeros)")
    # argmax gives the first of equal maxima: the first 1 of the reversed row is the last 1.
    return mask.shape[-1] - 1 - mask.flip(-1).argmax(dim=-1)


def token_rewards(score: Tensor, kl: Tensor, mask: Tensor, kl_coef: float) -> Tensor:
    """Per-token rewards: ``-kl_coef * kl`` on valid tokens, plus ``score`` on the last one.

    score: (B,) sequence score of the reward model; kl: (B, T); mask: (B, T). Returns (B, T), zero
    on padding. This is the KL-shaped reward R(x, y) = r(x, y) - beta * KL of Ziegler et al. 2019
    eq. 2, spread over tokens as OpenRLHF and veRL do. Row-wise, so invariant to any split.
    """
    rewards = -kl_coef * kl * mask
    last = last_token_index(mask)
    rows = torch.arange(rewards.shape[0], device=rewards.device)
    rewards[rows, last] += score.to(rewards.dtype)
    return rewards


@torch.no_grad()
def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float
        ) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016, eq. 16), not whitened.

    rewards, values, mask: (B, T). The time steps are the valid tokens (the actions) of a row, in
    order: ``delta_t = r_t + gamma * V_{t'} - V_t`` with t' the next valid token (``V`` taken as 0
    after the last one: the episode ends there), ``A_t = delta_t + gamma * lam * A_{t'}``. A run of
    masked tokens between two valid ones (a multi-turn episode's observation) is not a step:
    gamma and lambda apply once across it, as if the environment's answer took no time, and a
    reward there is ignored. Returns ``(advantages, returns)``, both (B, T) and zero where the
    mask is, with ``returns = advantages + values``. Row-wise, so invariant to any split of the
    batch; with a mask that is a prefix of each row it is the textbook recursion.
    """
    rewards = rewards * mask
    values = values * mask
    num_tokens = rewards.shape[-1]
    advantages = torch.zeros_like(rewards)
    next_advantage = torch.zeros_like(rewards[:, 0])
    next_value = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(num_tokens)):
        valid = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        advantages[:, t] = advantage * valid
        # A masked token carries the next valid token's advantage and value through unchanged.
        next_advantage = torch.where(valid.bool(), advantage, next_advantage)
        next_value = torch.where(valid.bool(), values[:, t], next_value)
    returns = (advantages + values) * mask
    return advantages, returns


def masked_sum(x: Tensor, mask: Tensor) -> Tensor:
    return (x * mask).sum()


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``x`` over the valid tokens of the whole tensor.

    Data-parallel invariant when combined as ``sum(masked_sum) / sum(mask.sum())`` over ranks;
    the mean of per-rank means is not (ranks hold different numbers of valid tokens).
    """
    return masked_sum(x, mask) / mask.sum()


def masked_moments(x: Tensor, mask: Tensor) -> Tensor:
    """``[count, sum, sum of squares]`` of the valid entries, float64, to all-reduce over ranks.

    Summing these over ranks gives the moments of the full batch exactly (up to float64 rounding),
    which is what makes ``masked_whiten`` invariant to the data-parallel split.
    """
    x64 = x.detach().to(torch.float64)
    m64 = mask.to(torch.float64)
    return torch.stack([m64.sum(), (x64 * m64).sum(), (x64.square() * m64).sum()])


def masked_whiten(x: Tensor, mask: Tensor, moments: Tensor | None = None, shift_mean: bool = True,
                  eps: float = 1e-8) -> Tensor:
    """Normalise ``x`` to zero mean and unit variance over all valid tokens of the batch.

    x, mask: (B, T). ``moments``: the global ``masked_moments`` summed over ranks; None uses this
    tensor's own (single process). The variance is the unbiased one (Bessel's correction), as in
    OpenRLHF's and veRL's ``masked_whiten``; ``shift_mean=False`` adds the mean back after scaling,
    as they do.
    Padding positions are returned as 0. Invariant: with summed moments, whitening each rank's
    slice gives exactly the slices of the full-batch result.
    """
    if moments is None:
        moments = masked_moments(x, mask)
    count, total, total_sq = moments.tolist()
    if count < 2:
        raise ValueError(f"whitening needs at least 2 valid tokens, got {int(count)}")
    mean = total / count
    var = max(total_sq / count - mean * mean, 0.0) * count / (count - 1)
    whitened = (x - mean) / math.sqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask


def _no_collective(x: Tensor) -> Tensor:
    return x


@dataclass(frozen=True)
class AdvantageInputs:
    """What every advantage estimator reads; one rank's part of the rollout batch."""

    # (B, T) token rewards (``token_rewards``: the score on the last valid token, minus
    # ``kl_coef * kl`` on every valid token when the KL is in the reward); zero on padding.
    rewards: Tensor
    # (B, T) 0/1.
    mask: Tensor
    # (B,) int64: samples of one prompt share an id, in any order; a group is always whole in one
    # call (never split over ranks), so group statistics need no collective.
    group: Tensor
    # (B, T) critic values; only ``gae`` reads them.
    values: Tensor | None = None
    gamma: float = 1.0
    lam: float = 1.0
    # ``gae`` only: whiten the advantages over the whole (global) batch.
    whiten: bool = True
    # Sums a small float64 tensor over the data-parallel ranks (an all-reduce); the identity in
    # one process. The whitening estimators pass their moments through it.
    sum_over_ranks: Callable[[Tensor], Tensor] = _no_collective


AdvantageEstimator = Callable[[AdvantageInputs], tuple[Tensor, Tensor]]
ADV_ESTIMATORS: dict[str, AdvantageEstimator] = {}


def register_adv_estimator(name: str) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Register ``f(inputs) -> (advantages, returns)``, both (B, T) and zero on padding, under
    ``name``. Advantages are constants of the loss, so the registered function runs without
    autograd."""

    def wrap(fn: AdvantageEstimator) -> AdvantageEstimator:
        ADV_ESTIMATORS[name] = torch.no_grad()(fn)
        return fn

    return wrap


def advantages(name: str, inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """``(advantages, returns)`` of the estimator registered as ``name``, both (B, T), zero on
    padding. ``returns`` is what a critic would regress to (each estimator says what it gives);
    only ``gae``'s are trained on, the others are logged."""
    try:
        estimator = ADV_ESTIMATORS[name]
    except KeyError:
        raise ValueError(
            f"unknown advantage estimator {name!r}; allowed: {', '.join(sorted(ADV_ESTIMATORS))}"
        ) from None
    return estimator(inputs)


def _return_to_go(rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    # G_t = sum_{k >= t} gamma^(k - t) r_k is GAE with V = 0 and lam = 1 (then delta_t = r_t).
    return gae(rewards, torch.zeros_like(rewards), mask, gamma, 1.0)[0]


@register_adv_estimator("gae")
def _adv_gae(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    # ``gae``, then whitened with moments summed over ranks: the slices of the full-batch result.
    # Returns are the unwhitened advantages + values, the critic's target.
    if inputs.values is None:
        raise ValueError("advantage estimator 'gae' needs critic values (AdvantageInputs.values)")
    adv, returns = gae(inputs.rewards, inputs.values, inputs.mask, inputs.gamma, inputs.lam)
    if inputs.whiten:
        moments = inputs.sum_over_ranks(masked_moments(adv, inputs.mask))
        adv = masked_whiten(adv, inputs.mask, moments)
    return adv, returns


@register_adv_estimator("reinforce_pp")
def _adv_reinforce_pp(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    # REINFORCE++ (Hu 2025): the discounted return-to-go of the token rewards (the KL penalty
    # included when it is in the reward), whitened over all valid tokens of the global batch with
    # moments summed over ranks, so each rank's slice is that of the unsplit batch. Returns are
    # the return-to-go before whitening.
    returns = _return_to_go(inputs.rewards, inputs.mask, inputs.gamma)
    moments = inputs.sum_over_ranks(masked_moments(returns, inputs.mask))
    return masked_whiten(returns, inputs.mask, moments), returns


def _group_outcomes(inputs: AdvantageInputs, name: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(r, mean, size, index)`` for outcome supervision: r (B,) the sum of each sample's token
    rewards; mean and size (G,) its group's mean outcome and number of samples; index (B,) the
    sample's group in 0..G-1 (ids may come in any order)."""
    if inputs.group.shape != inputs.rewards.shape[:1]:
        raise ValueError(f"group must be (B,) = {tuple(inputs.rewards.shape[:1])}, "
                         f"got {tuple(inputs.group.shape)}")
    r = (inputs.rewards * inputs.mask).sum(-1)
    _, index = torch.unique(inputs.group, return_inverse=True)
    size = torch.bincount(index).to(r.dtype)
    if bool((size < 2).any()):
        raise ValueError(f"advantage estimator {name!r} needs at least 2 samples per group "
                         f"(rollout.n >= 2); a group has {int(size.min())}")
    mean = torch.zeros_like(size).index_add_(0, index, r) / size
    return r, mean, size, index


def _outcome_result(adv: Tensor, inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    # One advantage per sample on each of its valid tokens; returns are the undiscounted
    # return-to-go of the token rewards (the outcome estimators ignore gamma).
    return adv[:, None] * inputs.mask, _return_to_go(inputs.rewards, inputs.mask, 1.0)


@register_adv_estimator("grpo")
def _adv_grpo(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    # GRPO (Shao et al. 2024, section 4.1.2): A_i = (r_i - mean(group)) / (std(group) + 1e-6) with
    # the unbiased (Bessel) std of the group's outcomes.
    r, mean, size, index = _group_outcomes(inputs, "grpo")
    centred = r - mean[index]
    var = torch.zeros_like(size).index_add_(0, index, centred.square()) / (size - 1)
    return _outcome_result(centred / (var.sqrt()[index] + 1e-6), inputs)


@register_adv_estimator("dr_grpo")
def _adv_dr_grpo(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    # Dr. GRPO (Liu et al. 2025): A_i = r_i - mean(group), without GRPO's division by the std (its
    # other change, no per-sequence length normalisation, is the ``seq_mean_token_sum`` loss).
    r, mean, _, index = _group_outcomes(inputs, "dr_grpo")
    return _outcome_result(r - mean[index], inputs)


@register_adv_estimator("rloo")
def _adv_rloo(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    # RLOO (Ahmadian et al. 2024, Kool et al. 2019): A_i = r_i - mean of the other n - 1 samples of
    # the group, which is n / (n - 1) * (r_i - mean(group)).
    r, mean, size, index = _group_outcomes(inputs, "rloo")
    return _outcome_result(size[index] / (size[index] - 1) * (r - mean[index]), inputs)


@dataclass(frozen=True)
class Experience:
    """What the policy update reads of one rank's rollout, besides the rollout itself; every
    tensor (B, T), zero on padding."""

    # Log-probs of the sampled tokens under the policy before the update; None: the update's
    # own forwards give them (``algorithms.old_logprobs_from_update``).
    old_logp: Tensor | None
    ref_logp: Tensor | None  # the reference's, kept only when the KL is a loss term
    advantages: Tensor
    returns: Tensor  # the critic's targets (``advantages`` says what each estimator gives)
    # The KL estimate per token (zero without a reference or without old_logp), for the metrics
    kl: Tensor

    def select(self, rows: Tensor) -> Experience:
        """The rows ``rows`` of every tensor."""
        return Experience(None if self.old_logp is None else self.old_logp[rows],
                          None if self.ref_logp is None else self.ref_logp[rows],
                          self.advantages[rows], self.returns[rows], self.kl[rows])


@dataclass(frozen=True)
class ExperienceSpec:
    """How a run turns scores into advantages (the ``algorithm`` and ``ppo`` sections). No
    field has a default: the config's are the defaults, and a second set here could differ."""

    estimator: str  # a registered advantage estimator
    kl_estimator: str
    kl_in_loss: bool  # the KL is a loss term (then not in the reward)
    gamma: float
    lam: float
    whiten: bool


@torch.no_grad()
def make_experience(spec: ExperienceSpec, old_logp: Tensor | None, ref_logp: Tensor | None,
                    score: Tensor, mask: Tensor, group: Tensor, values: Tensor | None,
                    kl_coef: float, sum_over_ranks: Callable[[Tensor], Tensor] = _no_collective
                    ) -> Experience:
    """One rank's experience: the KL estimate against the reference (none: zero), the token
    rewards (the KL penalty in them at ``kl_coef`` unless ``spec.kl_in_loss``), then the
    estimator's advantages and returns.

    old_logp: (B, T), or None when the update gives it, which only a KL in the loss allows (the
    KL in the reward reads it; the KL estimate is then zero here and the update's to log).
    ref_logp, values: (B, T) or None as ``AdvantageInputs`` says; score: (B,); mask:
    (B, T); group: (B,) ids of the samples of one prompt, whole on this rank. ``sum_over_ranks``
    all-reduces the moments of a batch-wide whitening, so the result is this rank's slice of the
    global batch's (see the note on data parallelism).
    """
    kl = torch.zeros_like(mask, dtype=torch.float32)
    if ref_logp is not None and old_logp is None and not spec.kl_in_loss:
        raise ValueError("the KL penalty in the reward needs the old log-probs")
    if ref_logp is not None and old_logp is not None:
        kl = kl_estimate(old_logp, ref_logp, spec.kl_estimator) * mask
    rewards = token_rewards(score, kl, mask, 0.0 if spec.kl_in_loss else kl_coef)
    adv, returns = advantages(spec.estimator, AdvantageInputs(
        rewards=rewards, mask=mask, group=group, values=values, gamma=spec.gamma, lam=spec.lam,
        whiten=spec.whiten, sum_over_ranks=sum_over_ranks))
    return Experience(old_logp, ref_logp if spec.kl_in_loss else None, adv, returns, kl)


LOSS_AGG_MODES = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean")


def _check_agg(agg: str) -> None:
    if agg not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss aggregation {agg!r}; allowed: {', '.join(LOSS_AGG_MODES)}")


def agg_count(mask: Tensor, agg: str) -> float:
    """What a rank counts towards the divisor of ``aggregate``: its valid tokens (``token_mean``)
    or its sequences, the rows with at least one valid token (the ``seq_*`` modes). The divisor
    of a micro-batch is this count summed over the step's ranks and micro-batches, / (N*s)."""
    _check_agg(agg)
    if agg == "token_mean":
        return float(mask.sum())
    return float((mask.sum(-1) > 0).sum())


def aggregate(per_token: Tensor, mask: Tensor, agg: str, divisor: float | None = None,
              token_sum_norm: float | None = None) -> Tensor:
    """Reduce a (B, T) per-token loss to this micro-batch's share of the step's loss.

    - ``token_mean``: sum over valid tokens / ``divisor``. Invariant: with ``divisor`` = the
      step's valid tokens / (N*s), the mean of the N*s micro-batch losses is the token-mean over
      the global mini-batch, whatever the split.
    - ``seq_mean_token_sum``: sum over sequences of the sequence's token sum (divided by
      ``token_sum_norm``, Dr. GRPO's constant response budget, when given) / ``divisor``.
      Invariant: with ``divisor`` = the step's sequences / (N*s), the mean of the N*s
      micro-batch losses is the mean over all sequences of the global mini-batch.
    - ``seq_mean_token_mean``: sum over sequences of the sequence's token mean / ``divisor``.
      Invariant: as for ``seq_mean_token_sum``.

    ``divisor=None`` uses this micro-batch's own ``agg_count``, exact only when one micro-batch
    is the whole step (see the module note).
    """
    _check_agg(agg)
    if token_sum_norm is not None and agg != "seq_mean_token_sum":
        raise ValueError(f"token_sum_norm applies to seq_mean_token_sum only, not to {agg!r}")
    if divisor is None:
        divisor = max(agg_count(mask, agg), 1.0)
    elif divisor <= 0:
        raise ValueError(f"the loss divisor (num_tokens) must be positive, got {divisor}")
    if agg == "token_mean":
        return masked_sum(per_token, mask) / divisor
    seq = (per_token * mask).sum(-1)
    if agg == "seq_mean_token_mean":
        seq = seq / mask.sum(-1).clamp(min=1)
    elif token_sum_norm is not None:
        seq = seq / token_sum_norm
    return seq.sum() / divisor


@torch.no_grad()
def tis_weights(old_logp: Tensor, rollout_logp: Tensor, cap: float) -> Tensor:
    """(B, T) truncated importance weights ``min(exp(old_logp - rollout_logp), cap)`` for the
    rollout engine's mismatch (docs/design.md, "Rollout"), and for a rollout generated by an
    older policy (docs/design.md, "Asynchronous rollouts").

    [Note: the decoupled objective]
    With ``rollout.max_staleness=K`` the rollout of step t was sampled by the behaviour policy
    pi_b, the policy after update t - K (its log-probs: the engine's, ``rollout_logp``), while
    the update starts from the proximal policy pi_prox, the one after t updates (its log-probs:
    the trainer's, recomputed at the step, ``old_logp``). The loss is then the decoupled PPO
    objective (Hilton et al. 2022; AReaL, Fu et al. 2025):

        L = E_{y ~ pi_b} [ min(pi_prox / pi_b, cap) *
                           max(-A * r, -A * clip(r, 1 - eps, 1 + eps)) ],  r = pi_theta / pi_prox

    clipping against the proximal policy (``policy_loss``'s ratio) and reweighting each token from
    the behaviour policy to the proximal one by the truncated ratio computed here. With K = 0 the
    two policies are the same weights and the weight is the engine's mismatch alone.

    The rollout was sampled from the engine's distribution (``rollout_logp``), while the surrogate
    treats it as sampled from the trainer's (``old_logp``, the same weights computed by another
    path): the ratio trainer / engine reweights each token to the distribution the loss assumes,
    and the cap bounds the variance a rare token with a tiny engine probability would bring.
    Computed without grad: a constant correction of the sample, not something to optimise.
    """
    return (old_logp - rollout_logp).clamp(max=math.log(cap)).exp()


# What a mask for the engine's mismatch bounds, per sample (``mask_log_ratio``): the ratio of
# the sample's probabilities, trainer / engine (``sequence``), or its geometric mean per action
# token (``geometric``). The names are the field's: veRL's ``rollout_rs`` levels, TRL's
# ``sequence_mask``, SkyRL's geometric mask.
MASK_LEVELS = ("sequence", "geometric")


@torch.no_grad()
def mask_log_ratio(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, level: str) -> Tensor:
    """(B,) float64: the log of each sample's engine-mismatch ratio, over its action tokens
    (``mask``): ``sequence``, sum_t (old_logp - rollout_logp), the log of
    prod_t pi_trainer / pi_engine, the ratio of the whole sample's probabilities; ``geometric``,
    that sum / the sample's action tokens, the log of the product's geometric mean (a sample
    without action tokens: 0, a ratio of 1).

    In log space, since the product over a long response leaves float range (a thousand tokens
    0.1 apart is e^100); in float64, so that summing a long response adds no rounding of its own
    to a decision at the band's edge. A non-finite log-prob on an action gives a NaN or an
    infinity, which no band holds (``in_band``).

    [Note: masks for the engine's mismatch] (docs/design.md, "Rollout")
    The token product's variance grows with the length of the response: each token's ratio is
    near 1, but a sequence-level importance weight multiplies T of them, so token TIS
    (``tis_weights``) corrects each token while no token says whether the sample as a whole is
    one the trainer would have drawn. A mask checks the sample instead and leaves out the
    policy loss of those whose ratio leaves a band: the product for ``sequence`` (TRL's
    ``sequence_mask``: one bad token leaves the product far from 1); its geometric mean for
    ``geometric`` (SkyRL's ``geo_mask``), a per-token average that does not drift with length,
    so one band fits responses of any length.
    """
    if level not in MASK_LEVELS:
        raise ValueError(f"unknown mask level {level!r}; allowed: {', '.join(MASK_LEVELS)}")
    actions = mask.bool()
    diff = torch.where(actions, old_logp.double() - rollout_logp.double(), 0.0).sum(-1)
    if level == "geometric":
        diff = diff / actions.sum(-1).clamp(min=1)
    return diff


def in_band(log_ratio: Tensor, low: float, high: float) -> Tensor:
    """(B,) bool: the samples whose ratio exp(``log_ratio``) lies in [``low``, ``high``], both
    edges kept (as TRL, veRL and SkyRL mask only a ratio beyond a bound); compared in log space,
    so a ratio too large for float64 still counts as above the band."""
    return (log_ratio >= math.log(low)) & (log_ratio <= math.log(high))


def policy_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, clip_eps: float,
                num_tokens: float | None = None, agg: str = "token_mean",
                token_sum_norm: float | None = None, weights: Tensor | None = None
                ) -> tuple[Tensor, dict[str, float]]:
    """Clipped surrogate objective (Schulman et al. 2017, eq. 7), as a loss to minimise.

    logp: (B, T) log-probs under the current policy (with grad); old_logp: (B, T) under the policy
    that sampled the rollout; advantages: (B, T). Per token
    ``max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps))`` with ``ratio = exp(logp - old_logp)``,
    reduced by ``aggregate(per_token, mask, agg, num_tokens, token_sum_norm)``: ``num_tokens`` is
    the divisor of the mode (for ``token_mean`` the step's valid tokens / (ranks * micro-batches),
    and the step is the token-mean over the global mini-batch; see the module note). ``weights``
    (B, T), no grad: each token's term multiplied by it before the reduction (``tis_weights``).

    Metrics are token-means over this micro-batch's valid tokens plus ``num_tokens`` (its valid
    token count): combine micro-batches and ranks by weighting with that count.
    """
    log_ratio = (logp - old_logp).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps)
    per_token = torch.maximum(unclipped, clipped)
    if weights is not None:
        per_token = per_token * weights
    loss = aggregate(per_token, mask, agg, num_tokens, token_sum_norm)
    with torch.no_grad():
        valid = mask.sum().clamp(min=1)
        metrics = {
            "clipfrac": float(masked_sum((clipped > unclipped).float(), mask) / valid),
            # k3 of old vs new: a low-variance estimate of how far this update moved the policy.
            "approx_kl": float(masked_sum(_kl_k3(old_logp, logp), mask) / valid),
            "ratio_mean": float(masked_sum(ratio, mask) / valid),
            "num_tokens": float(mask.sum()),
        }
    return loss, metrics


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip_eps: float,
               num_tokens: float | None = None, agg: str = "token_mean"
               ) -> tuple[Tensor, dict[str, float]]:
    """Clipped value loss ``0.5 * max((V - R)^2, (V_clip - R)^2)``, reduced like ``policy_loss``
    (``aggregate`` with ``agg`` and ``num_tokens`` as its divisor).

    values: (B, T) current critic values (with grad); old_values: (B, T) values at rollout time;
    returns: (B, T) GAE returns. ``V_clip = old_values + clip(values - old_values, -eps, eps)``, the
    clipping of OpenAI baselines' PPO2 that OpenRLHF and veRL use. Metrics as in ``policy_loss``;
    ``vf_clipfrac`` is the fraction of tokens where the clipped term is the larger.
    """
    clipped_values = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
    unclipped = (values - returns).square()
    clipped = (clipped_values - returns).square()
    per_token = 0.5 * torch.maximum(unclipped, clipped)
    loss = aggregate(per_token, mask, agg, num_tokens)
    with torch.no_grad():
        valid = mask.sum().clamp(min=1)
        metrics = {
            "vf_clipfrac": float(masked_sum((clipped > unclipped).float(), mask) / valid),
            "value_mean": float(masked_sum(values, mask) / valid),
            "value_mse": float(masked_sum(unclipped, mask) / valid),
            "num_tokens": float(mask.sum()),
        }
    return loss, metrics


def kl_loss(logp: Tensor, ref_logp: Tensor, mask: Tensor, kind: str, agg: str = "token_mean",
            divisor: float | None = None, token_sum_norm: float | None = None
            ) -> tuple[Tensor, dict[str, float]]:
    """The KL to the reference as a loss term (GRPO's, Shao et al. 2024 eq. 3-4, with any
    registered estimator, k3 there), instead of a penalty in the reward.

    logp: (B, T) log-probs under the current policy (with grad, which flows through the
    estimator); ref_logp: (B, T) under the reference. Per token ``kl_estimate(logp, ref_logp,
    kind)``, reduced by ``aggregate(per_token, mask, agg, divisor, token_sum_norm)`` (as the
    policy loss it joins), so it has that mode's
    data-parallel invariant; the caller scales it by its coefficient and adds it to the policy
    loss. Metrics: ``kl``, the token-mean over this micro-batch.
    """
    per_token = kl_estimate(logp, ref_logp, kind)
    loss = aggregate(per_token, mask, agg, divisor, token_sum_norm)
    with torch.no_grad():
        kl = float(masked_sum(per_token, mask) / mask.sum().clamp(min=1))
    return loss, {"kl": kl}


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, kl_coef: float) -> None:
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        pass


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. 2019, section 2.2.

    ``e = clip(KL / target - 1, -0.2, 0.2)`` and ``beta <- beta * (1 + e * n_steps / horizon)``:
    the coefficient grows when the policy drifts beyond the target KL and shrinks below it, by at
    most 20% of ``n_steps / horizon`` per update. ``current_kl`` is the mean per-sequence KL
    (summed over the response tokens), the quantity the target is stated in; ``n_steps`` the number
    of samples (sequences) behind that estimate. With data parallelism pass the mean over the
    whole rollout (sum of per-sequence KL and number of sequences all-reduced), so every rank
    holds the same coefficient.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: int) -> None:
        if target <= 0 or horizon <= 0:
            raise ValueError(f"KL target ({target}) and horizon ({horizon}) must be positive")
        self.value = init_kl_coef
        self.target = target
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


def kl_controller(kl_coef: float, adaptive: bool, target: float, horizon: int
                  ) -> FixedKLController | AdaptiveKLController:
    """The controller the config asks for (``ppo.adaptive_kl``)."""
    if adaptive:
        return AdaptiveKLController(kl_coef, target, horizon)
    return FixedKLController(kl_coef)
