"""Per-token policy-gradient weights and losses in the unified form of the DPPO paper (its template U1).

Every method on the paper's ladder has the gradient  sum_t w_t * grad log pi(y_t | s_t)  with a per-token weight
w_t computed without gradient; for DPPO, w_t = M_t * min(r_t, C) * A_t with r_t = pi / mu. Writing the loss as
`-w_t * exp(log pi - sg(log pi))` gives that gradient with the value -w_t, so the weights can also be handed to any
trainer that accepts per-token advantages (this is how `DPPOTrainer` reuses GRPOTrainer's loss normalisation).
"""

from __future__ import annotations

import torch

from .divergence import binary_divergence, trust_region_mask

__all__ = ["dppo_gradient_weights", "dppo_per_token_loss", "loss_from_weights"]


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
