"""`AsyncDPPOConfig`: TRL's `AsyncGRPOConfig` plus DPPO's trust region, for `AsyncDPPOTrainer`."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl.experimental.async_grpo import AsyncGRPOConfig

from .config import (
    DISABLE_DROPOUT_HELP,
    STOP_ON_NON_FINITE_HELP,
    TrustRegionArguments,
    refuse_vllm_truncated_sampling,
)
from .trust_regions import get_trust_region
from .weight_sync import WEIGHT_SYNC_CHECKS, refuse_unknown_weight_sync_check


__all__ = ["AsyncDPPOConfig"]


@dataclass
class AsyncDPPOConfig(TrustRegionArguments, AsyncGRPOConfig):
    r"""
    Configuration for [`AsyncDPPOTrainer`]: everything TRL's `AsyncGRPOConfig` holds, plus DPPO's trust region.

    The trust-region fields are [`DPPOConfig`]'s: `trust_region` (`dppo`, or for a baseline in the same trainer
    `grpo`, PPO's ratio clip at `epsilon` / `epsilon_high`, or another registered method that needs only the sampled
    token's log-probabilities) with its `trust_region_kwargs`, `divergence` (`binary_tv` or `binary_kl`),
    `divergence_delta`, `delta_low` and `delta_high`. The trust region is anchored to the log-probability the rollout
    worker's vLLM server recorded for each sampled token, however many policy versions old (`max_staleness`).

    Refused here: the top-K divergences (TRL's rollout worker asks vLLM for the sampled token's log-probability only),
    a trust region that recomputes its anchor (`minirl`: the trainer runs no pass over a batch before updating on it),
    and truncated or penalised sampling (`top_p` < 1, `top_k` > 0, `min_p` > 0, `repetition_penalty` != 1: vLLM
    reports the log-probabilities after them, which pi = softmax(logits / T) lacks).

    `disable_dropout` (not a field of AsyncGRPOConfig) is GRPOConfig's, on by default as in [`DPPOConfig`]: the
    trainer zeroes the model's dropout, whose noise would make pi another function than the server's mu.
    `stop_on_non_finite` is [`DPPOConfig`]'s: training stops at the first step with a non-finite loss, gradient norm or
    parameter. `weight_sync_check` takes [`DPPOConfig`]'s values on this trainer's sync: after each adapter sync, the
    adapter the server was asked to load must be this version's, under the name the rollout worker requests, in
    files equal to the trainer's adapter tensors.
    """

    _VALID_DICT_FIELDS = AsyncGRPOConfig._VALID_DICT_FIELDS + [
        "trust_region_kwargs",
        "trust_region_corrections_kwargs",
    ]

    # AsyncGRPOConfig has no such field and AsyncGRPOTrainer leaves dropout on; AsyncDPPOTrainer applies it
    disable_dropout: bool = field(default=True, metadata={"help": DISABLE_DROPOUT_HELP})
    # DPPOConfig's field of the same name and help: both trainers stop at a non-finite step (`non_finite.py`)
    stop_on_non_finite: bool = field(default=True, metadata={"help": STOP_ON_NON_FINITE_HELP})
    # DPPOConfig's field of the same name and values, on this trainer's sync path (`adapter_sync.py`)
    weight_sync_check: str = field(
        default="raise",
        metadata={
            "help": "After each adapter sync to the vLLM server (TRL's adapter-file sync, with a LoRA adapter), check "
            "that the server was asked to load this version, under the name the rollout worker requests, from files "
            "equal to the trainer's adapter tensors: 'raise' stops at a difference naming it, 'log' logs "
            "weight_sync/mismatched_parameters and trains on, 'off' skips it. Each check logs "
            "weight_sync/checked_parameters (the adapter's tensors); a sync not checked logs weight_sync/unchecked. "
            "The server's memory is not read: it loads the files when asked.",
            "choices": list(WEIGHT_SYNC_CHECKS),
        },
    )

    def __post_init__(self):
        self._resolve_trust_region()
        if self.divergence.startswith("topk"):
            raise ValueError(
                f"divergence={self.divergence!r} needs the sampler's top-K log-probabilities at every token, and TRL's "
                "rollout worker asks vLLM for the sampled token's only. Use divergence='binary_tv' or 'binary_kl'."
            )
        if self.true_divergence_fraction > 0:
            raise ValueError(
                f"true_divergence_fraction={self.true_divergence_fraction}: TRL's rollout worker asks vLLM for the "
                "sampled token's log-probability only, so AsyncDPPOTrainer has no whole distribution to compare. "
                "Measure the true divergence with DPPOTrainer (transformers generation or vLLM colocate) and "
                "set true_divergence_fraction=0 here."
            )
        if get_trust_region(self.trust_region).recomputes_anchor:
            raise ValueError(
                f"trust_region={self.trust_region!r} clips against pi_old, recomputed by the trainer before a batch's "
                "first update; the asynchronous trainer runs no such pass, and its anchor is the sampler's record. "
                "Use trust_region='grpo' for PPO's clip against the sampler, or 'dppo'."
            )
        refuse_vllm_truncated_sampling(
            self, "Remove it: AsyncDPPOTrainer samples through vLLM, which cannot report the untruncated mu."
        )
        refuse_unknown_weight_sync_check(
            self.weight_sync_check, "when the adapter the server loads is not the trainer's"
        )
        super().__post_init__()  # parses `trust_region_kwargs` given as a JSON string
        self.trust_region_settings  # a bad or missing setting fails here, not at the first step  # noqa: B018
        self.trust_region_correction_settings  # likewise for the corrections  # noqa: B018
