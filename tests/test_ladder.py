"""The paper's ladder, DRPO and the paper's relaxed clip in one trainer: each method's per-token gradient on
hand-computed cases (`trl_dppo.trust_regions`)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from trl_dppo.divergence import binary_divergence
from trl_dppo.losses import drpo_gradient_weights, loss_from_weights
from trl_dppo.trust_regions import TRUST_REGIONS, TrustRegionInput, get_trust_region

from .conftest import PolicyForwardCounter, make_trainer


def log(*probs: float) -> torch.Tensor:
    return torch.tensor([math.log(p) for p in probs])


def weights_of(method, pi, mu, advantages, delta=0.15, anchor=None, eps=(0.2, 0.28), **kwargs):
    """(weights, keep) of a method on tokens with trainer probabilities `pi` and sampler probabilities `mu`; `kwargs`
    are the method's own settings (`trust_region_kwargs`), the rest take its defaults."""
    trainer_logps, sampler_logps = log(*pi), log(*mu)
    shared = dict(delta_low=delta, delta_high=delta, epsilon_low=eps[0], epsilon_high=eps[1])
    trust_region = get_trust_region(method)
    batch = TrustRegionInput(
        trainer_logps=trainer_logps,
        sampler_logps=sampler_logps,
        base_logps=sampler_logps,
        advantages=torch.tensor(advantages),
        divergence=binary_divergence(sampler_logps, trainer_logps, "tv"),
        anchor_logps=trainer_logps if anchor is None else log(*anchor),
    )
    return trust_region(batch, **trust_region.resolve_settings(kwargs, shared))


def grad_of(method, pi, mu, advantage, anchor=None, **settings):
    """d(loss)/d(log pi) for one token: -w, with w the method's weight of grad log pi."""
    weights, keep = weights_of(
        method, [pi], [mu], [advantage], anchor=None if anchor is None else [anchor], **settings
    )
    trainer_logps = log(pi).requires_grad_(True)
    loss_from_weights(trainer_logps, weights).sum().backward()
    return trainer_logps.grad.item(), bool(keep.item())


def test_pg_is_weights_every_token_by_the_full_ratio():
    assert grad_of("pg_is", pi=0.5, mu=0.01, advantage=1.0)[0] == pytest.approx(-50.0)


def test_cispo_truncates_the_ratio_at_the_papers_cap_of_3_but_never_blocks():
    assert grad_of("cispo", pi=0.5, mu=0.01, advantage=1.0)[0] == pytest.approx(-3.0)
    assert grad_of("cispo", pi=0.5, mu=0.01, advantage=1.0, ratio_cap=10.0)[0] == pytest.approx(-10.0)
    assert grad_of("cispo", pi=0.2, mu=0.4, advantage=-1.0)[0] == pytest.approx(0.5)


def test_grpo_clips_the_ratio_at_mu_with_clip_higher():
    assert grad_of("grpo", pi=0.13, mu=0.1, advantage=1.0) == (pytest.approx(0.0), False)  # r = 1.3 > 1.28
    assert grad_of("grpo", pi=0.12, mu=0.1, advantage=1.0)[0] == pytest.approx(-1.2)  # r = 1.2 passes
    assert grad_of("grpo", pi=0.07, mu=0.1, advantage=-1.0) == (pytest.approx(0.0), False)  # r = 0.7 < 0.8
    assert grad_of("grpo", pi=0.07, mu=0.1, advantage=1.0)[0] == pytest.approx(-0.7)  # back toward mu


def test_minirl_clips_at_the_recomputed_anchor_and_weights_by_pi_over_mu():
    # pi/anchor = 1.5 is clipped although pi/mu = 1.0
    assert grad_of("minirl", pi=0.3, mu=0.3, advantage=1.0, anchor=0.2) == (pytest.approx(0.0), False)
    # pi/anchor = 1.0 passes although pi/mu = 3: the weight is still pi/mu
    assert grad_of("minirl", pi=0.3, mu=0.1, advantage=1.0, anchor=0.3)[0] == pytest.approx(-3.0)


def test_negative_mask_blocks_only_large_drops_on_negative_advantage():
    assert grad_of("negative_mask", pi=0.3, mu=0.9, advantage=-1.0) == (pytest.approx(0.0), False)  # drop 0.6
    assert grad_of("negative_mask", pi=0.5, mu=0.9, advantage=-1.0)[1] is True  # drop 0.4
    assert grad_of("negative_mask", pi=0.01, mu=0.9, advantage=1.0)[1] is True  # positive advantage


def test_dppo_blocks_only_beyond_delta_and_moving_away():
    assert grad_of("dppo", pi=0.80, mu=0.99, advantage=-1.0) == (pytest.approx(0.0), False)
    assert grad_of("dppo", pi=0.01, mu=1e-4, advantage=1.0)[0] == pytest.approx(-100.0)  # no cap by default
    assert grad_of("dppo", pi=0.01, mu=1e-4, advantage=1.0, ratio_cap=10.0)[0] == pytest.approx(-10.0)


@pytest.mark.parametrize("mu,pi,advantage", [(0.5, 0.6, 1.0), (0.5, 0.4, -1.0), (0.3, 0.2, 1.0), (0.3, 0.45, -2.0)])
def test_drpo_weight_is_the_gradient_of_its_objective(mu, pi, advantage):
    """r A - (|A| / (2 delta)) mu (r - 1)^2 differentiated through log pi gives the closed-form weight."""
    delta = 0.15
    log_pi = torch.tensor(math.log(pi), requires_grad=True)
    ratio = torch.exp(log_pi - math.log(mu))
    objective = ratio * advantage - abs(advantage) / (2 * delta) * mu * (ratio - 1) ** 2
    objective.backward()
    weight = drpo_gradient_weights(
        torch.tensor(math.log(pi)), torch.tensor(math.log(mu)), torch.tensor(advantage), delta
    )
    assert log_pi.grad.item() == pytest.approx(weight.item(), rel=1e-5)


def test_drpo_attenuates_moving_away_amplifies_moving_back_and_stops_at_delta():
    delta, mu = 0.15, 0.5
    r = lambda pi: pi / mu  # noqa: E731
    away = -grad_of("drpo", pi=0.6, mu=mu, advantage=1.0, delta=delta)[0]
    assert away == pytest.approx(r(0.6) * (1 - 0.1 / delta))
    back = -grad_of("drpo", pi=0.4, mu=mu, advantage=1.0, delta=delta)[0]
    assert back == pytest.approx(r(0.4) * (1 + 0.1 / delta))
    assert grad_of("drpo", pi=mu + delta, mu=mu, advantage=1.0, delta=delta)[0] == pytest.approx(0.0, abs=1e-6)
    # beyond the boundary the gradient reverses: descending the loss lowers pi
    assert grad_of("drpo", pi=0.8, mu=mu, advantage=1.0, delta=delta)[0] > 0
    assert grad_of("drpo", pi=0.2, mu=mu, advantage=-1.0, delta=delta)[0] < 0


def test_mask_drpo_switches_from_dppo_to_drpo_at_the_boundary():
    delta, mu = 0.15, 0.5
    inside, kept = grad_of("mask_drpo", pi=mu + delta - 1e-3, mu=mu, advantage=1.0, delta=delta)
    assert kept and inside == pytest.approx(-(mu + delta - 1e-3) / mu)  # DPPO: -r A
    outside, kept = grad_of("mask_drpo", pi=mu + delta + 0.05, mu=mu, advantage=1.0, delta=delta)
    r = (mu + delta + 0.05) / mu
    assert not kept and outside == pytest.approx(-r * (1 - (delta + 0.05) / delta))  # DRPO: corrective


def test_relaxed_clip_is_grpos_clip_except_for_tokens_the_sampler_found_rare():
    """The paper's efficiency probe: epsilon -> infinity on both sides where mu < alpha (0.1), PPO's clip elsewhere."""
    assert grad_of("relaxed_clip", pi=0.1, mu=0.05, advantage=1.0) == (pytest.approx(-2.0), True)  # r = 2 > 1.28
    assert grad_of("relaxed_clip", pi=0.02, mu=0.05, advantage=-1.0) == (pytest.approx(0.4), True)  # r = 0.4 < 0.8
    assert grad_of("relaxed_clip", pi=0.4, mu=0.2, advantage=1.0) == (pytest.approx(0.0), False)  # mu >= alpha: grpo
    assert grad_of("relaxed_clip", pi=0.24, mu=0.2, advantage=1.0)[0] == pytest.approx(-1.2)  # r = 1.2 inside
    assert grad_of("relaxed_clip", pi=0.4, mu=0.2, advantage=1.0, alpha=0.25) == (pytest.approx(-2.0), True)


def test_relaxed_clip_gradient_on_a_batch_computed_by_hand():
    """Two tokens, A = +1, both with r = pi / mu = 2 > 1 + epsilon_high = 1.28: the one drawn with mu = 0.05 < alpha
    keeps its gradient -r A = -2 (and its weight r A = 2); the one drawn with mu = 0.3 >= alpha is clipped to 0."""
    weights, keep = weights_of("relaxed_clip", pi=[0.1, 0.6], mu=[0.05, 0.3], advantages=[1.0, 1.0], alpha=0.1)
    assert keep.tolist() == [True, False]
    torch.testing.assert_close(weights, torch.tensor([2.0, 0.0]))
    trainer_logps = log(0.1, 0.6).requires_grad_(True)
    loss_from_weights(trainer_logps, weights).sum().backward()
    torch.testing.assert_close(trainer_logps.grad, torch.tensor([-2.0, 0.0]))


def test_relaxed_clip_tests_rarity_on_the_untruncated_mu_base():
    """A token drawn at mu = 0.2 after top-p renormalisation, with mu_base = 0.05 before it, counts as rare."""
    sampled, base, pi = log(0.2), log(0.05), log(0.5)  # r = pi / mu = 2.5, outside the clip
    batch = TrustRegionInput(pi, sampled, base, torch.tensor([1.0]), torch.zeros(1), pi)
    weights, keep = get_trust_region("relaxed_clip")(batch, epsilon_low=0.2, epsilon_high=0.28, alpha=0.1)
    assert keep.item() and weights.item() == pytest.approx(2.5)  # the ratio keeps the mu sampled from


@pytest.mark.parametrize("method", TRUST_REGIONS)
def test_every_method_trains_in_the_trainer(method, tmp_path, tiny_model_dir, prompts, tokenizer):
    trainer = make_trainer(
        tmp_path,
        tiny_model_dir,
        prompts,
        tokenizer,
        trust_region=method,
        max_steps=1,
        steps_per_generation=2,
        gradient_accumulation_steps=1,
    )
    counter = PolicyForwardCounter(trainer)
    trainer.train()
    # minirl is the one method that recomputes (its anchor); the others use the sampler's record
    assert (counter.count > 0) == TRUST_REGIONS[method].recomputes_anchor
    entry = next(e for e in trainer.state.log_history if "loss" in e)
    for key in ("diagnostics/bad_update_fraction", "trust_region/masked_fraction"):
        assert math.isfinite(entry[key]), key
    for key in ("diagnostics/bad_updates_blocked_by_ppo_clip", "diagnostics/bad_updates_blocked_by_dppo_mask"):
        # shares of the bad updates: None, not 0, in a step without any (docs/metrics.md)
        if entry["diagnostics/bad_update_fraction"] == 0:
            assert entry[key] is None, key
        else:
            assert math.isfinite(entry[key]), key
    report = json.loads((tmp_path / "out" / "masked_tokens.json").read_text())
    assert set(report) == {"positive", "negative"}
