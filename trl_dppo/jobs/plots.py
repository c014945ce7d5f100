"""Plots of a DPPO run from its log history.

    python -m trl_dppo.jobs.plots OUTPUT_DIR [--out PLOT_DIR]

reads ``OUTPUT_DIR/log_history.json`` (written by the example scripts) or a Trainer's ``trainer_state.json`` (in
OUTPUT_DIR, or in its latest ``checkpoint-*``; a path to either file works too) and writes into ``OUTPUT_DIR/plots/``:

- ``reward.png``: mean reward per step, with a moving average;
- ``masked_fraction.png``: fraction of tokens the trust region masked, overall and by advantage sign;
- ``mismatch.png``: mean and max |pi - mu| of the sampled tokens (log scale);
- ``tokens_by_mu.png``: tokens kept and masked by DPPO per sampler-probability bucket, beside the tokens PPO's ratio
  clip would have blocked, as counts and as fractions of the bucket (where the two trust regions disagree).
  Skipped, with a note, when the log has no ``tokens_by_mu/...`` metrics.
- ``true_divergence.png`` (runs with ``true_divergence_fraction`` > 0): per step, on the recorded tokens, the
  full-vocabulary TV beside DPPO's binary and top-K estimates of it, the same for KL, and the shares of tokens whose
  true divergence is past delta (``over_delta``) and that DPPO's mask kept although the true divergence would block
  them (``missed_block``), with the share of the former the configured estimate caught (docs/true_divergence.md).
  Skipped, with a note, when the log has no ``true_divergence/...`` metrics.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..extras import INSTALL_EXAMPLES, import_extra


matplotlib = import_extra("matplotlib", "Drawing a run's plots", INSTALL_EXAMPLES)
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


__all__ = [
    "bucket_means",
    "load_log_history",
    "main",
    "moving_average",
    "mu_buckets",
    "plot_run",
    "series",
    "true_divergence_summary",
]


LogHistory = Sequence[Mapping[str, Any]]


def _checkpoint_number(path: Path) -> int:
    match = re.search(r"checkpoint-(\d+)$", path.name)
    return int(match.group(1)) if match else -1


def load_log_history(path: str | Path) -> list[dict[str, Any]]:
    """Read a log history from a run folder, a checkpoint folder, ``log_history.json`` or ``trainer_state.json``."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: pass a run's output_dir (with log_history.json) or a file.")
    if path.is_dir():
        candidates = [path / "log_history.json", path / "trainer_state.json"]
        checkpoints = sorted(path.glob("checkpoint-*"), key=_checkpoint_number)
        if checkpoints:
            candidates.append(checkpoints[-1] / "trainer_state.json")
        found = next((c for c in candidates if c.is_file()), None)
        if found is None:
            raise FileNotFoundError(
                f"No log_history.json or trainer_state.json in {path} (nor in a checkpoint-* folder inside it). Pass "
                "the output_dir of a run made by the example scripts, or a checkpoint folder."
            )
        path = found
    data = json.loads(path.read_text())
    history = data["log_history"] if isinstance(data, dict) else data
    if not isinstance(history, list):
        raise ValueError(f"{path} holds no log history (expected a list of dicts or a trainer_state.json).")
    return history


def series(history: LogHistory, key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of the training-log entries that carry ``key``."""
    pairs = [
        (float(entry.get("step", i)), float(entry[key]))
        for i, entry in enumerate(history)
        if isinstance(entry.get(key), (int, float))
    ]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over up to `window` values."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _finish(fig: plt.Figure, ax: plt.Axes, path: Path) -> Path:
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_reward(history: LogHistory, path: Path) -> Path | None:
    steps, reward = series(history, "reward")
    if not steps:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, reward, ".", alpha=0.45, color="tab:blue", label="reward (steps that logged one)")
    window = max(1, len(reward) // 10)
    ax.plot(steps, moving_average(reward, window), color="tab:blue", lw=2, label=f"moving average ({window} points)")
    ax.set(title="Mean reward per step", xlabel="optimizer step", ylabel="mean reward")
    return _finish(fig, ax, path)


def plot_masked_fraction(history: LogHistory, path: Path) -> Path | None:
    keys = {
        "all tokens": ("trust_region/masked_fraction", "black", "-"),
        "positive advantage": ("trust_region/masked_fraction_pos_adv", "tab:green", "--"),
        "negative advantage": ("trust_region/masked_fraction_neg_adv", "tab:red", "--"),
    }
    fig, ax = plt.subplots(figsize=(7, 4))
    plotted = False
    for label, (key, color, style) in keys.items():
        steps, values = series(history, key)
        if steps:
            ax.plot(steps, values, style, color=color, marker=".", label=label)
            plotted = True
    if not plotted:
        plt.close(fig)
        return None
    ax.set(
        title="Tokens masked by DPPO's trust region, by advantage sign",
        xlabel="optimizer step",
        ylabel="masked fraction of tokens",
    )
    ax.set_ylim(bottom=0)
    return _finish(fig, ax, path)


def plot_mismatch(history: LogHistory, path: Path) -> Path | None:
    fig, ax = plt.subplots(figsize=(7, 4))
    plotted = False
    for label, key, color in (
        (r"mean $|\pi - \mu|$", "mismatch/abs_prob_diff_mean", "tab:blue"),
        (r"max $|\pi - \mu|$", "mismatch/abs_prob_diff_max", "tab:orange"),
    ):
        steps, values = series(history, key)
        points = [(s, v) for s, v in zip(steps, values, strict=True) if v > 0]  # a log axis cannot show zeros
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], marker=".", color=color, label=label)
            plotted = True
    if not plotted:
        plt.close(fig)
        return None
    ax.set_yscale("log")
    ax.set(
        title="Trainer vs sampler probability of the sampled tokens",
        xlabel="optimizer step",
        ylabel=r"$|\pi - \mu|$ (log scale)",
    )
    return _finish(fig, ax, path)


_BUCKET_TOTAL = re.compile(r"tokens_by_mu/(.+)/total")


def _lower_bound(label: str) -> float:
    """Where a bucket starts: ``"<0.001"`` at 0, ``"0.001-0.01"`` at 0.001, ``">=0.9"`` at 0.9."""
    if label.startswith("<"):
        return 0.0
    try:
        return float(label.removeprefix(">=").split("-")[0])
    except ValueError:
        raise ValueError(f"tokens_by_mu bucket {label!r} is not of the form '<a', 'a-b' or '>=a'.") from None


def mu_buckets(history: LogHistory) -> list[str]:
    """Labels of the log's ``tokens_by_mu/<label>/total`` metrics, lowest sampler probability first.

    Read from the log itself, so that plotting a run needs nothing from the trainer (nor torch).
    """
    labels = {m.group(1) for entry in history for key in entry if (m := _BUCKET_TOTAL.fullmatch(key))}
    return sorted(labels, key=_lower_bound)


def bucket_means(history: LogHistory) -> dict[str, dict[str, float]] | None:
    """Run mean of ``tokens_by_mu/<bucket>/{total,masked,ppo_clipped}`` per bucket (`mu_buckets` order), or None."""
    means: dict[str, dict[str, float]] = {}
    for bucket in mu_buckets(history):
        row = {}
        for kind in ("total", "masked", "ppo_clipped"):
            _, values = series(history, f"tokens_by_mu/{bucket}/{kind}")
            row[kind] = sum(values) / len(values) if values else float("nan")
        means[bucket] = row
    if all(math.isnan(row["total"]) for row in means.values()):  # the metrics are absent
        return None
    return {b: {k: 0.0 if math.isnan(v) else v for k, v in row.items()} for b, row in means.items()}


def plot_tokens_by_mu(history: LogHistory, path: Path) -> Path | None:
    means = bucket_means(history)
    if means is None:
        return None
    buckets = list(means)
    x = list(range(len(buckets)))
    total = [means[b]["total"] for b in buckets]
    masked = [means[b]["masked"] for b in buckets]
    clipped = [means[b]["ppo_clipped"] for b in buckets]
    kept = [t - m for t, m in zip(total, masked, strict=True)]
    width = 0.27
    fig, (ax_counts, ax_frac) = plt.subplots(1, 2, figsize=(13, 4.8))
    bars = (
        ("kept by DPPO", kept, "tab:green", -width),
        ("masked by DPPO", masked, "tab:red", 0.0),
        ("clipped by PPO ratio", clipped, "tab:purple", width),
    )
    for label, values, color, offset in bars:
        ax_counts.bar([i + offset for i in x], values, width, label=label, color=color)
    ax_counts.set_yscale("symlog", linthresh=1.0)
    ax_counts.set(
        title="Tokens per sampler-probability bucket",
        xlabel=r"sampler probability $\mu$ of the sampled token",
        ylabel="tokens per logging step (run mean, symlog)",
    )
    for label, values, color, offset in bars[1:]:
        fractions = [v / t if t > 0 else 0.0 for v, t in zip(values, total, strict=True)]
        ax_frac.bar([i + offset - width / 2 for i in x], fractions, width, label=label, color=color)
    ax_frac.set(
        title="Share of each bucket blocked: DPPO mask vs PPO clip",
        xlabel=r"sampler probability $\mu$ of the sampled token",
        ylabel="fraction of the bucket's tokens",
    )
    for ax in (ax_counts, ax_frac):
        ax.set_xticks(x, buckets)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# The `true_divergence/*` rates over the recorded tokens (DPPOTrainer's `true_divergence.TRUE_DIVERGENCE_RATES`;
# `caught_fraction` is a rate over the tokens past delta)
_TRUE_DIVERGENCE_MEANS = ("tv", "kl", "binary_tv", "binary_kl", "topk_tv", "topk_kl")
_TRUE_DIVERGENCE_SHARES = ("over_delta_fraction", "missed_block_fraction")


def true_divergence_summary(history: LogHistory) -> dict[str, float | None] | None:
    """The run's ``true_divergence/*`` rates over all its recorded tokens, or None when the log has none.

    Each logged rate is its window's numerator over its denominator, so weighting the windows by their denominators
    (``true_divergence/recorded_tokens``; for ``caught_fraction`` the tokens past delta) gives the rate over the whole
    run, by the same rule. Keys: ``recorded_tokens`` (the run's total), ``steps`` (the logged steps with recorded
    tokens), ``<name>_mean`` for the six divergences, ``over_delta_fraction``, ``missed_block_fraction``,
    ``caught_fraction`` (None when no token was past delta), and the estimates' shares of the true divergence,
    ``binary_tv_over_tv``, ``topk_tv_over_tv``, ``binary_kl_over_kl``, ``topk_kl_over_kl``.
    """
    if not any(key.startswith("true_divergence/") for entry in history for key in entry):
        return None
    sums = dict.fromkeys([*(f"{n}_mean" for n in _TRUE_DIVERGENCE_MEANS), *_TRUE_DIVERGENCE_SHARES], 0.0)
    tokens = over_delta = caught = 0.0
    steps = 0
    for entry in history:
        count = entry.get("true_divergence/recorded_tokens")
        if not isinstance(count, (int, float)):
            continue
        count = float(count)
        if count > 0:
            steps += 1
            tokens += count
            for key in sums:
                value = entry.get(f"true_divergence/{key}")
                sums[key] += float(value) * count if isinstance(value, (int, float)) else 0.0
            over = entry.get("true_divergence/over_delta_fraction")
            over = float(over) * count if isinstance(over, (int, float)) else 0.0
            over_delta += over
            value = entry.get("true_divergence/caught_fraction")
            caught += float(value) * over if isinstance(value, (int, float)) else 0.0
    out: dict[str, float | None] = {"recorded_tokens": tokens, "steps": float(steps)}
    out.update({key: total / tokens if tokens else None for key, total in sums.items()})
    out["caught_fraction"] = caught / over_delta if over_delta else None
    for kind in ("tv", "kl"):
        true = out[f"{kind}_mean"]
        for estimate in ("binary", "topk"):
            value = out[f"{estimate}_{kind}_mean"]
            out[f"{estimate}_{kind}_over_{kind}"] = value / true if true and value is not None else None
    return out


def _positive(history: LogHistory, key: str) -> tuple[list[float], list[float]]:
    """`series` without the zeros, which a log axis cannot show."""
    steps, values = series(history, key)
    points = [(s, v) for s, v in zip(steps, values, strict=True) if v > 0]
    return [p[0] for p in points], [p[1] for p in points]


def plot_true_divergence(history: LogHistory, path: Path) -> Path | None:
    summary = true_divergence_summary(history)
    if summary is None or not series(history, "true_divergence/tv_mean")[0]:
        return None
    fig, ((ax_tv, ax_kl), (ax_share, ax_caught)) = plt.subplots(2, 2, figsize=(14, 9))
    for ax, kind, name in ((ax_tv, "tv", "TV"), (ax_kl, "kl", r"KL($\mu \| \pi$)")):
        for label, key, color, style in (
            ("true (whole vocabulary)", kind, "black", "-"),
            ("top-K estimate", f"topk_{kind}", "tab:blue", "--"),
            ("binary estimate", f"binary_{kind}", "tab:orange", ":"),
        ):
            steps, values = _positive(history, f"true_divergence/{key}_mean")
            ratio = summary.get(f"{key}_over_{kind}") if key != kind else None
            if ratio is not None:
                label += f" ({ratio:.2f}x the true over the run)"
            ax.plot(steps, values, style, color=color, marker=".", label=label)
        ax.set_yscale("log")
        ax.set(
            title=f"{name} between sampler and trainer on the recorded tokens",
            xlabel="optimizer step",
            ylabel=f"mean {name} per token (log scale)",
        )
    for label, key, color in (
        ("true divergence past delta (over_delta)", "over_delta_fraction", "black"),
        ("kept by DPPO, blocked on the true divergence (missed_block)", "missed_block_fraction", "tab:red"),
    ):
        steps, values = series(history, f"true_divergence/{key}")
        share = summary[key]
        ax_share.plot(steps, values, color=color, marker=".", label=f"{label}: {share:.4f} over the run")
    ax_share.set_ylim(bottom=0)
    ax_share.set(
        title="The trust region's rule on the true divergence",
        xlabel="optimizer step",
        ylabel="share of the recorded tokens",
    )
    steps, values = series(history, "true_divergence/caught_fraction")  # None where no token was past delta
    caught = summary["caught_fraction"]
    label = "steps with tokens past delta" + ("" if caught is None else f" ({caught:.2f} over the run)")
    ax_caught.plot(steps, values, "o", color="tab:green", label=label)
    ax_caught.set_ylim(-0.05, 1.05)
    ax_caught.set(
        title=f"Tokens past delta the estimate caught ({summary['recorded_tokens']:.0f} recorded tokens in all)",
        xlabel="optimizer step",
        ylabel="caught share",
    )
    for ax in (ax_tv, ax_kl, ax_share, ax_caught):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# File name -> (plotting function, the metrics it needs, for the note when they are absent)
PLOTS = {
    "reward.png": (plot_reward, "reward"),
    "masked_fraction.png": (plot_masked_fraction, "trust_region/masked_fraction*"),
    "mismatch.png": (plot_mismatch, "mismatch/abs_prob_diff_mean|max"),
    "tokens_by_mu.png": (plot_tokens_by_mu, "tokens_by_mu/<bucket>/total|masked|ppo_clipped"),
    "true_divergence.png": (plot_true_divergence, "true_divergence/* (true_divergence_fraction > 0)"),
}


def plot_run(source: str | Path | LogHistory, out_dir: str | Path | None = None) -> list[Path]:
    """Write the PNGs for a run and return their paths; prints a note for each figure the log cannot make.

    Args:
        source: A run folder, checkpoint folder or log file (see `load_log_history`), or a log history itself.
        out_dir: Where the PNGs go; defaults to ``<run folder>/plots`` (required when ``source`` is a log history).
    """
    if isinstance(source, (str, Path)):
        history = load_log_history(source)
        run_dir = Path(source) if Path(source).is_dir() else Path(source).parent
        out_dir = Path(out_dir) if out_dir is not None else run_dir / "plots"
    else:
        history = list(source)
        if out_dir is None:
            raise ValueError("Pass out_dir when plotting a log history given as a list.")
        out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, (plot, metrics) in PLOTS.items():
        path = plot(history, out_dir / name)
        if path is None:
            print(f"Skipping {name}: the log history has no {metrics} metrics.")
        else:
            written.append(path)
    return written


def main(argv: Sequence[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(prog="python -m trl_dppo.jobs.plots", description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="output_dir of a run, a checkpoint folder, log_history.json or trainer_state.json")
    parser.add_argument("--out", default=None, help="folder for the PNGs (default: RUN/plots)")
    args = parser.parse_args(argv)
    written = plot_run(args.run, args.out)
    for path in written:
        print(path)
    return written


if __name__ == "__main__":
    main()
