"""PPO math against hand-computed values, and the data-parallel invariance of every reduction."""

import math
import statistics
from dataclasses import replace

import pytest
import torch

from rlhf_paro.ppo import core


def t(rows):
    return torch.tensor(rows, dtype=torch.float64)


# --- hand-computed values -------------------------------------------------------------------------

def test_kl_estimators_match_hand_values():
    # pi(y) = 0.5, ref(y) = 0.25: k1 = ln 2; k2 = (ln 2)^2 / 2;
    # k3 = e^r - 1 - r with r = ln(0.25/0.5) = -ln 2, i.e. 0.5 - 1 + ln 2.
    logp, ref_logp = t([[math.log(0.5)]]), t([[math.log(0.25)]])
    ln2 = math.log(2)
    assert core.kl_estimate(logp, ref_logp, "k1").item() == pytest.approx(ln2)
    assert core.kl_estimate(logp, ref_logp, "k2").item() == pytest.approx(0.5 * ln2 ** 2)
    assert core.kl_estimate(logp, ref_logp, "k3").item() == pytest.approx(ln2 - 0.5)


def test_a_log_ratio_past_20_is_taken_as_20_in_k3_and_the_policy_ratio():
    # A policy drifted far from the reference or from the rollout's: e^30 is finite in float32
    # but means nothing, so both exponentials see the log-ratio clamped to +-20 (_MAX_LOG_RATIO).
    zero, far = t([[0.0]]), t([[30.0]])
    assert core.kl_estimate(zero, far, "k3").item() == pytest.approx(math.exp(20) - 21)
    assert core.kl_estimate(far, zero, "k3").item() == pytest.approx(math.exp(-20) - 1 + 20)
    loss, metrics = core.policy_loss(far, zero, t([[-1.0]]), t([[1]]), clip_eps=0.2)
    assert loss.item() == pytest.approx(math.exp(20))  # max(-A * ratio, -A * 1.2) = ratio
    assert metrics["ratio_mean"] == pytest.approx(math.exp(20))


def test_kl_estimate_rejects_unknown_kind_naming_the_allowed_ones():
    with pytest.raises(ValueError, match="k1, k2, k3"):
        core.kl_estimate(t([[0.0]]), t([[0.0]]), "k4")


def test_token_rewards_put_score_on_last_valid_token():
    # -0.5 * kl on every valid token; row 0 ends at t=2 (+1.0), row 1 ends at t=1 (+2.0);
    # the padded kl of 9.0 in row 1 must not leak into the rewards.
    score = t([1.0, 2.0])
    kl = t([[0.1, 0.2, 0.3], [0.4, 0.5, 9.0]])
    mask = t([[1, 1, 1], [1, 1, 0]])
    rewards = core.token_rewards(score, kl, mask, kl_coef=0.5)
    torch.testing.assert_close(rewards, t([[-0.05, -0.1, 0.85], [-0.2, 1.75, 0.0]]))


def test_token_rewards_reject_empty_response():
    with pytest.raises(ValueError, match="at least one valid token"):
        core.token_rewards(t([1.0]), t([[0.0, 0.0]]), t([[0, 0]]), kl_coef=0.1)


def test_gae_without_discount_is_reward_to_go_minus_value():
    # gamma = lam = 1: returns are the undiscounted reward-to-go (1 everywhere), A = 1 - 0.5.
    adv, ret = core.gae(t([[0.0, 0.0, 1.0]]), t([[0.5, 0.5, 0.5]]), t([[1, 1, 1]]), 1.0, 1.0)
    torch.testing.assert_close(adv, t([[0.5, 0.5, 0.5]]))
    torch.testing.assert_close(ret, t([[1.0, 1.0, 1.0]]))
    # A response of one token: A = r - V.
    adv, ret = core.gae(t([[1.0]]), t([[0.25]]), t([[1]]), 0.9, 0.5)
    assert (adv.tolist(), ret.tolist()) == ([[0.75]], [[1.0]])


def test_gae_with_discount_and_padding():
    # gamma = 0.9, lam = 0.5, the response ends at t=1 so V_2 counts as 0 and t=2 is padding:
    #   t=1: delta = 1 + 0.9*0 - 0.4 = 0.6,            A_1 = 0.6
    #   t=0: delta = 0 + 0.9*0.4 - 0.2 = 0.16,         A_0 = 0.16 + 0.9*0.5*0.6 = 0.43
    # returns = A + V = [0.63, 1.0, 0].
    rewards, values = t([[0.0, 1.0, 7.0]]), t([[0.2, 0.4, 5.0]])
    adv, ret = core.gae(rewards, values, t([[1, 1, 0]]), gamma=0.9, lam=0.5)
    torch.testing.assert_close(adv, t([[0.43, 0.6, 0.0]]))
    torch.testing.assert_close(ret, t([[0.63, 1.0, 0.0]]))


def test_gae_steps_once_across_an_observation_and_ignores_its_rewards():
    # A multi-turn row: an action (t=0), an observation (t=1, 2), two actions (t=3, 4), padding
    # (t=5). gamma = 0.9, lam = 0.5; the valid steps are t = 0, 3, 4, in that order, and the
    # observation's and the padding's rewards (5.0, 9.0) and values (7.0, 3.0) count for nothing:
    #   t=4: delta = 1 + 0.9*0 - 0.4 = 0.6,                    A_4 = 0.6
    #   t=3: delta = 0 + 0.9*0.4 - 0.3 = 0.06,                 A_3 = 0.06 + 0.45*0.6 = 0.33
    #   t=0: delta = 0.1 + 0.9*0.3 - 0.2 = 0.17 (V_3 next),    A_0 = 0.17 + 0.45*0.33 = 0.3185
    # returns = A + V = [0.5185, 0, 0, 0.63, 1.0, 0].
    rewards, values = t([[0.1, 5.0, 5.0, 0.0, 1.0, 9.0]]), t([[0.2, 7.0, 7.0, 0.3, 0.4, 3.0]])
    mask = t([[1, 0, 0, 1, 1, 0]])
    adv, ret = core.gae(rewards, values, mask, gamma=0.9, lam=0.5)
    torch.testing.assert_close(adv, t([[0.3185, 0.0, 0.0, 0.33, 0.6, 0.0]]))
    torch.testing.assert_close(ret, t([[0.5185, 0.0, 0.0, 0.63, 1.0, 0.0]]))
    # The same as the textbook recursion on the row without its observation.
    keep = mask[0].bool()
    compact = core.gae(rewards[:, keep], values[:, keep], mask[:, keep], 0.9, 0.5)
    torch.testing.assert_close(adv[:, keep], compact[0])
    torch.testing.assert_close(ret[:, keep], compact[1])


def test_last_token_index_and_token_rewards_with_holes():
    # The last valid token of each row is its last action, whatever holes come before it.
    mask = t([[1, 0, 0, 1, 1, 0], [1, 1, 0, 0, 0, 0], [0, 1, 0, 1, 0, 0], [1, 0, 1, 0, 1, 1]])
    assert core.last_token_index(mask).tolist() == [4, 1, 3, 5]
    # The score lands on it, and the KL penalty only on actions: row 0's observations and
    # padding carry kl 9.0 that must not reach the rewards.
    kl = t([[0.1, 9.0, 9.0, 0.2, 0.3, 9.0]])
    rewards = core.token_rewards(t([1.0]), kl, mask[:1], kl_coef=0.5)
    torch.testing.assert_close(rewards, t([[-0.05, 0.0, 0.0, -0.1, 0.85, 0.0]]))


def test_masked_whiten_uses_valid_tokens_only():
    # valid 1, 2, 3: mean 2, unbiased variance 1 -> -1, 0, 1; the padded 100 is ignored and zeroed.
    x, mask = t([[1.0, 2.0, 3.0, 100.0]]), t([[1, 1, 1, 0]])
    torch.testing.assert_close(core.masked_whiten(x, mask), t([[-1.0, 0.0, 1.0, 0.0]]))
    # shift_mean=False adds the mean back after scaling: 1, 2, 3.
    torch.testing.assert_close(core.masked_whiten(x, mask, shift_mean=False),
                               t([[1.0, 2.0, 3.0, 0.0]]))
    # Two valid tokens are the fewest with an unbiased variance: 1, 3 -> mean 2, variance 2.
    two = core.masked_whiten(t([[1.0, 3.0, 7.0]]), t([[1, 1, 0]]))
    torch.testing.assert_close(two, t([[-1 / math.sqrt(2), 1 / math.sqrt(2), 0.0]]))
    with pytest.raises(ValueError, match="at least 2 valid tokens, got 1"):
        core.masked_whiten(x, t([[0, 1, 0, 0]]))
    # A spread near eps is damped by it: 0 and 1e-4 have variance 5e-9, so +-5e-5 / sqrt(1.5e-8).
    tiny = core.masked_whiten(t([[0.0, 1e-4]]), t([[1, 1]]))
    torch.testing.assert_close(tiny, t([[-1.0, 1.0]]) * 5e-5 / math.sqrt(5e-9 + 1e-8))
    # Equal values have no spread: zeros, not a division by zero (the eps under the root).
    torch.testing.assert_close(core.masked_whiten(t([[2.0, 2.0, 5.0]]), t([[1, 1, 0]])),
                               t([[0.0, 0.0, 0.0]]))


def test_a_registered_estimator_stays_callable_by_its_name_and_runs_without_autograd(
        monkeypatch):
    # ``register_adv_estimator`` is a decorator: the module keeps the function it decorates.
    monkeypatch.setitem(core.ADV_ESTIMATORS, "mine", None)

    @core.register_adv_estimator("mine")
    def mine(inputs):
        doubled = inputs.rewards * 2
        return doubled, doubled.requires_grad

    assert callable(mine) and mine.__name__ == "mine"
    rewards = t([[1.0, 2.0]]).requires_grad_()
    inputs = core.AdvantageInputs(rewards, t([[1, 1]]), t([0]))
    adv, graded = core.advantages("mine", inputs)
    assert not graded and adv.tolist() == [[2.0, 4.0]]
    assert mine(inputs)[1]  # called directly, it is the function itself, with autograd


def test_policy_loss_clips_hand_values():
    # ratios 1.5, 0.5, 0.5 with advantages +1, +1, -1 and eps 0.2:
    #   token 0: max(-1.5, -1.2) = -1.2 (clipped)
    #   token 1: max(-0.5, -0.8) = -0.5
    #   token 2: max(+0.5, +0.8) = +0.8 (clipped)
    # token 3 is padding with a huge advantage that must not count. Mean (-1.2 - 0.5 + 0.8)/3.
    old = t([[0.0, 0.0, 0.0, 0.0]])
    logp = t([[math.log(1.5), math.log(0.5), math.log(0.5), 0.0]])
    adv = t([[1.0, 1.0, -1.0, 1e6]])
    mask = t([[1, 1, 1, 0]])
    loss, metrics = core.policy_loss(logp, old, adv, mask, clip_eps=0.2)
    assert loss.item() == pytest.approx(-0.3)
    assert metrics["clipfrac"] == pytest.approx(2 / 3)
    assert metrics["num_tokens"] == 3
    assert metrics["ratio_mean"] == pytest.approx((1.5 + 0.5 + 0.5) / 3)
    # The same ratios from other old log-probs; a ratio inside the range is not counted clipped
    # (its two terms are equal); one valid token's metrics are its own.
    shift = t([[0.7, -1.3, 2.0, 0.0]])
    moved, _ = core.policy_loss(logp + shift, old + shift, adv, mask, clip_eps=0.2)
    assert moved.item() == pytest.approx(-0.3)
    _, inside = core.policy_loss(t([[0.1, 0.0]]), t([[0.0, 0.0]]), t([[1.0, 1.0]]), t([[1, 0]]),
                                 clip_eps=0.2)
    assert (inside["clipfrac"], inside["ratio_mean"], inside["num_tokens"]) == (
        0.0, pytest.approx(math.exp(0.1)), 1.0)
    # k3 of the old policy against the new one, e^r - 1 - r with r = log(new / old) per token.
    k3 = [math.exp(r) - 1 - r for r in (math.log(1.5), math.log(0.5), math.log(0.5))]
    assert metrics["approx_kl"] == pytest.approx(sum(k3) / 3)


def test_tis_weights_are_the_capped_trainer_over_rollout_ratio_without_grad():
    # old - rollout = log 0.5, log 1.5, log 4, 0 (the two agree) with cap 2:
    #   weights 0.5, 1.5, min(4, 2) = 2, and exactly 1 where the log-probs agree.
    rollout = t([[-1.0, -2.0, -0.5, -0.7]])
    old = (rollout + t([[math.log(0.5), math.log(1.5), math.log(4.0), 0.0]])).requires_grad_()
    w = core.tis_weights(old, rollout, cap=2.0)
    torch.testing.assert_close(w, t([[0.5, 1.5, 2.0, 1.0]]))
    assert not w.requires_grad
    assert torch.equal(core.tis_weights(rollout, rollout, cap=2.0), torch.ones(1, 4))


def test_mask_log_ratio_sums_or_averages_the_action_tokens_only():
    # old - rollout per token, mask holes (padding, an observation) ignored, even a -inf there:
    #   row 0: 0.5 - 0.25 = 0.25 over 2 actions: sequence 0.25, geometric 0.125
    #   row 1: -1 + -1 = -2 over 2 actions (the observation's 3 between them ignored): -2, -1
    #   row 2: no action: 0 both ways (a ratio of 1)
    rollout = torch.tensor([[-1.0, -2.0, float("-inf")], [-1.0, -1.0, -2.0], [-3.0, -1.0, -1.0]])
    diff = torch.tensor([[0.5, -0.25, 0.0], [-1.0, 3.0, -1.0], [5.0, 5.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    old = rollout + diff  # exact: every value here has few bits
    seq = core.mask_log_ratio(old, rollout, mask, "sequence")
    geo = core.mask_log_ratio(old, rollout, mask, "geometric")
    assert seq.dtype == geo.dtype == torch.float64
    assert seq.tolist() == [0.25, -2.0, 0.0] and geo.tolist() == [0.125, -1.0, 0.0]
    with pytest.raises(ValueError, match="allowed: sequence, geometric"):
        core.mask_log_ratio(old, rollout, mask, "product")


def test_in_band_keeps_the_edges_and_masks_beyond_them():
    # Band [e^-1, e^0.5]: math.log gives back -1 and 0.5 exactly. Per-sample log ratios at
    # each edge are kept; a hair past either, a NaN (a non-finite log-prob) or a ratio beyond
    # float64 is masked.
    low, high = math.exp(-1.0), math.exp(0.5)
    log_ratio = t([0.5, -1.0, 0.0, 0.5 + 1e-12, -1.0 - 1e-12, math.nan, math.inf, -math.inf])
    assert core.in_band(log_ratio, low, high).tolist() == [True, True, True] + [False] * 5
    # Through mask_log_ratio: two tokens 0.25 apart each are 0.5 as a product (the upper edge:
    # kept) and 0.25 as a geometric mean (inside); 0.5 and 0.25 are 0.75 (above: masked).
    rollout = torch.tensor([[-1.0, -2.0], [-1.0, -2.0], [-1.0, -2.0]])
    old = rollout + torch.tensor([[0.25, 0.25], [-0.5, -0.5], [0.5, 0.25]])
    mask = torch.ones(3, 2)
    assert core.in_band(core.mask_log_ratio(old, rollout, mask, "sequence"), low, high).tolist() \
        == [True, True, False]
    assert core.in_band(core.mask_log_ratio(old, rollout, mask, "geometric"), low,
                        high).tolist() == [True, True, True]


@pytest.mark.parametrize("agg", core.LOSS_AGG_MODES)
@pytest.mark.parametrize("tis", [False, True])
def test_a_masked_sample_has_no_gradient_and_a_kept_one_the_same_as_without_the_mask(agg, tis):
    # The actor's way: the sample's weight times 0 (masked) or 1 (kept), over the same divisor
    # (the step's count, masked samples' tokens included). Kept rows: the same per-token terms
    # times 1.0, so the same gradient to the bit; masked: 0 on every token.
    mask, rand = _rollout(seed=3)
    old, rollout, adv = rand().tanh(), rand().tanh(), rand()
    logp = (old + 0.3 * rand().tanh()).requires_grad_(True)
    weights = core.tis_weights(old, rollout, 2.0) if tis else None
    keep = torch.ones(len(mask), dtype=torch.bool)
    keep[[1, 4]] = False
    kept = keep.double()[:, None].expand_as(mask)
    divisor = core.agg_count(mask, agg)

    def grad(w):
        loss, _ = core.policy_loss(logp, old, adv, mask, 0.2, divisor, agg, weights=w)
        return loss, torch.autograd.grad(loss, logp)[0]

    plain, plain_grad = grad(weights)
    masked, masked_grad = grad(kept if weights is None else weights * kept)
    assert torch.equal(masked_grad[keep], plain_grad[keep])
    assert torch.equal(masked_grad[~keep], torch.zeros_like(masked_grad[~keep]))
    assert plain_grad[~keep].abs().sum() > 0  # they had a gradient to lose
    # The loss: the kept rows' terms over the unchanged divisor, which still counts the masked
    # rows' tokens. Both sides add the same <= 48 float64 terms (each below |A| e^0.3 x 2 < 15
    # for these draws) in other groupings, within 47 u 48 x 15 = 3.8e-12 of each other, then
    # divide by a divisor >= 8: 1e-12.
    only_kept, _ = core.policy_loss(logp[keep], old[keep], adv[keep], mask[keep], 0.2, divisor,
                                    agg, weights=None if weights is None else weights[keep])
    torch.testing.assert_close(masked, only_kept, rtol=0, atol=1e-12)
    assert masked.item() != plain.item()


def test_policy_loss_with_weights_multiplies_each_token_s_term():
    # The hand case of test_policy_loss_clips_hand_values, terms -1.2, -0.5, +0.8, with weights
    # 0.5, 2, 1 (padding's weight 7 must not count): (-0.6 - 1.0 + 0.8) / 3. Unit weights give
    # the unweighted loss.
    old = t([[0.0, 0.0, 0.0, 0.0]])
    logp = t([[math.log(1.5), math.log(0.5), math.log(0.5), 0.0]]).requires_grad_()
    adv, mask = t([[1.0, 1.0, -1.0, 1e6]]), t([[1, 1, 1, 0]])
    loss, _ = core.policy_loss(logp, old, adv, mask, 0.2, weights=t([[0.5, 2.0, 1.0, 7.0]]))
    assert loss.item() == pytest.approx((-0.6 - 1.0 + 0.8) / 3)
    # Token 1's term -ratio is unclipped: its gradient is scaled by its weight, -2 * 0.5 / 3.
    loss.backward()
    assert logp.grad[0, 1].item() == pytest.approx(-2.0 * 0.5 / 3)
    plain, _ = core.policy_loss(logp, old, adv, mask, 0.2)
    unit, _ = core.policy_loss(logp, old, adv, mask, 0.2, weights=torch.ones(1, 4))
    assert unit.item() == plain.item() == pytest.approx(-0.3)


def test_value_loss_clips_hand_values():
    # token 0: V=1.0, old=0, R=0.5 -> V_clip=0.2: max(0.25, 0.09) = 0.25 -> 0.125
    # token 1: V=0.3, old=0, R=1.0 -> V_clip=0.2: max(0.49, 0.64) = 0.64 -> 0.32 (clipped)
    # token 2: V=-0.3, old=0, R=-1.0 -> V_clip=-0.2: the same, clipped from below
    # token 3: V=1.0, old=0.9, R=0 -> V_clip=1.0 (a move of 0.1, inside eps): max(1, 1) -> 0.5
    values, old = t([[1.0, 0.3, -0.3, 1.0]]), t([[0.0, 0.0, 0.0, 0.9]])
    ret = t([[0.5, 1.0, -1.0, 0.0]])
    loss, metrics = core.value_loss(values, old, ret, t([[1, 1, 1, 1]]), clip_eps=0.2)
    assert loss.item() == pytest.approx((0.125 + 0.32 + 0.32 + 0.5) / 4)
    assert metrics["vf_clipfrac"] == pytest.approx(2 / 4)
    assert metrics["value_mean"] == pytest.approx((1.0 + 0.3 - 0.3 + 1.0) / 4)
    assert metrics["value_mse"] == pytest.approx((0.25 + 0.49 + 0.49 + 1.0) / 4)
    # One valid token: its own values, not halved; padding's 7 ignored.
    _, one = core.value_loss(t([[2.0, 7.0]]), t([[0.0, 0.0]]), t([[0.0, 0.0]]), t([[1, 0]]),
                             clip_eps=0.2)
    assert (one["value_mean"], one["value_mse"], one["num_tokens"]) == (2.0, 4.0, 1.0)


def test_aggregation_modes_hand_values():
    # Row 0 has valid terms 1, 2, 3; row 1 has 4; the padded 100s must not count.
    #   token_mean:          (1 + 2 + 3 + 4) / 4 tokens = 2.5; with divisor 5: 10 / 5 = 2
    #   seq_mean_token_sum:  (6 + 4) / 2 sequences = 5; with token_sum_norm 3: (6/3 + 4/3) / 2 = 5/3
    #   seq_mean_token_mean: (6/3 + 4/1) / 2 sequences = 3
    x, mask = t([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0]]), t([[1, 1, 1], [1, 0, 0]])
    assert core.aggregate(x, mask, "token_mean").item() == pytest.approx(2.5)
    assert core.aggregate(x, mask, "token_mean", divisor=5.0).item() == pytest.approx(2.0)
    assert core.aggregate(x, mask, "seq_mean_token_sum").item() == pytest.approx(5.0)
    assert core.aggregate(x, mask, "seq_mean_token_sum", token_sum_norm=3.0).item() == \
        pytest.approx(5 / 3)
    assert core.aggregate(x, mask, "seq_mean_token_mean").item() == pytest.approx(3.0)
    assert core.agg_count(mask, "token_mean") == 4
    for agg in ("seq_mean_token_sum", "seq_mean_token_mean"):
        assert core.agg_count(mask, agg) == 2
    with pytest.raises(ValueError, match="seq_mean_token_sum only"):
        core.aggregate(x, mask, "token_mean", token_sum_norm=3.0)
    # A row without a valid token is no sequence; a single valid token is its own mean.
    empty_row = t([[1, 1, 1], [0, 0, 0]])
    assert core.agg_count(empty_row, "seq_mean_token_mean") == 1
    one = t([[0, 1, 0], [0, 0, 0]])
    for agg in ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean"):
        assert core.aggregate(x, one, agg).item() == 2.0


def test_kl_loss_k3_gradient_is_closed_form():
    # k3 = e^r - 1 - r with r = ref - logp, so d k3 / d logp = -(e^r - 1) = 1 - e^r; the token-mean
    # loss spreads that over the valid tokens: grad = mask * (1 - e^r) / valid tokens.
    mask, rand = _rollout(seed=3)
    logp, ref_logp = rand().requires_grad_(True), rand()
    loss, metrics = core.kl_loss(logp, ref_logp, mask, "k3")
    (grad,) = torch.autograd.grad(loss, logp)
    e_r = (ref_logp - logp.detach()).exp()
    count = mask.sum()
    # Autograd multiplies the same e^r by -1 and by 1/count: a few roundings of terms below
    # 1 + e^r, so within 8 * u * max(1 + e^r) / count (u = 2^-53).
    bound = 8 * 2.0 ** -53 * float((1 + e_r).max() / count)
    torch.testing.assert_close(grad, mask * (1 - e_r) / count, rtol=0, atol=bound)
    k3 = e_r - 1 - (ref_logp - logp.detach())
    assert metrics["kl"] == pytest.approx(float((mask * k3).sum() / count))
    # One valid token: its own estimate (k1 here), padding's ignored.
    _, one = core.kl_loss(t([[0.0, 0.0]]), t([[-0.5, 9.0]]), t([[1, 0]]), "k1")
    assert one["kl"] == 0.5


# Outcome supervision on two groups given out of order (ids 7 and 3 interleaved) of three and two
# samples, right-padded. Token rewards are -0.5 * kl on each valid token plus the score on the last
# one (the padded kl of 9 must not leak):
#   row 0, group 7: kl .2 .2 .2, score 1.3  -> -0.1 -0.1  1.2    outcome r =  1
#   row 1, group 3: kl .6 .2 -,  score 2.4  -> -0.3  2.3   -     outcome r =  2
#   row 2, group 7: kl .4 .2 -,  score 0.3  -> -0.2  0.2   -     outcome r =  0
#   row 3, group 3: kl .2 .4 .2, score -0.6 -> -0.1 -0.2 -0.7    outcome r = -1
#   row 4, group 7: kl .2 -  -,  score 2.1  ->  2.0   -    -     outcome r =  2
GROUP = torch.tensor([7, 3, 7, 3, 7])
OUTCOME = [1.0, 2.0, 0.0, -1.0, 2.0]
MASK = t([[1, 1, 1], [1, 1, 0], [1, 1, 0], [1, 1, 1], [1, 0, 0]])
# Undiscounted return-to-go, what the outcome estimators give as returns.
RETURN_TO_GO = t([[1.0, 1.1, 1.2], [2.0, 2.3, 0.0], [0.0, 0.2, 0.0], [-1.0, -0.9, -0.7],
                  [2.0, 0.0, 0.0]])


def _hand_rewards():
    score = t([1.3, 2.4, 0.3, -0.6, 2.1])
    kl = t([[0.2, 0.2, 0.2], [0.6, 0.2, 9.0], [0.4, 0.2, 9.0], [0.2, 0.4, 0.2], [0.2, 9.0, 9.0]])
    rewards = core.token_rewards(score, kl, MASK, kl_coef=0.5)
    torch.testing.assert_close(rewards, t([[-0.1, -0.1, 1.2], [-0.3, 2.3, 0.0], [-0.2, 0.2, 0.0],
                                           [-0.1, -0.2, -0.7], [2.0, 0.0, 0.0]]))
    return rewards


def _per_sample(values):
    return t(values)[:, None] * MASK


def _whitened(table, mask):
    # The valid entries' mean and unbiased variance, by the standard library.
    valid = [x for row, m in zip(table, mask.tolist()) for x, v in zip(row, m) if v]
    mean, var = statistics.mean(valid), statistics.variance(valid)
    return (t(table) - mean) / math.sqrt(var + 1e-8) * mask


def test_grpo_hand_values():
    # group 7: r = 1, 0, 2 -> mean 1, deviations 0, -1, 1, unbiased var (0 + 1 + 1) / 2 = 1, std 1;
    # group 3: r = 2, -1 -> mean 0.5, deviations +-1.5, var (2.25 + 2.25) / 1 = 4.5,
    # std 1.5 * sqrt 2.
    adv, ret = core.advantages("grpo", core.AdvantageInputs(_hand_rewards(), MASK, GROUP))
    s3 = 1.5 * math.sqrt(2) + 1e-6
    torch.testing.assert_close(adv, _per_sample([0.0, 1.5 / s3, -1 / (1 + 1e-6), -1.5 / s3,
                                                 1 / (1 + 1e-6)]))
    torch.testing.assert_close(ret, RETURN_TO_GO)


def test_dr_grpo_hand_values():
    # r - group mean: group 7 (mean 1): 0, -1, 1; group 3 (mean 0.5): 1.5, -1.5. Values left on
    # padding (9) must not count.
    rewards = _hand_rewards() + 9.0 * (1 - MASK)
    adv, ret = core.advantages("dr_grpo", core.AdvantageInputs(rewards, MASK, GROUP))
    torch.testing.assert_close(adv, _per_sample([0.0, 1.5, -1.0, -1.5, 1.0]))
    torch.testing.assert_close(ret, RETURN_TO_GO)


def test_rloo_is_leave_one_out_baseline():
    # n / (n - 1) * (r - group mean): group 7, 3/2 * (0, -1, 1); group 3, 2 * (1.5, -1.5).
    adv, ret = core.advantages("rloo", core.AdvantageInputs(_hand_rewards(), MASK, GROUP))
    torch.testing.assert_close(adv, _per_sample([0.0, 3.0, -1.5, -3.0, 1.5]))
    torch.testing.assert_close(ret, RETURN_TO_GO)
    # The same as r minus the explicit mean of the other samples of the group, e.g. row 2:
    # 0 - (1 + 2) / 2 = -1.5, row 1: 2 - (-1) = 3.
    ids = GROUP.tolist()
    loo = [r - statistics.mean(o for j, o in enumerate(OUTCOME) if ids[j] == ids[i] and j != i)
           for i, r in enumerate(OUTCOME)]
    torch.testing.assert_close(adv, _per_sample(loo))


def test_reinforce_pp_whitens_discounted_return_to_go():
    # gamma = 0.5, G_t = r_t + 0.5 * G_{t+1} from the end of each response:
    #   row 0: G_2 = 1.2, G_1 = -0.1 + 0.6 = 0.5, G_0 = -0.1 + 0.25 = 0.15
    #   row 1: G_1 = 2.3, G_0 = -0.3 + 1.15 = 0.85
    #   row 2: G_1 = 0.2, G_0 = -0.2 + 0.1 = -0.1
    #   row 3: G_2 = -0.7, G_1 = -0.2 - 0.35 = -0.55, G_0 = -0.1 - 0.275 = -0.375
    #   row 4: G_0 = 2.0
    # then whitened over the 11 valid tokens of the batch (all groups together).
    g = [[0.15, 0.5, 1.2], [0.85, 2.3, 0.0], [-0.1, 0.2, 0.0], [-0.375, -0.55, -0.7],
         [2.0, 0.0, 0.0]]
    inputs = core.AdvantageInputs(_hand_rewards(), MASK, GROUP, gamma=0.5)
    adv, ret = core.advantages("reinforce_pp", inputs)
    torch.testing.assert_close(ret, t(g))
    torch.testing.assert_close(adv, _whitened(g, MASK))


def test_gae_estimator_whitens_gae():
    # gamma = lam = 1 and V = 0.5 on valid tokens (5 on padding, ignored): the deltas telescope to
    # A_t = G_t - V_t with the undiscounted return-to-go G, and returns = A + V = G. Whitening
    # A = G - 0.5 over the 11 valid tokens is whitening G (a shift does not change it).
    values = 0.5 * MASK + 5.0 * (1 - MASK)
    inputs = core.AdvantageInputs(_hand_rewards(), MASK, GROUP, values=values, whiten=False)
    adv, ret = core.advantages("gae", inputs)
    torch.testing.assert_close(adv, (RETURN_TO_GO - 0.5) * MASK)
    torch.testing.assert_close(ret, RETURN_TO_GO)
    adv, ret = core.advantages("gae", replace(inputs, whiten=True))
    torch.testing.assert_close(adv, _whitened(RETURN_TO_GO.tolist(), MASK))
    torch.testing.assert_close(ret, RETURN_TO_GO)
    with pytest.raises(ValueError, match="needs critic values"):
        core.advantages("gae", replace(inputs, values=None))


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_group_estimators_refuse_a_group_of_one(name):
    # Group 5 has one sample: it has no baseline from its peers.
    inputs = core.AdvantageInputs(t([[1.0], [2.0], [3.0]]), t([[1], [1], [1]]),
                                  torch.tensor([4, 5, 4]))
    with pytest.raises(ValueError, match=r"needs at least 2 samples per group \(rollout.n >= 2\)"):
        core.advantages(name, inputs)


def test_unknown_names_are_rejected_naming_the_allowed_ones():
    mask = t([[1, 1, 0]])
    allowed = "allowed: token_mean, seq_mean_token_sum, seq_mean_token_mean"
    with pytest.raises(ValueError, match=allowed):
        core.aggregate(mask, mask, "seq_sum")
    with pytest.raises(ValueError, match=allowed):
        core.agg_count(mask, "seq_sum")
    with pytest.raises(ValueError, match=allowed):
        core.policy_loss(mask, mask, mask, mask, clip_eps=0.2, agg="seq_sum")
    with pytest.raises(ValueError, match="k1, k2, k3"):
        core.kl_loss(mask, mask, mask, "k4")
    for divisor in (0.0, -1.0):  # a step's count is never 0: a divisor of 0 is a caller's bug
        with pytest.raises(ValueError, match="must be positive, got"):
            core.aggregate(mask, mask, "token_mean", divisor)
    with pytest.raises(ValueError, match="allowed: dr_grpo, gae, grpo, reinforce_pp, rloo"):
        core.advantages("ppo", core.AdvantageInputs(_hand_rewards(), MASK, GROUP))


def test_adaptive_kl_controller_follows_ziegler():
    # beta *= 1 + clip(KL/target - 1, -0.2, 0.2) * n / horizon, with n/horizon = 0.1.
    ctl = core.AdaptiveKLController(0.1, target=6.0, horizon=10000)
    ctl.update(current_kl=12.0, n_steps=1000)  # error 1.0 clipped to 0.2 -> 0.1 * 1.02
    assert ctl.value == pytest.approx(0.102)
    ctl.update(current_kl=6.0, n_steps=1000)  # on target: unchanged
    assert ctl.value == pytest.approx(0.102)
    ctl.update(current_kl=5.4, n_steps=1000)  # error -0.1 -> * 0.99
    assert ctl.value == pytest.approx(0.102 * 0.99)
    fixed = core.kl_controller(0.05, adaptive=False, target=6.0, horizon=10000)
    fixed.update(100.0, 1000)
    assert fixed.value == 0.05
    adaptive = core.kl_controller(0.1, adaptive=True, target=6.0, horizon=10000)
    adaptive.update(current_kl=12.0, n_steps=1000)
    assert adaptive.value == pytest.approx(0.102)
    ctl.update(current_kl=0.0, n_steps=1000)  # error -1 clipped to -0.2 -> * 0.98
    assert ctl.value == pytest.approx(0.102 * 0.99 * 0.98)
    small = core.AdaptiveKLController(0.1, target=0.5, horizon=1)  # any positive pair is valid
    small.update(current_kl=0.55, n_steps=1)
    assert small.value == pytest.approx(0.11)
    for target, horizon in ((0.0, 10000), (6.0, 0)):  # either alone is refused
        with pytest.raises(ValueError, match="must be positive"):
            core.AdaptiveKLController(0.1, target, horizon)


# --- data-parallel invariance ---------------------------------------------------------------------

def _rollout(batch=8, length=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).double()
    def rand():
        return torch.randn(batch, length, generator=gen, dtype=torch.float64)
    return mask, rand


# Uneven rows per fake rank and per micro-batch: 2 ranks x 2 micro-batches of 1, 2, 4 and 1 rows.
SPLITS = [1, 2, 4, 1]


def _split(*tensors):
    return zip(*(x.split(SPLITS) for x in tensors))


def test_masked_mean_combines_over_ranks_as_sums_and_counts():
    mask, rand = _rollout()
    x = rand()
    full = core.masked_mean(x, mask)
    parts = list(_split(x, mask))
    combined = sum(core.masked_sum(a, m) for a, m in parts) / sum(m.sum() for _, m in parts)
    torch.testing.assert_close(combined, full)
    # The mean of per-rank means is not the same number: the combination above is what matters.
    naive = torch.stack([core.masked_mean(a, m) for a, m in parts]).mean()
    assert not torch.allclose(naive, full)


def test_masked_whiten_with_summed_moments_equals_full_batch():
    mask, rand = _rollout()
    x = rand() * 3 + 1
    full = core.masked_whiten(x, mask)
    parts = list(_split(x, mask))
    moments = sum(core.masked_moments(a, m) for a, m in parts)  # the all-reduce
    sharded = torch.cat([core.masked_whiten(a, m, moments=moments) for a, m in parts])
    torch.testing.assert_close(sharded, full)
    # Whitening a rank's slice with its own moments gives other numbers.
    x2, m2 = parts[2]
    assert not torch.allclose(core.masked_whiten(x2, m2), full[3:7])


def test_rowwise_functions_are_invariant_to_the_split():
    mask, rand = _rollout()
    logp, ref_logp, values = rand(), rand(), rand()
    score = torch.randn(mask.shape[0], dtype=torch.float64)
    kl = core.kl_estimate(logp, ref_logp, "k3")
    rewards = core.token_rewards(score, kl, mask, 0.1)
    adv, ret = core.gae(rewards, values, mask, 0.99, 0.95)
    parts = [core.gae(core.token_rewards(s, core.kl_estimate(a, b, "k3"), m, 0.1), v, m, 0.99, 0.95)
             for a, b, v, m, s in _split(logp, ref_logp, values, mask, score)]
    torch.testing.assert_close(torch.cat([p[0] for p in parts]), adv)
    torch.testing.assert_close(torch.cat([p[1] for p in parts]), ret)


# Every loss with every aggregation mode (and Dr. GRPO's constant for the token sums of the policy).
LOSS_CASES = [(which, agg, None) for which in ("policy", "value", "kl")
              for agg in core.LOSS_AGG_MODES] + [("policy", "seq_mean_token_sum", 6.0)]


@pytest.mark.parametrize("which,agg,token_sum_norm", LOSS_CASES)
def test_losses_aggregate_globally_under_any_split(which, agg, token_sum_norm):
    """Each micro-batch divides by (global agg_count / number of micro-batches); the engine
    averages over ranks and micro-batches. The result, loss and gradient, equals the full-batch
    aggregate although the micro-batches hold different numbers of sequences and tokens."""
    mask, rand = _rollout(seed=1)
    # tanh keeps every input in (-1, 1), which bounds the per-token terms below (see tolerance).
    old, other = rand().tanh(), rand().tanh()
    current = (old + 0.3 * rand().tanh()).requires_grad_(True)

    def loss_fn(cur, o, a, m, divisor=None):
        if which == "policy":  # a: advantages
            return core.policy_loss(cur, o, a, m, 0.2, divisor, agg, token_sum_norm)[0]
        if which == "value":  # a: returns
            return core.value_loss(cur, o, a, m, 0.2, divisor, agg)[0]
        return core.kl_loss(cur, o, m, "k3", agg, divisor)[0]  # o: the reference's log-probs

    full = loss_fn(current, old, other, mask)
    (full_grad,) = torch.autograd.grad(full, current)

    num_micro = len(SPLITS)  # N * s over all fake ranks
    divisor = core.agg_count(mask, agg) / num_micro
    losses = [loss_fn(c, o, a, m, divisor) for c, o, a, m in _split(current, old, other, mask)]
    averaged = torch.stack(losses).mean()  # what the engine's gradient averaging amounts to
    (split_grad,) = torch.autograd.grad(averaged, current)
    # Tolerance: per-token terms are below 10 (|A| * ratio <= e^0.3; 0.5 * (V - R)^2 <= 0.5 * 2.3^2;
    # k3 <= e^2.3), so a sequence's term is below T * 10 = 60. Both sides add the same n = 48
    # float64 terms in other orders, each within (n - 1) * u * 60 = 3.1e-13 (u = 2^-53) of the exact
    # value; a gradient entry is one token's derivative (below 10) scaled by the same divisor up
    # to a few roundings, within ~1e-14. Hence 1e-12 absolute, and no relative slack.
    torch.testing.assert_close(averaged, full, rtol=0, atol=1e-12)
    torch.testing.assert_close(split_grad, full_grad, rtol=0, atol=1e-12)

    # Dividing each micro-batch by its own count would weight short micro-batches more.
    local = torch.stack([loss_fn(c, o, a, m) for c, o, a, m in _split(current, old, other, mask)])
    assert not torch.allclose(local.mean(), full)


def test_loss_metrics_combine_by_token_count():
    mask, rand = _rollout(seed=2)
    old, adv = rand(), rand()
    logp = old + 0.5 * rand()
    _, full = core.policy_loss(logp, old, adv, mask, clip_eps=0.1)
    parts = [core.policy_loss(a, b, c, m, clip_eps=0.1)[1]
             for a, b, c, m in _split(logp, old, adv, mask)]
    tokens = sum(p["num_tokens"] for p in parts)
    weighted = sum(p["clipfrac"] * p["num_tokens"] for p in parts) / tokens
    assert weighted == pytest.approx(full["clipfrac"])


def _on_fake_ranks(name, parts):
    """Run estimator ``name`` on each fake rank's inputs as ranks would: the first pass collects
    what each rank hands to the all-reduce, the second gives every rank their sum."""
    sent = []
    for inputs in parts:
        core.advantages(name, replace(inputs, sum_over_ranks=lambda x: sent.append(x) or x))
    total = torch.stack(sent).sum(0)
    return [core.advantages(name, replace(inputs, sum_over_ranks=lambda x: total))
            for inputs in parts]


@pytest.mark.parametrize("name", ["gae", "reinforce_pp"])
def test_whitening_estimators_equal_the_full_batch_on_fake_ranks(name):
    mask, rand = _rollout(seed=4)
    score = torch.randn(mask.shape[0], dtype=torch.float64)
    rewards = core.token_rewards(score, core.kl_estimate(rand(), rand(), "k3"), mask, 0.1)
    full = core.AdvantageInputs(rewards, mask, torch.arange(mask.shape[0]), values=rand(),
                                gamma=0.99, lam=0.95)
    adv, ret = core.advantages(name, full)
    rows = [3, 5]  # two fake ranks holding different numbers of rows and tokens
    parts = [core.AdvantageInputs(r, m, g, values=v, gamma=0.99, lam=0.95)
             for r, m, g, v in zip(*(x.split(rows) for x in (rewards, mask, full.group,
                                                            full.values)))]
    sharded = _on_fake_ranks(name, parts)
    # The summed moments differ from the full batch's only by the order of <= 48 float64 additions
    # (relative error <= 48 * u = 5e-15), and the whitened values of order 1 by a few times that.
    torch.testing.assert_close(torch.cat([a for a, _ in sharded]), adv, rtol=0, atol=1e-12)
    torch.testing.assert_close(torch.cat([r for _, r in sharded]), ret, rtol=0, atol=1e-12)
    # A rank whitening with its own moments gets other numbers: the all-reduce matters.
    assert not torch.allclose(core.advantages(name, parts[1])[0], adv[3:])


def _forbidden_all_reduce(x):
    raise AssertionError("group estimators must not all-reduce: a group never spans ranks")


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_group_estimators_per_rank_equal_the_full_batch(name):
    # Four groups of three with shuffled ids; fake rank 0 holds groups 11 and 4, rank 1 groups 8
    # and 2, each group whole on its rank but its rows not contiguous.
    group = torch.tensor([11, 4, 11, 8, 2, 4, 8, 2, 11, 2, 4, 8])
    mask, rand = _rollout(batch=len(group), seed=5)
    rewards = rand() * mask
    adv, ret = core.advantages(name, core.AdvantageInputs(rewards, mask, group))
    for ids in ([11, 4], [8, 2]):
        rows = torch.isin(group, torch.tensor(ids))
        local = core.AdvantageInputs(rewards[rows], mask[rows], group[rows],
                                     sum_over_ranks=_forbidden_all_reduce)
        rank_adv, rank_ret = core.advantages(name, local)
        # The same members in the same order give the same group sums; 1e-12 leaves room for
        # another summation order (<= 6 terms of order 1, error <= 6 * u).
        torch.testing.assert_close(rank_adv, adv[rows], rtol=0, atol=1e-12)
        torch.testing.assert_close(rank_ret, ret[rows], rtol=0, atol=1e-12)


@pytest.mark.parametrize("agg", core.LOSS_AGG_MODES)
def test_token_budget_micro_batches_keep_the_global_aggregate_on_fake_ranks(agg):
    """Micro-batches by tokens (batching.split_by_tokens): fake rank 0 holds four long
    sequences, rank 1 four short ones, so a budget of 8 tokens splits them into 4 and 2
    micro-batches. Both run the agreed 4 (rank 1 two fillers of weight 0), each micro-batch's
    loss divided by batching.micro_divisor(global count, 2 ranks, 4); the engine scales by 1/4
    and averages over ranks. Loss and gradient equal the unsplit mini-batch's aggregate."""
    from rlhf_paro import batching

    response = torch.tensor([6, 6, 5, 6, 1, 1, 2, 1])  # real response tokens per row
    mask = (torch.arange(6)[None, :] < response[:, None]).double()
    num_tokens = response + 2  # a prompt of 2 tokens: 8 8 7 8 | 3 3 4 3
    gen = torch.Generator().manual_seed(4)
    old, adv = (torch.randn(8, 6, generator=gen, dtype=torch.float64).tanh() for _ in range(2))
    current = (old + 0.3 * torch.randn(8, 6, generator=gen, dtype=torch.float64).tanh()
               ).requires_grad_(True)

    def loss_fn(rows, divisor=None):
        return core.policy_loss(current[rows], old[rows], adv[rows], mask[rows], 0.2, divisor,
                                agg)[0]

    full = loss_fn(torch.arange(8))
    (full_grad,) = torch.autograd.grad(full, current)

    ranks = [torch.tensor([2, 0, 3, 1]), torch.tensor([6, 4, 7, 5])]  # shuffled mini-batches
    splits = [batching.split_by_tokens(rows, num_tokens, max_tokens=8) for rows in ranks]
    assert [len(s) for s in splits] == [4, 2]
    agreed = max(len(s) for s in splits)  # the worker's all-reduce MAX
    divisor = batching.micro_divisor(core.agg_count(mask, agg), len(ranks), agreed)

    def engine_mean(divisor):
        per_rank = [sum(m.weight * loss_fn(m.rows, divisor)
                        for m in batching.fill_to(split, agreed, num_tokens)) / agreed
                    for split in splits]
        return torch.stack(per_rank).mean()  # the gradient's mean over ranks

    split_loss = engine_mean(divisor)
    (split_grad,) = torch.autograd.grad(split_loss, current)
    # Same float64 terms summed in another order (see the tolerance of the test above).
    torch.testing.assert_close(split_loss, full, rtol=0, atol=1e-12)
    torch.testing.assert_close(split_grad, full_grad, rtol=0, atol=1e-12)
    # A divisor from the configured accumulation (4 rows / micro_batch_size 2 = 2 micro-batches)
    # while the engine divides by the agreed 4 would halve the loss.
    wrong = engine_mean(batching.micro_divisor(core.agg_count(mask, agg), len(ranks), 2))
    torch.testing.assert_close(wrong, full / 2, rtol=0, atol=1e-12)


# --- experience assembly --------------------------------------------------------------------------

@pytest.mark.parametrize("estimator", ["gae", "grpo"])
@pytest.mark.parametrize("kl_in_loss", [False, True])
def test_make_experience_is_kl_then_token_rewards_then_the_estimator(estimator, kl_in_loss):
    # The actor's former assembly, step by step: the k3 KL on valid tokens, the score on the last
    # token minus kl_coef * KL (no KL when it is a loss term), then the estimator.
    mask, rand = _rollout(seed=6)
    old, ref, values = rand(), rand(), rand()
    score = torch.randn(8, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    group = torch.arange(8) // 2
    spec = core.ExperienceSpec(estimator, "k3", kl_in_loss, gamma=0.9, lam=0.8, whiten=True)
    got = core.make_experience(spec, old, ref, score, mask, group,
                               values if estimator == "gae" else None, kl_coef=0.3)
    kl = core.kl_estimate(old, ref, "k3") * mask
    rewards = core.token_rewards(score, kl, mask, 0.0 if kl_in_loss else 0.3)
    adv, ret = core.advantages(estimator, core.AdvantageInputs(
        rewards=rewards, mask=mask, group=group, values=values if estimator == "gae" else None,
        gamma=0.9, lam=0.8, whiten=True))
    torch.testing.assert_close(got.kl, kl, rtol=0, atol=0)
    torch.testing.assert_close(got.advantages, adv, rtol=0, atol=0)
    torch.testing.assert_close(got.returns, ret, rtol=0, atol=0)
    assert got.old_logp is old
    assert (got.ref_logp is ref) if kl_in_loss else got.ref_logp is None
    # The KL moves the advantages only when it is in the reward (GRPO's outcome is the sum of the
    # token rewards, so it moves too).
    spec_no_kl = replace(spec, kl_in_loss=True)
    other = core.make_experience(spec_no_kl, old, ref, score, mask, group,
                                 values if estimator == "gae" else None, kl_coef=0.3)
    same = torch.equal(other.advantages, got.advantages)
    assert same == kl_in_loss


def test_make_experience_by_hand_for_one_grpo_group_without_a_reference():
    # Scores 1 and 0 in one group: mean 0.5, unbiased std sqrt(0.5), so the advantages are
    # +-0.5 / (sqrt(0.5) + 1e-6) on every valid token; no reference: KL 0.
    mask = t([[1, 1, 0], [1, 1, 1]])
    spec = core.ExperienceSpec("grpo", "k1", False, gamma=1.0, lam=1.0, whiten=True)
    exp = core.make_experience(spec, torch.zeros_like(mask), None, t([1.0, 0.0]), mask,
                               torch.tensor([0, 0]), None, kl_coef=0.5)
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    torch.testing.assert_close(exp.advantages, t([[a, a, 0], [-a, -a, -a]]))
    assert exp.kl.abs().sum() == 0 and exp.ref_logp is None
    assert torch.equal(exp.select(torch.tensor([1])).advantages, exp.advantages[1:])
