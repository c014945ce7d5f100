"""`DPPOConfig`: GRPOConfig plus the divergence trust region, with GRPO options that contradict DPPO switched off."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, fields
from typing import Any

from trl import GRPOConfig

from .trust_regions import TRUST_REGIONS, get_trust_region


__all__ = [
    "DPPOConfig",
    "TrustRegionArguments",
    "refuse_vllm_truncated_sampling",
    "DIVERGENCES",
    "DEFAULT_DELTA",
    "EXPERIMENTAL_DPPO_RENAMES",
]

DIVERGENCES = ("binary_tv", "binary_kl", "topk_tv", "topk_kl")
# The paper's stability-test thresholds; its large runs used 0.2 for TV.
DEFAULT_DELTA = {"tv": 0.15, "kl": 0.05}
# vLLM SamplingParams keys (through `generation_kwargs`) that leave the sampling distribution as it is
VLLM_DISTRIBUTION_NEUTRAL_KWARGS = (
    "max_tokens",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "detokenize",
    "truncate_prompt_tokens",
    "output_kind",
)
# Loss types whose only role is normalisation: GRPOTrainer's `cispo`, `sapo` and `vespo` are trust regions of their own.
SUPPORTED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
# trl.experimental.dppo's DPPOConfig (TRL 1.0-1.8) -> this package's field of the same meaning. There, `epsilon` and
# `epsilon_high` were the thresholds delta_low / delta_high; here they keep GRPOConfig's meaning (PPO's ratio clip).
EXPERIMENTAL_DPPO_RENAMES = {"divergence_type": "divergence", "divergence_topk": "topk", "clip_ratio_c": "ratio_cap"}
# The settings through which a trust region reads GRPOConfig's `epsilon` / `epsilon_high` (PPO's ratio clip)
_PPO_CLIP_SETTINGS = {"epsilon_low", "epsilon_high"}


@dataclass
class TrustRegionArguments:
    """The trust-region fields of [`DPPOConfig`] and [`AsyncDPPOConfig`], declared and checked once for both.

    A config built on it reads PPO's clip range from its own `epsilon` / `epsilon_high` (GRPOConfig's and
    AsyncGRPOConfig's fields), calls `_resolve_trust_region()` in its `__post_init__`, and hands the trainer the chosen
    method's settings through `trust_region_settings()`. [`DPPOConfig`]'s docstring describes the fields.
    """

    trust_region: str = field(
        default="dppo",
        metadata={
            "help": "Trust region: DPPO's ('dppo', the default) or, for ablations, another method, given by its "
            "per-token weight w of grad log pi (r = pi/mu, A the advantage, C = ratio_cap, D the divergence): "
            + "; ".join(f"'{name}': {method.equation}" for name, method in TRUST_REGIONS.items())
            + ". Methods registered with trl_dppo.trust_regions.register_trust_region are accepted too.",
            "choices": TRUST_REGIONS.keys(),  # a live view: methods registered later are accepted
        },
    )
    negative_mask_threshold: float = field(
        default=0.5,
        metadata={"help": "Drop mu - pi at which trust_region='negative_mask' blocks a token (the paper's RQ3: 0.5)."},
    )
    relaxed_clip_below: float = field(
        default=0.1,
        metadata={
            "help": "alpha of trust_region='relaxed_clip': PPO's ratio clip (epsilon, epsilon_high), except that "
            "tokens the sampler drew with probability mu < alpha are never clipped (epsilon -> infinity on both "
            "sides). The paper's efficiency probe (Qi et al. 2026, section 6): alpha = 0.1 learned substantially "
            "faster than GRPO's clip."
        },
    )
    divergence: str = field(
        default="binary_tv",
        metadata={
            "help": "Divergence estimate for the trust region: 'binary_tv' (default), 'binary_kl', 'topk_tv' or "
            "'topk_kl'. Top-K also sees the head of the distribution move, at the cost of recording K log-probs per "
            "token; the paper found binary as good in its runs.",
            "choices": list(DIVERGENCES),
        },
    )
    delta: float | None = field(
        default=None,
        metadata={
            "help": "Divergence threshold delta. Defaults to 0.15 for TV and 0.05 for KL (the paper's stability "
            "settings; 0.2 TV in its large runs). Lower it for a tighter trust region."
        },
    )
    delta_low: float | None = field(
        default=None,
        metadata={"help": "Threshold for negative-advantage tokens (moves down). Defaults to `delta`."},
    )
    delta_high: float | None = field(
        default=None,
        metadata={"help": "Threshold for positive-advantage tokens (moves up). Defaults to `delta`."},
    )
    ratio_cap: float | None = field(
        default=10.0,
        metadata={
            "help": "Cap C on the importance ratio pi/mu in the gradient weight M * min(pi/mu, C) * A, as in the "
            "authors' reference code. Set None to disable."
        },
    )

    def _resolve_trust_region(self) -> None:
        """Fill the thresholds' defaults and refuse values the trust region cannot work with."""
        trust_region = get_trust_region(self.trust_region)
        if self.trust_region in ("drpo", "mask_drpo") and self.divergence != "binary_tv":
            raise ValueError(
                f"trust_region={self.trust_region!r} regularises toward DPPO's binary-TV boundary |pi - mu| <= delta; "
                f"set divergence='binary_tv' (got {self.divergence!r})."
            )
        if not 0 < self.negative_mask_threshold <= 1:
            raise ValueError(f"negative_mask_threshold must be in (0, 1], got {self.negative_mask_threshold}.")
        if not 0 < self.relaxed_clip_below <= 1:
            raise ValueError(
                f"relaxed_clip_below must be in (0, 1] (a sampler probability alpha), got {self.relaxed_clip_below}."
            )
        if self.divergence not in DIVERGENCES:
            raise ValueError(f"divergence must be one of {DIVERGENCES}, got {self.divergence!r}.")
        kind = self.divergence.split("_")[1]
        if self.delta is None:
            self.delta = DEFAULT_DELTA[kind]
        self.delta_low = self.delta if self.delta_low is None else self.delta_low
        self.delta_high = self.delta if self.delta_high is None else self.delta_high
        for name in ("delta", "delta_low", "delta_high"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}.")
            if kind == "tv" and value >= 1:
                raise ValueError(
                    f"{name}={value} never masks anything: total variation lies in [0, 1]. Use a threshold below 1 "
                    "(the paper uses 0.15-0.2)."
                )
        if self.ratio_cap is not None and not self.ratio_cap >= 1:
            raise ValueError(f"ratio_cap must be >= 1 or None (no cap), got {self.ratio_cap}.")
        if _PPO_CLIP_SETTINGS.isdisjoint(trust_region.settings) and (
            self.epsilon != self.__dataclass_fields__["epsilon"].default or self.epsilon_high is not None
        ):
            warnings.warn(
                f"epsilon={self.epsilon}, epsilon_high={self.epsilon_high}: with trust_region={self.trust_region!r} "
                "PPO's ratio clip only sets what the diagnostics compare DPPO's mask against (the `ppo_clipped` "
                "metrics); it is not DPPO's threshold. trl.experimental.dppo used epsilon / epsilon_high as the "
                "thresholds: set delta_low / delta_high (or delta) instead.",
                UserWarning,
                stacklevel=4,
            )
        self.trust_region_settings()  # a setting with neither a field nor a default fails here, not at the first step

    def trust_region_settings(self) -> dict[str, Any]:
        """The settings `trust_region`'s function declares, read from this config's fields of the same names.

        `epsilon_low` / `epsilon_high` are PPO's clip range as GRPOTrainer reads it: `epsilon`, and `epsilon_high`
        defaulting to `epsilon`. A setting with no field takes the function's default.
        """
        return get_trust_region(self.trust_region).settings_from(
            self,
            epsilon_low=self.epsilon,
            epsilon_high=self.epsilon if self.epsilon_high is None else self.epsilon_high,
        )


@dataclass
class DPPOConfig(TrustRegionArguments, GRPOConfig):
    r"""
    Configuration for [`DPPOTrainer`]: everything [`~trl.GRPOConfig`] holds, plus DPPO's trust region.

    DPPO replaces PPO's ratio clip by a mask on an estimate D_t of the divergence between the sampler's next-token
    distribution (mu, recorded at generation) and the trainer's (pi): a token loses its gradient only when
    D_t > delta and the update moves further from mu. Its per-token gradient is M_t * min(pi/mu, C) * A * grad log pi.

    Parameters:
        trust_region (`str`, defaults to `"dppo"`):
            The trust region: `dppo`, or for ablations another method registered in `trl_dppo.trust_regions` (the
            paper's ladder, DRPO and the paper's relaxed clip; the field's help and the README's table list them with
            their equations), or your own registered with `register_trust_region`. A method's settings are the fields
            of the same names (`epsilon_low` / `epsilon_high` are PPO's `epsilon` / `epsilon_high`).
        negative_mask_threshold (`float`, defaults to `0.5`):
            Probability drop mu - pi at which `negative_mask` blocks a negative-advantage token.
        relaxed_clip_below (`float`, defaults to `0.1`):
            alpha of `relaxed_clip`: tokens the sampler drew with probability mu_base < alpha are never clipped.
        divergence (`str`, defaults to `"binary_tv"`):
            Estimate of D_t: `binary_tv` (|mu - pi| of the sampled token), `binary_kl` (KL of the two coin flips
            "sampled token or not"), `topk_tv` / `topk_kl` (over the sampler's `topk` most likely tokens plus the
            sampled one, the rest in one bucket).
        delta (`float`, *optional*):
            Divergence threshold. Defaults to 0.15 for TV and 0.05 for KL (the paper's stability settings; its large
            runs used 0.2 TV). Not GRPOConfig's two-sided clipping bound of the same name.
        delta_low (`float`, *optional*):
            Threshold for tokens with negative advantage; defaults to `delta`.
        delta_high (`float`, *optional*):
            Threshold for tokens with positive advantage; defaults to `delta`.
        topk (`int`, defaults to `20`):
            K of the top-K divergence.
        ratio_cap (`float` or `None`, defaults to `10.0`):
            Cap C on the importance ratio pi/mu in the gradient weight; `None` disables it.
        vllm_allow_truncated_sampling (`bool`, defaults to `False`):
            Accept truncated or penalised sampling (`top_p`, `top_k`, `min_p`, `repetition_penalty`, distribution-
            changing `generation_kwargs`) with vLLM. vLLM reports only the renormalised log-probabilities, so the
            divergence then includes a spurious (1 - Z)/Z (Z the kept mass); it is logged as `truncation/*`.
            transformers generation records the untruncated mu and needs no opt-in.
        log_tokens_by_mu (`bool`, defaults to `False`):
            Also log the token counts per sampler-probability bucket (`tokens_by_mu/<bucket>/{total,masked,
            ppo_clipped}`, 18 series), which `trl-dppo plot` draws as `tokens_by_mu.png`. The shipped jobs turn it on.

    GRPOConfig options that contradict DPPO are off by default here and rejected when set: vLLM's importance-sampling
    correction (it recomputes old log-probabilities, which DPPO does without), sequence-level importance sampling, the
    loss types that are trust regions of their own (`cispo`, `sapo`, `vespo`), the off-policy sequence mask, and
    transformers' continuous-batching generation (it records no per-token log-probabilities). PPO's `epsilon` /
    `epsilon_high` are not DPPO's thresholds: they set the ratio clip of the trust regions that clip (`grpo`,
    `minirl`, `relaxed_clip`) and what the diagnostics count as PPO-clipped; set elsewhere they warn, since
    `trl.experimental.dppo` used them as delta_low / delta_high. Its other names (`divergence_type`,
    `divergence_topk`, `clip_ratio_c`) raise an error naming the field here; `from_grpo_config` converts a GRPOConfig.
    """

    topk: int = field(
        default=20,
        metadata={"help": "K of the top-K divergence (the paper uses 20). Only read when `divergence` is topk_*."},
    )
    vllm_allow_truncated_sampling: bool = field(
        default=False,
        metadata={
            "help": "Accept top_p < 1, top_k > 0, min_p > 0, repetition_penalty != 1 or distribution-changing "
            "generation_kwargs with vLLM, although vLLM reports only the truncated (renormalised) mu: the divergence "
            "then includes a spurious (1 - Z)/Z, logged as truncation/* on the first step after each generation. "
            "Not needed with transformers generation, which records the untruncated mu."
        },
    )
    log_tokens_by_mu: bool = field(
        default=False,
        metadata={
            "help": "Also log tokens_by_mu/<bucket>/{total,masked,ppo_clipped}: per sampler-probability bucket (6 "
            "buckets, 18 series), the tokens, those the trust region masked and those PPO's clip would block. "
            "`trl-dppo plot` draws them as tokens_by_mu.png (skipped without them); the shipped jobs turn it on."
        },
    )
    vllm_importance_sampling_correction: bool = field(
        default=False,
        metadata={
            "help": "Must stay False: DPPO measures its trust region against the sampler's own log-probabilities, "
            "so GRPO's recomputation pass and importance-sampling correction are not needed."
        },
    )

    def __new__(cls, *args, **kwargs):
        # The dataclass __init__ would fail on an old name with a bare "unexpected keyword" TypeError
        renamed = {old: EXPERIMENTAL_DPPO_RENAMES[old] for old in kwargs if old in EXPERIMENTAL_DPPO_RENAMES}
        if renamed:
            hints = ", ".join(f"`{old}` is now `{new}`" for old, new in renamed.items())
            raise TypeError(
                f"DPPOConfig got trl.experimental.dppo's argument names: {hints}. See the README's migration section."
            )
        return super().__new__(cls)

    @classmethod
    def from_grpo_config(cls, config: GRPOConfig, **dppo_fields: Any) -> DPPOConfig:
        """Build a DPPOConfig from a [`~trl.GRPOConfig`], with `dppo_fields` (e.g. `divergence`, `delta`) on top.

        Every GRPOConfig setting of `config` carries over except the ones DPPO replaces: vLLM's importance-sampling
        correction (off: DPPO runs no recomputation to correct), and `generation_batch_size`, which GRPOConfig derived
        from `steps_per_generation` or the other way round (the step count is kept). GRPO's `delta` (a two-sided
        ratio clip) is refused because DPPOConfig's `delta` is the divergence threshold. Settings that contradict
        DPPO raise DPPOConfig's errors.
        """
        if not isinstance(config, GRPOConfig):
            raise TypeError(f"from_grpo_config takes a GRPOConfig, got {type(config).__name__}.")
        if config.delta is not None:
            raise ValueError(
                f"GRPOConfig.delta={config.delta} is GRPO's two-sided ratio clip, which DPPO does not use; "
                "DPPOConfig.delta is the divergence threshold. Set delta=None on the GRPOConfig and pass DPPO's "
                "threshold as from_grpo_config(config, delta=...)."
            )
        replaced = {"vllm_importance_sampling_correction", "generation_batch_size", "delta"}
        # Read the attributes, not to_dict(): that one writes tokens as placeholders and enums as strings
        settings = {f.name: getattr(config, f.name) for f in fields(GRPOConfig) if f.init and f.name not in replaced}
        return cls(**{**settings, **dppo_fields})

    def __post_init__(self):
        self._resolve_trust_region()
        if self.divergence.startswith("topk") and not (isinstance(self.topk, int) and self.topk >= 1):
            raise ValueError(f"topk must be a positive integer, got {self.topk!r}.")
        if self.vllm_importance_sampling_correction:
            raise ValueError(
                "vllm_importance_sampling_correction=True recomputes old log-probabilities and reweights by "
                "pi_old/mu; DPPO anchors its trust region to the sampler's log-probabilities directly. Set "
                "vllm_importance_sampling_correction=False."
            )
        if self.importance_sampling_level != "token":
            raise ValueError(
                f"importance_sampling_level={self.importance_sampling_level!r} is not supported: DPPO's mask and "
                "ratio are per token. Set importance_sampling_level='token'."
            )
        if self.loss_type not in SUPPORTED_LOSS_TYPES:
            raise ValueError(
                f"loss_type={self.loss_type!r} is a trust region of its own and cannot be combined with DPPO's. Use "
                f"one of {SUPPORTED_LOSS_TYPES}, which only choose how the loss is normalised (default 'dapo')."
            )
        if self.off_policy_mask_threshold is not None:
            raise ValueError(
                "off_policy_mask_threshold (GRPO's off-policy sequence mask) is a second trust region on top of "
                "DPPO's mask. Set off_policy_mask_threshold=None."
            )
        if self.use_transformers_continuous_batching or self.use_transformers_paged:
            raise ValueError(
                "Continuous-batching generation in transformers records no per-token log-probabilities, which DPPO "
                "needs as mu. Set use_transformers_continuous_batching=False (and use_transformers_paged=False), or "
                "use_vllm=True."
            )
        super().__post_init__()
        if self.use_vllm and not self.vllm_allow_truncated_sampling:
            refuse_vllm_truncated_sampling(
                self,
                "Remove it, use transformers generation (use_vllm=False), which records the untruncated mu, or set "
                "vllm_allow_truncated_sampling=True to accept the spurious divergence (logged as truncation/*).",
            )


def refuse_vllm_truncated_sampling(config: Any, remedy: str) -> None:
    """Refuse sampling options under which vLLM's log-probabilities are not those of softmax(logits / T).

    vLLM reports mu after truncation and penalties, which the trainer's pi = softmax(logits / T) lacks. `config` is a
    DPPOConfig or an AsyncDPPOConfig; options a config does not have (AsyncGRPOConfig has no `generation_kwargs` or
    structured outputs) are not set. `remedy` ends the error with what to do instead.
    """
    options = {
        "top_p": config.top_p is not None and config.top_p < 1.0,
        "top_k": config.top_k is not None and config.top_k > 0,
        "min_p": config.min_p is not None and config.min_p > 0.0,
        "repetition_penalty": config.repetition_penalty is not None and config.repetition_penalty != 1.0,
        "vllm_structured_outputs_regex": getattr(config, "vllm_structured_outputs_regex", None) is not None,
    }
    kwargs = getattr(config, "generation_kwargs", None) or {}
    for key, value in kwargs.items():
        if key == "temperature":
            options["generation_kwargs['temperature']"] = value != config.temperature
        elif key not in VLLM_DISTRIBUTION_NEUTRAL_KWARGS:
            options[f"generation_kwargs[{key!r}]"] = True
    for name, changes_distribution in options.items():
        if changes_distribution:
            raise ValueError(
                f"{name} with vLLM generation changes the sampling distribution, and vLLM reports only the "
                "processed (truncated, renormalised) log-probabilities, so mu would be compared with a pi that "
                "has none of it (at top_p=0.8 truncation alone makes |mu - pi| reach 0.2 > delta). " + remedy
            )
