"""DPPOTrainer as a TRL trainer: GRPOTrainer's signature, a model card that cites DPPO, reward models by path."""

from __future__ import annotations

import inspect
from pathlib import Path

from peft import LoraConfig
from trl import GRPOTrainer

from trl_dppo import DPPOConfig, DPPOTrainer


def test_init_takes_grpotrainers_parameters():
    """Same names, order, kinds and defaults: `reward_funcs` optional, everything after `model` a keyword."""
    ours = inspect.signature(DPPOTrainer.__init__).parameters
    theirs = inspect.signature(GRPOTrainer.__init__).parameters
    assert [(n, p.kind, p.default) for n, p in ours.items()] == [(n, p.kind, p.default) for n, p in theirs.items()]
    assert ours["reward_funcs"].default is None


def test_reward_model_by_path_and_a_saved_card_that_cites_dppo(tmp_path, tiny_model_dir, reward_model_dir, prompts):
    """As in GRPOTrainer, `reward_funcs` may name a sequence-classification model; the checkpoint's card cites DPPO."""
    config = DPPOConfig(
        output_dir=str(tmp_path),
        report_to="none",
        bf16=False,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        max_steps=1,
        save_strategy="steps",
        save_steps=1,
    )
    trainer = DPPOTrainer(
        model=tiny_model_dir,
        reward_funcs=reward_model_dir,
        args=config,
        train_dataset=prompts,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )
    assert trainer.reward_funcs[0].config.num_labels == 1
    trainer.train()
    assert trainer.state.global_step == 1
    assert [k for k in trainer.state.log_history[0] if k.startswith("rewards/")]
    card = (Path(tmp_path) / "README.md").read_text()
    assert "Rethinking the Trust Region in LLM Reinforcement Learning" in card
    assert "2602.04879" in card and "qi2026rethinking" in card and "DPPO" in card
    assert "DeepSeekMath" not in card
