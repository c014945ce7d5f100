"""Per-token policy-gradient weights and losses in the unified form of the DPPO paper (its template U1).

Every method on the paper's ladder has the gradient  sum_t w_t * grad log pi(y_t | s_t)  with a per-token weight
w_t computed without gradient; for DPPO, w_t = M_t * min(r_t, C) * A_t with r_t = pi / mu. Writing the loss as
`-w_t * exp(log pi - sg(log pi))` gives that gradient with the value -w_t, so the weights can also be handed to any
trainer that accepts per-token advantages (this is how `DPPOTrainer` reuses GRPOTrainer's loss normalisation).
"""

from __future__ import annotations

import torch

from .divergence import binary_divergence, trust_region_mask


__all__ = [
    "TRUST_REGIONS",
    "dppo_gradient_weights",
    "dppo_per_token_loss",
    "drpo_gradient_weights",
    "loss_from_weights",
    "negative_update_keep",
    "ratio_clip_keep",
    "trust_region_weights",
]

# The paper's ladder (template U1: w_t = M_t * min(r_t, C) * A_t) plus DRPO's smooth trust region:
#   pg_is          M = 1, no cap                          (no trust region)
#   cispo          M = 1, cap C                           (truncated importance sampling, PG-TIS)
#   grpo           M = PPO's clip of r = pi/mu            (epsilon, epsilon_high)
#   minirl         M = PPO's clip of pi/pi_old            (pi_old recomputed by the trainer: the one mode that recomputes)
#   negative_mask  M = 0 iff A < 0 and mu - pi >= 0.5     (the paper's RQ3 minimal mask)
#   dppo           M = DPPO's divergence mask, cap C
#   drpo           w = r * A * (1 - sign(A) * (pi - mu) / delta)
#   mask_drpo      DPPO's weight inside the trust region, DRPO's outside
TRUST_REGIONS = ("dppo", "drpo", "mask_drpo", "grpo", "minirl", "pg_is", "cispo", "negative_mask")


@torch.no_grad()
def dppo_gradient_weights(
    trainer_logps: torch.Tensor,
    sampler_logps: torch.Tensor,
    advantages: torch.Tensor,
    keep: torch.Tensor,
    ratio_cap: float | None = None,
) -> torch.Tensor:
    """w_t = M_t * min(r_t, C) * A_t, the weight of grad log pi(y_t) in DPPO's gradient.

    Args:
        trainer_logps: log pi of the sampled tokens, `(B, T)`.
        sampler_logps: log mu of the same tokens, `(B, T)`.
        advantages: `(B, 1)` or `(B, T)`.
        keep: the trust-region mask M_t (see `trust_region_mask`).
        ratio_cap: C, or None for no cap.
    """
    ratio = torch.exp(trainer_logps.float() - sampler_logps.float())
    if ratio_cap is not None:
        ratio = ratio.clamp(max=ratio_cap)
    return keep.float() * ratio * advantages.float()


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
    negative beyond it, pulling pi back. With `base_logps` (log mu before truncation, see `trust_region_weights`) the
    move pi - mu is measured from it; the ratio r keeps `sampler_logps`.
    """
    ratio = torch.exp(trainer_logps.float() - sampler_logps.float())
    base = sampler_logps if base_logps is None else base_logps
    shift = trainer_logps.float().exp() - base.float().exp()
    return ratio * advantages.float() * (1 - torch.sign(advantages.float()) * shift / delta)


@torch.no_grad()
def trust_region_weights(
    method: str,
    trainer_logps: torch.Tensor,
    sampler_logps: torch.Tensor,
    advantages: torch.Tensor,
    divergence: torch.Tensor,
    delta_low: float,
    delta_high: float,
    ratio_cap: float | None = None,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    anchor_logps: torch.Tensor | None = None,
    negative_threshold: float = 0.5,
    base_logps: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token weight w_t of grad log pi and the mask M_t for one of `TRUST_REGIONS`.

    `divergence` is DPPO's estimate D_t (used by dppo and mask_drpo); `anchor_logps` is the recomputed pi_old that
    minirl clips against. `base_logps` is log mu_base, the sampler's distribution before truncation or penalties
    (the one pi is comparable with): the masks test the direction and size of pi's move against it, while the ratio
    pi/mu keeps `sampler_logps`, the distribution the token was drawn from. Defaults to `sampler_logps`.
    Returns `(weights, keep)`; `keep` is True where no mask blocks the token (for drpo, where the token is inside the
    trust region: its weight is then positive).
    """
    if method not in TRUST_REGIONS:
        raise ValueError(f"method must be one of {TRUST_REGIONS}, got {method!r}.")
    base = sampler_logps if base_logps is None else base_logps
    ratio = torch.exp(trainer_logps.float() - sampler_logps.float())
    everything = torch.ones_like(ratio, dtype=torch.bool)
    if method == "pg_is":
        return dppo_gradient_weights(trainer_logps, sampler_logps, advantages, everything), everything
    if method == "cispo":
        return dppo_gradient_weights(trainer_logps, sampler_logps, advantages, everything, ratio_cap), everything
    if method == "grpo":
        keep = ratio_clip_keep(ratio, advantages, eps_low, eps_high)
        return dppo_gradient_weights(trainer_logps, sampler_logps, advantages, keep), keep
    if method == "minirl":
        if anchor_logps is None:
            raise ValueError("minirl clips against recomputed log-probabilities: pass anchor_logps.")
        keep = ratio_clip_keep(torch.exp(trainer_logps.float() - anchor_logps.float()), advantages, eps_low, eps_high)
        return dppo_gradient_weights(trainer_logps, sampler_logps, advantages, keep), keep
    if method == "negative_mask":
        keep = negative_update_keep(trainer_logps, base, advantages, negative_threshold)
        return dppo_gradient_weights(trainer_logps, sampler_logps, advantages, keep), keep
    keep = trust_region_mask(divergence, base, trainer_logps, advantages, delta_low, delta_high)
    if method == "dppo":
        return dppo_gradient_weights(trainer_logps, sampler_logps, advantages, keep, ratio_cap), keep
    delta = torch.where(advantages > 0, delta_high, delta_low)
    drpo = drpo_gradient_weights(trainer_logps, sampler_logps, advantages, delta, base_logps)
    if method == "drpo":
        inside = (trainer_logps.exp() - base.exp()).abs() <= delta
        return drpo, inside | (torch.sign(advantages) * (trainer_logps - base) <= 0)
    dppo = dppo_gradient_weights(trainer_logps, sampler_logps, advantages, keep, ratio_cap)
    return torch.where(keep, dppo, drpo), keep


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
