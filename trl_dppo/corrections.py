"""Off-policy corrections that stack on any trust region: IcePop's token mask, sequence masks, truncated importance
weights and a KL penalty to the sampler, one registered function each.

A correction is a pure function of the loss batch (`TrustRegionInput`, the same one the trust region saw) and of the
per-token weights the trust region (and the corrections before it) gave; it returns the new weights and what it did
(`CorrectionOutput`), which the trainers log as `corrections/<name>/*`. `DPPOConfig(trust_region_corrections=[...],
trust_region_corrections_kwargs={name: {...}})` picks them, in both trainers alike.

Stacking order. The corrections apply in the order of `CORRECTIONS` (registration order), whatever the order they
are listed in, those that add a loss term last: first the masks and the truncation, which multiply the weight by a
factor in [0, 1] (so their order among themselves changes nothing), then the KL penalty, which adds a term of its
own, so that no mask or truncation removes it (prime-rl applies it on every loss token, masked or not).

In the equations r = pi / mu (mu the distribution the token was drawn from, as in the trust regions' ratio), w the
weight so far, and a sequence one completion (one row of the batch; `TrustRegionInput.loss_mask` says which tokens
are in the loss).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from .losses import LOG_RATIO_LIMIT
from .registry import Registered
from .trust_regions import TrustRegionInput


__all__ = [
    "CORRECTIONS",
    "Correction",
    "CorrectionOutput",
    "apply_corrections",
    "get_correction",
    "register_correction",
    "resolve_corrections",
]


@dataclass(frozen=True)
class CorrectionOutput:
    """A correction's result: the new per-token weights, and what it did, for its metrics."""

    weights: torch.Tensor
    # Loss tokens whose weight it removed or reduced (`corrections/<name>/token_fraction`, and `sequence_fraction`
    # the completions with any); None for a correction that removes nothing
    affected: torch.Tensor | None = None
    # The per-token value of a loss term it adds (`corrections/<name>/penalty_mean`); None if it adds none
    penalty: torch.Tensor | None = None


CorrectionFunction = Callable[..., CorrectionOutput]


@dataclass(frozen=True)
class Correction(Registered):
    """A registered correction, and what it requires."""

    kind: ClassVar[str] = "correction"
    inputs: ClassVar[tuple[str, ...]] = ("the TrustRegionInput", "the weights")
    settings_need_defaults: ClassVar[bool] = True

    caps_ratio: bool = False  # it truncates the ratio: refused on a trust region that caps it already
    needs_sequences: bool = False  # it reads whole completions (`TrustRegionInput.loss_mask`)
    adds_term: bool = False  # it adds a loss term (stacked after every factor) rather than removing weight

    @property
    def metrics(self) -> tuple[str, ...]:
        """What it logs, as `corrections/<name>/<metric>`."""
        return ("penalty_mean",) if self.adds_term else ("token_fraction", "sequence_fraction")

    def resolve_settings(self, kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
        """`kwargs` (the user's settings for this correction) over the function's defaults; raises on an unknown key."""
        given_in = f"trust_region_corrections_kwargs[{self.name!r}]"
        return self._resolve(kwargs, given_in, f"the correction {self.name!r}")


# name -> correction, in the order they stack
CORRECTIONS: dict[str, Correction] = {}


def register_correction(
    name: str,
    *,
    equation: str,
    source: str,
    caps_ratio: bool = False,
    needs_sequences: bool = False,
    adds_term: bool = False,
    check_settings: Callable[..., None] | None = None,
) -> Callable[[CorrectionFunction], CorrectionFunction]:
    """Register `fn(x: TrustRegionInput, weights, *, <settings with defaults>) -> CorrectionOutput` as a correction.

    Corrections stack in registration order, except that those adding a loss term (`adds_term`) come after every one
    that scales the weight, so that no mask or truncation removes the term."""
    fields = dict(equation=equation, source=source, caps_ratio=caps_ratio, needs_sequences=needs_sequences)
    return lambda fn: Correction.register(
        CORRECTIONS, name, fn, adds_term=adds_term, check_settings=check_settings, **fields
    )


def get_correction(name: str) -> Correction:
    if name not in CORRECTIONS:
        raise ValueError(
            f"trust_region_corrections has {name!r}, which is not a correction: they are {', '.join(CORRECTIONS)}."
        )
    return CORRECTIONS[name]


def resolve_corrections(
    names: Sequence[str],
    kwargs: Mapping[str, Mapping[str, Any]] | None,
    trust_region: str,
    trust_region_settings: Mapping[str, Any],
) -> list[tuple[Correction, dict[str, Any]]]:
    """The corrections `names` with their settings, in stacking order. Refuses an unknown or repeated name, settings
    for a correction not chosen, and a combination that contradicts itself: a ratio cap stacked on a trust region
    that caps the ratio already."""
    names = list(names)
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"trust_region_corrections lists {repeated} more than once; list each correction once.")
    chosen = [get_correction(name) for name in names]
    kwargs = dict(kwargs or {})
    orphans = sorted(set(kwargs) - set(names))
    if orphans:
        raise ValueError(
            f"trust_region_corrections_kwargs has settings for {orphans}, which trust_region_corrections does not "
            f"list ({names}): add them there or drop their settings."
        )
    cap = trust_region_settings.get("ratio_cap")
    for correction in chosen:
        if correction.caps_ratio and cap is not None:
            fix = (
                "use trust_region='pg_is' (cispo without its cap) with the correction, or trust_region='cispo' without it"
                if trust_region == "cispo"
                else f"drop ratio_cap from trust_region_kwargs, or drop the correction {correction.name!r}"
            )
            raise ValueError(
                f"The correction {correction.name!r} truncates the importance ratio, and trust_region={trust_region!r} "
                f"already caps it (ratio_cap={cap}): two caps on one ratio, the lower one silently wins. To cap once, "
                f"{fix}."
            )
    order = list(CORRECTIONS)
    chosen.sort(key=lambda correction: (correction.adds_term, order.index(correction.name)))
    return [(correction, correction.resolve_settings(kwargs.get(correction.name))) for correction in chosen]


def apply_corrections(
    corrections: Sequence[tuple[Correction, Mapping[str, Any]]], x: TrustRegionInput, weights: torch.Tensor
) -> tuple[torch.Tensor, dict[str, CorrectionOutput]]:
    """Stack `corrections` (from `resolve_corrections`) on the trust region's `weights`; returns the final weights
    and each correction's output, by name."""
    outputs = {}
    for correction, settings in corrections:
        output = correction(x, weights, **settings)
        weights = output.weights
        outputs[correction.name] = output
    return weights, outputs


def _log_ratio(x: TrustRegionInput) -> torch.Tensor:
    """log r = log pi - log mu per token, float64, within +-`LOG_RATIO_LIMIT` as the weights' ratio (finite where mu
    is 0); 0 on tokens outside the loss, which hold mu = pi."""
    log_ratio = x.trainer_logps.double() - x.sampler_logps.double()
    return log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)


def _sequence_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The mean of `values` over each row's loss tokens, `(B, 1)` (0 for a row without any)."""
    return torch.where(mask, values, 0.0).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)


def _check_interval(low: str, high: str) -> Callable[..., None]:
    def check(**settings: Any) -> None:
        if not 0 <= settings[low] < 1 < settings[high]:
            raise ValueError(
                f"{low} and {high} bound the ratio around 1: need 0 <= {low} < 1 < {high}, got "
                f"{low}={settings[low]}, {high}={settings[high]}."
            )

    return check


def _check_at_least(setting: str, minimum: float) -> Callable[..., None]:
    def check(**settings: Any) -> None:
        if not settings[setting] >= minimum:
            raise ValueError(f"{setting} must be >= {minimum}, got {settings[setting]}.")

    return check


# --- Masks and truncation (a factor in [0, 1] of the weight) -------------------------------------------------------


@register_correction(
    "icepop",
    equation="w = 0 where r < low or r > high",
    source="IcePop: Ling Team, Ring-1T report (arXiv 2510.18855); verl rollout_rs='token', OpenRLHF "
    "is_correction_type='icepop'",
    check_settings=_check_interval("low", "high"),
)
def icepop(x: TrustRegionInput, weights: torch.Tensor, *, low: float = 0.5, high: float = 5.0) -> CorrectionOutput:
    """IcePop's token mask: a token whose ratio pi / mu left [low, high] (the report's alpha = 0.5, beta = 5) loses its
    gradient, on either side and whatever the sign of A. Unlike PPO's clip it does not look at the direction of the
    update: a token the two engines disagree on that much is noise either way."""
    log_ratio = _log_ratio(x)
    outside = (log_ratio < torch.log(torch.tensor(low, dtype=torch.float64))) | (
        log_ratio > torch.log(torch.tensor(high, dtype=torch.float64))
    )
    return CorrectionOutput(torch.where(outside, 0.0, weights), affected=outside)


@register_correction(
    "geometric_sequence_mask",
    equation="w = 0 on every token of a completion whose exp(mean_t log r_t) < low or > high",
    source="verl rollout_rs='geometric' (docs/algo/rollout_corr.md, geo_rs)",
    needs_sequences=True,
    check_settings=_check_interval("low", "high"),
)
def geometric_sequence_mask(
    x: TrustRegionInput, weights: torch.Tensor, *, low: float = 0.99, high: float = 1.01
) -> CorrectionOutput:
    """A sequence-level mask on the geometric-mean ratio: a completion whose per-token ratios average (in log space)
    outside [log low, log high] is dropped whole. Unlike the product of ratios it does not grow with length; verl's
    preset is [0.999, 1.001] against a recomputed pi_old, the default here is [0.99, 1.01] against the sampler (a
    gap of 1% per token). A bf16 sampler's rounding alone can leave it on short completions: on the ladder study
    (vLLM bf16, fp32 trainer, at most 32 tokens) it dropped 26-29% of the tokens right after a weight sync and 54-56% on
    stale steps (`benchmarks/results/stability/`); widen `low`/`high` there."""
    mask = x.sequences("the correction 'geometric_sequence_mask'")
    mean_log_ratio = _sequence_mean(_log_ratio(x), mask)
    outside = (mean_log_ratio < torch.log(torch.tensor(low, dtype=torch.float64))) | (
        mean_log_ratio > torch.log(torch.tensor(high, dtype=torch.float64))
    )
    dropped = outside.expand_as(mask) & mask
    return CorrectionOutput(torch.where(dropped, 0.0, weights), affected=dropped)


@register_correction(
    "off_policy_sequence_mask",
    equation="w = 0 on every token of a completion with A < 0 and mean_t log(mu_t / pi_t) > delta",
    source="DeepSeek-V3.2 (arXiv 2512.02556, section 3.1, off-policy sequence masking); slime --use-opsm, TRL "
    "GRPOConfig.off_policy_mask_threshold",
    needs_sequences=True,
)
def off_policy_sequence_mask(x: TrustRegionInput, weights: torch.Tensor, *, delta: float = 1e-4) -> CorrectionOutput:
    """DeepSeek-V3.2's off-policy sequence mask (OPSM): a negative-advantage token is dropped when its completion's
    mean log(mu / pi), a sample estimate of KL(mu || pi) along it, exceeds `delta`: pushing down a completion the
    current policy already finds much less likely than the sampler did is what destabilises training; positive
    advantages are kept. Ties (mean exactly delta) are kept, as in TRL's `get_off_policy_mask`. TRL's own switch
    (`off_policy_mask_threshold`) is refused by DPPOConfig: GRPOTrainer applies it to the advantages, which DPPO
    replaces by its weights. delta: slime's default, 1e-4 (TRL's help suggests 0.5).
    """
    mask = x.sequences("the correction 'off_policy_sequence_mask'")
    drift = _sequence_mean(-_log_ratio(x), mask)
    dropped = (x.advantages < 0) & (drift > delta) & mask
    return CorrectionOutput(torch.where(dropped, 0.0, weights), affected=dropped)


@register_correction(
    "truncated_importance_weights",
    equation="w = w * min(1, C / r)",
    source="TIS: Yao et al., 'Your efficient RL framework secretly brings you off-policy RL training' (2025); verl "
    "rollout_is='token', OpenRLHF is_correction_type='tis'",
    caps_ratio=True,
    check_settings=_check_at_least("cap", 1.0),
)
def truncated_importance_weights(x: TrustRegionInput, weights: torch.Tensor, *, cap: float = 2.0) -> CorrectionOutput:
    """Token-level truncated importance sampling: the ratio pi / mu in the weight is truncated at C, w * min(1, C / r),
    which for every weight of the form r * A * (anything) gives min(r, C) * A * (the same). C = 2, verl's default.
    The paper DPPO builds on warns that truncating the ratio down-weights exactly the rare tokens DPPO lets move
    (its section 5); this is here to compare with, and refused on a trust region that caps the ratio already."""
    ratio = x.ratio.double()
    truncated = ratio > cap
    factor = torch.where(truncated, cap / ratio, 1.0)
    return CorrectionOutput((weights.double() * factor).to(weights.dtype), affected=truncated)


# --- Added terms (after every factor) --------------------------------------------------------------------------------


@register_correction(
    "kl_to_sampler",
    equation="w = w - 2 * tau * log r (the gradient of the loss term tau * (log pi - log mu)^2)",
    source="prime-rl ipo_loss_fn / default loss (kl_tau, the squared log-ratio of Kimi K2.5, arXiv 2602.02276)",
    adds_term=True,
    check_settings=_check_at_least("tau", 0.0),
)
def kl_to_sampler(x: TrustRegionInput, weights: torch.Tensor, *, tau: float = 1e-3) -> CorrectionOutput:
    """prime-rl's KL penalty to the sampler, tau * (log pi - log mu)^2 per loss token, masked or not (its
    `kl_loss = loss_mask * log_ratio**2`; tau = 1e-3, prime-rl's kl_tau until PR #3586 turned it off by default).

    It is a loss term, not a weight, but it fits the weight-replacement design exactly: its gradient with respect to
    log pi is 2 * tau * log r, and the trainers' loss has the gradient -w * grad log pi, so subtracting 2 * tau * log r
    from the weight adds the penalty's gradient (normalised like the policy-gradient term, as prime-rl does). The
    loss value the trainer logs does not include the penalty's value; `corrections/kl_to_sampler/penalty_mean` logs
    it."""
    log_ratio = _log_ratio(x)
    penalty = tau * log_ratio.square()
    return CorrectionOutput((weights.double() - 2 * tau * log_ratio).to(weights.dtype), penalty=penalty.float())
