"""Trains DPPOTrainer (the tiny model of tests/conftest.py, LoRA) for two steps under whatever launched it, with the
loss made NaN on the last process only at step 1, and writes per process the error that stopped it:
tests/test_non_finite.py checks that every process stops at that step (none waits for the others in a collective).

    python tests/non_finite_worker.py MODEL_DIR OUT_FILE
"""

from __future__ import annotations

import sys

import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoTokenizer

from tests.conftest import leave_launched_run
from trl_dppo import DPPOConfig, DPPOTrainer
from trl_dppo.non_finite import NonFiniteTrainingError


def length_reward(completions, **kwargs):
    return [float(len(c[0]["content"]) % 5) for c in completions]


def main(model_dir: str, out_file: str) -> None:
    torch.set_num_threads(1)
    args = DPPOConfig(
        output_dir=f"{out_file}.run",
        report_to="none",
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        max_steps=2,
        logging_steps=1,
        save_strategy="no",
        seed=0,
    )
    prompts = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Count to {i}."}] for i in range(32)]})
    trainer = DPPOTrainer(
        model_dir,
        length_reward,
        args,
        train_dataset=prompts,
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )
    last = trainer.accelerator.num_processes - 1
    if trainer.accelerator.process_index == last:
        compute_loss = trainer._compute_loss
        trainer._compute_loss = lambda model, inputs: compute_loss(model, inputs) + float("nan")
    try:
        trainer.train()
        outcome = "trained"
    except NonFiniteTrainingError as error:
        outcome = str(error)
    with open(f"{out_file}.rank{trainer.accelerator.process_index}", "w") as f:
        f.write(outcome)
    leave_launched_run()


if __name__ == "__main__":
    main(*sys.argv[1:])
