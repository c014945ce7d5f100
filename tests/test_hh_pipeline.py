"""The HH-RLHF pipeline: preference pairs, a disjoint split, a RewardTrainer reward model that DPPO then trains on."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForSequenceClassification, set_seed

from trl_dppo.jobs.default_model import default_model_path
from trl_dppo.jobs.hh_pipeline import HHDataArguments, HHRewardArguments, build_reward_model
from trl_dppo.jobs.hh_pipeline import main as run_hh_pipeline
from trl_dppo.jobs.hh_reward_model import load_hh_pairs, score_conversations, split_hh_pairs
from trl_dppo.jobs.hh_rlhf import load_reward_model

from .conftest import DATA, needs_data


def test_split_is_disjoint_reproducible_and_keeps_held_out_fixed() -> None:
    pairs = Dataset.from_dict({"id": list(range(100))})
    splits = split_hh_pairs(pairs, held_out=20, policy_train=30, seed=0)
    parts = [set(part["id"]) for part in (splits.reward_train, splits.policy_train, splits.held_out)]
    assert [len(p) for p in parts] == [50, 30, 20]
    assert set().union(*parts) == set(range(100)) and sum(map(len, parts)) == 100
    assert split_hh_pairs(pairs, 20, 30, seed=0).held_out["id"] == splits.held_out["id"]
    assert split_hh_pairs(pairs, 20, 30, seed=1).held_out["id"] != splits.held_out["id"]
    # Fewer reward-model pairs change neither the held-out nor the policy part
    capped = split_hh_pairs(pairs, 20, 30, seed=0, reward_train=10)
    assert len(capped.reward_train) == 10 and capped.held_out["id"] == splits.held_out["id"]
    assert capped.policy_train["id"] == splits.policy_train["id"]
    with pytest.raises(ValueError, match="leave none"):
        split_hh_pairs(pairs, 60, 40, seed=0)


def test_a_reward_model_made_on_another_split_is_not_reused(tmp_path: Path) -> None:
    folder = tmp_path / "reward_model"
    folder.mkdir()
    made_with = {**asdict(HHDataArguments(split_seed=1)), **asdict(HHRewardArguments())}
    del made_with["output_dir"]
    (folder / "reward_summary.json").write_text(json.dumps({"made_with": made_with}))
    assert build_reward_model(HHDataArguments(output_dir=str(tmp_path), split_seed=1), HHRewardArguments()) == {
        "made_with": made_with
    }
    with pytest.raises(ValueError, match="held-out pairs may not be this run's"):
        build_reward_model(HHDataArguments(output_dir=str(tmp_path), split_seed=0), HHRewardArguments())


@needs_data
def test_pairs_share_the_prompt_and_fit_max_length(tokenizer) -> None:
    pairs, rows_read = load_hh_pairs(tokenizer, max_length=256, data_path=str(DATA), num_rows=60)
    assert rows_read == 60 and 30 <= len(pairs) < 60  # long dialogues are dropped, not cut
    for pair in pairs:
        assert pair["prompt"][-1]["role"] == "user"
        assert [m["role"] for m in pair["chosen"]] == [m["role"] for m in pair["rejected"]] == ["assistant"]
        for side in ("chosen", "rejected"):
            conversation = pair["prompt"] + pair[side]
            assert len(tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=False)) <= 256


@needs_data
@pytest.mark.slow
def test_short_pipeline_connects_reward_model_and_dppo(tiny_model_dir: str, tmp_path: Path) -> None:
    """A few reward-model steps on SmolLM2, then a few DPPO steps of a tiny policy scored by that reward model."""
    out = tmp_path / "hh"
    summary = run_hh_pipeline([
        "--data_path", str(DATA), "--output_dir", str(out), "--num_rows", "120", "--max_length", "160",
        "--held_out_pairs", "8", "--policy_pairs", "16", "--reward_train_pairs", "8",
        "--reward_batch_size", "2", "--reward_max_steps", "3",
        "--model_name_or_path", tiny_model_dir, "--seeds", "0", "--max_steps", "2",
        "--per_device_train_batch_size", "4", "--num_generations", "4", "--steps_per_generation", "2",
        "--max_prompt_length", "128", "--max_completion_length", "8",
        "--eval_prompts", "4", "--eval_samples", "1", "--samples_shown", "2",
    ])  # fmt: skip

    # The reward model trained with RewardTrainer and loads through the HH example's loader
    assert summary["reward_model"]["steps"] == 3
    assert {"untrained", "trained"} <= set(summary["reward_model"])
    model, tokenizer = load_reward_model(str(out / "reward_model"), dtype=torch.float32)
    pairs, _ = load_hh_pairs(tokenizer, max_length=160, data_path=str(DATA), num_rows=120)
    held_out = split_hh_pairs(pairs, held_out=8, policy_train=16, seed=0).held_out
    chosen = score_conversations(
        model, tokenizer, [p + c for p, c in zip(held_out["prompt"], held_out["chosen"], strict=True)]
    )
    rejected = score_conversations(
        model, tokenizer, [p + r for p, r in zip(held_out["prompt"], held_out["rejected"], strict=True)]
    )
    assert all(abs(c - r) > 1e-6 for c, r in zip(chosen, rejected, strict=True))
    # The new score head was trained too (LoRA alone would leave it at its seeded initial weights)
    set_seed(0)
    untrained = AutoModelForSequenceClassification.from_pretrained(default_model_path(), num_labels=1)
    assert not torch.allclose(model.score.weight, untrained.score.weight)

    # DPPO ran against it, and the run's artefacts are in the one folder
    run = summary["policy"]["seeds"]["0"]
    assert run["steps"] == 2 and run["reward_first"] is not None
    assert summary["policy"]["held_out_reward_before"] is not None and run["held_out_reward_after"] is not None
    history = json.loads((out / "seed0" / "log_history.json").read_text())
    assert any("trust_region/masked_fraction" in entry for entry in history)
    assert (out / "seed0" / "adapter_config.json").is_file() and (out / "seed0" / "plots" / "reward.png").is_file()
    assert (out / "samples.md").read_text().count("| before (reward") == 2
    assert json.loads((out / "summary.json").read_text())["data"]["splits"]["held_out"] == 8
