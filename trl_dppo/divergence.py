"""Divergences between the sampler's and the trainer's next-token distributions, and DPPO's trust-region mask.

Pure tensor functions with no trainer state, for use in any training loop. Inputs are log-probabilities (any float
dtype); the arithmetic runs in float64 so that probabilities of exactly 0 or 1 (to the input's precision) give finite
results and `1 - sum(p)` keeps its digits, and results come back as float32.
"""

from __future__ import annotations

import torch


__all__ = ["DIVERGENCE_KINDS", "binary_divergence", "topk_divergence", "trust_region_mask"]

DIVERGENCE_KINDS = ("tv", "kl")

# Probabilities are floored here inside logarithms, so a KL whose trainer side reaches 0 is large but finite.
_TINY = torch.finfo(torch.float32).tiny


def _check_kind(kind: str) -> None:
    if kind not in DIVERGENCE_KINDS:
        raise ValueError(f"kind must be one of {DIVERGENCE_KINDS}, got {kind!r}.")


def _kl_terms(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """p * log(p / q) per outcome, 0 where p = 0, finite where q = 0."""
    return torch.xlogy(p, p) - torch.xlogy(p, q.clamp_min(_TINY))


def binary_divergence(sampler_logps: torch.Tensor, trainer_logps: torch.Tensor, kind: str = "tv") -> torch.Tensor:
    """Divergence between the two-outcome distributions {sampled token, everything else}, elementwise.

    Args:
        sampler_logps: log mu(y_t | s_t), the sampler's log-probability of each sampled token.
        trainer_logps: log pi(y_t | s_t), the trainer's log-probability of the same tokens.
        kind: `"tv"` for |mu - pi|, `"kl"` for KL(Bernoulli(mu) || Bernoulli(pi)).

    Returns:
        float32 tensor of the broadcast shape. A lower bound of the full-vocabulary divergence.
    """
    _check_kind(kind)
    # A log-probability a hair above 0 (rounding) would make 1 - p negative
    log_mu, log_pi = sampler_logps.double().clamp(max=0.0), trainer_logps.double().clamp(max=0.0)
    mu, pi = log_mu.exp(), log_pi.exp()
    if kind == "tv":
        return (mu - pi).abs().float()
    # 1 - p from the log-probability keeps its precision when p is close to 1
    rest_mu, rest_pi = -torch.expm1(log_mu), -torch.expm1(log_pi)
    return (_kl_terms(mu, pi) + _kl_terms(rest_mu, rest_pi)).float()


def topk_divergence(sampler_logps: torch.Tensor, trainer_logps: torch.Tensor, kind: str = "tv") -> torch.Tensor:
    """Divergence over a kept set of tokens plus one bucket holding the rest of the vocabulary.

    Args:
        sampler_logps: `(..., K')` log-probabilities under the sampler of the kept tokens (the sampler's top-K plus
            the sampled token). A slot holding `-inf` in both inputs is empty and contributes nothing, so batches
            can pad kept sets of K and K + 1 tokens to one width.
        trainer_logps: `(..., K')` log-probabilities under the trainer of the same token ids.
        kind: `"tv"` or `"kl"` (KL(mu || pi)).

    Returns:
        float32 tensor of shape `(...)`. A lower bound of the full-vocabulary divergence, and at least the binary one
        when the sampled token is kept.
    """
    _check_kind(kind)
    mu, pi = sampler_logps.double().exp(), trainer_logps.double().exp()
    rest_mu = (1.0 - mu.sum(-1)).clamp_min(0.0)
    rest_pi = (1.0 - pi.sum(-1)).clamp_min(0.0)
    if kind == "tv":
        return (0.5 * ((mu - pi).abs().sum(-1) + (rest_mu - rest_pi).abs())).float()
    return (_kl_terms(mu, pi).sum(-1) + _kl_terms(rest_mu, rest_pi)).float()


def trust_region_mask(
    divergence: torch.Tensor,
    sampler_logps: torch.Tensor,
    trainer_logps: torch.Tensor,
    advantages: torch.Tensor,
    delta_low: float,
    delta_high: float,
) -> torch.Tensor:
    """DPPO's mask M_t: True where the token keeps its gradient.

    A token is blocked only when its update leaves the trust region further: A > 0, pi > mu and D > delta_high, or
    A < 0, pi < mu and D > delta_low. A move back toward mu is never blocked. `advantages` broadcasts against the
    per-token tensors (for example `(B, 1)` against `(B, T)`). Compute it without gradient: the mask is a constant.
    """
    moving_up = trainer_logps > sampler_logps
    moving_down = trainer_logps < sampler_logps
    blocked_pos = (advantages > 0) & moving_up & (divergence > delta_high)
    blocked_neg = (advantages < 0) & moving_down & (divergence > delta_low)
    return ~(blocked_pos | blocked_neg)
