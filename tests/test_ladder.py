"""The paper's ladder and DRPO in one trainer: each method's per-token gradient on hand-computed cases."""

from __future__ import annotations

import json
import math

import pytest
import torch

from trl_dppo.divergence import binary_divergence
from trl_dppo.losses import TRUST_REGIONS, drpo_gradient_weights, loss_from_weights, trust_region_weights

from .conftest import PolicyForwardCounter, make_trainer


def grad_of(method, pi, mu, advantage, delta=0.15, ratio_cap=3.0, anchor=None, eps=(0.2, 0.28)):
    """d(loss)/d(log pi) for one token: -w, with w the method's weight of grad log pi."""
    trainer_logps = torch.tensor([math.log(pi)], requires_grad=True)
    sampler_logps = torch.tensor([math.log(mu)])
    advantages = torch.tensor([advantage])
    divergence = binary_divergence(sampler_logps, trainer_logps.detach(), "tv")
    weights, keep = trust_region_weights(
        method,
        trainer_logps.detach(),
        sampler_logps,
        advantages,
        divergence,
        delta,
        delta,
        ratio_cap=ratio_cap,
        eps_low=eps[0],
        eps_high=eps[1],
        anchor_logps=None if anchor is None else torch.tensor([math.log(anchor)]),
    )
    loss_from_weights(trainer_logps, weights).sum().backward()
    return trainer_logps.grad.item(), bool(keep.item())


def test_pg_is_weights_every_token_by_the_full_ratio():
    assert grad_of("pg_is", pi=0.5, mu=0.01, advantage=1.0)[0] == pytest.approx(-50.0)


def test_cispo_truncates_the_ratio_but_never_blocks():
    assert grad_of("cispo", pi=0.5, mu=0.01, advantage=1.0, ratio_cap=3.0)[0] == pytest.approx(-3.0)
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
    assert grad_of("dppo", pi=0.01, mu=1e-4, advantage=1.0, ratio_cap=None)[0] == pytest.approx(-100.0)


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


def test_unknown_method_is_rejected():
    with pytest.raises(ValueError, match="method"):
        trust_region_weights("ppo", *(torch.zeros(1),) * 4, 0.1, 0.1)


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
    assert (counter.count > 0) == (method == "minirl")
    entry = next(e for e in trainer.state.log_history if "loss" in e)
    for key in (
        "diagnostics/bad_update_fraction",
        "diagnostics/bad_updates_blocked_by_ppo_clip",
        "diagnostics/bad_updates_blocked_by_dppo_mask",
        "trust_region/masked_fraction",
    ):
        assert math.isfinite(entry[key]), key
    report = json.loads((tmp_path / "out" / "masked_tokens.json").read_text())
    assert set(report) == {"positive", "negative"}
