"""Tests for `trl_dppo.jobs.plots` on a synthetic log history."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

from trl_dppo.jobs.plots import (
    PLOTS,
    bucket_means,
    load_log_history,
    mu_buckets,
    plot_run,
    true_divergence_summary,
)


PNG_NAMES = sorted(PLOTS)
# DPPOTrainer's sampler-probability buckets, lowest first
BUCKETS = ("<0.001", "0.001-0.01", "0.01-0.1", "0.1-0.5", "0.5-0.9", ">=0.9")


def synthetic_log_history(
    steps: int = 30, buckets: bool = True, true_divergence: bool = True, seed: int = 0
) -> list[dict]:
    """A log history shaped like DPPOTrainer's: one entry per step, then the Trainer's closing entry."""
    rng = random.Random(seed)
    history = []
    for step in range(1, steps + 1):
        entry = {
            "step": step,
            "epoch": step / steps,
            "loss": rng.gauss(0, 0.01),
            "reward": min(1.0, 0.2 + 0.5 * step / steps + rng.gauss(0, 0.05)),
            "rewards/exact_answer_reward/mean": 0.2 + 0.5 * step / steps,
            "completions/mean_length": 30 - 20 * step / steps,
            "entropy": 1.0 - 0.5 * step / steps,
            "trust_region/masked_fraction": 0.02 * (step % 4),
            "trust_region/masked_fraction_pos_adv": 0.03 * (step % 4),
            "trust_region/masked_fraction_neg_adv": 0.01 * (step % 4),
            "mismatch/abs_prob_diff_mean": 1e-6 if step % 4 == 1 else 0.01 * (step % 4),
            "mismatch/abs_prob_diff_max": 1e-5 if step % 4 == 1 else 0.3 * (step % 4),
            "mismatch/kl_mean": 1e-4,
            "mismatch/missing_sampler_logps": 0.0,
        }
        if buckets:
            for i, label in reversed(list(enumerate(BUCKETS))):  # logged in any order
                total = [3.0, 6.0, 15.0, 30.0, 40.0, 160.0][i]
                entry[f"tokens_by_mu/{label}/total"] = total
                entry[f"tokens_by_mu/{label}/masked"] = [0.0, 0.0, 0.0, 1.0, 2.0, 0.5][i]
                entry[f"tokens_by_mu/{label}/ppo_clipped"] = [2.0, 3.0, 4.0, 2.0, 0.5, 0.0][i]
        if true_divergence:
            entry.update(true_divergence_metrics(step, rng))
        history.append(entry)
    history.append({"step": steps, "train_runtime": 12.3, "train_loss": 0.0})
    return history


def true_divergence_metrics(step: int, rng: random.Random) -> dict:
    """`true_divergence/*` as DPPOTrainer logs them with `true_divergence_fraction` > 0 and steps_per_generation=4:
    near 0 at the first step after each generation (the sampler's weights), binary <= top-K <= true after it."""
    tv = 1e-6 if step % 4 == 1 else 0.02 * (step % 4) * (1 + rng.random())
    over = 0.0 if step % 4 == 1 else 0.01 * (step % 4)
    return {
        "true_divergence/tv_mean": tv,
        "true_divergence/kl_mean": 0.5 * tv,
        "true_divergence/binary_tv_mean": 0.1 * tv,
        "true_divergence/binary_kl_mean": 0.02 * tv,
        "true_divergence/topk_tv_mean": 0.9 * tv,
        "true_divergence/topk_kl_mean": 0.4 * tv,
        "true_divergence/over_delta_fraction": over,
        "true_divergence/caught_fraction": None if over == 0 else 0.25,
        "true_divergence/missed_block_fraction": 0.75 * over,
        "true_divergence/recorded_tokens": 40.0,
    }


def _assert_pngs(folder: Path, names: list[str]) -> None:
    for name in names:
        path = folder / name
        assert path.is_file(), name
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert path.stat().st_size > 5_000, name  # an empty figure is a few kB at most


def test_plot_run_writes_every_png(tmp_path: Path) -> None:
    (tmp_path / "log_history.json").write_text(json.dumps(synthetic_log_history()))
    written = plot_run(tmp_path)
    assert sorted(p.name for p in written) == PNG_NAMES
    _assert_pngs(tmp_path / "plots", PNG_NAMES)


def test_rates_logged_as_none_are_left_out_of_the_figures(tmp_path: Path) -> None:
    """A logging window with no token in a rate's denominator (here: no token with A > 0) logs None."""
    history = synthetic_log_history()
    for entry in history[::3]:
        entry["trust_region/masked_fraction_pos_adv"] = None
    written = plot_run(history, tmp_path / "out")
    assert sorted(p.name for p in written) == PNG_NAMES
    _assert_pngs(tmp_path / "out", PNG_NAMES)


def test_missing_bucket_metrics_skip_that_figure(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    written = plot_run(synthetic_log_history(buckets=False), tmp_path / "out")
    assert sorted(p.name for p in written) == sorted(set(PNG_NAMES) - {"tokens_by_mu.png"})
    assert "Skipping tokens_by_mu.png" in capsys.readouterr().out


def test_missing_true_divergence_metrics_skip_that_figure(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    written = plot_run(synthetic_log_history(true_divergence=False), tmp_path / "out")
    assert sorted(p.name for p in written) == sorted(set(PNG_NAMES) - {"true_divergence.png"})
    assert "Skipping true_divergence.png" in capsys.readouterr().out
    assert true_divergence_summary(synthetic_log_history(true_divergence=False)) is None


def test_true_divergence_summary_is_the_rate_over_the_runs_tokens() -> None:
    """Windows weigh by their recorded tokens (caught_fraction by the tokens past delta), as a window weighs its
    micro-batches."""
    history = [
        {"step": 1, **dict.fromkeys(("true_divergence/tv_mean", "true_divergence/binary_tv_mean"), 0.0)},
        {"step": 2, "true_divergence/tv_mean": 0.2, "true_divergence/binary_tv_mean": 0.05},
        {"step": 3, "true_divergence/tv_mean": 0.4, "true_divergence/binary_tv_mean": 0.1},
    ]
    for entry, tokens, over, caught in zip(history, (10, 30, 10), (0.0, 0.1, 0.3), (None, 1.0, 0.0), strict=True):
        entry.update(
            {
                "true_divergence/recorded_tokens": float(tokens),
                "true_divergence/over_delta_fraction": over,
                "true_divergence/caught_fraction": caught,
                "true_divergence/missed_block_fraction": over / 2,
            }
        )
    summary = true_divergence_summary(history)
    assert summary is not None
    assert summary["recorded_tokens"] == 50 and summary["steps"] == 3
    assert math.isclose(summary["tv_mean"], (0.2 * 30 + 0.4 * 10) / 50)
    assert math.isclose(summary["binary_tv_over_tv"], 0.25)
    assert math.isclose(summary["over_delta_fraction"], 6 / 50)
    assert math.isclose(summary["caught_fraction"], 3 / 6)  # 3 of the 6 tokens past delta
    assert math.isclose(summary["missed_block_fraction"], 3 / 50)
    assert summary["kl_mean"] == 0 and summary["binary_kl_over_kl"] is None  # KLs absent from this log


def test_bucket_means_average_over_steps() -> None:
    history = synthetic_log_history(steps=4)
    history[0]["tokens_by_mu/>=0.9/total"] = 0.0  # one step without high-probability tokens
    means = bucket_means(history)
    assert means is not None and list(means) == list(BUCKETS)
    assert math.isclose(means[">=0.9"]["total"], 120.0)
    assert bucket_means(synthetic_log_history(buckets=False)) is None


def test_reads_the_latest_checkpoint_trainer_state(tmp_path: Path) -> None:
    for step, n in ((5, 5), (10, 10)):
        checkpoint = tmp_path / f"checkpoint-{step}"
        checkpoint.mkdir()
        (checkpoint / "trainer_state.json").write_text(
            json.dumps({"global_step": step, "log_history": synthetic_log_history(steps=n)})
        )
    assert len(load_log_history(tmp_path)) == 11
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="log_history.json"):
        load_log_history(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_log_history(tmp_path / "missing")


def test_cli(tmp_path: Path) -> None:
    (tmp_path / "log_history.json").write_text(json.dumps(synthetic_log_history()))
    result = subprocess.run(
        [sys.executable, "-m", "trl_dppo.jobs.plots", str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    _assert_pngs(tmp_path / "plots", PNG_NAMES)
    assert "reward.png" in result.stdout


def test_buckets_come_from_the_log_in_the_trainers_order() -> None:
    """The plots read the bucket labels off the log's keys (importing no trainer) and order them by lower bound."""
    from trl_dppo.diagnostics import MU_BUCKETS

    assert mu_buckets([{f"tokens_by_mu/{label}/total": 1.0 for label in sorted(MU_BUCKETS)}]) == list(MU_BUCKETS)
    assert BUCKETS == MU_BUCKETS
    with pytest.raises(ValueError, match="not of the form"):
        mu_buckets([{"tokens_by_mu/high/total": 1.0}])
