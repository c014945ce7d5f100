"""Trust-region diagnostics of the loss tokens, overall and by policy lag.

Pure tensor functions returning sums over the loss tokens, which a trainer adds up over processes and divides into the
rates of `RATES`. `trust_region_sums` counts what `DPPOTrainer._log_trust_region` logs (the masked fraction by
advantage sign, |pi - mu| and KL(mu || pi), the paper's bad updates and who blocks them), so both trainers can share
it; `sums_by_lag` splits the same sums by how many policy versions a sample's sampler lags the trainer (0, 1, 2, 3 and
more), which `AsyncDPPOTrainer` logs as `<metric>_lag_<bucket>`.
"""

from __future__ import annotations

import torch

from .losses import ratio_clip_keep


__all__ = ["LAG_BUCKETS", "LAG_RATES", "RATES", "lag_rate_name", "sums_by_lag", "trust_region_sums"]

# Policy lag buckets: lag 0, 1, 2, and 3 or more versions
LAG_BUCKETS = ("0", "1", "2", "3plus")
# metric -> (numerator, denominator) among `trust_region_sums`' keys
RATES = {
    "trust_region/masked_fraction": ("masked", "tokens"),
    "trust_region/masked_fraction_pos_adv": ("masked_pos_adv", "pos_adv"),
    "trust_region/masked_fraction_neg_adv": ("masked_neg_adv", "neg_adv"),
    "mismatch/abs_prob_diff_mean": ("abs_prob_diff", "tokens"),
    "mismatch/kl_mean": ("kl", "tokens"),
    "diagnostics/bad_update_fraction": ("bad", "tokens"),
    "diagnostics/bad_updates_blocked_by_ppo_clip": ("bad_ppo_clipped", "bad"),
    "diagnostics/bad_updates_blocked_by_dppo_mask": ("bad_dppo_masked", "bad"),
}
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
def trust_region_sums(
    mask: torch.Tensor,
    keep: torch.Tensor,
    dppo_keep: torch.Tensor,
    advantages: torch.Tensor,
    sampler_logps: torch.Tensor,
    trainer_logps: torch.Tensor,
    epsilon_low: float,
    epsilon_high: float,
) -> dict[str, torch.Tensor]:
    """Sums over the loss tokens (`mask`) of what the trust region did and how far pi is from mu.

    Args:
        mask: the loss tokens.
        keep: the trust region's mask (False: blocked).
        dppo_keep: DPPO's own mask, whatever the trust region, which the bad-update diagnostics compare with PPO's
            clip (at `epsilon_low` / `epsilon_high`, measured against mu).
        advantages: broadcast against the tokens.
        sampler_logps, trainer_logps: log mu and log pi of the sampled tokens (neutral, mu = pi, outside `mask`).
    """
    advantages = advantages.expand_as(mask)
    masked = ~keep & mask
    pos, neg = (advantages > 0) & mask, (advantages < 0) & mask
    mu, pi = sampler_logps.exp(), trainer_logps.exp()
    log_ratio = trainer_logps - sampler_logps
    # k3 estimator r - 1 - log r of KL(mu || pi) on tokens drawn from mu: unbiased and never negative
    kl = torch.expm1(log_ratio) - log_ratio
    ppo_clipped = ~ratio_clip_keep(log_ratio.exp(), advantages, epsilon_low, epsilon_high)
    # The paper's "bad updates" (RQ3): negative advantage and a drop of the sampled token's probability >= 0.5
    bad = (advantages < 0) & (mu - pi >= 0.5) & mask
    return {
        "masked": masked.sum(),
        "tokens": mask.sum(),
        "masked_pos_adv": (masked & pos).sum(),
        "pos_adv": pos.sum(),
        "masked_neg_adv": (masked & neg).sum(),
        "neg_adv": neg.sum(),
        "abs_prob_diff": ((pi - mu).abs() * mask).sum(),
        "kl": (kl * mask).sum(),
        "bad": bad.sum(),
        "bad_ppo_clipped": (bad & ppo_clipped).sum(),
        "bad_dppo_masked": (bad & ~dppo_keep).sum(),
    }


@torch.no_grad()
def sums_by_lag(lag: torch.Tensor, mask: torch.Tensor, **tokens: torch.Tensor | float) -> dict[str, torch.Tensor]:
    """`trust_region_sums` of the tokens of each lag bucket, keyed `<sum>_lag_<bucket>`.

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


def lag_rate_name(name: str, bucket: str) -> str:
    """The name of rate `name` (a key of `LAG_RATES` or `RATES`, or one of their sums) in lag bucket `bucket`."""
    return f"{name}_lag_{bucket}"
