"""What DPPOTrainer logs about its trust region, apart from the algorithm.

`trust_region_sums` is a pure function: the per-token quantities of one loss computation reduced to sums over a token
mask (not yet gathered over processes), so a trainer can log them over any subset of tokens (the asynchronous
trainer logs them per policy lag). `TrustRegionDiagnostics`, owned by the trainer and called once per loss, gathers
them over processes into the logged metrics, keeps the masked-token counts behind `masked_tokens.json` (training state:
saved in each checkpoint and restored on resume) and, with truncated vLLM sampling, the truncation gap.

The metrics (see docs/metrics.md):

- `trust_region/masked_fraction` (`_pos_adv`, `_neg_adv`): loss tokens the trust region blocked;
  `trust_region/ratio_limited_tokens`: kept tokens whose ratio pi / mu reached `losses.LOG_RATIO_LIMIT`.
- `mismatch/*`: the trainer's pi against the sampler's mu_base, the distribution the sampler had before any
  truncation or penalty (mu itself when it sampled untruncated, as by default); `mismatch/at_sync_*` the same on the
  first optimizer step after each generation, before any update; `mismatch/missing_sampler_logps`: loss tokens
  without a sampler log-probability, taken out of the loss.
- `diagnostics/*`: the paper's "bad updates" (A < 0 and mu_base - pi >= 0.5) and how many PPO's clip and DPPO's mask
  would block; `tokens_by_mu/*` (with `log_tokens_by_mu`): counts by the sampler's probability.
- `corrections/<name>/*` (with `trust_region_corrections`, `corrections.py`): for a mask or truncation the loss tokens
  it removed or truncated (`token_fraction`) and the completions with any (`sequence_fraction`); for the KL penalty
  its mean value per loss token (`penalty_mean`).
- `true_divergence/*` (with `true_divergence_fraction`, `true_divergence.py`): the full-vocabulary divergence beside
  the binary and top-K estimates on the recorded tokens, and what it says about the mask's decisions.

Over a logging window every rate is the window's numerator over its denominator, every maximum the window's and every
count the window's total (`reduce_window`): each loss logs a rate as a (numerator, denominator) pair, and both trainers'
`log` reduce DPPO's window lists (`reduce_dppo_metrics`) before TRL's `log`, which would average them.
"""

from __future__ import annotations

import json
import os
from collections import Counter

import torch
from accelerate.utils import gather_object
from transformers import TrainerCallback

from .corrections import CorrectionOutput
from .losses import LOG_RATIO_LIMIT, ratio_clip_keep
from .true_divergence import TRUE_DIVERGENCE_RATES


__all__ = [
    "COUNTS",
    "MAXIMA",
    "METRIC_PREFIXES",
    "MU_BUCKETS",
    "MU_BUCKET_EDGES",
    "RATES",
    "TrustRegionDiagnostics",
    "correction_metrics",
    "correction_sums",
    "gather_sums",
    "metrics_from_sums",
    "reduce_dppo_metrics",
    "record_correction_sums",
    "record_trust_region_sums",
    "reduce_window",
    "trust_region_sums",
]

# In each checkpoint: the masked-token counts summed over processes, restored on resume
MASKED_TOKEN_COUNTS_NAME = "dppo_masked_token_counts.json"
# Sampler-probability buckets for the masked/kept token counts (`tokens_by_mu/<label>/...` metrics)
MU_BUCKET_EDGES = (1e-3, 1e-2, 1e-1, 0.5, 0.9)
MU_BUCKETS = ("<0.001", "0.001-0.01", "0.01-0.1", "0.1-0.5", "0.5-0.9", ">=0.9")
# The paper's RQ3 "bad update": a negative-advantage token whose probability dropped by this much
BAD_UPDATE_DROP = 0.5
# Logged rate -> (numerator, denominator) among `trust_region_sums`' keys
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
# The metrics of both trainers' diagnostics (and of `staleness.py`), which `reduce_dppo_metrics` reduces; TRL logs none
METRIC_PREFIXES = (
    "trust_region/",
    "mismatch/",
    "diagnostics/",
    "tokens_by_mu/",
    "staleness/",
    "truncation/",
    "corrections/",
    "routing/",
    "weight_sync/",
    "true_divergence/",
)
# Of those, the maxima (the window's largest) and the counts (the window's total; also every `tokens_by_mu/*`); every
# other one is a rate, logged as a (numerator, denominator) pair
MAXIMA = frozenset(
    {
        "mismatch/abs_prob_diff_max",
        "mismatch/at_sync_abs_prob_diff_max",
        "staleness/lag_max",
        "weight_sync/max_abs_diff",
        "weight_sync/probe_gap",
    }
)
COUNTS = frozenset(
    {
        "trust_region/ratio_limited_tokens",
        "mismatch/missing_sampler_logps",
        "true_divergence/recorded_tokens",
        "weight_sync/checked_parameters",
        "weight_sync/mismatched_parameters",
        "weight_sync/unchecked",
        "weight_sync/probe_unresolved",
        "weight_sync/probe_served_previous",
        "weight_sync/probe_missing_tokens",
    }
)


@torch.no_grad()
def trust_region_sums(
    mask: torch.Tensor,
    keep: torch.Tensor,
    dppo_keep: torch.Tensor,
    advantages: torch.Tensor,
    sampler_logps: torch.Tensor,
    base_logps: torch.Tensor,
    trainer_logps: torch.Tensor,
    epsilon_low: float,
    epsilon_high: float,
    by_mu: bool = False,
) -> dict[str, torch.Tensor]:
    """Sums over the tokens of `mask` `(B, T)` of what the trust region did, as 0-d tensors.

    `keep` is the trust region's mask, `dppo_keep` DPPO's own (the diagnostics compare it with PPO's clip whatever the
    method); `sampler_logps` log mu (for the ratio), `base_logps` log mu_base (for the mismatch and the bad updates),
    `trainer_logps` log pi. Rates are ratios of two sums (`RATES`), so that sums over processes, steps or any subset
    of tokens give the exact rate.
    """
    advantages = advantages.expand_as(mask)
    masked = ~keep & mask
    pos, neg = (advantages > 0) & mask, (advantages < 0) & mask
    mu, pi = base_logps.double().exp(), trainer_logps.double().exp()
    prob_diff = (pi - mu).abs()
    log_ratio = trainer_logps.double() - base_logps.double()
    # k3 estimator r - 1 - log r of KL(mu || pi) on tokens drawn from mu: unbiased and never negative
    kl = torch.expm1(log_ratio) - log_ratio
    ppo_clipped = ~ratio_clip_keep(log_ratio.exp(), advantages, epsilon_low, epsilon_high)
    bad = (advantages < 0) & (mu - pi >= BAD_UPDATE_DROP) & mask
    limited = keep & mask & (trainer_logps.double() - sampler_logps.double() > LOG_RATIO_LIMIT)
    sums = {
        "masked": masked.sum(),
        "tokens": mask.sum(),
        "masked_pos_adv": (masked & pos).sum(),
        "pos_adv": pos.sum(),
        "masked_neg_adv": (masked & neg).sum(),
        "neg_adv": neg.sum(),
        "ratio_limited": limited.sum(),
        "abs_prob_diff": torch.where(mask, prob_diff, 0.0).sum(),
        "kl": torch.where(mask, kl, 0.0).sum(),
        "bad": bad.sum(),
        "bad_ppo_clipped": (bad & ppo_clipped).sum(),
        "bad_dppo_masked": (bad & ~dppo_keep).sum(),
    }
    if by_mu:
        # Where the mask and PPO's ratio clip (at the config's epsilon) act, by the sampler's probability
        bucket = torch.bucketize(mu, torch.tensor(MU_BUCKET_EDGES, dtype=mu.dtype, device=mu.device), right=True)
        for b, label in enumerate(MU_BUCKETS):
            in_bucket = (bucket == b) & mask
            sums[f"tokens_by_mu/{label}/total"] = in_bucket.sum()
            sums[f"tokens_by_mu/{label}/masked"] = (in_bucket & masked).sum()
            sums[f"tokens_by_mu/{label}/ppo_clipped"] = (in_bucket & ppo_clipped).sum()
    return sums


@torch.no_grad()
def correction_sums(mask: torch.Tensor, outputs: dict[str, CorrectionOutput]) -> dict[str, torch.Tensor]:
    """Sums over the loss tokens of `mask` `(B, T)` (one completion per row) of what each correction did
    (`corrections.apply_corrections`' outputs), with the token and completion counts they are rates of."""
    sums = {"corrections/tokens": mask.sum(), "corrections/sequences": mask.any(-1).sum()}
    for name, output in outputs.items():
        if output.affected is not None:
            affected = output.affected.expand_as(mask) & mask
            sums[f"corrections/{name}/token_fraction"] = affected.sum()
            sums[f"corrections/{name}/sequence_fraction"] = affected.any(-1).sum()
        if output.penalty is not None:
            sums[f"corrections/{name}/penalty_mean"] = torch.where(mask, output.penalty.double(), 0.0).sum()
    return sums


def correction_metrics(sums: dict[str, float]) -> dict[str, tuple[float, float]]:
    """The logged rates of `correction_sums` added up over processes, as (numerator, denominator) pairs."""
    return {
        name: (value, sums["corrections/sequences" if name.endswith("sequence_fraction") else "corrections/tokens"])
        for name, value in sums.items()
        if name.count("/") == 2
    }


def metrics_from_sums(sums: dict[str, float]) -> dict[str, float | tuple[float, float]]:
    """The logged metrics of `trust_region_sums` added up over processes: the rates of `RATES` as (numerator,
    denominator) pairs, the count of ratio-limited tokens and the `tokens_by_mu/*` counts."""
    metrics: dict[str, float | tuple[float, float]] = {
        name: (sums[num], sums[den]) for name, (num, den) in RATES.items()
    }
    metrics["trust_region/ratio_limited_tokens"] = sums["ratio_limited"]
    metrics.update({name: value for name, value in sums.items() if name.startswith("tokens_by_mu/")})
    return metrics


def reduce_window(name: str, values: list) -> float:
    """One logging window's values of DPPO's metric `name` as the number logged: a maximum's largest value, a count's
    total, and a rate's summed numerators over its summed denominators, NaN over no token (which TRL's `log` filters
    out, logging None, rather than 0, which would read as "nothing blocked")."""
    if name in MAXIMA:
        return max(values)
    if name in COUNTS or name.startswith("tokens_by_mu/"):
        return sum(values)
    numerator, denominator = (sum(part) for part in zip(*values, strict=True))
    return numerator / denominator if denominator else float("nan")


def reduce_dppo_metrics(metrics: dict[str, list]) -> None:
    """Replace each of DPPO's window lists in `metrics` (a trainer's `_metrics[mode]`) by `[reduce_window(...)]`, which
    TRL's `log` passes on as it is: it averages a list, or picks its extremum or total, and a list of one value is that
    value."""
    for name, values in metrics.items():
        if name.startswith(METRIC_PREFIXES) and values:
            metrics[name] = [reduce_window(name, values)]


def gather_sums(accelerator, sums: dict[str, torch.Tensor]) -> dict[str, float]:
    """Each sum added over processes, in one collective."""
    stacked = torch.stack([value.double() for value in sums.values()])
    return dict(zip(sums, accelerator.reduce(stacked, reduction="sum").tolist(), strict=True))


def gather_max(accelerator, value: torch.Tensor) -> float:
    """The largest of each process's `value` (a 0-d tensor)."""
    return accelerator.gather(value.double().reshape(1)).max().item()


def record_trust_region_sums(
    accelerator,
    metrics: dict[str, list],
    sums: dict[str, torch.Tensor],
    mask: torch.Tensor,
    base_logps: torch.Tensor,
    trainer_logps: torch.Tensor,
) -> dict[str, float]:
    """Both trainers' path from one loss's sums to its metrics: `sums` (`trust_region_sums`', with
    `missing_sampler_logps` and any of the caller's own) added over processes, their metrics (`metrics_from_sums`),
    the count of missing sampler log-probabilities and the largest |pi - mu_base| over the tokens of `mask` appended
    to `metrics` (a trainer's `_metrics[mode]`); returns the sums over processes."""
    gathered = gather_sums(accelerator, sums)
    for name, value in metrics_from_sums(gathered).items():
        metrics[name].append(value)
    prob_diff = (trainer_logps.double().exp() - base_logps.double().exp()).abs()
    local_max = prob_diff[mask].max() if mask.any() else prob_diff.new_zeros(())
    metrics["mismatch/abs_prob_diff_max"].append(gather_max(accelerator, local_max))
    metrics["mismatch/missing_sampler_logps"].append(gathered["missing_sampler_logps"])
    return gathered


def record_correction_sums(
    accelerator, metrics: dict[str, list], mask: torch.Tensor, outputs: dict[str, CorrectionOutput]
) -> None:
    """Both trainers' path from what the corrections did in one loss (`outputs`, over the tokens of `mask`) to their
    metrics, added up over processes (every process calls it) and appended to `metrics`."""
    if not outputs:
        return
    for name, value in correction_metrics(gather_sums(accelerator, correction_sums(mask, outputs))).items():
        metrics[name].append(value)


class TrustRegionDiagnostics:
    """The trainer's diagnostics: metrics per loss computation, the masked-token counts and their checkpoint file.

    `trainer` is a DPPOTrainer (or a subclass): its accelerator, `_metrics`, config and tokenizer are read.
    """

    def __init__(self, trainer):
        self.trainer = trainer
        self.masked_token_counts = {"positive": Counter(), "negative": Counter()}

    def record(
        self,
        mode: str,
        at_sync: bool,
        completion_ids: torch.Tensor,
        mask: torch.Tensor,
        keep: torch.Tensor,
        dppo_keep: torch.Tensor,
        advantages: torch.Tensor,
        sampler_logps: torch.Tensor,
        base_logps: torch.Tensor,
        trainer_logps: torch.Tensor,
        missing_sampler_logps: torch.Tensor,
    ) -> None:
        """Log one loss computation's metrics (every process calls it: they are gathered). `at_sync`: no update since
        the batch was sampled, so the gap is the sampler-trainer mismatch alone (precision, kernels)."""
        args = self.trainer.args
        settings = self.trainer.epsilon_low, self.trainer.epsilon_high
        advantages = advantages.expand_as(mask)
        masked = ~keep & mask
        if mode == "train":  # the counts are training state, carried by checkpoints: evaluation adds nothing to them
            for sign, side in (("positive", advantages > 0), ("negative", advantages < 0)):
                self.masked_token_counts[sign].update(completion_ids[masked & side].tolist())
        sums = trust_region_sums(
            mask,
            keep,
            dppo_keep,
            advantages,
            sampler_logps,
            base_logps,
            trainer_logps,
            *settings,
            args.log_tokens_by_mu,
        )
        sums["missing_sampler_logps"] = missing_sampler_logps
        metrics = self.trainer._metrics[mode]
        record_trust_region_sums(self.trainer.accelerator, metrics, sums, mask, base_logps, trainer_logps)
        if mode == "train" and at_sync:
            for name in ("abs_prob_diff_mean", "abs_prob_diff_max", "kl_mean"):
                metrics[f"mismatch/at_sync_{name}"].append(metrics[f"mismatch/{name}"][-1])

    def record_corrections(self, mode: str, mask: torch.Tensor, outputs: dict[str, CorrectionOutput]) -> None:
        """Log what the corrections did in one loss computation (every process calls it: the sums are gathered)."""
        record_correction_sums(self.trainer.accelerator, self.trainer._metrics[mode], mask, outputs)

    def record_true_divergence(self, mode: str, sums: dict[str, torch.Tensor]) -> None:
        """Log one loss computation's `true_divergence_sums` (every process calls it: they are gathered), as the rates
        of `TRUE_DIVERGENCE_RATES` and the count of recorded tokens."""
        gathered = gather_sums(self.trainer.accelerator, sums)
        metrics = self.trainer._metrics[mode]
        for name, (numerator, denominator) in TRUE_DIVERGENCE_RATES.items():
            metrics[name].append((gathered[numerator], gathered[denominator]))
        metrics["true_divergence/recorded_tokens"].append(gathered["tokens"])

    def record_truncation_gap(self, mask: torch.Tensor, sampler_logps: torch.Tensor, trainer_logps: torch.Tensor):
        """With `vllm_allow_truncated_sampling`, on the first optimizer step after a generation (the trainer's weights
        are the sampler's): mu/pi - 1 estimates (1 - Z)/Z, Z the mass the truncation kept, and mu - pi the spurious
        binary TV, compared with delta_low."""
        mu, pi = sampler_logps.double().exp(), trainer_logps.double().exp()
        over = (mu - pi > self.trainer.args.delta_low) & mask
        sums = gather_sums(
            self.trainer.accelerator,
            {"gap": torch.where(mask, mu / pi - 1, 0.0).sum(), "over": over.sum(), "tokens": mask.sum()},
        )
        metrics = self.trainer._metrics["train"]
        metrics["truncation/kept_mass_gap"].append((sums["gap"], sums["tokens"]))
        metrics["truncation/spurious_tv_over_delta_fraction"].append((sums["over"], sums["tokens"]))

    def record_replayed_routes(self, mode: str, replayed) -> None:
        """With router replay (`moe.ReplayedRoutes` of one loss forward): the share of replayed routing decisions (a
        token in one MoE layer) where the trainer's router would have chosen another expert set than the sampler."""
        sums = gather_sums(
            self.trainer.accelerator,
            {
                name: torch.tensor(getattr(replayed, name), device=self.trainer.accelerator.device)
                for name in ("differing", "replayed")
            },
        )
        self.trainer._metrics[mode]["routing/differing_expert_sets"].append((sums["differing"], sums["replayed"]))

    # --------------------------------------------------------------------------------------- masked-token counts

    def counts_over_processes(self) -> dict[str, Counter]:
        """The masked-token counts summed over processes (every process must call it)."""
        total = {sign: Counter() for sign in self.masked_token_counts}
        for counts in gather_object([self.masked_token_counts]):
            for sign, counter in counts.items():
                total[sign].update(counter)
        return total

    def masked_tokens_report(self, top: int = 20) -> dict[str, list[dict]]:
        """The tokens the trust region masked most often over all processes, decoded, per advantage sign."""
        decode = self.trainer.processing_class.decode
        return {
            sign: [
                {"token": decode([token_id]), "id": token_id, "count": count}
                for token_id, count in counter.most_common(top)
            ]
            for sign, counter in self.counts_over_processes().items()
        }

    def save_counts(self, folder: str, should_save: bool) -> None:
        """Write the counts summed over processes into a checkpoint folder (every process calls it)."""
        counts = self.counts_over_processes()
        if should_save:
            with open(os.path.join(folder, MASKED_TOKEN_COUNTS_NAME), "w") as f:
                json.dump({sign: dict(counter) for sign, counter in counts.items()}, f)

    def load_counts(self, checkpoint: str | None) -> None:
        """Continue the counts of a checkpoint being resumed (the main process holds the sum; the others restart)."""
        path = os.path.join(checkpoint, MASKED_TOKEN_COUNTS_NAME) if checkpoint else None
        if not (path and os.path.isfile(path)):
            return
        self.masked_token_counts = {"positive": Counter(), "negative": Counter()}
        if self.trainer.accelerator.is_main_process:
            with open(path) as f:
                for sign, counts in json.load(f).items():
                    self.masked_token_counts[sign].update({int(i): c for i, c in counts.items()})

    def callback(self) -> TrainerCallback:
        """Writes `masked_tokens.json` into `output_dir` at each save and at the end of training."""
        return _MaskedTokensWriter(self)


class _MaskedTokensWriter(TrainerCallback):
    def __init__(self, diagnostics: TrustRegionDiagnostics):
        self.diagnostics = diagnostics

    def _write(self, args, state) -> None:
        report = self.diagnostics.masked_tokens_report()  # every process takes part: the counts are summed over them
        if state.is_world_process_zero and args.output_dir:
            os.makedirs(args.output_dir, exist_ok=True)
            with open(os.path.join(args.output_dir, "masked_tokens.json"), "w") as f:
                json.dump(report, f, indent=1)

    def on_save(self, args, state, control, **kwargs):
        self._write(args, state)

    def on_train_end(self, args, state, control, **kwargs):
        self._write(args, state)
