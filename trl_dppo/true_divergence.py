"""The full-vocabulary divergence between the sampler's and the trainer's next-token distributions, beside DPPO's
estimates of it.

DPPO's binary and top-K divergences merge tokens (the sampled token against the rest; the sampler's K most likely and
the sampled one against the rest), and merging outcomes never increases TV or KL: each estimate is a lower bound of
the divergence the threshold delta is meant to bound. With `true_divergence_fraction` the sampler keeps its whole
next-token distribution for a share of the completions and the trainer compares it with its own at every optimizer
step, which shows how loose the trust region is in a run.

Pure tensor functions, usable in any loop: `full_vocabulary_divergences` gives the true divergence and both estimates
on the same tokens, computed from the same two distributions, so binary <= top-K <= true holds up to float64
rounding; `true_divergence_sums` reduces them with the trust region's decisions to sums over tokens, whose ratios are
the logged rates (`TRUE_DIVERGENCE_RATES`).
"""

from __future__ import annotations

import torch

from .divergence import _check_kind, trust_region_mask


__all__ = [
    "FULL_VOCABULARY_DIVERGENCES",
    "TRUE_DIVERGENCE_RATES",
    "divergences_from_hidden",
    "full_vocabulary_divergences",
    "true_divergence_sums",
]

# The divergences `full_vocabulary_divergences` gives per token
FULL_VOCABULARY_DIVERGENCES = ("tv", "kl", "binary_tv", "binary_kl", "topk_tv", "topk_kl")
# Logged rate -> (numerator, denominator) among `true_divergence_sums`' keys
TRUE_DIVERGENCE_RATES = {
    **{f"true_divergence/{name}_mean": (name, "tokens") for name in FULL_VOCABULARY_DIVERGENCES},
    "true_divergence/over_delta_fraction": ("over_delta", "tokens"),
    "true_divergence/caught_fraction": ("caught", "over_delta"),
    "true_divergence/missed_block_fraction": ("missed_block", "tokens"),
}


# Probabilities are floored here inside logarithms (float64's smallest normal), so a KL whose trainer side reaches 0 is
# large but finite, and a distribution against itself gives 0 exactly
_TINY = torch.finfo(torch.float64).tiny


def _kl_terms(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """p * log(p / q) per outcome in float64, 0 where p = 0."""
    return torch.xlogy(p, p) - torch.xlogy(p, q.clamp_min(_TINY))


def _merged(p: torch.Tensor, q: torch.Tensor, kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """TV and KL(p || q) over the outcomes `kept` (each its own) plus one bucket holding every other outcome."""
    rest_p = torch.where(kept, 0.0, p).sum(-1)
    rest_q = torch.where(kept, 0.0, q).sum(-1)
    tv = 0.5 * (torch.where(kept, (p - q).abs(), 0.0).sum(-1) + (rest_p - rest_q).abs())
    kl = torch.where(kept, _kl_terms(p, q), 0.0).sum(-1) + _kl_terms(rest_p, rest_q)
    return tv, kl


@torch.no_grad()
def full_vocabulary_divergences(
    sampler_logps: torch.Tensor, trainer_logps: torch.Tensor, sampled_ids: torch.Tensor, topk: int
) -> dict[str, torch.Tensor]:
    """The true divergence and DPPO's estimates of it, per token, in float64.

    Args:
        sampler_logps: `(N, V)` log mu_base, the sampler's whole next-token distribution at each token (normalised
            again in float64).
        trainer_logps: `(N, V)` log pi, the trainer's (likewise).
        sampled_ids: `(N,)` the sampled tokens.
        topk: K of the top-K estimate (the sampler's K most likely tokens plus the sampled one are kept).

    Returns:
        `FULL_VOCABULARY_DIVERGENCES` -> `(N,)`: `tv` and `kl` (KL(mu || pi)) over the vocabulary, `binary_*` over
        {sampled token, the rest}, `topk_*` over the kept tokens and one bucket for the rest. Each estimate merges the
        same probabilities the true divergence sums (the rest bucket is summed, not taken as 1 minus the kept mass),
        so binary <= top-K <= true exactly, up to the float64 rounding of sums over V terms.
    """
    # softmax in float64 renormalises each side: exp of float32 log-probabilities sums to 1 only to about V ulps,
    # which would enter TV as noise and could make a KL negative
    p, q = torch.softmax(sampler_logps.double(), -1), torch.softmax(trainer_logps.double(), -1)
    out = {"tv": 0.5 * (p - q).abs().sum(-1), "kl": _kl_terms(p, q).sum(-1)}
    kept = torch.zeros_like(p, dtype=torch.bool).scatter_(-1, sampled_ids.long()[:, None], True)
    out["binary_tv"], out["binary_kl"] = _merged(p, q, kept)
    kept.scatter_(-1, p.topk(min(topk, p.size(-1)), dim=-1).indices, True)
    out["topk_tv"], out["topk_kl"] = _merged(p, q, kept)
    return out


@torch.no_grad()
def true_divergence_sums(
    divergences: dict[str, torch.Tensor],
    estimate: torch.Tensor,
    dppo_keep: torch.Tensor,
    base_logps: torch.Tensor,
    trainer_logps: torch.Tensor,
    advantages: torch.Tensor,
    kind: str,
    delta_low: float,
    delta_high: float,
) -> dict[str, torch.Tensor]:
    """Sums over the recorded tokens of what the true divergence says about the trust region's decisions, as 0-d
    tensors (not yet added over processes).

    Args:
        divergences: `full_vocabulary_divergences`' output for the `N` recorded tokens.
        estimate: `(N,)` the divergence the trust region used at those tokens (its configured estimate).
        dppo_keep: `(N,)` DPPO's mask there (True: the token kept its gradient).
        base_logps, trainer_logps: `(N,)` log mu_base and log pi of the sampled tokens, as the mask compared them.
        advantages: `(N,)` the tokens' advantages.
        kind: the trust region's divergence, `"tv"` or `"kl"`.
        delta_low, delta_high: DPPO's thresholds (negative, positive advantages).

    A token is over delta when its true divergence of `kind` exceeds its side's threshold (delta_high for a positive
    advantage, delta_low otherwise); `caught` counts those the estimate also puts past it; `missed_block` the tokens
    DPPO's mask kept that the same rule on the true divergence (direction test included) would block.
    """
    _check_kind(kind)
    true = divergences[kind]
    threshold = torch.where(advantages > 0, delta_high, delta_low).double()
    over = true > threshold
    true_keep = trust_region_mask(true, base_logps, trainer_logps, advantages, delta_low, delta_high)
    sums = {name: value.sum() for name, value in divergences.items()}
    sums.update(
        tokens=torch.tensor(float(true.numel()), dtype=torch.float64, device=true.device),
        over_delta=over.sum(),
        caught=(over & (estimate.double() > threshold)).sum(),
        missed_block=(dppo_keep & ~true_keep).sum(),
    )
    return sums


# Per chunk of tokens, the `(n, V)` logits and the float64 intermediates of `full_vocabulary_divergences` (about 8
# tensors of n x V x 8 bytes) take at most this much
_CHUNK_BYTES = 64 * 2**20


@torch.no_grad()
def divergences_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    sampler_logps: torch.Tensor,
    sampled_ids: torch.Tensor,
    topk: int,
    temperature: float = 1.0,
) -> dict[str, torch.Tensor]:
    """`full_vocabulary_divergences` with the trainer's pi = softmax((W h + b) / T) from hidden states `(N, H)` and the
    LM head `weight` `(V, H)`, `bias`; `sampler_logps` `(N, V)` may sit on another device (the CPU). Runs a chunk of
    tokens at a time, so the transient is bounded whatever N (`_CHUNK_BYTES`); N = 0 gives empty tensors."""
    vocab = weight.size(0)
    chunk = max(1, _CHUNK_BYTES // (8 * 8 * vocab))
    weight = weight.float()
    parts = []
    for start in range(0, hidden.size(0), chunk):
        end = min(start + chunk, hidden.size(0))
        logits = hidden[start:end].float() @ weight.T
        if bias is not None:
            logits = logits + bias.float()
        trainer_logps = torch.log_softmax(logits / temperature, dim=-1)
        sampler = sampler_logps[start:end].to(trainer_logps.device)
        parts.append(full_vocabulary_divergences(sampler, trainer_logps, sampled_ids[start:end], topk))
    if not parts:
        return {name: hidden.new_zeros(0, dtype=torch.float64) for name in FULL_VOCABULARY_DIVERGENCES}
    return {name: torch.cat([part[name] for part in parts]) for name in FULL_VOCABULARY_DIVERGENCES}
