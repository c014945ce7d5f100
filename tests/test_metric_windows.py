"""How DPPO's metrics are reduced over a logging window, the same in both trainers (`diagnostics.reduce_window`).

A logging window holds every loss computation since the last log: several micro-batches with gradient accumulation
or `steps_per_generation`. Each rate is the window's numerator over its denominator, not a mean of per-micro-batch
rates; a window with no token in a rate's denominator logs None, not 0; maxima are the window's, counts its totals.

The windows below are built from two micro-batches, A and B, given token by token as (advantage, mu_base, pi, kept by
the trust region). A holds one bad update (A < 0, mu_base - pi >= 0.5) that DPPO's mask and PPO's clip both block,
and one positive-advantage token of two masked; B holds no bad update and no positive-advantage token.
"""

from __future__ import annotations

import math

import pytest
import torch

from trl_dppo.diagnostics import reduce_window
from trl_dppo.sequences import SequenceLayout

from .conftest import make_trainer
from .test_async_loss import stub_trainer


MICRO_BATCH_A = [(-1.0, 0.95, 0.30, False), (1.0, 0.6, 0.6, True), (1.0, 0.6, 0.8, False), (-1.0, 0.6, 0.6, True)]
MICRO_BATCH_B = [(-1.0, 0.6, 0.6, True)] * 3
# |pi - mu_base| summed over A's tokens (B's are 0), and A's largest
ABS_PROB_DIFF_A, ABS_PROB_DIFF_MAX_A = 0.65 + 0.2, 0.65
# The inputs are float64 and the sync trainer sums in float64: exp(log p) is p to an ulp, the sums to a few ulps
FLOAT64_REL = 1e-12
# The async trainer's per-token inputs are float32 (`staleness.record_sums_by_lag`): a few float32 ulps; its counts,
# integers below 2**24, stay exact
FLOAT32_REL = 1e-6


def k3(mu: float, pi: float) -> float:
    """The k3 estimate of KL(mu || pi) of one token drawn from mu, as `trust_region_sums` computes it."""
    return pi / mu - 1 - math.log(pi / mu)


def record_inputs(tokens, ratio_limited: bool = False, missing: int = 0) -> dict[str, torch.Tensor]:
    """`TrustRegionDiagnostics.record`'s tensors for a micro-batch of one row holding `tokens`. With `ratio_limited`,
    the last token's mu (the ratio's, not mu_base) is e**-50: pi/mu beyond 2**64, limited, while the token is kept."""
    advantages, mu_base, pi, kept = (
        torch.tensor([column], dtype=torch.float64) for column in zip(*tokens, strict=True)
    )
    sampler_logps = mu_base.log()
    if ratio_limited:
        sampler_logps[0, -1] = -50.0
    return dict(
        completion_ids=torch.arange(len(tokens))[None],
        mask=torch.ones(1, len(tokens), dtype=torch.bool),
        keep=kept.bool(),
        dppo_keep=kept.bool(),
        advantages=advantages,
        sampler_logps=sampler_logps,
        base_logps=mu_base.log(),
        trainer_logps=pi.log(),
        missing_sampler_logps=torch.tensor(missing),
    )


def test_a_window_reduces_rates_as_sums_maxima_as_maxima_and_counts_as_totals():
    pairs = [(1.0, 2.0), (0.0, 0.0), (3.0, 4.0)]
    assert reduce_window("trust_region/masked_fraction_pos_adv", pairs) == 4.0 / 6.0
    assert math.isnan(reduce_window("diagnostics/bad_updates_blocked_by_dppo_mask", [(0.0, 0.0), (0.0, 0.0)]))
    assert reduce_window("mismatch/abs_prob_diff_max", [0.1, 0.7, 0.2]) == 0.7
    assert reduce_window("staleness/lag_max", [1.0, 3.0]) == 3.0
    assert reduce_window("trust_region/ratio_limited_tokens", [0.0, 2.0, 1.0]) == 3.0
    assert reduce_window("tokens_by_mu/0.5-0.9/masked", [1.0, 4.0]) == 5.0


def test_the_sync_trainer_logs_a_windows_rates_maxima_and_counts_over_all_its_micro_batches(
    tmp_path, tiny_model_dir, prompts, tokenizer
):
    trainer = make_trainer(tmp_path, tiny_model_dir, prompts, tokenizer, log_tokens_by_mu=True)
    trainer.model.train()
    # Gradient accumulation over A and B, on the first optimizer step after their generation (at sync)
    trainer.diagnostics.record("train", True, **record_inputs(MICRO_BATCH_A))
    trainer.diagnostics.record("train", True, **record_inputs(MICRO_BATCH_B, ratio_limited=True, missing=2))
    trainer.log({})
    logged = trainer.state.log_history[-1]
    # Rates: A's and B's numerators over their denominators (7 tokens, 2 with A > 0, 5 with A < 0, 1 bad update)
    assert logged["diagnostics/bad_updates_blocked_by_dppo_mask"] == 1.0  # A's mean with B's empty 0 read 0.5
    assert logged["diagnostics/bad_updates_blocked_by_ppo_clip"] == 1.0
    assert logged["diagnostics/bad_update_fraction"] == 1 / 7
    assert logged["trust_region/masked_fraction"] == 2 / 7
    assert logged["trust_region/masked_fraction_pos_adv"] == 1 / 2
    assert logged["trust_region/masked_fraction_neg_adv"] == 1 / 5
    assert logged["mismatch/abs_prob_diff_mean"] == pytest.approx(ABS_PROB_DIFF_A / 7, rel=FLOAT64_REL)
    assert logged["mismatch/kl_mean"] == pytest.approx((k3(0.95, 0.3) + k3(0.6, 0.8)) / 7, rel=FLOAT64_REL)
    assert logged["mismatch/at_sync_abs_prob_diff_mean"] == pytest.approx(ABS_PROB_DIFF_A / 7, rel=FLOAT64_REL)
    # Maxima: the window's largest
    assert logged["mismatch/abs_prob_diff_max"] == pytest.approx(ABS_PROB_DIFF_MAX_A, rel=FLOAT64_REL)
    assert logged["mismatch/at_sync_abs_prob_diff_max"] == pytest.approx(ABS_PROB_DIFF_MAX_A, rel=FLOAT64_REL)
    # Counts: the window's totals
    assert logged["trust_region/ratio_limited_tokens"] == 1
    assert logged["mismatch/missing_sampler_logps"] == 2
    assert logged["tokens_by_mu/>=0.9/total"] == 1
    assert logged["tokens_by_mu/0.5-0.9/total"] == 6
    assert logged["tokens_by_mu/0.5-0.9/masked"] == 1
    assert logged["tokens_by_mu/>=0.9/ppo_clipped"] == 1

    # A window of B alone: no bad update, no token with A > 0, so those rates are unknown, not 0
    trainer.diagnostics.record("train", False, **record_inputs(MICRO_BATCH_B))
    trainer.log({})
    logged = trainer.state.log_history[-1]
    assert logged["diagnostics/bad_updates_blocked_by_dppo_mask"] is None
    assert logged["diagnostics/bad_updates_blocked_by_ppo_clip"] is None
    assert logged["trust_region/masked_fraction_pos_adv"] is None
    assert logged["trust_region/masked_fraction"] == 0.0  # a rate over B's tokens, all kept


def test_evaluation_logs_its_own_window_and_adds_nothing_to_the_trainings_masked_token_counts(
    tmp_path, tiny_model_dir, prompts, tokenizer
):
    trainer = make_trainer(tmp_path, tiny_model_dir, prompts, tokenizer)
    trainer.model.train()
    trainer.diagnostics.record("train", False, **record_inputs(MICRO_BATCH_A))
    counts = {sign: dict(counter) for sign, counter in trainer.diagnostics.masked_token_counts.items()}
    assert counts == {"positive": {2: 1}, "negative": {0: 1}}  # A's masked tokens, by position id
    trainer.model.eval()
    trainer.diagnostics.record("eval", False, **record_inputs(MICRO_BATCH_A))
    trainer.diagnostics.record("eval", False, **record_inputs(MICRO_BATCH_B))
    assert {sign: dict(counter) for sign, counter in trainer.diagnostics.masked_token_counts.items()} == counts
    trainer.log({})
    logged = trainer.state.log_history[-1]
    assert logged["eval_diagnostics/bad_updates_blocked_by_dppo_mask"] == 1.0
    assert logged["eval_trust_region/masked_fraction"] == 2 / 7
    assert trainer._metrics["train"]["trust_region/masked_fraction"] == [(2.0, 4.0)]  # the training window waits


def async_micro_batch(tokens, lags, missing: int = 0) -> dict[str, torch.Tensor]:
    """`AsyncDPPOTrainer._trust_region_loss`'s inputs for the loss terms `tokens` (their `kept` is the trust region's
    to decide), at policy lags `lags`, followed by `missing` terms without a sampler log-probability; all of one
    completion."""
    advantages, mu, pi, _ = (torch.tensor(column, dtype=torch.float64) for column in zip(*tokens, strict=True))
    extra = torch.full((missing,), 0.6, dtype=torch.float64)
    return dict(
        trainer_logps=torch.cat([pi, extra]).log(),
        sampler_logps=torch.cat([mu, extra]).log(),
        advantages=torch.cat([advantages, -torch.ones(missing, dtype=torch.float64)]),
        lag=torch.tensor(lags + [0] * missing),
        missing=torch.arange(len(tokens) + missing) >= len(tokens),
        global_n_tokens=torch.tensor(float(len(tokens) + missing)),
        completions=SequenceLayout.from_sequence_ids(torch.zeros(len(tokens) + missing, dtype=torch.long)),
    )


def test_the_async_trainer_logs_the_same_window_reductions(tmp_path, tiny_model_dir, tokenizer, prompts):
    trainer = stub_trainer(tmp_path, tiny_model_dir, tokenizer, prompts)
    trainer.model.train()
    trainer._metrics["train"].clear()  # nothing but the two micro-batches below in the window
    trainer._trust_region_loss(**async_micro_batch(MICRO_BATCH_A, lags=[0, 0, 1, 3]))
    trainer._trust_region_loss(**async_micro_batch(MICRO_BATCH_B, lags=[0, 0, 0], missing=2))
    trainer.log({})
    logged = trainer.state.log_history[-1]
    # DPPO's mask (binary TV, delta 0.15) blocks A's first and third tokens, as the sync test's `kept` says
    assert logged["diagnostics/bad_updates_blocked_by_dppo_mask"] == 1.0
    assert logged["diagnostics/bad_updates_blocked_by_ppo_clip"] == 1.0
    assert logged["trust_region/masked_fraction"] == 2 / 7
    assert logged["trust_region/masked_fraction_pos_adv"] == 1 / 2
    assert logged["mismatch/abs_prob_diff_mean"] == pytest.approx(ABS_PROB_DIFF_A / 7, rel=FLOAT32_REL)
    assert logged["mismatch/abs_prob_diff_max"] == pytest.approx(ABS_PROB_DIFF_MAX_A, rel=FLOAT32_REL)
    assert logged["mismatch/missing_sampler_logps"] == 2  # TRL's window mean read 1
    assert logged["trust_region/ratio_limited_tokens"] == 0
    assert logged["staleness/lag_mean"] == 4 / 7
    assert logged["staleness/lag_max"] == 3
    assert logged["staleness/token_fraction_lag_0"] == 5 / 7
    assert logged["trust_region/masked_fraction_lag_1"] == 1.0

    trainer._trust_region_loss(**async_micro_batch(MICRO_BATCH_B, lags=[0, 0, 0]))
    trainer.log({})
    logged = trainer.state.log_history[-1]
    # As in the sync trainer: unknown rates are None (TRL's pairs left them out of the log), a rate over kept tokens 0;
    # a lag bucket with no sample in the window is left out whole
    assert logged["diagnostics/bad_updates_blocked_by_dppo_mask"] is None
    assert logged["diagnostics/bad_updates_blocked_by_dppo_mask_lag_0"] is None
    assert logged["trust_region/masked_fraction_pos_adv"] is None
    assert logged["trust_region/masked_fraction"] == 0.0
    assert logged["staleness/token_fraction_lag_0"] == 1.0
    assert not any(key.endswith(("_lag_1", "_lag_2", "_lag_3plus")) for key in logged)
