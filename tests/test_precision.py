"""The sampler-trainer gap before any update: `mismatch/at_sync_*`, logged on the first optimizer step after each
generation, when the weights that sampled are the weights that train."""

from __future__ import annotations

from .conftest import make_trainer


AT_SYNC = ["mismatch/at_sync_abs_prob_diff_mean", "mismatch/at_sync_abs_prob_diff_max", "mismatch/at_sync_kl_mean"]


def at_sync_run(tmp_path, model_dir, prompts, tokenizer, **overrides):
    settings = dict(learning_rate=0.0, temperature=0.7, max_steps=4, steps_per_generation=2)
    settings.update(overrides)
    trainer = make_trainer(tmp_path, model_dir, prompts, tokenizer, **settings)
    trainer.train()
    return [entry for entry in trainer.state.log_history if "loss" in entry]


def test_at_sync_gap_is_logged_on_the_first_step_after_each_generation_only(
    tmp_path, tiny_model_dir, prompts, tokenizer
):
    """Two optimizer steps per generation: steps 1 and 3 train on fresh samples, steps 2 and 4 on the same ones."""
    logs = at_sync_run(tmp_path, tiny_model_dir, prompts, tokenizer)
    assert [all(key in entry for key in AT_SYNC) for entry in logs] == [True, False, True, False]
    for entry in logs[::2]:
        # fp32 generation against fp32 training: the gap is rounding alone
        assert entry["mismatch/at_sync_abs_prob_diff_max"] < 1e-4, entry
        assert entry["mismatch/at_sync_abs_prob_diff_mean"] == entry["mismatch/abs_prob_diff_mean"]


def test_bf16_training_against_fp32_generation_shows_a_gap_at_sync(tmp_path, tiny_model_dir, prompts, tokenizer):
    """TRL's default bf16=True autocasts the training forward but not transformers generation."""
    logs = at_sync_run(
        tmp_path, tiny_model_dir, prompts, tokenizer, bf16=True, use_cpu=True, max_steps=2, steps_per_generation=1
    )
    assert all(all(key in entry for key in AT_SYNC) for entry in logs)
    assert max(entry["mismatch/at_sync_abs_prob_diff_max"] for entry in logs) > 1e-3, logs
