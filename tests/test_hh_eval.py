"""The HH pipeline's held-out measures: distinct-n, the judge's win rate and its interval, and sampled replies."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from trl_dppo.jobs.hh_eval import (
    bootstrap_interval,
    distinct_n,
    judge_comparison,
    sample_replies,
    win_fractions,
)

from .conftest import build_tiny_model


def test_distinct_n_counts_repeated_ngrams_across_replies() -> None:
    assert distinct_n(["I am sorry.", "I am sorry."], 1) == 4 / 8  # i, am, sorry, "." twice each
    assert distinct_n(["I am sorry.", "I am sorry."], 2) == 3 / 6
    assert distinct_n(["a b c", "d e f"], 2) == 1.0  # no bigram spans two replies
    assert distinct_n(["", "one"], 2) == 0.0  # no bigram at all


def test_win_fractions_compare_every_pair_of_replies_and_count_ties_half() -> None:
    after = [[2.0, 0.0], [1.0], [0.5]]
    before = [[1.0, 1.0], [1.0], [0.7]]
    assert win_fractions(after, before) == [0.5, 0.5, 0.0]


def test_bootstrap_interval_brackets_the_mean_and_narrows_with_more_prompts() -> None:
    few = [0.0, 1.0] * 8
    many = few * 16
    low, high = bootstrap_interval(few)
    assert low < 0.5 < high and bootstrap_interval(few) == (low, high)  # seeded: the same interval every time
    many_low, many_high = bootstrap_interval(many)
    # The half-width of a mean's interval scales as 1/sqrt(n): 16x the prompts, about a quarter of the width
    assert many_high - many_low == pytest.approx((high - low) / 4, rel=0.3)
    assert bootstrap_interval([1.0] * 10) == (1.0, 1.0)


def test_judge_comparison_reports_win_rate_and_change_with_intervals() -> None:
    before = [[0.0, 0.0]] * 20
    after = [[1.0, 1.0]] * 15 + [[-1.0, -1.0]] * 5
    verdict = judge_comparison(after, before)
    assert verdict["win_rate"] == 0.75 and verdict["judge_change"] == 0.5
    assert verdict["win_rate_ci95"][0] < 0.75 < verdict["win_rate_ci95"][1]
    assert verdict["judge_change_ci95"][0] < 0.5 < verdict["judge_change_ci95"][1]


PROMPTS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Tell me a long story about a dragon that guards a library."}],
    [{"role": "user", "content": "Why is the sky blue? Answer briefly, please."}],
]


def test_sampled_replies_report_lengths_cut_and_entropy(tokenizer) -> None:
    model = build_tiny_model(tokenizer).eval()
    replies = sample_replies(model, tokenizer, PROMPTS, num_samples=3, max_new_tokens=6, seed=0)
    assert [len(texts) for texts in replies.texts] == [3, 3, 3]
    for lengths, cut in zip(replies.lengths, replies.cut, strict=True):
        assert all(0 <= n <= 6 for n in lengths) and all(n == 6 for n, c in zip(lengths, cut, strict=True) if c)
    # Entropy of a next-token distribution lies between 0 and log(vocabulary size)
    assert 0.0 < replies.entropy < torch.log(torch.tensor(float(len(tokenizer)))).item()
    assert replies.kl_to_base is None
    assert sample_replies(model, tokenizer, PROMPTS, 3, 6, seed=0) == replies  # the seed fixes the sampling noise
    with pytest.raises(ValueError, match="needs a PEFT model"):
        sample_replies(model, tokenizer, PROMPTS, 3, 6, seed=0, kl_to_base=True)


def test_kl_to_base_is_zero_for_untouched_adapters_and_positive_once_they_move(tokenizer) -> None:
    """The base log-probabilities are recomputed in one forward pass over left-padded prompts and the replies: with new
    LoRA adapters (B = 0) the policy is the base, so the estimate must be 0 up to fp32 rounding; a misaligned
    position or token would differ by nats on this peaked model."""
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    policy = get_peft_model(build_tiny_model(tokenizer), lora).eval()
    same = sample_replies(policy, tokenizer, PROMPTS, num_samples=2, max_new_tokens=8, seed=0, kl_to_base=True)
    # Cached decoding and one full pass sum in another order: fp32 rounding of logits of size ~10 is ~1e-6
    assert abs(same.kl_to_base) < 1e-5
    with torch.no_grad():
        for name, weight in policy.named_parameters():
            if "lora_B" in name:
                weight.normal_(std=0.5)
    moved = sample_replies(policy, tokenizer, PROMPTS, num_samples=2, max_new_tokens=8, seed=0, kl_to_base=True)
    assert moved.kl_to_base > 1e-3
