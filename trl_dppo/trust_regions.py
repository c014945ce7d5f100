"""The trust regions `DPPOTrainer` trains with: one registered function each, looked up by name.

Every method has the gradient  sum_t w_t * grad log pi(y_t)  of the DPPO paper's template U1, with a per-token weight
w_t computed without gradient (`losses.py` turns weights into a loss). A method is a function of one
`TrustRegionInput` (the batch's log-probabilities, advantages and divergence) and of its own settings, declared as
keyword-only parameters; it returns `(weights, keep)`, where `keep` is False on the tokens its trust region blocks.
`DPPOConfig(trust_region=NAME)` picks one, and fills each setting from the config field of the same name (a setting
with no such field takes its default). Register your own from outside the package with `register_trust_region`
(the README's "Trust regions" shows one in ten lines).

In the equations r = pi / mu, A the advantage, C = `ratio_cap`, D the divergence estimate, mu_base the sampler's
distribution before truncation or penalties (what the masks compare pi with; the ratio keeps the mu sampled from).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

import torch

from .divergence import trust_region_mask
from .losses import dppo_gradient_weights, drpo_gradient_weights, negative_update_keep, ratio_clip_keep


__all__ = ["TRUST_REGIONS", "TrustRegion", "TrustRegionInput", "get_trust_region", "register_trust_region"]

TokenTensor = Annotated[torch.Tensor, "(B, T): B sequences, T completion tokens"]


@dataclass(frozen=True)
class TrustRegionInput:
    """What a trust region sees of one micro-batch, all without gradient. Tokens outside the loss hold neutral values
    (mu = mu_base = pi); their weights are multiplied by 0 afterwards."""

    trainer_logps: TokenTensor  # log pi(y_t | s_t), the trainer's log-probability of each sampled token
    sampler_logps: TokenTensor  # log mu(y_t | s_t), of the distribution the token was drawn from
    base_logps: TokenTensor  # log mu_base(y_t | s_t), untruncated and unpenalised; sampler_logps if the chain had none
    advantages: Annotated[torch.Tensor, "(B, 1) or (B, T)"]  # A, broadcast against the tokens
    divergence: TokenTensor  # D_t between the sampler's (mu_base) and the trainer's next-token distributions
    anchor_logps: TokenTensor  # log pi_old recomputed by the trainer (`recomputes_anchor`), else trainer_logps

    @property
    def ratio(self) -> torch.Tensor:
        """r = pi / mu in float32, the importance ratio of each sampled token."""
        return torch.exp(self.trainer_logps.float() - self.sampler_logps.float())


TrustRegionFunction = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class TrustRegion:
    """A registered method: its function, its equation (the README's table) and its settings with their defaults."""

    name: str
    function: TrustRegionFunction
    equation: str
    settings: dict[str, Any]  # keyword-only parameter -> default (inspect.Parameter.empty when it has none)
    recomputes_anchor: bool = False

    @torch.no_grad()
    def __call__(self, x: TrustRegionInput, **settings: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self.function(x, **settings)

    def settings_from(self, config: object, **resolved: Any) -> dict[str, Any]:
        """This method's settings: from `resolved`, else `config`'s attribute of the same name, else the default."""
        values = {}
        for name, default in self.settings.items():
            if name in resolved:
                values[name] = resolved[name]
            elif hasattr(config, name):
                values[name] = getattr(config, name)
            elif default is not inspect.Parameter.empty:
                values[name] = default
            else:
                raise ValueError(
                    f"trust_region={self.name!r} needs the setting {name!r}, which {type(config).__name__} has no "
                    f"field for: give the parameter `{name}` of {self.function.__qualname__} a default."
                )
        return values


# name -> method, in registration order; DPPOConfig's `trust_region` accepts exactly these names
TRUST_REGIONS: dict[str, TrustRegion] = {}


def register_trust_region(
    name: str, *, equation: str, recomputes_anchor: bool = False
) -> Callable[[TrustRegionFunction], TrustRegionFunction]:
    """Register `fn(x: TrustRegionInput, *, <settings>) -> (weights, keep)` as `trust_region=name`.

    Args:
        name: the value of `DPPOConfig.trust_region` that selects it.
        equation: its per-token weight w_t in one line, for the README's table and the config's help.
        recomputes_anchor: let GRPOTrainer recompute log pi_old before the batch's first update (a forward pass per
            generation batch that serves several optimizer steps) and pass it as `anchor_logps`; otherwise the
            sampler's record is the only anchor and `anchor_logps` is log pi.
    """

    def register(fn: TrustRegionFunction) -> TrustRegionFunction:
        if name in TRUST_REGIONS:
            raise ValueError(f"A trust region named {name!r} is already registered; choose another name.")
        _, *params = inspect.signature(fn).parameters.values()
        positional = [p.name for p in params if p.kind is not p.KEYWORD_ONLY]
        if positional:
            raise TypeError(
                f"{fn.__qualname__} takes the TrustRegionInput, then its settings as keyword-only parameters (after "
                f"`*`) so that DPPOConfig can fill them by name; {positional} are not keyword-only."
            )
        settings = {p.name: p.default for p in params}
        TRUST_REGIONS[name] = TrustRegion(name, fn, equation, settings, recomputes_anchor)
        return fn

    return register


def get_trust_region(name: str) -> TrustRegion:
    if name not in TRUST_REGIONS:
        raise ValueError(
            f"trust_region={name!r} is not registered; the trust regions are {', '.join(TRUST_REGIONS)} (register "
            "your own with trl_dppo.trust_regions.register_trust_region before building the DPPOConfig)."
        )
    return TRUST_REGIONS[name]


# --- The paper's ladder and DRPO, in the README's order ---------------------------------------------------------


@register_trust_region(
    "dppo", equation="w = M * min(r, C) * A, M = 0 iff D > delta and pi moves away from mu_base in the direction of A"
)
def dppo(x: TrustRegionInput, *, delta_low: float, delta_high: float, ratio_cap: float | None):
    keep = trust_region_mask(x.divergence, x.base_logps, x.trainer_logps, x.advantages, delta_low, delta_high)
    return dppo_gradient_weights(x.trainer_logps, x.sampler_logps, x.advantages, keep, ratio_cap), keep


@register_trust_region("drpo", equation="w = r * A * (1 - sign(A) * (pi - mu_base) / delta)")
def drpo(x: TrustRegionInput, *, delta_low: float, delta_high: float):
    """DRPO's smooth regulariser toward DPPO's binary-TV boundary; `keep` is False outside it, moving away."""
    delta = torch.where(x.advantages > 0, delta_high, delta_low)
    weights = drpo_gradient_weights(x.trainer_logps, x.sampler_logps, x.advantages, delta, x.base_logps)
    inside = (x.trainer_logps.exp() - x.base_logps.exp()).abs() <= delta
    return weights, inside | (torch.sign(x.advantages) * (x.trainer_logps - x.base_logps) <= 0)


@register_trust_region("mask_drpo", equation="w = dppo's weight where its M = 1, drpo's where M = 0")
def mask_drpo(x: TrustRegionInput, *, delta_low: float, delta_high: float, ratio_cap: float | None):
    inside, keep = dppo(x, delta_low=delta_low, delta_high=delta_high, ratio_cap=ratio_cap)
    outside, _ = drpo(x, delta_low=delta_low, delta_high=delta_high)
    return torch.where(keep, inside, outside), keep


@register_trust_region(
    "grpo", equation="w = M * r * A, M = 0 iff A > 0 and r > 1 + epsilon_high, or A < 0 and r < 1 - epsilon_low"
)
def grpo(x: TrustRegionInput, *, epsilon_low: float, epsilon_high: float):
    keep = ratio_clip_keep(x.ratio, x.advantages, epsilon_low, epsilon_high)
    return dppo_gradient_weights(x.trainer_logps, x.sampler_logps, x.advantages, keep), keep


@register_trust_region(
    "minirl", equation="w = M * r * A, M = grpo's clip of pi / pi_old (pi_old recomputed)", recomputes_anchor=True
)
def minirl(x: TrustRegionInput, *, epsilon_low: float, epsilon_high: float):
    anchor_ratio = torch.exp(x.trainer_logps.float() - x.anchor_logps.float())
    keep = ratio_clip_keep(anchor_ratio, x.advantages, epsilon_low, epsilon_high)
    return dppo_gradient_weights(x.trainer_logps, x.sampler_logps, x.advantages, keep), keep


@register_trust_region("pg_is", equation="w = r * A (no trust region)")
def pg_is(x: TrustRegionInput):
    everything = torch.ones_like(x.trainer_logps, dtype=torch.bool)
    return dppo_gradient_weights(x.trainer_logps, x.sampler_logps, x.advantages, everything), everything


@register_trust_region("cispo", equation="w = min(r, C) * A (truncated importance sampling)")
def cispo(x: TrustRegionInput, *, ratio_cap: float | None):
    everything = torch.ones_like(x.trainer_logps, dtype=torch.bool)
    return dppo_gradient_weights(x.trainer_logps, x.sampler_logps, x.advantages, everything, ratio_cap), everything


@register_trust_region(
    "negative_mask", equation="w = M * r * A, M = 0 iff A < 0 and mu_base - pi >= negative_mask_threshold"
)
def negative_mask(x: TrustRegionInput, *, negative_mask_threshold: float):
    keep = negative_update_keep(x.trainer_logps, x.base_logps, x.advantages, negative_mask_threshold)
    return dppo_gradient_weights(x.trainer_logps, x.sampler_logps, x.advantages, keep), keep


@register_trust_region("relaxed_clip", equation="w = M * r * A, M = grpo's clip except M = 1 where mu_base < alpha")
def relaxed_clip(x: TrustRegionInput, *, epsilon_low: float, epsilon_high: float, relaxed_clip_below: float):
    """The paper's efficiency probe (section 6): PPO's clip, with epsilon -> infinity on both sides for rare tokens."""
    rare = x.base_logps.exp() < relaxed_clip_below
    keep = ratio_clip_keep(x.ratio, x.advantages, epsilon_low, epsilon_high) | rare
    return dppo_gradient_weights(x.trainer_logps, x.sampler_logps, x.advantages, keep), keep
