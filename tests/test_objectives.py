"""TROLL and clip objectives: hand-computed cases, invariants, GSPO, penalties and validation."""

from __future__ import annotations

import math
from dataclasses import fields, replace

import pytest
import torch

from lightning_troll.objectives import (
    AGGREGATIONS,
    IMPORTANCE_LEVELS,
    REF_KL_ESTIMATORS,
    ClipObjective,
    LossInputs,
    TrollObjective,
    build_objective,
    token_entropy,
)
from lightning_troll.objectives.aggregation import (
    K3_LOG_RATIO_LIMIT,
    K3_MAX,
    SEQUENCE_LOG_RATIO_MAX,
    TOKEN_LOG_RATIO_MAX,
)
from lightning_troll.rollouts.rollout import Rollout
from lightning_troll.trust_region.projection import ProjectionResult, sparsify


def binary_logits(p_new):
    """(B, T, 2) logits whose token-0 probability is p_new."""
    p = torch.tensor(p_new, dtype=torch.float64)
    return torch.stack([p.log(), (1 - p).log()], dim=-1)


def rollout(b=4, t=6, vocab=13, shift=0.7, seed=0, dtype=torch.float64):
    """A random minibatch: new logits and the loss inputs (tokens, mask, advantages, old
    log-probs and sparse old)."""
    g = torch.Generator().manual_seed(seed)
    old_logits = torch.randn(b, t, vocab, generator=g, dtype=dtype) * 2
    new = old_logits + torch.randn(b, t, vocab, generator=g, dtype=dtype) * shift
    tokens = torch.randint(0, vocab, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.bool)
    for i in range(b):
        mask[i, t - i :] = False  # sequences of lengths t, t-1, ...
    adv = torch.randn(b, generator=g, dtype=dtype)
    old_lp = torch.log_softmax(old_logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    old = sparsify(old_logits[mask], max_tokens=vocab, mass_delta=0.0, keep=tokens[mask])
    inputs = LossInputs(tokens=tokens, mask=mask, advantages=adv, old_logprobs=old_lp, old=old)
    return new, inputs


# --------------------------------------------------------------------------------------------
# Clip, by hand
# --------------------------------------------------------------------------------------------


def test_clip_hand_computed():
    """Three tokens, eps = 0.2, old prob 0.4 each:
    p = 0.6 (r = 1.5), A = +1 -> min(1.5, 1.2)   = 1.2  (clipped high)
    p = 0.2 (r = 0.5), A = -1 -> min(-0.5, -0.8) = -0.8 (clipped low)
    p = 0.36 (r = 0.9), A = +1 -> 0.9
    token_mean loss = -(1.2 - 0.8 + 0.9) / 3.
    """
    logits = binary_logits([[0.6, 0.2, 0.36]])
    tokens = torch.zeros(1, 3, dtype=torch.long)
    mask = torch.ones(1, 3, dtype=torch.bool)
    adv = torch.tensor([[1.0, -1.0, 1.0]], dtype=torch.float64)
    old_lp = torch.full((1, 3), math.log(0.4), dtype=torch.float64)
    inputs = LossInputs(tokens=tokens, mask=mask, advantages=adv, old_logprobs=old_lp, old=None)
    loss, stats = ClipObjective(eps_low=0.2)(logits, inputs)
    assert loss.item() == pytest.approx(-(1.2 - 0.8 + 0.9) / 3, abs=1e-12)
    assert stats.clip_frac_high.item() == pytest.approx(1 / 3)
    assert stats.clip_frac_low.item() == pytest.approx(1 / 3)
    torch.testing.assert_close(
        stats.token_ratio, torch.tensor([1.5, 0.5, 0.9], dtype=torch.float64)
    )
    assert stats.ratio_max.item() == pytest.approx(1.5)


@pytest.mark.parametrize("objective", ["clip", "troll"])
def test_a_token_the_old_policy_all_but_excluded_leaves_the_step_finite(objective):
    """Token 0 was drawn where the old policy gave it e^-100 (a stale or mismatched sampler): its
    ratio exp(100) overflows float32. Its log-ratio counts as TOKEN_LOG_RATIO_MAX, so the loss is
    finite, token 0 gets no gradient from its ratio (TROLL's regression term still pulls it), and
    token 1's gradient is the one it gets beside a token 0 of old probability 0.1. exp(100) gave
    a NaN gradient, which skipped the whole optimiser step. (TROLL projects token 0 to about
    5e-4: its log-ratio is above 90 as well.)"""
    logits = binary_logits([[0.5, 0.44]]).float().requires_grad_(True)
    tokens = torch.zeros(1, 2, dtype=torch.long)
    mask = torch.ones(1, 2, dtype=torch.bool)
    adv = torch.tensor([[1.0, 1.0]])
    results = []
    for old_token0 in (-100.0, math.log(0.1)):
        old_lp = torch.tensor([[old_token0, math.log(0.4)]])
        old_logits = torch.stack([old_lp[0], torch.log1p(-old_lp[0].exp())], -1)
        old = sparsify(old_logits, max_tokens=2, mass_delta=0.0, keep=tokens[mask])
        inputs = LossInputs(tokens=tokens, mask=mask, advantages=adv, old_logprobs=old_lp, old=old)
        kwargs = {"eps_low": 0.2} if objective == "clip" else {"eps": 0.05}
        loss, stats = build_objective(objective, **kwargs)(logits, inputs)
        (grad,) = torch.autograd.grad(loss, logits)
        assert torch.isfinite(loss) and torch.isfinite(grad).all()
        results.append((loss, grad, stats))
    (loss, grad, stats), (_, reference_grad, _) = results
    assert stats.token_ratio[0].item() == pytest.approx(math.exp(TOKEN_LOG_RATIO_MAX), rel=1e-6)
    torch.testing.assert_close(grad[0, 1], reference_grad[0, 1], rtol=1e-5, atol=1e-7)
    assert grad[0, 1].abs().sum() > 0
    if objective == "clip":  # token 0 clipped at 1.2 in both runs; token 1's ratio 0.44 / 0.4
        assert torch.equal(grad[0, 0], torch.zeros(2))
        assert loss.item() == pytest.approx(-(1.2 + 1.1) / 2, rel=1e-6)


def test_clip_asymmetric_and_dual_clip_by_hand():
    """eps_low = 0.1, eps_high = 0.3, c = 3, old prob 0.1:
    p = 0.15 (r = 1.5), A = +2 -> min(3.0, 1.3 * 2)       = 2.6
    p = 0.05 (r = 0.5), A = -1 -> min(-0.5, -0.9)         = -0.9
    p = 0.5  (r = 5.0), A = -1 -> max(min(-5, -1.3), -3)  = -3 (dual clip)
    """
    logits = binary_logits([[0.15, 0.05, 0.5]])
    tokens = torch.zeros(1, 3, dtype=torch.long)
    mask = torch.ones(1, 3, dtype=torch.bool)
    adv = torch.tensor([[2.0, -1.0, -1.0]], dtype=torch.float64)
    old_lp = torch.full((1, 3), math.log(0.1), dtype=torch.float64)
    inputs = LossInputs(tokens=tokens, mask=mask, advantages=adv, old_logprobs=old_lp, old=None)
    objective = ClipObjective(eps_low=0.1, eps_high=0.3, dual_clip=3.0)
    loss, stats = objective(logits, inputs)
    assert loss.item() == pytest.approx(-(2.6 - 0.9 - 3.0) / 3, abs=1e-12)
    assert stats.dual_clip_frac.item() == pytest.approx(1 / 3)
    assert stats.clip_frac.item() == pytest.approx(1.0)
    # without the dual clip the third token would contribute -5
    loss, _ = ClipObjective(eps_low=0.1, eps_high=0.3)(logits, inputs)
    assert loss.item() == pytest.approx(-(2.6 - 0.9 - 5.0) / 3, abs=1e-12)


# --------------------------------------------------------------------------------------------
# Aggregation, by hand
# --------------------------------------------------------------------------------------------


def test_aggregations_by_hand():
    """values [[1, 2, 3], [4, pad, pad]]:
    token_mean              = (1 + 2 + 3 + 4) / 4        = 2.5
    seq_mean_token_mean     = (2 + 4) / 2                = 3.0
    seq_mean_token_sum_norm = (6 / 5 + 4 / 5) / 2        = 1.0   (norm_length 5)
    """
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 99.0, float("nan")]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    assert AGGREGATIONS["token_mean"](values, mask, 5).item() == pytest.approx(2.5)
    assert AGGREGATIONS["seq_mean_token_mean"](values, mask, 5).item() == pytest.approx(3.0)
    assert AGGREGATIONS["seq_mean_token_sum_norm"](values, mask, 5).item() == pytest.approx(1.0)


def test_seq_mean_skips_empty_sequences():
    values = torch.tensor([[2.0, 4.0], [7.0, 7.0]])
    mask = torch.tensor([[True, True], [False, False]])
    assert AGGREGATIONS["seq_mean_token_mean"](values, mask, 2).item() == pytest.approx(3.0)


def test_dr_grpo_norm_length_defaults_to_padded_length():
    new, inputs = rollout()
    inputs = replace(inputs, old=None)
    length = inputs.mask.shape[1]
    objective = ClipObjective(aggregation="seq_mean_token_sum_norm")
    explicit = ClipObjective(aggregation="seq_mean_token_sum_norm", norm_length=length)
    doubled = ClipObjective(aggregation="seq_mean_token_sum_norm", norm_length=2 * length)
    a = objective(new, inputs)[0]
    assert a.item() == pytest.approx(explicit(new, inputs)[0].item())
    assert a.item() == pytest.approx(2 * doubled(new, inputs)[0].item())


# --------------------------------------------------------------------------------------------
# TROLL invariants
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("importance", ["token", "sequence"])
def test_troll_with_huge_eps_is_the_unclipped_policy_gradient(importance):
    new, inputs = rollout(shift=1.5)
    x = new.clone().requires_grad_(True)
    objective = TrollObjective(eps=1e12, importance=importance, max_tokens=64, mass_delta=0.0)
    loss, stats = objective(x, inputs)
    loss.backward()
    assert stats.active_frac.item() == 0

    tokens, mask, adv, old_lp = inputs.tokens, inputs.mask, inputs.advantages, inputs.old_logprobs
    y = new.clone().requires_grad_(True)
    logp = torch.log_softmax(y, -1).gather(-1, tokens[..., None]).squeeze(-1)
    log_r = torch.where(mask, logp - old_lp, 0.0)
    if importance == "sequence":  # GSPO: s = exp(mean log r), one ratio per sequence
        log_r = (log_r.sum(-1) / mask.sum(-1)).unsqueeze(-1).expand_as(log_r)
    unclipped = -(log_r.exp() * adv[:, None])[mask].mean()
    unclipped.backward()
    assert loss.item() == pytest.approx(unclipped.item(), abs=1e-10)
    torch.testing.assert_close(x.grad, y.grad, rtol=0, atol=1e-10)


@pytest.mark.parametrize("name", ["troll", "clip"])
def test_first_step_on_policy(name):
    """new == old: every ratio is 1, nothing is projected or clipped."""
    _, base = rollout()
    tokens, mask, adv = base.tokens, base.mask, base.advantages
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(*mask.shape, 13, generator=g, dtype=torch.float32) * 3
    old_lp = torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    old = sparsify(logits[mask], keep=tokens[mask])
    inputs = replace(base, advantages=adv.float(), old_logprobs=old_lp, old=old)
    loss, stats = build_objective(name)(logits, inputs)
    torch.testing.assert_close(
        stats.token_ratio, torch.ones_like(stats.token_ratio), rtol=0, atol=1e-6
    )
    if name == "troll":
        assert stats.projection.kl_before.abs().max() < 1e-6
        assert stats.active_frac.item() == 0
        assert stats.regression_loss.abs().item() < 1e-6
    else:
        assert stats.clip_frac.item() == 0
    # the loss is -mean(A) over tokens: ratio 1 everywhere
    expected = -(adv.float()[:, None].expand_as(mask)[mask]).mean()
    assert loss.item() == pytest.approx(expected.item(), abs=1e-5)


def test_troll_bound_holds_and_projection_reported():
    new, inputs = rollout(shift=2.0, dtype=torch.float32)
    loss, stats = TrollObjective(eps=0.05)(new, inputs)
    p = stats.projection
    assert p.kl_after.shape == (int(inputs.mask.sum()),)
    assert (p.kl_after <= 0.05 * (1 + 1e-4)).all()
    assert 0 < stats.active_frac.item() <= 1
    assert stats.active_frac.item() == pytest.approx((p.kl_before > 0.05).float().mean().item())
    assert stats.regression_loss.item() > 0  # projected rows differ from pi_new
    for value in (stats.loss, stats.entropy, p.logprob, p.kl_after):
        assert not value.requires_grad
    # the loss is the policy loss plus alpha times the regression
    assert stats.loss.item() == pytest.approx(
        stats.policy_loss.item() + stats.regression_loss.item(), abs=1e-6
    )


def test_troll_regression_weight_alpha():
    new, inputs = rollout(shift=2.0)
    zero = TrollObjective(alpha=0.0)(new, inputs)[1]
    two = TrollObjective(alpha=2.0)(new, inputs)[1]
    assert zero.regression_loss.item() > 0
    assert zero.loss.item() == pytest.approx(zero.policy_loss.item())
    assert two.loss.item() == pytest.approx(two.policy_loss.item() + 2 * two.regression_loss.item())


def test_gspo_sequence_ratio_against_a_loop():
    new, inputs = rollout(shift=0.5)
    inputs = replace(inputs, old=None)
    x = new.clone().requires_grad_(True)
    objective = ClipObjective(
        eps_low=10.0 / 11, eps_high=10.0, importance="sequence", aggregation="seq_mean_token_mean"
    )
    loss, stats = objective(x, inputs)
    loss.backward()

    tokens, mask, adv, old_lp = inputs.tokens, inputs.mask, inputs.advantages, inputs.old_logprobs
    y = new.clone().requires_grad_(True)
    logp = torch.log_softmax(y, -1).gather(-1, tokens[..., None]).squeeze(-1)
    ratios, terms = [], []
    for i in range(mask.shape[0]):
        n = int(mask[i].sum())
        s = torch.exp(sum(logp[i, t] - old_lp[i, t] for t in range(n)) / n)  # GSPO, no stop-grad
        ratios += [s.item()] * n
        terms.append(s * adv[i])
    reference = -torch.stack(terms).mean()
    reference.backward()
    torch.testing.assert_close(stats.token_ratio, torch.tensor(ratios, dtype=torch.float64))
    assert loss.item() == pytest.approx(reference.item(), abs=1e-12)
    torch.testing.assert_close(x.grad, y.grad, rtol=0, atol=1e-12)


def test_gspo_log_ratio_is_clamped_at_10():
    """Sequence 0: mean log-ratio 12 > 10, so both tokens get exp(10) and no gradient; sequence 1:
    mean log-ratio 3, so exp(3), and d ratio / d log pi(o_t) = exp(3) for each token."""
    logp = torch.zeros(2, 2, dtype=torch.float64, requires_grad=True)
    old_logp = torch.tensor([[-12.0, -12.0], [-2.0, -4.0]], dtype=torch.float64)
    mask = torch.ones(2, 2, dtype=torch.bool)
    ratio = IMPORTANCE_LEVELS["sequence"](logp, old_logp, mask)
    ratio.sum().backward()
    e10, e3 = math.exp(SEQUENCE_LOG_RATIO_MAX), math.exp(3.0)
    assert SEQUENCE_LOG_RATIO_MAX == 10.0
    expected = torch.tensor([[e10, e10], [e3, e3]], dtype=torch.float64)
    torch.testing.assert_close(ratio.detach(), expected, rtol=1e-12, atol=0)
    grad = torch.tensor([[0.0, 0.0], [e3, e3]], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, grad, rtol=1e-12, atol=0)


# --------------------------------------------------------------------------------------------
# Penalties
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_reference_kl_by_hand(estimator):
    """p_new = 0.5, p_ref = 0.25: d = log(0.25 / 0.5) = -log 2;
    k1 = log 2, k3 = exp(d) - d - 1 = 0.5 + log 2 - 1."""
    logits = binary_logits([[0.5, 0.5]])
    tokens = torch.zeros(1, 2, dtype=torch.long)
    mask = torch.ones(1, 2, dtype=torch.bool)
    old_lp = torch.full((1, 2), math.log(0.5), dtype=torch.float64)
    ref_lp = torch.full((1, 2), math.log(0.25), dtype=torch.float64)
    adv = torch.zeros(1, dtype=torch.float64)
    objective = ClipObjective(ref_kl_coef=0.1, ref_kl_estimator=estimator)
    inputs = LossInputs(
        tokens=tokens, mask=mask, advantages=adv, old_logprobs=old_lp, old=None, ref_logprobs=ref_lp
    )
    loss, stats = objective(logits, inputs)
    expected = math.log(2) if estimator == "k1" else 0.5 + math.log(2) - 1
    assert stats.ref_kl.item() == pytest.approx(expected, abs=1e-12)
    assert loss.item() == pytest.approx(0.1 * expected, abs=1e-12)


def test_k3_is_clamped_like_low_var_kl():
    """d = log pi_ref - log pi: d = -log 2 gives 0.5 + log 2 - 1 (no clamp); d = 2 gives
    e^2 - 3 = 4.389; d = 25 is clamped to 20 and e^20 - 21 to 10; d = -30 to -20, and
    e^-20 + 19 to 10. Clamped entries get no gradient."""
    d = torch.tensor([-math.log(2), 2.0, 25.0, -30.0], dtype=torch.float64)
    logp = torch.zeros(4, dtype=torch.float64, requires_grad=True)
    got = REF_KL_ESTIMATORS["k3"](logp, d)
    expected = [0.5 + math.log(2) - 1, math.exp(2) - 3, 10.0, 10.0]
    torch.testing.assert_close(got.detach(), torch.tensor(expected, dtype=torch.float64),
                               rtol=0, atol=1e-12)  # fmt: skip
    got.sum().backward()
    # d k3 / d log pi = 1 - exp(d) where nothing is clamped
    grad = torch.tensor([1 - 0.5, 1 - math.exp(2), 0.0, 0.0], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, grad, rtol=0, atol=1e-12)
    assert (K3_LOG_RATIO_LIMIT, K3_MAX) == (20.0, 10.0)


def test_masked_vocabulary_gives_finite_losses_and_gradients():
    """Tokens 8..12 of V = 13 masked (-inf) in the old and new logits: entropy, loss and
    gradients are finite for both objectives, and the entropy is that of the 8 unmasked tokens."""
    new, base = rollout(shift=1.5)
    mask = base.mask
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 8, base.tokens.shape, generator=g)
    old_logits = new + torch.randn(new.shape, generator=g, dtype=new.dtype)
    new[..., 8:] = old_logits[..., 8:] = float("-inf")
    old_lp = torch.log_softmax(old_logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    old = sparsify(old_logits[mask], keep=tokens[mask])
    inputs = replace(base, tokens=tokens, old_logprobs=old_lp, old=old)
    expected_entropy = token_entropy(new[..., :8])[mask].mean()
    for objective in (TrollObjective(entropy_coef=0.01), ClipObjective(entropy_coef=0.01)):
        x = new.clone().requires_grad_(True)
        loss, stats = objective(x, inputs)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(x.grad).all()
        assert (x.grad[..., 8:] == 0).all()
        assert stats.entropy.item() == pytest.approx(expected_entropy.item(), abs=1e-12)


def test_entropy_bonus_by_hand():
    """Uniform logits over V = 8: entropy log 8 per token; the loss falls by coef * log 8."""
    logits = torch.zeros(2, 3, 8, dtype=torch.float64)
    tokens = torch.zeros(2, 3, dtype=torch.long)
    mask = torch.ones(2, 3, dtype=torch.bool)
    old_lp = torch.full((2, 3), -math.log(8), dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    inputs = LossInputs(tokens=tokens, mask=mask, advantages=adv, old_logprobs=old_lp, old=None)
    base, stats = ClipObjective()(logits, inputs)
    bonus, _ = ClipObjective(entropy_coef=0.01)(logits, inputs)
    assert stats.entropy.item() == pytest.approx(math.log(8))
    assert (base - bonus).item() == pytest.approx(0.01 * math.log(8))


def test_empty_batch_gives_zero_loss_with_a_graph():
    new, inputs = rollout()
    none = torch.zeros_like(inputs.mask)
    old = sparsify(new[none], keep=inputs.tokens[none])
    inputs = replace(inputs, mask=none, old=old)
    x = new.clone().requires_grad_(True)
    for objective in (TrollObjective(), ClipObjective()):
        loss, stats = objective(x, inputs)
        loss.backward()
        assert loss.item() == 0 and stats.num_tokens.item() == 0
        assert (x.grad == 0).all()


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"importance": "tokens"},
            r"importance must be one of \['sequence', 'token'\]; got 'tokens'",
        ),
        ({"aggregation": "mean"}, r"aggregation must be one of .*; got 'mean'"),
        ({"ref_kl_estimator": "k9"}, r"ref_kl_estimator must be one of \['k1', 'k3'\]; got 'k9'"),
        ({"ref_kl_coef": -1.0}, r"ref_kl_coef must be a finite number >= 0; got -1.0"),
        ({"entropy_coef": float("nan")}, r"entropy_coef must be a finite number >= 0; got nan"),
        ({"norm_length": 0}, r"norm_length must be None or an integer >= 1; got 0"),
        ({"eps_low": 1.2}, r"eps_low must be in \(0, 1\); got 1.2"),
        ({"eps_high": 0.0}, r"eps_high must be > 0; got 0.0"),
        ({"dual_clip": 0.5}, r"dual_clip must be None or > 1; got 0.5"),
    ],
)
def test_clip_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ClipObjective(**kwargs)


def test_troll_validation_and_inputs():
    with pytest.raises(ValueError, match=r"alpha must be a finite number >= 0; got -1"):
        TrollObjective(alpha=-1)
    with pytest.raises(ValueError, match=r"alpha must be a finite number >= 0; got inf"):
        TrollObjective(alpha=float("inf"))
    with pytest.raises(ValueError, match=r"eps must be a finite number > 0.*got inf"):
        TrollObjective(eps=float("inf"))  # a bound that never binds: no trust region at all
    with pytest.raises(ValueError, match=r"entropy_coef must be a finite number >= 0; got inf"):
        TrollObjective(entropy_coef=float("inf"))
    with pytest.raises(ValueError, match=r"eps must be a finite number > 0"):
        TrollObjective(eps=0.0)
    with pytest.raises(
        ValueError, match=r"objective must be one of \['clip', 'troll'\]; got 'ppo'"
    ):
        build_objective("ppo")
    new, inputs = rollout()
    objective = TrollObjective()
    with pytest.raises(ValueError, match=r"needs old"):
        objective(new, replace(inputs, old=None))
    with pytest.raises(ValueError, match=r"advantages must be \(B,\) = \(4,\)"):
        objective(new, replace(inputs, advantages=inputs.advantages[:3]))
    with pytest.raises(ValueError, match=r"mask must be \(B, T\)"):
        objective(new, replace(inputs, mask=inputs.mask[:, :2]))
    with pytest.raises(ValueError, match=r"ref_kl_coef=0.1 needs ref_logprobs"):
        TrollObjective(ref_kl_coef=0.1)(new, inputs)
    with pytest.raises(ValueError, match=r"one row per row of new_logits"):
        objective(new, replace(inputs, old=inputs.old.select(torch.arange(3))))


@pytest.mark.parametrize("support", ["union", "official", "dense"])
def test_no_advantage_on_policy_moves_no_weight_under_adam(support):
    """new == old and every advantage 0: TROLL's loss has an exactly zero gradient (the
    regression KL is zero, not rounding, on rows the projection leaves as they are), so an Adam
    step with an empty second moment leaves the weights where they are, as clipping's does.
    (Rounding noise of ~1e-7 would become a full lr-sized step there.)"""
    torch.manual_seed(0)
    b, t, hidden, vocab = 4, 6, 8, 13
    head = torch.nn.Linear(hidden, vocab, bias=False)
    states = torch.randn(b, t, hidden)
    tokens = torch.randint(0, vocab, (b, t))
    mask = torch.ones(b, t, dtype=torch.bool)
    with torch.no_grad():
        logits = head(states)
    old_lp = torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    old = logits[mask] if support == "dense" else sparsify(logits[mask], keep=tokens[mask])
    inputs = LossInputs(
        tokens=tokens, mask=mask, advantages=torch.zeros(b), old_logprobs=old_lp, old=old
    )
    before = head.weight.detach().clone()
    optimizer = torch.optim.Adam(head.parameters(), lr=1e-3)
    for name in ("troll", "clip"):
        objective = build_objective(name, support=support) if name == "troll" else ClipObjective()
        loss, _ = objective(head(states), inputs)
        optimizer.zero_grad()
        loss.backward()
        assert head.weight.grad.abs().max().item() == 0.0, name
        optimizer.step()
        assert torch.equal(head.weight, before), name


# --------------------------------------------------------------------------------------------
# The inputs, by name
# --------------------------------------------------------------------------------------------

HOW = (
    ": pass LossInputs(tokens=..., mask=..., advantages=..., old_logprobs=..., old=..., "
    "ref_logprobs=...) from lightning_troll.objectives, or rollout.loss_inputs()"
)


def test_tensors_passed_one_by_one_are_refused_with_how_to_pass_them():
    new, inputs = rollout()
    tensors = (inputs.tokens, inputs.mask, inputs.advantages, inputs.old_logprobs, inputs.old)
    objective = TrollObjective()
    head = torch.nn.Linear(5, new.shape[-1]).double()
    hidden = torch.randn(*inputs.mask.shape, 5, dtype=torch.float64)
    refused = {
        "TrollObjective.forward takes its per-token tensors as one LossInputs "
        "(too many positional arguments)": lambda: objective(new, *tensors),
        "TrollObjective.forward takes its per-token tensors as one LossInputs "
        "(got inputs of type Tensor)": lambda: objective(new, inputs.tokens),
        "TrollObjective.forward takes its per-token tensors as one LossInputs "
        "(got an unexpected keyword argument 'old')": lambda: objective(
            new, inputs, old=inputs.old
        ),
        "TrollObjective.forward_hidden takes its per-token tensors as one LossInputs "
        "(too many positional arguments)": lambda: objective.forward_hidden(
            hidden, head, 1.0, *tensors, None, 4
        ),
        "TrollObjective.forward_hidden takes its per-token tensors as one LossInputs "
        "(multiple values for argument 'chunk_size')": lambda: objective.forward_hidden(
            hidden, head, 1.0, *tensors, chunk_size=4
        ),
        "TrollObjective.forward_hidden takes its per-token tensors as one LossInputs "
        "(got inputs of type tuple)": lambda: objective.forward_hidden(hidden, head, 1.0, tensors),
    }
    for message, call in refused.items():
        with pytest.raises(TypeError) as error:
            call()
        assert str(error.value) == message + HOW


def _assert_equal_stats(got, expected) -> None:
    """Every field of two statistics records (the projection record's too) is bit-identical."""
    assert type(got) is type(expected)
    for field in fields(expected):
        a, b = getattr(got, field.name), getattr(expected, field.name)
        if isinstance(b, ProjectionResult):
            for part in fields(b):
                assert torch.equal(getattr(a, part.name), getattr(b, part.name)), part.name
        else:
            assert torch.equal(a, b), field.name


@pytest.mark.parametrize("name", ["troll", "clip"])
def test_a_rollouts_loss_inputs_give_the_loss_of_inputs_built_by_hand(name):
    """A Rollout of 2-token prompts (left padded) and the minibatch of :func:`rollout` as its
    responses, with reference log-probs: ``rollout.loss_inputs()`` gives, bit for bit, the loss
    and statistics of the same tensors passed by hand, in both passes."""
    new, inputs = rollout()
    b = inputs.mask.shape[0]
    g = torch.Generator().manual_seed(4)
    prompts = torch.randint(0, 13, (b, 2), generator=g)
    prompt_mask = torch.tensor([[0, 1], [1, 1], [1, 1], [0, 1]])
    ref_lp = inputs.old_logprobs + 0.1 * torch.randn(inputs.mask.shape, generator=g).double()
    sampled = Rollout(
        input_ids=torch.cat([prompts, inputs.tokens], dim=-1),
        attention_mask=torch.cat([prompt_mask, inputs.mask.long()], dim=-1),
        response_mask=inputs.mask,
        old_logprobs=inputs.old_logprobs,
        old=inputs.old,
        rewards=inputs.advantages + 1,
        advantages=inputs.advantages,
        truncated=torch.zeros(b, dtype=torch.bool),
        temperature=1.0,
        group_size=2,
        ref_logprobs=ref_lp,
    )
    by_hand = LossInputs(
        tokens=inputs.tokens.clone(),
        mask=inputs.mask.clone(),
        advantages=inputs.advantages.clone(),
        old_logprobs=inputs.old_logprobs.clone(),
        old=inputs.old,
        ref_logprobs=ref_lp.clone(),
    )
    from_rollout = sampled.loss_inputs()
    assert torch.equal(from_rollout.tokens, by_hand.tokens)
    assert from_rollout.old is sampled.old and from_rollout.ref_logprobs is ref_lp

    objective = build_objective(name, ref_kl_coef=0.1, entropy_coef=0.01)
    loss, stats = objective(new, by_hand)
    got_loss, got_stats = objective(new, from_rollout)
    assert torch.equal(got_loss, loss)
    _assert_equal_stats(got_stats, stats)
    assert stats.ref_kl != 0

    head = torch.nn.Linear(5, new.shape[-1]).double()
    hidden = torch.randn(*inputs.mask.shape, 5, generator=g, dtype=torch.float64)
    loss, stats = objective.forward_hidden(hidden, head, 0.7, by_hand, chunk_size=4)
    got_loss, got_stats = objective.forward_hidden(hidden, head, 0.7, from_rollout, chunk_size=4)
    assert torch.equal(got_loss, loss)
    _assert_equal_stats(got_stats, stats)


def test_response_tokens_take_and_scatter_as_the_boolean_mask_does():
    from lightning_troll.objectives.aggregation import ResponseTokens

    _, inputs = rollout()
    mask = inputs.mask  # sequences of lengths 6, 5, 4, 3
    values = torch.randn(*mask.shape, 3, dtype=torch.float64, requires_grad=True)
    response = ResponseTokens.of(mask)
    assert response.count == 18 and response.index.dtype == torch.long
    assert torch.equal(response.take(values), values[mask])
    assert torch.equal(response.take(inputs.tokens), inputs.tokens[mask])
    taken = response.take(values)[:, 0]  # (N,)
    scattered = response.scatter(taken)
    assert scattered.shape == mask.shape
    assert torch.equal(scattered[mask], values[mask][:, 0]) and (scattered[~mask] == 0).all()
    scattered.sum().backward()
    assert torch.equal(values.grad[..., 0], mask.double()) and (values.grad[..., 1:] == 0).all()
    empty = ResponseTokens.of(torch.zeros(2, 3, dtype=torch.bool))
    assert empty.count == 0 and empty.scatter(torch.zeros(0)).abs().sum() == 0
