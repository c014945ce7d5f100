"""The trust region's diagnostics by policy lag, for the asynchronous trainer.

`sums_by_lag` splits `diagnostics.trust_region_sums` (what the trust region did and how far pi is from mu, as sums
over the loss tokens) by how many policy versions a sample's sampler lags the trainer (0, 1, 2, 3 and more), which
`AsyncDPPOTrainer` logs as `<metric>_lag_<bucket>`: a user sees the trust region tighten as samples age. A lag counts
optimizer updates, `updates_since_sampled`: TRL publishes a policy version (`model_version`) every `weight_sync_steps`
updates, so versions alone would put samples up to `weight_sync_steps` - 1 updates old at lag 0; counted in updates,
lag 0 is always the weights that sampled.
"""

from __future__ import annotations

from typing import Any

import torch

from .diagnostics import RATES, gather_max, record_trust_region_sums, trust_region_sums


__all__ = [
    "LAG_BUCKETS",
    "LAG_RATES",
    "lag_rate_name",
    "record_sums_by_lag",
    "sums_by_lag",
    "updates_since_sampled",
]

# Policy lag buckets: lag 0, 1, 2, and 3 or more optimizer updates
LAG_BUCKETS = ("0", "1", "2", "3plus")
# The rates logged per lag bucket, and the bucket's share of the loss tokens
LAG_RATES = {
    **{
        name: RATES[name]
        for name in (
            "trust_region/masked_fraction",
            "mismatch/abs_prob_diff_mean",
            "diagnostics/bad_update_fraction",
            "diagnostics/bad_updates_blocked_by_ppo_clip",
            "diagnostics/bad_updates_blocked_by_dppo_mask",
        )
    },
    "staleness/token_fraction": ("tokens", None),  # None: the denominator is all the loss tokens
}


@torch.no_grad()
def sums_by_lag(lag: torch.Tensor, mask: torch.Tensor, **tokens: torch.Tensor | float) -> dict[str, torch.Tensor]:
    """`diagnostics.trust_region_sums` of the tokens of each lag bucket, keyed `<sum>_lag_<bucket>`.

    `lag` (per token, broadcast against `mask`) is how many policy versions the trainer's weights are ahead of the
    weights that sampled the token; the last bucket holds every lag from 3 on. `tokens` are `trust_region_sums`'
    other arguments.
    """
    bucket = lag.clamp(0, len(LAG_BUCKETS) - 1)
    sums = {}
    for index, label in enumerate(LAG_BUCKETS):
        for name, value in trust_region_sums(mask & (bucket == index), **tokens).items():
            sums[lag_rate_name(name, label)] = value
    return sums


def record_sums_by_lag(
    accelerator, metrics: dict[str, list], lag: torch.Tensor, mask: torch.Tensor, diagnostics: dict[str, Any]
) -> dict[str, float]:
    """The trust-region metrics of one loss, as DPPOTrainer logs them (`diagnostics.record_trust_region_sums`), and
    the same sums grouped by lag bucket, with the lag's mean and maximum, appended to `metrics` (rates as
    (numerator, denominator) pairs, reduced over the logging window); returns the sums over processes. `diagnostics`
    are `trust_region_sums`' arguments but the mask."""
    counts = trust_region_sums(mask, **diagnostics)
    counts.update(sums_by_lag(lag, mask, **diagnostics))
    counts["missing_sampler_logps"] = (~mask).sum()
    counts["lag"] = (lag * mask).sum()
    base_logps, trainer_logps = diagnostics["base_logps"], diagnostics["trainer_logps"]
    sums = record_trust_region_sums(accelerator, metrics, counts, mask, base_logps, trainer_logps)
    for bucket in LAG_BUCKETS:
        if sums[lag_rate_name("tokens", bucket)] == 0:  # no sample of this lag: the bucket is left out of the log
            continue
        for name, (numerator, denominator) in LAG_RATES.items():
            in_bucket = lag_rate_name(denominator, bucket) if denominator else "tokens"
            metrics[lag_rate_name(name, bucket)].append((sums[lag_rate_name(numerator, bucket)], sums[in_bucket]))
    metrics["staleness/lag_mean"].append((sums["lag"], sums["tokens"]))
    metrics["staleness/lag_max"].append(gather_max(accelerator, lag[mask].max() if mask.any() else lag.new_zeros(())))
    return sums


def lag_rate_name(name: str, bucket: str) -> str:
    """The name of rate `name` (a key of `LAG_RATES` or `diagnostics.RATES`, or one of their sums) in lag bucket
    `bucket`."""
    return f"{name}_lag_{bucket}"


def updates_since_sampled(versions: torch.Tensor, published_at: dict[int, int], step: int) -> torch.Tensor:
    """How many optimizer updates the trainer's weights, at optimizer step `step`, are past the weights that sampled
    each entry of `versions` (policy versions), given the step at which each version was published (`published_at`).
    """
    unknown = set(versions.unique().tolist()) - published_at.keys()
    if unknown:
        raise RuntimeError(
            f"Samples of policy versions {sorted(unknown)} reached the loss, but this trainer published only versions "
            f"{sorted(published_at)}: the rollout worker tags its samples with versions the trainer did not sync."
        )
    published = torch.tensor([published_at[v] for v in versions.tolist()], dtype=torch.long, device=versions.device)
    return step - published
