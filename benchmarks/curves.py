"""Learning curves of several training runs: trimmed logs, one plot per metric, and summary numbers.

A run's log is the Trainer's `log_history` cut to the training-step entries and the metrics below. `reward` is
logged on generation steps only (every `steps_per_generation`-th step), the mismatch and trust-region metrics on
every step. Reward averages are taken over logged generation batches, each the mean of `num_generations` x prompts
completions.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib


matplotlib.use("Agg")
import matplotlib.pyplot as plt

from trl_dppo.jobs.plots import moving_average, series


KEPT_METRICS = (
    "step",
    "reward",
    "entropy",
    "grad_norm",
    "step_time",
    "completions/mean_length",
    "completions/clipped_ratio",
    "kl",
    "mismatch/kl_mean",
    "mismatch/abs_prob_diff_mean",
    "mismatch/abs_prob_diff_max",
    "trust_region/masked_fraction",
    "diagnostics/bad_update_fraction",
)
# Per-bucket token counts by the sampler's probability (`log_tokens_by_mu`): where a trust region blocks; and what each
# stacked correction removed (`trust_region_corrections`)
KEPT_PREFIXES = ("tokens_by_mu/", "corrections/")

Log = Sequence[Mapping[str, Any]]


def trim(log_history: Log) -> list[dict[str, Any]]:
    """The training-step entries of a Trainer log history (those with a loss), with only the kept metrics."""
    return [
        {k: v for k, v in e.items() if k in KEPT_METRICS or k.startswith(KEPT_PREFIXES)}
        for e in log_history
        if "loss" in e
    ]


def mean_of(log: Log, key: str, first: int | None = None, last: int | None = None) -> float | None:
    """Mean of `key` over its first or last `n` logged values (all of them when neither is given)."""
    _, values = series(log, key)
    values = values[:first] if first else values[-last:] if last else values
    return statistics.fmean(values) if values else None


def steps_to_level(log: Log, level: float, window: int = 3) -> int | None:
    """First step at which the reward, averaged over `window` generation batches, reaches `level` (None: never).

    Only full windows count, so one lucky first batch does not count as reaching a level.
    """
    steps, values = series(log, "reward")
    averages = moving_average(values, window)
    for step, value in list(zip(steps, averages, strict=True))[window - 1 :]:
        if value >= level:
            return int(step)
    return None


def plot_metric(
    runs: Mapping[str, Sequence[Log]],
    key: str,
    path: Path,
    title: str,
    ylabel: str,
    window: int = 1,
    log_scale: bool = False,
) -> Path:
    """One line per method: the mean over its seeds (thick) and each seed (thin), smoothed over `window` points."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, (method, logs) in enumerate(runs.items()):
        color = plt.cm.tab10(i % 10)
        style = ("-", "--", "-.", ":")[i % 4]  # runs that coincide stay visible
        curves = [series(log, key) for log in logs]
        curves = [(s, moving_average(v, window)) for s, v in curves if s]
        if not curves:
            continue
        if len(curves) > 1:
            for steps, values in curves:
                ax.plot(steps, values, color=color, alpha=0.3, linewidth=0.8)
        common = sorted(set.intersection(*(set(s) for s, _ in curves)))
        by_step = [dict(zip(s, v, strict=True)) for s, v in curves]
        mean = [statistics.fmean(d[step] for d in by_step) for step in common]
        label = method if len(curves) == 1 else f"{method} (mean of {len(curves)} seeds)"
        ax.plot(common, mean, color=color, linestyle=style, linewidth=2, label=label)
    if log_scale:
        ax.set_yscale("log")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def save_run(path: Path, log_history: Log, **fields: Any) -> None:
    """Write one run's trimmed log with its provenance (command, seed, runtime...)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**fields, "log": trim(log_history)}, indent=1))


def load_runs(directory: Path) -> dict[str, list[dict[str, Any]]]:
    """`{method: [run, ...]}` from `directory/<method>-seed<S>.json`, seeds in order."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(directory.glob("*-seed*.json")):
        method = path.stem.rsplit("-seed", 1)[0]
        runs.setdefault(method, []).append(json.loads(path.read_text()))
    return runs


def fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def levels_reached(logs: Sequence[Log], level: float, window: int = 3) -> str:
    """How many runs reach `level` (see `steps_to_level`) and at which step each: "2/3 seeds (12, 20, never)"."""
    steps = [steps_to_level(log, level, window) for log in logs]
    shown = ", ".join("never" if s is None else str(s) for s in steps)
    return f"{sum(s is not None for s in steps)}/{len(logs)} seeds ({shown})"


def commands_section(meta: Mapping[str, Sequence[dict]], env: Mapping[str, str]) -> str:
    """The results.md footer: every logged run's exact command, with the environment the study ran them in."""
    commands = "\n".join(run["command"] for runs in meta.values() for run in runs)
    return f"\n\nCommands (run from the repository root, env {env}):\n\n```\n{commands}\n```\n"
