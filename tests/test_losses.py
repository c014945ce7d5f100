"""Specification of DPPO's per-token gradient weights and losses (`trl_dppo.losses`).

DPPO's gradient is  sum_t M_t * min(r_t, C) * A_t * grad log pi(y_t)  with r_t = pi / mu, M_t the trust-region mask and
C the ratio cap. The per-token loss is -M_t * min(r_t, C) * A_t in value, so its derivative with respect to log pi(y_t)
is -M_t * min(r_t, C) * A_t.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from trl_dppo.divergence import binary_divergence, topk_divergence, trust_region_mask
from trl_dppo.losses import LOG_RATIO_LIMIT, dppo_gradient_weights, dppo_per_token_loss, loss_from_weights
from trl_dppo.trust_regions import TRUST_REGIONS, TrustRegionInput


def logp(*probs: float) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float32).log()


def grad_wrt_trainer_logps(loss_fn, trainer_logps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, d sum(loss) / d log pi) with log pi a leaf tensor."""
    leaf = trainer_logps.detach().clone().requires_grad_(True)
    loss = loss_fn(leaf)
    (grad,) = torch.autograd.grad(loss.sum(), leaf)
    return loss.detach(), grad


def random_batch(seed: int, batch: int = 8, length: int = 64):
    gen = torch.Generator().manual_seed(seed)
    sampler = -torch.rand(batch, length, generator=gen) * 5
    trainer = (sampler + torch.randn(batch, length, generator=gen) * 0.6).clamp(max=0.0)
    advantages = torch.randn(batch, 1, generator=gen)
    return sampler, trainer, advantages


# --- Gradients ----------------------------------------------------------------------------------------------------


def test_masked_tokens_get_exactly_zero_gradient():
    sampler, trainer, advantages = random_batch(0)
    delta = 0.05
    _, grad = grad_wrt_trainer_logps(
        lambda lp: dppo_per_token_loss(lp, sampler, advantages, delta, delta, "tv", ratio_cap=10.0), trainer
    )
    keep = trust_region_mask(binary_divergence(sampler, trainer, "tv"), sampler, trainer, advantages, delta, delta)
    assert (~keep).sum() > 20 and keep.sum() > 20
    assert torch.equal(grad[~keep], torch.zeros_like(grad[~keep]))
    assert (grad[keep & (advantages != 0)] != 0).all()


def test_kept_token_gradient_is_minus_ratio_times_advantage_below_the_cap():
    """d loss / d log pi = -r * A for a kept token with r <= C."""
    sampler, trainer, advantages = random_batch(1)
    ratio_cap = 10.0
    _, grad = grad_wrt_trainer_logps(
        lambda lp: dppo_per_token_loss(lp, sampler, advantages, 1e9, 1e9, "kl", ratio_cap=ratio_cap), trainer
    )
    ratio = torch.exp(trainer - sampler)
    assert (ratio <= ratio_cap).all()  # delta = 1e9 keeps every token; the cap is not reached here
    torch.testing.assert_close(grad, -ratio * advantages)


def test_kept_token_gradient_is_minus_cap_times_advantage_above_the_cap():
    """A token whose ratio exceeds C gets d loss / d log pi = -C * A."""
    sampler = logp(1e-4, 1e-3, 0.2, 0.01)[None]
    trainer = logp(1e-2, 0.5, 0.3, 0.011)[None]  # r = 100, 500, 1.5, 1.1
    advantages = torch.tensor([[1.0, 2.0, -0.5, 3.0]])
    ratio_cap = 10.0
    # TV under 0.6 for every token, so all four stay inside the trust region
    _, grad = grad_wrt_trainer_logps(
        lambda lp: dppo_per_token_loss(lp, sampler, advantages, 0.6, 0.6, "tv", ratio_cap=ratio_cap), trainer
    )
    ratio = torch.exp(trainer - sampler)
    expected = -torch.where(ratio > ratio_cap, torch.full_like(ratio, ratio_cap), ratio) * advantages
    torch.testing.assert_close(grad, expected)
    torch.testing.assert_close(grad[0, :2], torch.tensor([-10.0, -20.0]))


def test_without_a_cap_the_gradient_is_minus_ratio_times_advantage_even_for_large_ratios():
    sampler = logp(1e-4, 1e-3)[None]
    trainer = logp(1e-2, 0.05)[None]  # r = 100, 50
    advantages = torch.tensor([[1.0, -2.0]])
    _, grad = grad_wrt_trainer_logps(
        lambda lp: dppo_per_token_loss(lp, sampler, advantages, 0.15, 0.15, "tv", ratio_cap=None), trainer
    )
    ratio = torch.exp(trainer - sampler)
    assert (ratio > 10).all()
    torch.testing.assert_close(grad, -ratio * advantages)


def test_loss_from_weights_has_value_minus_w_and_gradient_minus_w():
    gen = torch.Generator().manual_seed(2)
    trainer = -torch.rand(4, 16, generator=gen) * 3
    weights = torch.randn(4, 16, generator=gen)
    loss, grad = grad_wrt_trainer_logps(lambda lp: loss_from_weights(lp, weights), trainer)
    torch.testing.assert_close(loss, -weights)
    torch.testing.assert_close(grad, -weights)


def test_gradient_weights_carry_no_gradient():
    sampler, trainer, advantages = random_batch(3, 2, 8)
    leaf = trainer.clone().requires_grad_(True)
    keep = torch.ones_like(leaf, dtype=torch.bool)
    weights = dppo_gradient_weights(leaf, sampler, advantages, keep, ratio_cap=10.0)
    assert not weights.requires_grad


# --- Values -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["tv", "kl"])
@pytest.mark.parametrize("ratio_cap", [1.5, 10.0, None])
def test_per_token_loss_value_is_minus_mask_times_capped_ratio_times_advantage(kind, ratio_cap):
    sampler, trainer, advantages = random_batch(4)
    delta = 0.05 if kind == "tv" else 0.01
    loss = dppo_per_token_loss(trainer, sampler, advantages, delta, delta, kind, ratio_cap=ratio_cap)
    keep = trust_region_mask(binary_divergence(sampler, trainer, kind), sampler, trainer, advantages, delta, delta)
    ratio = torch.exp(trainer - sampler)
    capped = ratio if ratio_cap is None else ratio.clamp(max=ratio_cap)
    assert (~keep).any() and keep.any()
    torch.testing.assert_close(loss, -keep.float() * capped * advantages)


def test_gradient_weights_are_mask_times_capped_ratio_times_advantage():
    sampler, trainer, advantages = random_batch(5)
    gen = torch.Generator().manual_seed(5)
    keep = torch.rand(trainer.shape, generator=gen) > 0.3
    weights = dppo_gradient_weights(trainer, sampler, advantages, keep, ratio_cap=2.0)
    expected = keep.float() * torch.exp(trainer - sampler).clamp(max=2.0) * advantages
    torch.testing.assert_close(weights, expected)


# --- Extreme ratios and missing sampler probabilities ---------------------------------------------------------------


@pytest.mark.parametrize("log_ratio", [20.0, 60.0, 100.0])
def test_a_masked_token_weighs_exactly_zero_at_any_ratio(log_ratio):
    trainer = torch.tensor([[-1.0, -1.0]])
    sampler = trainer - log_ratio
    weights = dppo_gradient_weights(trainer, sampler, torch.tensor([[1.0]]), torch.tensor([[False, True]]))
    assert weights[0, 0].item() == 0.0 and torch.isfinite(weights).all()


@pytest.mark.parametrize("log_ratio", [20.0, 60.0, 100.0])
def test_a_kept_tokens_ratio_is_used_up_to_2_to_the_64_and_limited_there(log_ratio):
    """The uncapped weight is r * A; beyond 2**64 (log-ratio 44.4) it is 2**64 * A."""
    trainer = torch.tensor([[-0.5]])
    weights = dppo_gradient_weights(trainer, trainer - log_ratio, torch.tensor([[-2.0]]), torch.tensor([[True]]))
    expected = -2.0 * min(math.exp(log_ratio), 2.0**64)
    assert torch.isfinite(weights).all() and weights.item() == pytest.approx(expected, rel=1e-6)
    assert LOG_RATIO_LIMIT == pytest.approx(64 * math.log(2))


@pytest.mark.parametrize("sampler_logp", [-math.inf, math.nan])
def test_a_token_without_a_sampler_probability_weighs_zero(sampler_logp):
    trainer = torch.tensor([[-0.5, -0.5]])
    sampler = torch.tensor([[sampler_logp, -0.7]])
    keep = torch.ones(1, 2, dtype=torch.bool)
    weights = dppo_gradient_weights(trainer, sampler, torch.tensor([[1.0]]), keep)
    assert weights[0, 0].item() == 0.0 and weights[0, 1].item() == pytest.approx(math.exp(0.2), rel=1e-6)


@pytest.mark.parametrize("method", TRUST_REGIONS)
def test_every_method_gives_finite_weights_and_gradients_through_a_model_at_extreme_ratios(method):
    """Log-ratios of 0, 20, 60 and 100 on both advantage signs, and sampler log-probs of -inf and NaN, pushed through
    a model's backward pass in float32: every weight and every parameter gradient is finite."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, 64, (2, 7))
    logps = torch.log_softmax(model(ids).logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    shifts = torch.tensor([[0.0, 20.0, 60.0, 100.0, 20.0, 0.0], [60.0, 100.0, 0.0, 20.0, 0.0, 0.0]])
    sampler = logps.detach() - shifts
    sampler[0, 4], sampler[1, 5] = -math.inf, math.nan
    advantages = torch.tensor([[1.0], [-1.0]])
    batch = TrustRegionInput(
        trainer_logps=logps.detach(),
        sampler_logps=sampler,
        base_logps=sampler,
        advantages=advantages,
        divergence=binary_divergence(sampler, logps.detach(), "tv"),
        anchor_logps=logps.detach(),
        loss_mask=torch.ones_like(logps, dtype=torch.bool),  # one completion per row, as the trainers pass it
    )
    shared = dict(delta_low=0.15, delta_high=0.15, epsilon_low=0.2, epsilon_high=0.28)
    trust_region = TRUST_REGIONS[method]
    weights, _ = trust_region(batch, **trust_region.resolve_settings({}, shared))
    assert torch.isfinite(weights).all()
    assert weights[0, 4].item() == weights[1, 5].item() == 0.0
    loss_from_weights(logps, weights).mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


# --- Choice of divergence -----------------------------------------------------------------------------------------


def test_explicit_divergence_replaces_the_binary_default():
    """Two likely tokens swap while the sampled third token barely moves: binary TV keeps it, a top-K divergence
    passed as `divergence=` exceeds delta, and the token is masked (zero loss, zero gradient)."""
    kept_mu, kept_pi = logp(0.45, 0.45, 0.10), logp(0.249, 0.65, 0.101)
    sampler, trainer = kept_mu[2].view(1, 1), kept_pi[2].view(1, 1)
    advantages = torch.tensor([[1.0]])
    delta = 0.15
    topk = topk_divergence(kept_mu, kept_pi, "tv").view(1, 1)
    assert binary_divergence(sampler, trainer, "tv").item() < delta < topk.item()

    loss_binary, grad_binary = grad_wrt_trainer_logps(
        lambda lp: dppo_per_token_loss(lp, sampler, advantages, delta, delta, "tv", ratio_cap=10.0), trainer
    )
    loss_topk, grad_topk = grad_wrt_trainer_logps(
        lambda lp: dppo_per_token_loss(lp, sampler, advantages, delta, delta, "tv", ratio_cap=10.0, divergence=topk),
        trainer,
    )
    assert grad_binary.item() == pytest.approx(-1.01, rel=1e-5)
    assert loss_topk.item() == 0 and grad_topk.item() == 0


def test_kind_selects_the_binary_divergence():
    """mu = 0.5 -> pi = 0.6, A > 0: TV 0.1 and binary KL ~0.0204; delta = 0.05 blocks under TV but not under KL."""
    sampler, trainer = logp(0.5)[None], logp(0.6)[None]
    advantages = torch.tensor([[1.0]])
    loss_tv = dppo_per_token_loss(trainer, sampler, advantages, 0.05, 0.05, "tv")
    loss_kl = dppo_per_token_loss(trainer, sampler, advantages, 0.05, 0.05, "kl")
    assert loss_tv.item() == 0
    assert loss_kl.item() == pytest.approx(-1.2, rel=1e-5)


# --- Shapes -------------------------------------------------------------------------------------------------------


def test_sequence_advantages_broadcast_against_tokens():
    """(B, 1) advantages give the same loss and gradient as the same advantages repeated to (B, T)."""
    sampler, trainer, advantages = random_batch(6, batch=4, length=32)
    per_seq = advantages
    per_token = advantages.expand(-1, 32).contiguous()
    out = {}
    for name, adv in (("seq", per_seq), ("tok", per_token)):
        out[name] = grad_wrt_trainer_logps(
            lambda lp, adv=adv: dppo_per_token_loss(lp, sampler, adv, 0.05, 0.05, "tv", ratio_cap=3.0), trainer
        )
    assert out["seq"][0].shape == (4, 32)
    assert torch.equal(out["seq"][0], out["tok"][0])
    assert torch.equal(out["seq"][1], out["tok"][1])


def test_per_sequence_advantage_signs_pick_the_blocked_direction():
    """In one (B, T) batch, the A > 0 row blocks its upward moves and the A < 0 row its downward ones."""
    sampler = logp(0.5, 0.5, 0.5, 0.5).view(2, 2)
    trainer = logp(0.9, 0.1, 0.9, 0.1).view(2, 2)
    advantages = torch.tensor([[1.0], [-1.0]])
    _, grad = grad_wrt_trainer_logps(
        lambda lp: dppo_per_token_loss(lp, sampler, advantages, 0.15, 0.15, "tv", ratio_cap=10.0), trainer
    )
    assert (grad == 0).tolist() == [[True, False], [False, True]]
    torch.testing.assert_close(grad[0, 1], torch.tensor(-0.2))
    torch.testing.assert_close(grad[1, 0], torch.tensor(1.8))


def test_half_precision_trainer_logps_keep_their_dtype_and_gradient():
    sampler, trainer, advantages = random_batch(7, 2, 16)
    leaf = trainer.to(torch.bfloat16).requires_grad_(True)
    loss = dppo_per_token_loss(leaf, sampler, advantages, 1e9, 1e9, "tv", ratio_cap=10.0)
    loss.sum().backward()
    assert leaf.grad is not None and leaf.grad.dtype == torch.bfloat16
    assert torch.isfinite(leaf.grad).all()
    expected = -torch.exp(leaf.detach().float() - sampler).clamp(max=10.0) * advantages
    torch.testing.assert_close(leaf.grad.float(), expected, rtol=2e-2, atol=1e-2)
