"""One trust-region step on tensors: the method's weights, the corrections stacked on them, and DPPO's own mask.

Both trainers call `trust_region_step` once per loss, with the `TrustRegionSetup` their config chose and the loss
batch as a `TrustRegionInput` (how each gathers it, and its divergence, is its own). Nothing here reads a trainer:
a loop of your own can build a `TrustRegionInput` and call it the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .corrections import Correction, CorrectionOutput, apply_corrections
from .divergence import trust_region_mask
from .trust_regions import TrustRegion, TrustRegionInput, dppo, get_trust_region


__all__ = ["TrustRegionSetup", "TrustRegionStep", "trust_region_step"]


@dataclass(frozen=True)
class TrustRegionSetup:
    """The trust region as a config chose it (`DPPOConfig` or `AsyncDPPOConfig`), read once (`from_args`)."""

    method: TrustRegion
    settings: dict[str, Any]  # the method's resolved settings
    corrections: list[tuple[Correction, dict[str, Any]]]  # stacked on the method's weights, in order
    kind: str  # of the divergence: "tv" or "kl"
    delta_low: float  # DPPO's thresholds, for DPPO's own mask whatever the method
    delta_high: float

    @classmethod
    def from_args(cls, args: Any) -> TrustRegionSetup:
        return cls(
            method=get_trust_region(args.trust_region),
            settings=args.trust_region_settings,
            corrections=args.trust_region_correction_settings,
            kind=args.divergence_kind,
            delta_low=args.delta_low,
            delta_high=args.delta_high,
        )


@dataclass(frozen=True)
class TrustRegionStep:
    """What one step gives, each shaped like the input's tokens."""

    weights: torch.Tensor  # the per-token weights w_t, after the corrections (not yet multiplied by the loss mask)
    keep: torch.Tensor  # False where the method's trust region blocks the token
    dppo_keep: torch.Tensor  # DPPO's own mask M_t, whatever the method (the diagnostics compare it with PPO's clip)
    corrections: dict[str, CorrectionOutput]  # each correction's output, by name


@torch.no_grad()
def trust_region_step(setup: TrustRegionSetup, x: TrustRegionInput) -> TrustRegionStep:
    """Run `setup`'s method on `x`, stack its corrections on the weights, and give DPPO's mask (the method's own keep
    when the method is DPPO at the setup's thresholds, which is the same tensor `trust_region_mask` computes)."""
    weights, keep = setup.method(x, **setup.settings)
    weights, corrections = apply_corrections(setup.corrections, x, weights)
    thresholds = setup.settings.get("delta_low"), setup.settings.get("delta_high")
    if setup.method.function is dppo and thresholds == (setup.delta_low, setup.delta_high):
        dppo_keep = keep
    else:
        dppo_keep = trust_region_mask(
            x.divergence, x.base_logps, x.trainer_logps, x.advantages, setup.delta_low, setup.delta_high
        )
    return TrustRegionStep(weights, keep, dppo_keep, corrections)
