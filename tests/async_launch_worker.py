"""Trains AsyncDPPOTrainer (MODEL_DIR + LoRA, learning rate 0) against a vLLM server under whatever launched it and
saves, per process, each loss computation's (pi, mu) of its loss terms and the versions the trainer published:
tests/test_async_launches.py checks that with two training processes, under DDP or DeepSpeed ZeRO, both train on the server's
records under the adapter the trainer publishes. The adapter changes the model (PEFT starts B at 0, a no-op).

    python tests/async_launch_worker.py SERVER_URL OUT_FILE MODEL_DIR
"""

from __future__ import annotations

import gc
import os
import sys

import torch
from datasets import Dataset
from peft import LoraConfig

from trl_dppo import AsyncDPPOConfig, AsyncDPPOTrainer
from trl_dppo.jobs.default_model import smollm2_tokenizer


SAMPLES_PER_STEP = 4  # per process


def length_reward(completions, **kwargs):
    return [float(len(c[0]["content"]) % 5) for c in completions]


def main(url: str, out_file: str, model: str) -> None:
    torch.set_num_threads(1)
    args = AsyncDPPOConfig(
        output_dir=f"{out_file}.run",
        report_to="none",
        use_cpu=True,
        bf16=False,
        vllm_server_base_url=url,
        per_device_train_batch_size=SAMPLES_PER_STEP,
        num_generations=4,
        max_completion_length=12,
        temperature=0.7,
        token_budget=0,
        max_staleness=3,
        learning_rate=0.0,
        max_steps=3,  # samples of versions published by at least two syncs
        logging_steps=1,
        save_strategy="no",
        gradient_checkpointing=False,
        seed=0,
    )
    trainer = AsyncDPPOTrainer(
        model=model,
        reward_funcs=length_reward,
        args=args,
        train_dataset=Dataset.from_dict(
            {"prompt": [[{"role": "user", "content": f"Count to {i}."}] for i in range(64)]}
        ),
        processing_class=smollm2_tokenizer(),
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0),
    )
    torch.manual_seed(0)  # the same adapter on every process, set before DeepSpeed partitions it
    for name, param in trainer.model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(std=0.15)  # as tests/test_async.py's first test
    seen = []
    trust_region_loss = trainer._trust_region_loss

    def spy(trainer_logps, sampler_logps, advantages, lag, missing, global_n_tokens, completions):
        seen.append({"pi": trainer_logps.detach().clone(), "mu": sampler_logps.clone(), "missing": missing.clone()})
        return trust_region_loss(trainer_logps, sampler_logps, advantages, lag, missing, global_n_tokens, completions)

    trainer._trust_region_loss = spy
    trainer.train()
    result = {
        "num_processes": trainer.accelerator.num_processes,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "partitioned": all(hasattr(p, "ds_id") for p in trainer.model.parameters()),
        "published": sorted(trainer._published_at),
        "seen": seen,
    }
    torch.save(result, f"{out_file}.rank{os.environ['RANK']}")
    if torch.distributed.is_initialized():  # else gloo can abort at exit after a good run (pytorch/pytorch#190489)
        gc.collect()
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
