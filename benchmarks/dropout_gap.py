"""The sampler-trainer gap before any update (`mismatch/at_sync_*`) with dropout active in the training forward.

Hypothesis (written before the run): transformers generation runs the model in eval mode, so the sampler's mu has no
dropout, while the training forward runs in train mode, where GRPOConfig's default `disable_dropout=False` leaves
dropout on. pi and mu are then different functions of the same weights: the at-sync gap, fp32 noise alone without
dropout (about 1e-5 at most on SmolLM2, `precision_gap.md`), grows to the size of what dropout removes. A freshly
initialised LoRA adapter contributes nothing (its B is 0), so LoRA dropout shows only once the adapter has moved:
expected below 1e-5 on the first step, then growing with the adapter, to 1e-3 and above within a few steps at a
learning rate that moves a peaked model. Dropout in the model itself (`attention_dropout`) acts from the first step
and is expected to reach max |pi - mu| of 0.1 or more, far above delta = 0.15's scale of what the trust region
decides on. With `disable_dropout=True` every variant is expected back at the fp32 gap.

Each variant trains a few steps (one generation per step, so each step's loss runs on the weights that sampled its
batch: the at-sync gap is logged every step) with transformers generation, fp32 throughout (`bf16=False`), LoRA on the
attention projections: SmolLM2-135M-Instruct, and the tests' tiny peaked model (`tests/conftest.py`,
`build_tiny_model`), also with `attention_dropout=0.1`. The reward (completion length mod 5) only gives the groups
advantages, so that the adapter moves.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/dropout_gap.py
Writes benchmarks/results/dropout_gap/results.{json,md} (about 4 minutes on 2 cores).
"""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
from pathlib import Path
from unittest import mock


ROOT = Path(__file__).resolve().parents[1]
METRICS = ("at_sync_abs_prob_diff_mean", "at_sync_abs_prob_diff_max")
# (model, attention_dropout, lora_dropout, disable_dropout); disable_dropout is set explicitly, so the run does not
# depend on the config's default
VARIANTS = [
    ("smollm2", 0.0, 0.0, False),
    ("smollm2", 0.0, 0.1, False),
    ("smollm2", 0.0, 0.1, True),
    ("tiny", 0.0, 0.0, False),
    ("tiny", 0.0, 0.1, False),
    ("tiny", 0.0, 0.1, True),
    ("tiny", 0.1, 0.0, False),
    ("tiny", 0.1, 0.0, True),
]
SETTINGS = {
    # A learning rate a LoRA run on SmolLM2 could use, over 4 steps: the adapter moves off B = 0
    "smollm2": dict(learning_rate=1e-3, max_steps=4, per_device_train_batch_size=8, num_generations=4),
    "tiny": dict(learning_rate=1e-2, max_steps=6, per_device_train_batch_size=8, num_generations=4),
}


def length_reward(completions, **kwargs):
    """A reward with spread within each group, so that the adapter moves on the tiny model too (which never finds an
    exact answer)."""
    return [float(len(c[0]["content"]) % 5) for c in completions]


def model_dir(name: str, attention_dropout: float, tmp: Path) -> str:
    from trl_dppo.jobs.default_model import default_model_path, smollm2_tokenizer

    if name == "smollm2":
        return default_model_path()
    sys.path.insert(0, str(ROOT))
    from tests.conftest import build_tiny_model

    tokenizer = smollm2_tokenizer()
    model = build_tiny_model(tokenizer)
    model.config.attention_dropout = attention_dropout
    path = tmp / f"tiny-{attention_dropout}"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def measure(name: str, attention_dropout: float, lora_dropout: float, disable_dropout: bool, tmp: Path) -> dict:
    from peft import LoraConfig

    from trl_dppo import DPPOConfig, DPPOTrainer
    from trl_dppo.jobs.arithmetic import arithmetic_dataset
    from trl_dppo.jobs.default_model import smollm2_tokenizer

    config = DPPOConfig(
        output_dir=str(tmp / "out"),
        report_to="none",
        bf16=False,
        save_strategy="no",
        logging_steps=1,
        seed=0,
        disable_tqdm=True,
        max_completion_length=16,
        disable_dropout=disable_dropout,
        **SETTINGS[name],
    )
    # DPPOTrainer refuses attention_dropout with disable_dropout=True (it cannot turn it off); the refusal is skipped
    # here to measure what it prevents
    refusal = mock.patch("trl_dppo.trainer.check_training_dropout") if attention_dropout and disable_dropout else None
    with refusal or contextlib.nullcontext():
        trainer = DPPOTrainer(
            model=model_dir(name, attention_dropout, tmp),
            reward_funcs=length_reward,
            args=config,
            train_dataset=arithmetic_dataset(64, seed=0),
            processing_class=smollm2_tokenizer(),
            peft_config=LoraConfig(
                r=16,
                lora_alpha=32,
                lora_dropout=lora_dropout,
                target_modules=["q_proj", "v_proj"],
                task_type="CAUSAL_LM",
            ),
        )
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    return {metric: [entry[f"mismatch/{metric}"] for entry in logs] for metric in METRICS}


def main() -> None:
    import torch

    torch.manual_seed(0)
    results = []
    for name, attention_dropout, lora_dropout, disable_dropout in VARIANTS:
        with tempfile.TemporaryDirectory() as tmp:
            per_step = measure(name, attention_dropout, lora_dropout, disable_dropout, Path(tmp))
        row = dict(
            model=name,
            attention_dropout=attention_dropout,
            lora_dropout=lora_dropout,
            disable_dropout=disable_dropout,
            per_step=per_step,
            abs_prob_diff_mean=sum(per_step["at_sync_abs_prob_diff_mean"])
            / len(per_step["at_sync_abs_prob_diff_mean"]),
            abs_prob_diff_max=max(per_step["at_sync_abs_prob_diff_max"]),
        )
        results.append(row)
        print(json.dumps(row), flush=True)
    out = Path(__file__).parent / "results" / "dropout_gap"
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"settings": SETTINGS, "results": results}, indent=2))
    lines = [
        "# Sampler-trainer gap at sync with dropout in the training forward (`benchmarks/dropout_gap.py`)",
        "",
        "transformers generation and training in fp32, LoRA r=16 on q_proj / v_proj, 8 completions of up to 16 tokens "
        "per step, one generation per step (every step's loss runs on the weights that sampled it). SmolLM2-135M-"
        f"Instruct: {SETTINGS['smollm2']['max_steps']} steps at learning rate {SETTINGS['smollm2']['learning_rate']}; "
        f"tiny peaked model: {SETTINGS['tiny']['max_steps']} steps at {SETTINGS['tiny']['learning_rate']}. Mean "
        "|pi - mu| averaged over the steps, max |pi - mu| over all tokens; per step: the max of each step.",
        "",
        "| model | attention_dropout | lora_dropout | disable_dropout | mean \\|pi - mu\\| | max \\|pi - mu\\| | "
        "max per step |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        steps = ", ".join(f"{v:.1e}" for v in r["per_step"]["at_sync_abs_prob_diff_max"])
        lines.append(
            f"| {r['model']} | {r['attention_dropout']} | {r['lora_dropout']} | {r['disable_dropout']} | "
            f"{r['abs_prob_diff_mean']:.2e} | {r['abs_prob_diff_max']:.2e} | {steps} |"
        )
    text = "\n".join(lines) + "\n"
    (out / "results.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
