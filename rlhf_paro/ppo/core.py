"""PPO math as pure functions on right-padded response tensors.

Shape legend (every tensor here is about the response part of a rollout, never the prompt):

    B   number of sequences in the (micro-)batch
    T   response length after right padding
    mask (B, T) float 0/1: 1 on generated tokens, 0 on padding after the end of a response

Conventions are those OpenRLHF and veRL share. References: PPO is Schulman et al. 2017 ("Proximal
Policy Optimization Algorithms", eq. 7 for the clipped surrogate), GAE is Schulman et al. 2016
("High-Dimensional Continuous Control Using Generalized Advantage Estimation", eq. 16), the KL
penalty and its adaptive coefficient are Ziegler et al. 2019 ("Fine-Tuning Language Models from
Human Preferences", section 2.2), the k1/k2/k3 estimators are Schulman's "Approximating KL
Divergence" note.

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
caller all-reduces, so they are exact under any split too.
"""

from __future__ import annotations

import math
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
    """(B,) index of the last valid token of each right-padded row; every row needs one."""
    lengths = mask.sum(dim=-1).long()
    if bool((lengths == 0).any()):
        raise ValueError("every response needs at least one valid token (mask row of zeros)")
    return lengths - 1


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

    rewards, values, mask: (B, T). ``delta_t = r_t + gamma * V_{t+1} - V_t`` with ``V`` taken as 0
    after the last valid token (the episode ends there), ``A_t = delta_t + gamma * lam * A_{t+1}``.
    Returns ``(advantages, returns)``, both (B, T) and zero on padding, with
    ``returns = advantages + values``. Row-wise, so invariant to any split of the batch.
    """
    rewards = rewards * mask
    values = values * mask
    num_tokens = rewards.shape[-1]
    advantages = torch.zeros_like(rewards)
    next_advantage = torch.zeros_like(rewards[:, 0])
    next_value = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(num_tokens)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        next_advantage = (delta + gamma * lam * next_advantage) * mask[:, t]
        advantages[:, t] = next_advantage
        next_value = values[:, t]
    returns = (advantages + values) * mask
    return advantages, returns


def masked_sum(x: Tensor, mask: Tensor) -> Tensor:
    return (x * mask).sum()


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over valid tokens (of the whole tensor, or along ``dim``).

    Data-parallel invariant when combined as ``sum(masked_sum) / sum(mask.sum())`` over ranks;
    the mean of per-rank means is not (ranks hold different numbers of valid tokens).
    """
    if dim is None:
        return masked_sum(x, mask) / mask.sum()
    return (x * mask).sum(dim) / mask.sum(dim)


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


def policy_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, clip_eps: float,
                num_tokens: float | None = None, agg: str = "token_mean",
                token_sum_norm: float | None = None) -> tuple[Tensor, dict[str, float]]:
    """Clipped surrogate objective (Schulman et al. 2017, eq. 7), as a loss to minimise.

    logp: (B, T) log-probs under the current policy (with grad); old_logp: (B, T) under the policy
    that sampled the rollout; advantages: (B, T). Per token
    ``max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps))`` with ``ratio = exp(logp - old_logp)``,
    reduced by ``aggregate(per_token, mask, agg, num_tokens, token_sum_norm)``: ``num_tokens`` is
    the divisor of the mode (for ``token_mean`` the step's valid tokens / (ranks * micro-batches),
    and the step is the token-mean over the global mini-batch; see the module note).

    Metrics are token-means over this micro-batch's valid tokens plus ``num_tokens`` (its valid
    token count): combine micro-batches and ranks by weighting with that count.
    """
    log_ratio = (logp - old_logp).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps)
    per_token = torch.maximum(unclipped, clipped)
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
            divisor: float | None = None) -> tuple[Tensor, dict[str, float]]:
    """The KL to the reference as a loss term (GRPO's, Shao et al. 2024 eq. 3-4, with any
    registered estimator, k3 there), instead of a penalty in the reward.

    logp: (B, T) log-probs under the current policy (with grad, which flows through the
    estimator); ref_logp: (B, T) under the reference. Per token ``kl_estimate(logp, ref_logp,
    kind)``, reduced by ``aggregate(per_token, mask, agg, divisor)``, so it has that mode's
    data-parallel invariant; the caller scales it by its coefficient and adds it to the policy
    loss. Metrics: ``kl``, the token-mean over this micro-batch.
    """
    per_token = kl_estimate(logp, ref_logp, kind)
    loss = aggregate(per_token, mask, agg, divisor)
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
