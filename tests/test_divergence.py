"""Specification of DPPO's divergence estimates and trust-region mask (`trl_dppo.divergence`).

Notation: mu is the sampler's probability of a token (recorded at generation), pi the trainer's, r = pi / mu, A the
advantage. Every function takes log-probabilities.
"""

from __future__ import annotations

import math

import pytest
import torch

from trl_dppo.divergence import binary_divergence, topk_divergence, trust_region_mask


NEG_INF = -math.inf


def logp(*probs: float) -> torch.Tensor:
    """float64 log-probabilities of the given probabilities."""
    return torch.tensor(probs, dtype=torch.float64).log()


def ppo_gradient_is_zero(sampler_logps, trainer_logps, advantages, eps):
    """Whether d/d(log pi) of PPO's surrogate min(r A, clip(r, 1 - eps, 1 + eps) A) is zero, per token (autograd)."""
    log_pi = trainer_logps.clone().requires_grad_(True)
    ratio = torch.exp(log_pi - sampler_logps)
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(1 - eps, 1 + eps) * advantages)
    (grad,) = torch.autograd.grad(surrogate.sum(), log_pi)
    return grad == 0


def random_distributions(gen, n, vocab, temperature, shift):
    """n pairs (log mu, log pi) over `vocab` tokens; pi's logits are mu's plus noise of size `shift`."""
    logits_mu = torch.randn(n, vocab, generator=gen, dtype=torch.float64) * temperature
    logits_pi = logits_mu + torch.randn(n, vocab, generator=gen, dtype=torch.float64) * shift
    return logits_mu.log_softmax(-1), logits_pi.log_softmax(-1)


def full_divergence(log_mu, log_pi, kind):
    mu, pi = log_mu.exp(), log_pi.exp()
    if kind == "tv":
        return 0.5 * (mu - pi).abs().sum(-1)
    return (mu * (log_mu - log_pi)).sum(-1)


def kept_set(log_mu, log_pi, sampled, k):
    """Log-probs at the sampler's top-K tokens plus the sampled one; `-inf` in the spare slot if it is in the top-K."""
    top = log_mu.topk(k, dim=-1).indices
    in_top = (top == sampled[:, None]).any(-1)
    ids = torch.cat([top, sampled[:, None]], dim=-1)
    kept_mu, kept_pi = log_mu.gather(-1, ids), log_pi.gather(-1, ids)
    kept_mu[in_top, -1] = NEG_INF
    kept_pi[in_top, -1] = NEG_INF
    return kept_mu, kept_pi


# --- The paper's worked examples -------------------------------------------------------------------------------------


def test_rare_token_raised_with_positive_advantage_keeps_its_gradient_where_ppo_clips_it():
    """mu = 1e-4 -> pi = 1e-2 with A > 0: binary TV ~0.0099 stays under delta = 0.15, so DPPO keeps the token,
    while PPO's ratio r = 100 lies far outside [0.8, 1.2] and PPO zeroes its gradient."""
    mu, pi, adv = logp(1e-4), logp(1e-2), torch.tensor([1.0], dtype=torch.float64)
    tv = binary_divergence(mu, pi, "tv")
    assert tv.item() == pytest.approx(0.0099, abs=1e-6)
    assert trust_region_mask(tv, mu, pi, adv, 0.15, 0.15).item()
    assert torch.exp(pi - mu).item() == pytest.approx(100.0)
    assert ppo_gradient_is_zero(mu, pi, adv, eps=0.2).item()


def test_likely_token_lowered_with_negative_advantage_is_blocked():
    """mu = 0.99 -> pi = 0.80 with A < 0 moves further away by TV 0.19 > 0.15: the token loses its gradient."""
    mu, pi = logp(0.99), logp(0.80)
    tv = binary_divergence(mu, pi, "tv")
    assert tv.item() == pytest.approx(0.19, abs=1e-6)
    assert not trust_region_mask(tv, mu, pi, torch.tensor([-1.0]), 0.15, 0.15).item()


def test_likely_token_lowered_with_positive_advantage_is_not_blocked():
    """The same 0.99 -> 0.80 move with A > 0: the update pushes pi back up toward mu, so it is never blocked."""
    mu, pi = logp(0.99), logp(0.80)
    tv = binary_divergence(mu, pi, "tv")
    assert trust_region_mask(tv, mu, pi, torch.tensor([1.0]), 0.15, 0.15).item()


# --- trust_region_mask -----------------------------------------------------------------------------------------------


def test_a_move_back_toward_mu_is_never_blocked_whatever_the_divergence():
    """A > 0 with pi <= mu, A < 0 with pi >= mu, and A = 0 always keep their gradient, even for huge D."""
    gen = torch.Generator().manual_seed(0)
    n = 20_000
    sampler = -torch.rand(n, generator=gen, dtype=torch.float64) * 12
    trainer = -torch.rand(n, generator=gen, dtype=torch.float64) * 12
    trainer[: n // 10] = sampler[: n // 10]  # some ties pi = mu
    advantages = torch.randn(n, generator=gen, dtype=torch.float64)
    advantages[-n // 10 :] = 0.0
    divergence = torch.rand(n, generator=gen) * 100
    delta = torch.rand(2, generator=gen) * 0.5
    keep = trust_region_mask(divergence, sampler, trainer, advantages, delta[0].item(), delta[1].item())
    back_toward_mu = ((advantages > 0) & (trainer <= sampler)) | ((advantages < 0) & (trainer >= sampler))
    assert back_toward_mu.sum() > n // 3
    assert keep[back_toward_mu].all()
    assert keep[advantages == 0].all()


def test_mask_blocks_exactly_the_moves_further_away_beyond_delta():
    """Blocked iff (A > 0, pi > mu, D > delta_high) or (A < 0, pi < mu, D > delta_low)."""
    gen = torch.Generator().manual_seed(1)
    n = 20_000
    sampler = -torch.rand(n, generator=gen) * 8
    trainer = -torch.rand(n, generator=gen) * 8
    advantages = torch.randn(n, generator=gen)
    divergence = torch.rand(n, generator=gen) * 0.4
    keep = trust_region_mask(divergence, sampler, trainer, advantages, 0.1, 0.25)
    blocked = ((advantages > 0) & (trainer > sampler) & (divergence > 0.25)) | (
        (advantages < 0) & (trainer < sampler) & (divergence > 0.1)
    )
    assert blocked.any() and (~blocked).any()
    assert torch.equal(keep, ~blocked)


def test_delta_high_applies_to_positive_advantages_and_delta_low_to_negative_ones():
    up_mu, up_pi = logp(0.3), logp(0.5)  # pi > mu, TV 0.2
    down_mu, down_pi = logp(0.5), logp(0.3)  # pi < mu, TV 0.2
    d = torch.tensor([0.2])
    # delta_low = 0.1, delta_high = 0.3: the upward move with A > 0 is inside, the downward one with A < 0 outside
    assert trust_region_mask(d, up_mu, up_pi, torch.tensor([1.0]), 0.1, 0.3).item()
    assert not trust_region_mask(d, down_mu, down_pi, torch.tensor([-1.0]), 0.1, 0.3).item()
    # swapped thresholds swap the decisions
    assert not trust_region_mask(d, up_mu, up_pi, torch.tensor([1.0]), 0.3, 0.1).item()
    assert trust_region_mask(d, down_mu, down_pi, torch.tensor([-1.0]), 0.3, 0.1).item()


def test_mask_at_exactly_delta_keeps_the_token():
    """The threshold is strict: D == delta is still inside the trust region."""
    mu, pi = logp(0.3), logp(0.5)
    assert trust_region_mask(torch.tensor([0.25]), mu, pi, torch.tensor([1.0]), 0.25, 0.25).item()


def test_ratio_divergence_with_delta_epsilon_reproduces_ppo_clip_decisions():
    """With D = |r - 1| and delta_low = delta_high = eps, DPPO blocks exactly the tokens whose gradient PPO's
    min(r A, clip(r, 1 - eps, 1 + eps) A) zeroes: r > 1 + eps for A > 0, r < 1 - eps for A < 0."""
    gen = torch.Generator().manual_seed(2)
    n = 10_000
    sampler = -torch.rand(n, generator=gen, dtype=torch.float64) * 6
    trainer = sampler + torch.randn(n, generator=gen, dtype=torch.float64) * 0.4
    trainer = trainer.clamp(max=0.0)
    advantages = torch.randn(n, generator=gen, dtype=torch.float64)
    for eps in (0.1, 0.2, 0.28):
        divergence = (torch.exp(trainer - sampler) - 1).abs()
        keep = trust_region_mask(divergence, sampler, trainer, advantages, eps, eps)
        ratio = torch.exp(trainer - sampler)
        assert ((ratio > 1 + eps) & (advantages > 0)).any() and ((ratio < 1 - eps) & (advantages < 0)).any()
        assert torch.equal(~keep, ppo_gradient_is_zero(sampler, trainer, advantages, eps))


def test_advantages_broadcast_per_sequence():
    """(B, 1) advantages broadcast against (B, T) tokens."""
    sampler = logp(0.5, 0.5, 0.5, 0.5).view(2, 2)
    trainer = logp(0.9, 0.1, 0.9, 0.1).view(2, 2)
    d = binary_divergence(sampler, trainer, "tv")
    keep = trust_region_mask(d, sampler, trainer, torch.tensor([[1.0], [-1.0]]), 0.15, 0.15)
    assert keep.shape == (2, 2)
    assert keep.tolist() == [[False, True], [True, False]]


# --- binary_divergence -----------------------------------------------------------------------------------------------


def test_binary_tv_is_the_absolute_probability_difference():
    mu, pi = logp(0.1, 0.7, 0.3), logp(0.4, 0.2, 0.3)
    torch.testing.assert_close(binary_divergence(mu, pi, "tv"), torch.tensor([0.3, 0.5, 0.0]))


def test_binary_kl_matches_its_closed_form():
    """KL(Bernoulli(mu) || Bernoulli(pi)) = mu log(mu/pi) + (1 - mu) log((1 - mu)/(1 - pi))."""
    gen = torch.Generator().manual_seed(3)
    mu = torch.rand(1000, generator=gen, dtype=torch.float64) * 0.98 + 0.01
    pi = torch.rand(1000, generator=gen, dtype=torch.float64) * 0.98 + 0.01
    expected = mu * torch.log(mu / pi) + (1 - mu) * torch.log((1 - mu) / (1 - pi))
    torch.testing.assert_close(binary_divergence(mu.log(), pi.log(), "kl"), expected.float(), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kind", ["tv", "kl"])
def test_binary_divergence_is_zero_for_equal_distributions(kind):
    lp = logp(1e-6, 0.2, 0.5, 0.999)
    assert torch.equal(binary_divergence(lp, lp, kind), torch.zeros(4))


# --- topk_divergence -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["tv", "kl"])
@pytest.mark.parametrize("k", [1, 5, 20])
@pytest.mark.parametrize("temperature", [0.3, 4.0], ids=["flat", "peaked"])
def test_binary_le_topk_le_full_divergence(kind, k, temperature):
    """Both estimates are lower bounds of the full-vocabulary divergence, and the top-K one (whose kept set holds the
    sampled token) is at least the binary one."""
    gen = torch.Generator().manual_seed(1000 * k + int(10 * temperature))
    log_mu, log_pi = random_distributions(gen, n=300, vocab=50, temperature=temperature, shift=0.7)
    sampled = torch.multinomial(log_mu.exp(), 1, generator=gen).squeeze(-1)
    kept_mu, kept_pi = kept_set(log_mu, log_pi, sampled, k)

    sampled_mu, sampled_pi = log_mu.gather(-1, sampled[:, None])[:, 0], log_pi.gather(-1, sampled[:, None])[:, 0]
    binary = binary_divergence(sampled_mu, sampled_pi, kind)
    topk = topk_divergence(kept_mu, kept_pi, kind)
    full = full_divergence(log_mu, log_pi, kind).float()

    assert topk.shape == binary.shape == (300,)
    torch.testing.assert_close(torch.minimum(binary, topk), binary, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(torch.minimum(topk, full), topk, rtol=1e-6, atol=1e-7)
    # the sampled token is not always in the top-K: both kept-set shapes were exercised
    if k < 20:
        assert torch.isinf(kept_mu[:, -1]).any() and torch.isfinite(kept_mu[:, -1]).any()


@pytest.mark.parametrize("kind", ["tv", "kl"])
def test_topk_equals_full_divergence_when_the_kept_set_is_the_whole_vocabulary(kind):
    gen = torch.Generator().manual_seed(4)
    log_mu, log_pi = random_distributions(gen, n=100, vocab=50, temperature=2.0, shift=0.5)
    perm = torch.randperm(50, generator=gen)
    torch.testing.assert_close(
        topk_divergence(log_mu[:, perm], log_pi[:, perm], kind),
        full_divergence(log_mu, log_pi, kind).float(),
        rtol=1e-5,
        atol=1e-7,
    )


@pytest.mark.parametrize("kind", ["tv", "kl"])
def test_empty_slots_holding_minus_inf_in_both_inputs_contribute_nothing(kind):
    gen = torch.Generator().manual_seed(5)
    log_mu, log_pi = random_distributions(gen, n=50, vocab=30, temperature=2.0, shift=0.5)
    kept_mu, kept_pi = log_mu[:, :6], log_pi[:, :6]
    pad = torch.full((50, 3), NEG_INF, dtype=torch.float64)
    padded = topk_divergence(torch.cat([kept_mu, pad], -1), torch.cat([kept_pi, pad], -1), kind)
    assert torch.equal(padded, topk_divergence(kept_mu, kept_pi, kind))


def test_topk_tv_counts_the_rest_of_the_vocabulary_as_one_bucket():
    """Kept {0.5 -> 0.3, 0.2 -> 0.2}: the rest moves 0.3 -> 0.5, so TV = 0.5 * (0.2 + 0 + 0.2) = 0.2."""
    d = topk_divergence(logp(0.5, 0.2)[None], logp(0.3, 0.2)[None], "tv")
    torch.testing.assert_close(d, torch.tensor([0.2]))


def test_two_likely_tokens_swapping_escape_binary_but_not_topk():
    """mu = [0.45, 0.45, 0.10], pi = [0.249, 0.65, 0.101], sampled token the third: its own probability barely
    moves (binary TV 0.001), yet the head of the distribution moved by TV ~0.2, which top-K sees and binary cannot."""
    mu, pi = logp(0.45, 0.45, 0.10), logp(0.249, 0.65, 0.101)
    delta = 0.15
    binary = binary_divergence(mu[2], pi[2], "tv")
    topk = topk_divergence(mu, pi, "tv")
    assert binary.item() < delta < topk.item()
    # a positive advantage raises the sampled token further: top-K blocks it, binary lets it through
    adv = torch.tensor(1.0)
    assert trust_region_mask(binary, mu[2], pi[2], adv, delta, delta).item()
    assert not trust_region_mask(topk, mu[2], pi[2], adv, delta, delta).item()
    # the same holds for KL at its default threshold
    assert binary_divergence(mu[2], pi[2], "kl").item() < 0.05 < topk_divergence(mu, pi, "kl").item()


# --- Edge probabilities, dtypes, errors ------------------------------------------------------------------------------

EDGE_LOGPS = [0.0, -1e-12, -1e4, NEG_INF, math.log(0.5)]


@pytest.mark.parametrize("kind", ["tv", "kl"])
def test_binary_divergence_is_finite_at_probabilities_zero_and_one(kind):
    values = torch.tensor(EDGE_LOGPS)
    sampler, trainer = torch.meshgrid(values, values, indexing="ij")
    d = binary_divergence(sampler, trainer, kind)
    assert torch.isfinite(d).all()
    assert (d >= 0).all()
    assert d.diagonal().eq(0).all()
    # mu = 1 vs pi ~ 0 is the largest divergence possible: 1 for TV, large for KL
    if kind == "tv":
        assert d[0, 2].item() == pytest.approx(1.0)
    else:
        assert d[0, 2].item() > 50


@pytest.mark.parametrize("kind", ["tv", "kl"])
def test_topk_divergence_is_finite_at_probabilities_zero_and_one(kind):
    rows = [
        ([0.0, NEG_INF], [-1e4, NEG_INF]),  # mu puts all mass on the kept token, pi none
        ([-1e4, 0.0], [0.0, -1e4]),
        ([0.0, -1e4], [0.0, -1e4]),  # identical, p = 1
        ([NEG_INF, NEG_INF], [NEG_INF, NEG_INF]),  # every slot empty
        ([-1e4, -1e4], [-1e4, -1e4]),  # all mass in the rest bucket
        ([math.log(0.5), math.log(0.5)], [-1e4, NEG_INF]),
    ]
    sampler = torch.tensor([r[0] for r in rows])
    trainer = torch.tensor([r[1] for r in rows])
    d = topk_divergence(sampler, trainer, kind)
    assert torch.isfinite(d).all()
    assert (d >= 0).all()
    assert d[2].item() == 0 and d[3].item() == 0 and d[4].item() == 0


def test_probabilities_near_one_keep_their_digits():
    """float32 log-probs of 1 - 3e-7 and 1 - 1e-7 differ by 2e-7 in probability; the divergences resolve that (the
    arithmetic runs in float64, which float32 arithmetic would get 10% wrong)."""
    log_mu, log_pi = torch.tensor([-3e-7]), torch.tensor([-1e-7])
    mu, pi = torch.exp(log_mu.double()), torch.exp(log_pi.double())
    tv = (mu - pi).abs()
    assert binary_divergence(log_mu, log_pi, "tv").item() == pytest.approx(tv.item(), rel=1e-5, abs=0)
    assert topk_divergence(log_mu[None], log_pi[None], "tv").item() == pytest.approx(tv.item(), rel=1e-5, abs=0)
    # binary KL with both sides within 1e-8 of 1 (KL ~2e-9) stays accurate to a relative 1e-6
    lm, lp = -1e-9, -3e-9
    rest_mu, rest_pi = -math.expm1(lm), -math.expm1(lp)
    expected = math.exp(lm) * (lm - lp) + rest_mu * math.log(rest_mu / rest_pi)
    kl = binary_divergence(torch.tensor([lm], dtype=torch.float64), torch.tensor([lp], dtype=torch.float64), "kl")
    assert kl.item() == pytest.approx(expected, rel=1e-6, abs=0)


@pytest.mark.parametrize("fn", [binary_divergence, topk_divergence])
@pytest.mark.parametrize("kind", ["tv", "kl"])
def test_mu_equal_pi_equal_one_gives_zero(fn, kind):
    one = torch.zeros(1, 1)
    assert fn(one, one, kind).abs().max().item() == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["tv", "kl"])
def test_half_precision_inputs_give_float32_equal_to_the_float32_computation(dtype, kind):
    gen = torch.Generator().manual_seed(6)
    log_mu, log_pi = random_distributions(gen, n=64, vocab=40, temperature=2.0, shift=0.5)
    kept_mu, kept_pi = log_mu[:, :21].to(dtype), log_pi[:, :21].to(dtype)

    binary = binary_divergence(kept_mu[:, 0], kept_pi[:, 0], kind)
    topk = topk_divergence(kept_mu, kept_pi, kind)
    assert binary.dtype == topk.dtype == torch.float32
    assert torch.equal(binary, binary_divergence(kept_mu[:, 0].float(), kept_pi[:, 0].float(), kind))
    assert torch.equal(topk, topk_divergence(kept_mu.float(), kept_pi.float(), kind))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["tv", "kl"])
def test_results_are_float32_whatever_the_input_dtype(dtype, kind):
    mu, pi = logp(0.2, 0.3).to(dtype), logp(0.25, 0.1).to(dtype)
    assert binary_divergence(mu, pi, kind).dtype == torch.float32
    assert topk_divergence(mu, pi, kind).dtype == torch.float32


@pytest.mark.parametrize("fn", [binary_divergence, topk_divergence])
@pytest.mark.parametrize("kind", ["TV", "js", "binary_tv", ""])
def test_unknown_kind_raises_value_error(fn, kind):
    with pytest.raises(ValueError, match="kind"):
        fn(logp(0.5), logp(0.4), kind)
