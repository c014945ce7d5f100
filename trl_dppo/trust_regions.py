"""The trust regions `DPPOTrainer` trains with: one registered function each, looked up by name.

Every method has the gradient  sum_t w_t * grad log pi(y_t)  of the DPPO paper's template U1, with a per-token weight
w_t computed without gradient (`losses.py` turns weights into a loss). A method is a function of one
`TrustRegionInput` (the batch's log-probabilities, advantages and divergence) and of its own settings, declared as
keyword-only parameters with their defaults; it returns `(weights, keep)`, where `keep` is False on the tokens its
trust region blocks. The registration also declares what the method requires of the rest of the configuration (a
divergence, a recomputed anchor) and how its settings are checked, so every rule of a method stands where it is
registered.

`DPPOConfig(trust_region=NAME, trust_region_kwargs={...})` picks one. A setting is filled, in this order, from
`trust_region_kwargs`, from the thresholds every method may share (`SHARED_SETTINGS`: DPPO's `delta_low` /
`delta_high` and PPO's clip range `epsilon_low` / `epsilon_high`, which are the config's fields), then from the
function's default. Register your own from outside the package with `register_trust_region` (see docs/trust_regions.md).
Off-policy corrections stacked on any method's weights (IcePop, sequence masks, truncation, a KL to the sampler) are
`corrections.py`'s.

In the equations r = pi / mu, A the advantage, C a ratio cap, D the divergence estimate, mu_base the sampler's
distribution before truncation or penalties (what the masks compare pi with; the ratio keeps the mu sampled from).
The defaults follow the paper's unified table (appendix C.1): no cap for PG-IS, GRPO, MiniRL and DPPO (C = infinity),
C = 3 for the truncated-importance-sampling baseline (PG-TIS / CISPO).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar

import torch

from .divergence import trust_region_mask
from .losses import (
    dppo_gradient_weights,
    drpo_gradient_weights,
    importance_ratio,
    negative_update_keep,
    ratio_clip_keep,
)
from .registry import Registered


__all__ = [
    "SHARED_SETTINGS",
    "TRUST_REGIONS",
    "TrustRegion",
    "TrustRegionInput",
    "get_trust_region",
    "register_trust_region",
]

TokenTensor = Annotated[torch.Tensor, "(B, T): B sequences, T completion tokens"]

# Settings a method may declare that come from DPPOConfig's own fields rather than from `trust_region_kwargs`
SHARED_SETTINGS = ("delta_low", "delta_high", "epsilon_low", "epsilon_high")


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
    # True on the tokens in the loss, in order along each row, one row per sequence: what a method or correction that
    # reads positions or whole sequences needs (`needs_sequences`). None: no sequence boundaries (such methods refuse)
    loss_mask: TokenTensor | None = None

    @property
    def ratio(self) -> torch.Tensor:
        """r = pi / mu of each sampled token (float32, at most 2**64: `losses.importance_ratio`)."""
        return importance_ratio(self.trainer_logps, self.sampler_logps)

    def sequences(self, reader: str) -> torch.Tensor:
        """`loss_mask` as a bool tensor, for `reader` (a method's or correction's name), which needs one row per
        sequence; raises where the batch has no sequence boundaries."""
        if self.loss_mask is None:
            raise ValueError(
                f"{reader} reads whole sequences (positions along a completion, or a mask over all of its tokens), "
                "and this batch has no sequence boundaries: pass TrustRegionInput(loss_mask=...), a (B, T) mask of "
                "the loss tokens with one completion per row. DPPOTrainer and AsyncDPPOTrainer always do."
            )
        return self.loss_mask.bool()


TrustRegionFunction = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class TrustRegion(Registered):
    """A registered method, and what it requires of the configuration."""

    kind: ClassVar[str] = "trust region"
    config_fields: ClassVar[tuple[str, ...]] = SHARED_SETTINGS

    recomputes_anchor: bool = False
    divergences: tuple[str, ...] | None = None  # the divergences it works with; None: any

    def resolve_settings(self, kwargs: Mapping[str, Any] | None, shared: Mapping[str, Any]) -> dict[str, Any]:
        """This method's settings: from `kwargs` (the user's `trust_region_kwargs`), else `shared` (DPPOConfig's
        thresholds), else the function's default. Raises on a key the method does not take or a missing value."""
        return self._resolve(kwargs, "trust_region_kwargs", f"trust_region={self.name!r}", shared)

    def check_divergence(self, divergence: str) -> None:
        if self.divergences is not None and divergence not in self.divergences:
            raise ValueError(
                f"trust_region={self.name!r} works with divergence in {self.divergences} only, got {divergence!r}."
            )


# name -> method, in registration order; DPPOConfig's `trust_region` accepts exactly these names
TRUST_REGIONS: dict[str, TrustRegion] = {}


def register_trust_region(
    name: str,
    *,
    equation: str,
    recomputes_anchor: bool = False,
    divergences: tuple[str, ...] | None = None,
    check_settings: Callable[..., None] | None = None,
    source: str = "",
) -> Callable[[TrustRegionFunction], TrustRegionFunction]:
    """Register `fn(x: TrustRegionInput, *, <settings>) -> (weights, keep)` as `trust_region=name`.

    Args:
        name: the value of `DPPOConfig.trust_region` that selects it.
        equation: its per-token weight w_t in one line, for the docs' table and the config's help.
        recomputes_anchor: let GRPOTrainer recompute log pi_old before the batch's first update (a forward pass per
            generation batch that serves several optimizer steps) and pass it as `anchor_logps`; otherwise the
            sampler's record is the only anchor and `anchor_logps` is log pi.
        divergences: the `DPPOConfig.divergence` values the method is defined for (None: any); others are refused
            when the config is built.
        check_settings: called with the resolved settings as keyword arguments when the config is built; raises
            ValueError on a bad value.
        source: the paper or code it comes from, for the docs' table.
    """
    fields = dict(equation=equation, recomputes_anchor=recomputes_anchor, divergences=divergences, source=source)
    return lambda fn: TrustRegion.register(TRUST_REGIONS, name, fn, check_settings=check_settings, **fields)


def get_trust_region(name: str) -> TrustRegion:
    """The method registered as `name`; `"module.path:name"` imports `module.path` first (which registers it), so a
    method defined outside the package can be chosen from YAML or the command line."""
    module, _, registered = name.rpartition(":")
    if module and registered not in TRUST_REGIONS:
        importlib.import_module(module)
    if registered not in TRUST_REGIONS:
        where = f"importing {module} registered no method of that name; " if module else ""
        raise ValueError(
            f"trust_region={name!r} is not registered: {where}the trust regions are {', '.join(TRUST_REGIONS)}. "
            "Register your own with trl_dppo.trust_regions.register_trust_region, and name it as 'module.path:name' "
            "to have the module imported."
        )
    return TRUST_REGIONS[registered]


def _check_ratio_cap(ratio_cap: float | None, **_: Any) -> None:
    if ratio_cap is not None and not ratio_cap >= 1:
        raise ValueError(f"ratio_cap must be >= 1 or None (no cap), got {ratio_cap}.")


def _check_probability(setting: str) -> Callable[..., None]:
    def check(**settings: Any) -> None:
        if not 0 < settings[setting] <= 1:
            raise ValueError(f"{setting} must be a probability in (0, 1], got {settings[setting]}.")

    return check


# --- The paper's ladder and DRPO, in the README's order ---------------------------------------------------------


@register_trust_region(
    "dppo",
    equation="w = M * min(r, C) * A, M = 0 iff D > delta and pi moves away from mu_base in the direction of A",
    check_settings=_check_ratio_cap,
    source="Qi et al., DPPO (arXiv 2602.04879), section 4 and U1 (appendix C.1)",
)
def dppo(x: TrustRegionInput, *, delta_low: float, delta_high: float, ratio_cap: float | None = None):
    """DPPO. The paper's U1 has no cap (C = infinity) and its section 5 finds that truncating the ratio brings collapse
    sooner, since it down-weights the rare tokens DPPO lets move; `ratio_cap` is there to reproduce capped recipes
    (the authors' DPPO recipe sets 1e4, TRL's removed trainer 20)."""
    keep = trust_region_mask(x.divergence, x.base_logps, x.trainer_logps, x.advantages, delta_low, delta_high)
    return dppo_gradient_weights(x.trainer_logps, x.sampler_logps, x.advantages, keep, ratio_cap), keep


@register_trust_region(
    "drpo",
    equation="w = r * A * (1 - sign(A) * (pi - mu_base) / delta)",
    divergences=("binary_tv",),
    source="DRPO, 'Rethinking the Divergence Regularization in LLM RL' (DPPO's authors)",
)
def drpo(x: TrustRegionInput, *, delta_low: float, delta_high: float):
    """DRPO's smooth regulariser toward DPPO's binary-TV boundary; `keep` is False outside it, moving away."""
    delta = torch.where(x.advantages > 0, delta_high, delta_low)
    weights = drpo_gradient_weights(x.trainer_logps, x.sampler_logps, x.advantages, delta, x.base_logps)
    inside = (x.trainer_logps.exp() - x.base_logps.exp()).abs() <= delta
    return weights, inside | (torch.sign(x.advantages) * (x.trainer_logps - x.base_logps) <= 0)


@register_trust_region(
    "mask_drpo",
    equation="w = dppo's weight where its M = 1, drpo's where M = 0",
    divergences=("binary_tv",),
    check_settings=_check_ratio_cap,
    source="DRPO paper, Mask-DRPO",
)
def mask_drpo(x: TrustRegionInput, *, delta_low: float, delta_high: float, ratio_cap: float | None = None):
    inside, keep = dppo(x, delta_low=delta_low, delta_high=delta_high, ratio_cap=ratio_cap)
    outside, _ = drpo(x, delta_low=delta_low, delta_high=delta_high)
    return torch.where(keep, inside, outside), keep


@register_trust_region(
    "grpo",
    equation="w = M * r * A, M = 0 iff A > 0 and r > 1 + epsilon_high, or A < 0 and r < 1 - epsilon_low",
    source="PPO's clip against mu (GRPO, DAPO's clip-higher); DPPO paper's ladder, appendix C.1",
)
def grpo(x: TrustRegionInput, *, epsilon_low: float, epsilon_high: float):
    keep = ratio_clip_keep(x.ratio, x.advantages, epsilon_low, epsilon_high)
    return dppo_gradient_weights(x.trainer_logps, x.sampler_logps, x.advantages, keep), keep


@register_trust_region(
    "minirl",
    equation="w = M * r * A, M = grpo's clip of pi / pi_old (pi_old recomputed)",
    recomputes_anchor=True,
    source="DPPO paper's ladder (RQ2), appendix C.1",
)
def minirl(x: TrustRegionInput, *, epsilon_low: float, epsilon_high: float):
    anchor_ratio = importance_ratio(x.trainer_logps, x.anchor_logps)
    keep = ratio_clip_keep(anchor_ratio, x.advantages, epsilon_low, epsilon_high)
    return dppo_gradient_weights(x.trainer_logps, x.sampler_logps, x.advantages, keep), keep


@register_trust_region("pg_is", equation="w = r * A (no trust region)", source="DPPO paper's ladder (RQ1)")
def pg_is(x: TrustRegionInput):
    everything = torch.ones_like(x.trainer_logps, dtype=torch.bool)
    return dppo_gradient_weights(x.trainer_logps, x.sampler_logps, x.advantages, everything), everything


@register_trust_region(
    "cispo",
    equation="w = min(r, C) * A (truncated importance sampling)",
    check_settings=_check_ratio_cap,
    source="PG-TIS / CISPO (MiniMax-M1); DPPO paper's ladder (RQ1), C = 3",
)
def cispo(x: TrustRegionInput, *, ratio_cap: float | None = 3.0):
    """PG-TIS / CISPO as the paper's stability baseline: C = 3 (appendix C.1). Not GRPOTrainer's `loss_type="cispo"`,
    which DPPOConfig refuses: that one is CISPO's whole loss, here the trust region is the only part that changes."""
    everything = torch.ones_like(x.trainer_logps, dtype=torch.bool)
    return dppo_gradient_weights(x.trainer_logps, x.sampler_logps, x.advantages, everything, ratio_cap), everything


@register_trust_region(
    "negative_mask",
    equation="w = M * r * A, M = 0 iff A < 0 and mu_base - pi >= drop",
    check_settings=_check_probability("drop"),
    source="DPPO paper's minimal mask (RQ3)",
)
def negative_mask(x: TrustRegionInput, *, drop: float = 0.5):
    """The paper's RQ3 minimal mask: only large negative updates are blocked (its threshold: a drop of 0.5)."""
    keep = negative_update_keep(x.trainer_logps, x.base_logps, x.advantages, drop)
    return dppo_gradient_weights(x.trainer_logps, x.sampler_logps, x.advantages, keep), keep


@register_trust_region(
    "relaxed_clip",
    equation="w = M * r * A, M = grpo's clip except M = 1 where mu_base < alpha",
    check_settings=_check_probability("alpha"),
    source="DPPO paper's efficiency probe (section 6)",
)
def relaxed_clip(x: TrustRegionInput, *, epsilon_low: float, epsilon_high: float, alpha: float = 0.1):
    """The paper's efficiency probe (section 6): PPO's clip, with epsilon -> infinity on both sides for tokens the
    sampler drew with probability below alpha (the paper's 0.1 learned substantially faster than GRPO's clip)."""
    rare = x.base_logps.exp() < alpha
    keep = ratio_clip_keep(x.ratio, x.advantages, epsilon_low, epsilon_high) | rare
    return dppo_gradient_weights(x.trainer_logps, x.sampler_logps, x.advantages, keep), keep


# --- Rollout-anchored trust regions from after the paper --------------------------------------------------------


def cppo_position_weights(loss_mask: torch.Tensor, w_min: float) -> torch.Tensor:
    """CPPO's position weight (arXiv 2606.10968, Eq. 9): w_t = w_min + (1 - w_min) * (T - t) / max(T - 1, 1) for the
    t-th of a row's T loss tokens (t = 1 .. T), from 1 at the first token down to w_min at the last; 0 off the loss.
    float64."""
    mask = loss_mask.bool()
    position = mask.cumsum(-1).double()
    length = mask.sum(-1, keepdim=True).double()
    weights = w_min + (1 - w_min) * (length - position) / (length - 1).clamp(min=1)
    return torch.where(mask, weights, 0.0)


def _exclusive_cumsum(values: torch.Tensor) -> torch.Tensor:
    """sum_{j < t} values_j along the last dimension (0 at the first position)."""
    return torch.nn.functional.pad(values.cumsum(-1)[..., :-1], (1, 0))


def _check_cppo(w_min: float, delta_b: float, **_: Any) -> None:
    if not 0 < w_min <= 1:
        raise ValueError(f"w_min must be in (0, 1] (the last position's weight; the first's is 1), got {w_min}.")
    if not delta_b > 0:
        raise ValueError(f"delta_b (CPPO's per-token prefix budget) must be > 0, got {delta_b}.")


@register_trust_region(
    "cppo",
    equation="w = M * r * A, M = 0 iff pi moves away from mu_base in the direction of A and w_t * D_t > "
    "min(delta, delta + delta_b * W_{t-1} - S_{t-1}); w_t from 1 (first token) to w_min (last), S_{t-1} and "
    "W_{t-1} the sums of w_j * D_j and w_j over the earlier tokens of the completion",
    check_settings=_check_cppo,
    source="CPPO (arXiv 2606.10968), Eq. 8-11 and 22; Tencent-Hunyuan/UniRL CPPO",
)
def cppo(
    x: TrustRegionInput,
    *,
    delta_low: float,
    delta_high: float,
    w_min: float = 0.8,
    delta_b: float = 0.02,
    adaptive_delta_b: bool = True,
):
    """CPPO, Cumulative Prefix-divergence Policy Optimization (Mao, Zhou, Tao et al., "Beyond Uniform Token-Level Trust
    Region in LLM Reinforcement Learning", arXiv 2606.10968, Eq. 8-11 and 22; the authors' code:
    Tencent-Hunyuan/UniRL, CPPO/README.md). DPPO's divergence mask with two changes along each completion:

    - a position-weighted threshold: the t-th of T tokens is held to w_t * D_t <= delta (D_t <= delta / w_t), with
      w_t falling linearly from 1 at the first token to `w_min` at the last, so early tokens, whose change conditions
      everything after them, get the tightest bound;
    - a cumulative prefix budget: with S_{t-1} = sum_{j<t} w_j D_j and W_{t-1} = sum_{j<t} w_j, the threshold is
      c_t = min(delta, delta + delta_b * W_{t-1} - S_{t-1}): once the prefix has drifted more than `delta_b` per
      (weighted) token, later tokens get less room. Every token's divergence counts in the prefix, masked or not.

    A token is blocked when w_t * D_t > c_t and pi moves away from mu_base in the direction of A (the paper keeps
    any update with A (r - 1) <= 0); delta is `delta_high` for A > 0 and `delta_low` for A < 0 (the paper: one
    delta). With `adaptive_delta_b` (the paper's Eq. 22, the authors' recipe) each completion's budget is
    clamp(P90(D_1..T), delta_b, 2 * delta_b), its divergences' 90th percentile (linear interpolation); otherwise
    `delta_b`. Defaults: the paper's w_min = 0.8, delta_b = 0.02 (binary TV; delta 0.15 dense, 0.2 MoE). Positions
    count the completion's loss tokens (tool outputs and tokens without a sampler record take none). The weight is
    DPPO's, r * A on kept tokens, no cap.
    """
    mask = x.sequences("trust_region='cppo'")
    divergence = torch.where(mask, x.divergence.double(), 0.0)
    position_weight = cppo_position_weights(mask, w_min)
    spent = position_weight * divergence  # Z_t
    if adaptive_delta_b:
        percentile = torch.nanquantile(torch.where(mask, divergence, float("nan")), 0.9, dim=-1, keepdim=True)
        budget = percentile.nan_to_num(delta_b).clamp(delta_b, 2 * delta_b)  # a row without loss tokens: delta_b
    else:
        budget = torch.full_like(divergence[..., :1], delta_b)
    advantages = x.advantages.expand_as(divergence)
    delta = torch.where(advantages > 0, delta_high, delta_low).double()
    threshold = torch.minimum(delta, delta + budget * _exclusive_cumsum(position_weight) - _exclusive_cumsum(spent))
    moving_away = ((advantages > 0) & (x.trainer_logps > x.base_logps)) | (
        (advantages < 0) & (x.trainer_logps < x.base_logps)
    )
    keep = ~(moving_away & (spent > threshold) & mask)
    return dppo_gradient_weights(x.trainer_logps, x.sampler_logps, x.advantages, keep), keep


@register_trust_region(
    "ipo",
    equation="w = M * r * A, M = 0 iff abs(pi - mu_base) > eps, whatever the sign of A",
    divergences=("binary_tv",),
    check_settings=_check_probability("eps"),
    source="prime-rl ipo_loss_fn (PRs #3418, #3586: eps 0.3, no KL)",
)
def ipo(x: TrustRegionInput, *, eps: float = 0.3):
    """IPO, prime-rl's default RL loss (PrimeIntellect-ai/prime-rl, src/prime_rl/trainer/rl/loss.py `ipo_loss_fn`;
    made the default in PR #3418, eps 0.3 and no KL term since PR #3586): a symmetric probability mask, the binary
    TV of DPPO without its direction test. A token is blocked whenever its probability moved more than `eps` from
    the sampler's, toward or away from mu and whatever the sign of A; prime-rl moved to it for asynchronous training
    after a tight DPPO delta masked mostly structural tokens (prime-rl #3236, #3244). Its former KL term is the
    correction `kl_to_sampler` (corrections.py). The weight is r * A on kept tokens."""
    keep = (x.trainer_logps.double().exp() - x.base_logps.double().exp()).abs() <= eps
    return dppo_gradient_weights(x.trainer_logps, x.sampler_logps, x.advantages, keep), keep
