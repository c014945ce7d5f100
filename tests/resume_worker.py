"""A short DPPO run (transformers generation, tiny model, LoRA) for tests/test_kill_and_resume.py.

    python tests/resume_worker.py MODEL_DIR OUTPUT_DIR MODE [save_on_each_node]
    accelerate launch --config_file examples/accelerate_configs/cpu_zero3.yaml tests/resume_worker.py ...  # ZeRO-3

MODE `straight` trains 4 steps; `stop_after_checkpoint` saves checkpoint-2, then waits to be killed; `resume` resumes
from the last checkpoint in OUTPUT_DIR (`resume_from_checkpoint=True`) and trains to step 4. `save_on_each_node`: each
machine writes its checkpoints into its own OUTPUT_DIR (machines without a shared filesystem). Every mode appends
each logged step to OUTPUT_DIR/steps-MODE.jsonl as it goes (the main process: the metrics are reduced over processes).
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import TrainerCallback

from tests.conftest import leave_launched_run, length_reward
from trl_dppo import DPPOConfig, DPPOTrainer
from trl_dppo.jobs.default_model import smollm2_tokenizer


SAVE_STEPS = 2  # a multiple of steps_per_generation: the checkpoint falls between generation batches
CHECKPOINT_SAVED = "checkpoint-saved"  # marker file: the process is now waiting to be killed


class StepLog(TrainerCallback):
    def __init__(self, path: str):
        self.path = path

    def on_log(self, args, state, control, logs=None, **kwargs):
        if "loss" in logs and state.is_world_process_zero:
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": state.global_step, **logs}) + "\n")


class WaitToBeKilled(TrainerCallback):
    def __init__(self, marker: str):
        self.marker = marker

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == SAVE_STEPS:
            if state.is_world_process_zero:  # all have saved: DPPOTrainer's save ends in a gather of the counts
                open(self.marker, "w").close()
            time.sleep(3600)


def main(model_dir: str, output_dir: str, mode: str, *flags: str) -> None:
    torch.set_num_threads(1)
    os.makedirs(output_dir, exist_ok=True)
    args = DPPOConfig(
        output_dir=output_dir,
        report_to="none",
        bf16=False,
        use_cpu=True,  # also what an accelerate launch of several CPU processes needs
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        steps_per_generation=2,
        max_steps=4,
        logging_steps=1,
        learning_rate=3e-2,  # large enough that the second step of each generation batch is masked somewhere
        save_strategy="steps",
        save_steps=SAVE_STEPS,
        save_on_each_node="save_on_each_node" in flags,
        seed=0,
    )
    prompts = [[{"role": "user", "content": f"Count to {i} and stop."}] for i in range(64)]
    trainer = DPPOTrainer(
        model=model_dir,
        reward_funcs=length_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=smollm2_tokenizer(),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
        callbacks=[StepLog(os.path.join(output_dir, f"steps-{mode}.jsonl"))],
    )
    if mode == "stop_after_checkpoint":
        trainer.add_callback(WaitToBeKilled(os.path.join(output_dir, CHECKPOINT_SAVED)))
    trainer.train(resume_from_checkpoint=mode == "resume")
    leave_launched_run()


if __name__ == "__main__":
    main(*sys.argv[1:])
