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
from trl_dppo.jobs.hh_pipeline import HHDataArguments, HHRewardArguments, build_reward_models
from trl_dppo.jobs.hh_pipeline import main as run_hh_pipeline
from trl_dppo.jobs.hh_reward_model import load_hh_pairs, score_conversations, split_hh_pairs
from trl_dppo.jobs.hh_rlhf import load_reward_model

from .conftest import DATA, needs_data


def test_split_is_disjoint_reproducible_and_keeps_held_out_fixed() -> None:
    pairs = Dataset.from_dict({"id": list(range(100))})
    splits = split_hh_pairs(pairs, held_out=20, policy_train=30, seed=0)
    parts = [
        set(part["id"]) for part in (splits.reward_train, splits.judge_train, splits.policy_train, splits.held_out)
    ]
    # The judge gets half of what the held-out and policy parts leave, the reward model the rest; no pair is in two
    assert [len(p) for p in parts] == [25, 25, 30, 20]
    assert set().union(*parts) == set(range(100)) and sum(map(len, parts)) == 100
    assert split_hh_pairs(pairs, 20, 30, seed=0).held_out["id"] == splits.held_out["id"]
    assert split_hh_pairs(pairs, 20, 30, seed=1).held_out["id"] != splits.held_out["id"]
    # Other sizes for the two reward models change neither the held-out nor the policy part
    capped = split_hh_pairs(pairs, 20, 30, seed=0, judge_train=10, reward_train=10)
    assert len(capped.judge_train) == len(capped.reward_train) == 10
    assert capped.held_out["id"] == splits.held_out["id"] and capped.policy_train["id"] == splits.policy_train["id"]
    assert set(capped.judge_train["id"]).isdisjoint(capped.reward_train["id"])
    with pytest.raises(ValueError, match="cannot give the judge"):
        split_hh_pairs(pairs, 60, 39, seed=0)
    with pytest.raises(ValueError, match="cannot give the judge"):
        split_hh_pairs(pairs, 20, 30, seed=0, judge_train=30, reward_train=30)


def test_reward_models_made_on_another_split_are_not_reused(tmp_path: Path) -> None:
    made_with = {**asdict(HHDataArguments(split_seed=1)), **asdict(HHRewardArguments())}
    del made_with["output_dir"], made_with["reward_models_dir"]
    for name in ("reward_model", "judge"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "reward_summary.json").write_text(json.dumps({"made_with": made_with}))
    # Another run's output_dir, the models from the shared folder: nothing is loaded or trained
    shared = HHDataArguments(output_dir=str(tmp_path / "run"), reward_models_dir=str(tmp_path), split_seed=1)
    assert build_reward_models(shared, HHRewardArguments()) == {
        "reward_model": {"made_with": made_with},
        "judge": {"made_with": made_with},
    }
    with pytest.raises(ValueError, match="held-out pairs may not be this run's"):
        build_reward_models(HHDataArguments(output_dir=str(tmp_path), split_seed=0), HHRewardArguments())


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
def test_short_pipeline_connects_reward_models_dppo_and_the_judge(tiny_model_dir: str, tmp_path: Path) -> None:
    """A few steps of the reward model and the judge on SmolLM2, then DPPO with a KL anchor on a tiny policy scored
    by that reward model, measured on held-out prompts by both."""
    out = tmp_path / "hh"
    summary = run_hh_pipeline([
        "--data_path", str(DATA), "--output_dir", str(out), "--num_rows", "120", "--max_length", "160",
        "--held_out_pairs", "4", "--policy_pairs", "16", "--judge_train_pairs", "8", "--reward_train_pairs", "8",
        "--reward_batch_size", "2", "--reward_max_steps", "3",
        "--model_name_or_path", tiny_model_dir, "--seeds", "0", "--max_steps", "3", "--beta", "0.1",
        "--learning_rate", "1e-2", "--per_device_train_batch_size", "4", "--num_generations", "4",
        "--steps_per_generation", "2", "--max_prompt_length", "128", "--max_completion_length", "8",
        "--eval_prompts", "4", "--eval_samples", "1", "--samples_shown", "1",
    ])  # fmt: skip

    # Both reward models trained with RewardTrainer, on disjoint pairs, and load through the HH example's loader
    assert summary["data"]["splits"] == {"reward_train": 8, "judge_train": 8, "policy_train": 16, "held_out": 4}
    for name in ("reward_model", "judge"):
        assert summary[name]["steps"] == 3 and {"untrained", "trained"} <= set(summary[name])
    model, tokenizer = load_reward_model(str(out / "reward_model"), dtype=torch.float32)
    judge, _ = load_reward_model(str(out / "judge"), dtype=torch.float32)
    pairs, _ = load_hh_pairs(tokenizer, max_length=160, data_path=str(DATA), num_rows=120)
    held_out = split_hh_pairs(pairs, held_out=4, policy_train=16, seed=0, judge_train=8).held_out
    chosen = [p + c for p, c in zip(held_out["prompt"], held_out["chosen"], strict=True)]
    rejected = [p + r for p, r in zip(held_out["prompt"], held_out["rejected"], strict=True)]
    scores = score_conversations(model, tokenizer, chosen), score_conversations(model, tokenizer, rejected)
    assert all(abs(c - r) > 1e-6 for c, r in zip(*scores, strict=True))
    # The new score heads were trained too (LoRA alone would leave them at their seeded initial weights), each from
    # its own seed
    for scorer, seed in ((model, 0), (judge, 1)):
        set_seed(seed)
        untrained = AutoModelForSequenceClassification.from_pretrained(default_model_path(), num_labels=1)
        assert not torch.allclose(scorer.score.weight, untrained.score.weight)
    assert summary["reward_model"]["seed"] == 0 and summary["judge"]["seed"] == 1

    # DPPO ran against the reward model with TRL's KL to the base: 0 at step 1, where the new adapters (B = 0) change
    # nothing, and clearly above 0 at step 3, the first of the next rollout, after an update at lr 2.5e-3 (warm-up):
    # the reference stayed the base. Step 1 compares identical weights (0 here); 1e-6 bounds what fp32 could add
    # should kernels group rows differently: k3 = exp(d) - d - 1 of a log-prob difference d ~ 1e-6 is ~1e-12, and its
    # fp32 evaluation cancels to within ~1e-7. A reference that followed the policy would give 0 at step 3 too.
    run = summary["policy"]["seeds"]["0"]
    assert run["steps"] == 3 and run["reward_first"] is not None and run["beta"] == 0.1
    history = json.loads((out / "seed0" / "log_history.json").read_text())
    kl = {entry["step"]: entry["kl"] for entry in history if "kl" in entry}
    assert kl[1] < 1e-6 and kl[3] > 1e-3 and run["kl_first"] == kl[1]
    assert any("trust_region/masked_fraction" in entry for entry in history)
    assert (out / "seed0" / "adapter_config.json").is_file() and (out / "seed0" / "plots" / "reward.png").is_file()

    # The held-out measures, before and after, and the judge's verdict with its interval
    before, after = summary["policy"]["before"], run["held_out"]
    measures = {"reward", "judge", "length", "cut_share", "distinct_1", "distinct_2", "entropy", "kl_to_base"}
    assert measures <= set(before) and measures <= set(after)
    assert before["kl_to_base"] is None and after["kl_to_base"] != 0.0
    low, high = after["win_rate_ci95"]
    assert 0.0 <= low <= after["win_rate"] <= high <= 1.0
    assert (
        summary["policy"]["after_mean"]["judge"] == after["judge"] and summary["policy"]["after_sd"]["judge"] is None
    )
    samples = (out / "samples.md").read_text()
    assert samples.count("| base model (reward") == 3  # 1 nearest the median, the best, the worst
    assert json.loads((out / "summary.json").read_text())["data"]["splits"]["held_out"] == 4
