"""Per-token policy-gradient weights and losses in the unified form of the DPPO paper (its template U1).

Every method on the paper's ladder has the gradient  sum_t w_t * grad log pi(y_t | s_t)  with a per-token weight
w_t computed without gradient; for DPPO, w_t = M_t * min(r_t, C) * A_t with r_t = pi / mu. Writing the loss as
`-w_t * exp(log pi - sg(log pi))` gives that gradient with the value -w_t, so the weights can also be handed to any
trainer that accepts per-token advantages (this is how `DPPOTrainer` reuses GRPOTrainer's loss normalisation).
The trust regions built from these pieces, one function per method, are in `trust_regions.py`.
"""

from __future__ import annotations

import math

import torch

from .divergence import binary_divergence, trust_region_mask


__all__ = [
    "LOG_RATIO_LIMIT",
    "dppo_gradient_weights",
    "dppo_per_token_loss",
    "drpo_gradient_weights",
    "importance_ratio",
    "loss_from_weights",
    "negative_update_keep",
    "ratio_clip_keep",
]


# The largest importance ratio a weight uses: 2**64. A ratio beyond float32's range (log-ratio above ~88.7) would make
# the weight inf, and 0 * inf = NaN on a masked token; 2**64 leaves the other half of float32's exponent range (up to
# 2**128) to the backward pass, which multiplies the weight by activations and sums over hidden sizes. No ratio of a
# sampler and a trainer that agree comes near it (a token mu gave 1e-19 that pi gives 1): the limit changes no weight
# the paper's uncapped U1 would give in practice, and the trainer counts the tokens it binds
# (`trust_region/ratio_limited_tokens`). Below it, ratios are float32 exactly as `exp(log pi - log mu)` gives them.
LOG_RATIO_LIMIT = 64 * math.log(2)


def importance_ratio(trainer_logps: torch.Tensor, sampler_logps: torch.Tensor) -> torch.Tensor:
    """r = pi / mu per token, float32, at most exp(`LOG_RATIO_LIMIT`) = 2**64; NaN where either log-prob is NaN.

    A sampler log-probability of -inf (mu = 0) gives the limit; the weights give such a token, which has no sampler
    probability, weight 0 (`dppo_gradient_weights`).
    """
    return torch.exp((trainer_logps.float() - sampler_logps.float()).clamp(max=LOG_RATIO_LIMIT))


def _weights(ratio: torch.Tensor, advantages: torch.Tensor, sampler_logps: torch.Tensor, keep: torch.Tensor):
    """ratio * A on kept tokens with a sampler probability, exactly 0 elsewhere (never 0 * inf)."""
    usable = keep & torch.isfinite(sampler_logps)
    return torch.where(usable, ratio * advantages.float(), 0.0)


@torch.no_grad()
def dppo_gradient_weights(
    trainer_logps: torch.Tensor,
    sampler_logps: torch.Tensor,
    advantages: torch.Tensor,
    keep: torch.Tensor,
    ratio_cap: float | None = None,
) -> torch.Tensor:
    """w_t = M_t * min(r_t, C) * A_t, the weight of grad log pi(y_t) in DPPO's gradient (the paper's U1).

    Finite for any finite advantage: a blocked token (M_t = 0) and a token without a sampler probability (log mu =
    -inf or NaN) weigh exactly 0 whatever the ratio, and the ratio is limited to 2**64 (`importance_ratio`). The result
    is float32.

    Args:
        trainer_logps: log pi of the sampled tokens, `(B, T)`.
        sampler_logps: log mu of the same tokens, `(B, T)`.
        advantages: `(B, 1)` or `(B, T)`.
        keep: the trust-region mask M_t (see `trust_region_mask`).
        ratio_cap: C, or None for no cap (the paper's DPPO: C = infinity).
    """
    ratio = importance_ratio(trainer_logps, sampler_logps)
    if ratio_cap is not None:
        ratio = ratio.clamp(max=ratio_cap)
    return _weights(ratio, advantages, sampler_logps, keep)


def ratio_clip_keep(ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float) -> torch.Tensor:
    """PPO's clip as a mask: min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) has zero gradient exactly where False."""
    blocked = ((advantages > 0) & (ratio > 1 + eps_high)) | ((advantages < 0) & (ratio < 1 - eps_low))
    return ~blocked


def negative_update_keep(
    trainer_logps: torch.Tensor, sampler_logps: torch.Tensor, advantages: torch.Tensor, threshold: float = 0.5
) -> torch.Tensor:
    """The paper's RQ3 minimal mask: block only when A < 0 and mu - pi >= threshold (a large negative update)."""
    drop = sampler_logps.exp() - trainer_logps.exp()
    return ~((advantages < 0) & (drop >= threshold))


@torch.no_grad()
def drpo_gradient_weights(
    trainer_logps: torch.Tensor,
    sampler_logps: torch.Tensor,
    advantages: torch.Tensor,
    delta: float | torch.Tensor,
    base_logps: torch.Tensor | None = None,
) -> torch.Tensor:
    """DRPO's weight of grad log pi: the per-token objective r A - (|A| / (2 delta)) mu (r - 1)^2 differentiates to

        r A (1 - sign(A) (pi - mu) / delta),

    that is r A (1 - D / delta) when pi moves away from mu in the direction A pushes and r A (1 + D / delta) when it
    moves back, with D = |pi - mu|; zero at D = delta (the stationary point is DPPO's binary-TV boundary) and
    negative beyond it, pulling pi back. With `base_logps` (log mu_base, the sampler's distribution before truncation
    or penalties, see `trust_regions.TrustRegionInput`) the move pi - mu is measured from it; the ratio r keeps
    `sampler_logps`.
    """
    ratio = importance_ratio(trainer_logps, sampler_logps)
    base = sampler_logps if base_logps is None else base_logps
    shift = trainer_logps.float().exp() - base.float().exp()
    factor = 1 - torch.sign(advantages.float()) * shift / delta
    return _weights(ratio * factor, advantages, sampler_logps, torch.ones_like(ratio, dtype=torch.bool))


def loss_from_weights(trainer_logps: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Per-token loss with value -w_t and gradient -w_t * grad log pi(y_t)."""
    return -weights.detach() * torch.exp(trainer_logps - trainer_logps.detach())


def dppo_per_token_loss(
    trainer_logps: torch.Tensor,
    sampler_logps: torch.Tensor,
    advantages: torch.Tensor,
    delta_low: float,
    delta_high: float,
    kind: str = "tv",
    ratio_cap: float | None = None,
    divergence: torch.Tensor | None = None,
) -> torch.Tensor:
    """DPPO's per-token loss -M_t * min(r_t, C) * A_t, for your own training loop.

    The divergence defaults to the binary one of `kind`; pass `divergence` (for example a `topk_divergence`) to use
    another estimate. Reduce the result over tokens the way your loop normalises losses.
    """
    with torch.no_grad():
        if divergence is None:
            divergence = binary_divergence(sampler_logps, trainer_logps, kind)
        keep = trust_region_mask(divergence, sampler_logps, trainer_logps, advantages, delta_low, delta_high)
    weights = dppo_gradient_weights(trainer_logps, sampler_logps, advantages, keep, ratio_cap)
    return loss_from_weights(trainer_logps, weights)
