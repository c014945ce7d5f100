"""Trains prepared generation batches with DPPOTrainer under whatever launched it (python, or `accelerate launch` with
N processes) and saves the parameter updates and logged metrics: tests/test_distributed_equivalence.py compares a
one-process run with a two-process one.

    python tests/equivalence_worker.py BATCH_FILE OUT_FILE

BATCH_FILE (torch.save) holds `model_dir` and `batch`, a global generation batch in the shape
`_generate_and_score_completions` returns (prompt and completion ids and masks, advantages,
`sampling_per_token_logps`, `sampler_kept_ids`, `sampler_kept_logps`), micro-batch after micro-batch of
`WORLD_ROWS` rows each. Every process trains its share of each micro-batch, so every optimizer step sees the same
global rows whatever the number of processes.
"""

from __future__ import annotations

import gc
import os
import sys

import torch
import trl.trainer.grpo_trainer as grpo_trainer_module
from datasets import Dataset
from peft import LoraConfig
from transformers import set_seed

from trl_dppo import DPPOConfig, DPPOTrainer
from trl_dppo.jobs.default_model import smollm2_tokenizer


WORLD_ROWS = 4  # rows per micro-batch, over all processes
TOPK = 4
DPPO_METRICS = ("trust_region/", "mismatch/", "diagnostics/", "tokens_by_mu/")

# Every configuration takes 2 optimizer steps from one generation batch: with gradient_accumulation_steps 1 the second
# step is off-policy (its pi has moved from mu by the first update); with 2 each step accumulates two micro-batches.
CONFIGS = {
    f"{divergence}-{loss_type}-{tuning}": dict(
        divergence=divergence,
        loss_type=loss_type,
        lora=tuning == "lora",
        steps_per_generation=2 if tuning == "lora" else 4,
        gradient_accumulation_steps=1 if tuning == "lora" else 2,
    )
    for divergence in ("binary_tv", "topk_tv")
    for loss_type in ("dapo", "grpo")
    for tuning in ("lora", "full")
}


def local_generation_batch(batch: dict, steps_per_generation: int, rank: int, world: int) -> dict:
    """This process's rows of each micro-batch, in micro-batch order, as `_generate_and_score_completions` returns."""
    share = WORLD_ROWS // world
    rows = [m * WORLD_ROWS + rank * share + i for m in range(steps_per_generation) for i in range(share)]
    local = {key: value[rows] for key, value in batch.items()}
    # GRPOTrainer's count of loss tokens over the generation batch of all processes
    local["num_items_in_batch"] = batch["completion_mask"][: steps_per_generation * WORLD_ROWS].sum()
    return local


def train(name: str, settings: dict, batch: dict, model_dir: str, output_dir: str) -> dict:
    world = int(os.environ.get("WORLD_SIZE", "1"))  # set by the launcher; the trainer's accelerator must agree
    set_seed(0)  # the LoRA initialisation
    steps_per_generation = settings["steps_per_generation"]
    args = DPPOConfig(
        output_dir=f"{output_dir}/{name}",
        report_to="none",
        use_cpu=True,  # without it, processes launched on a machine without GPUs would each train alone
        bf16=False,
        per_device_train_batch_size=WORLD_ROWS // world,
        num_generations=2,
        max_completion_length=batch["completion_ids"].size(1),
        steps_per_generation=steps_per_generation,
        gradient_accumulation_steps=settings["gradient_accumulation_steps"],
        max_steps=2,
        logging_steps=1,
        # SGD: the update is -lr x gradient, so any difference in the gradient's scale shows (Adam would hide it)
        optim="sgd",
        learning_rate=0.2,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        save_strategy="no",
        seed=0,
        divergence=settings["divergence"],
        divergence_topk=TOPK,
        loss_type=settings["loss_type"],
        log_tokens_by_mu=True,
    )
    trainer = DPPOTrainer(
        model=model_dir,
        reward_funcs=lambda completions, **kwargs: [0.0] * len(completions),
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["unused"] * 64}),
        processing_class=smollm2_tokenizer(),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]) if settings["lora"] else None,
    )
    accelerator = trainer.accelerator
    assert accelerator.num_processes == world, f"{world} processes launched, {accelerator.num_processes} training"
    local = local_generation_batch(batch, steps_per_generation, accelerator.process_index, world)
    trainer._generate_and_score_completions = lambda inputs: dict(local)
    trainable = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
    before = {n: p.detach().clone() for n, p in trainable.items()}
    trainer.train()
    logs = [
        {k: v for k, v in entry.items() if k == "loss" or k.startswith(DPPO_METRICS)}
        for entry in trainer.state.log_history
        if "loss" in entry
    ]
    return {
        "num_processes": accelerator.num_processes,
        "distributed_type": accelerator.distributed_type.value,
        "before": before,
        "update": {n: p.detach() - before[n] for n, p in trainable.items()},
        "logs": logs,
        "masked_token_counts": {s: dict(c) for s, c in trainer.diagnostics.counts_over_processes().items()},
    }


def main(batch_file: str, out_file: str) -> None:
    torch.set_num_threads(1)
    # GRPOTrainer shuffles each process's generation batch before splitting it into micro-batches: a different
    # (equally valid) order of rows per number of processes. The order is held fixed so the runs compare.
    grpo_trainer_module.shuffle_sequence_dict = lambda batch: batch
    prepared = torch.load(batch_file)
    results = {
        name: train(name, settings, prepared["batch"], prepared["model_dir"], f"{out_file}.runs")
        for name, settings in CONFIGS.items()
    }
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(results, out_file)
    if torch.distributed.is_initialized():  # else gloo can abort at exit after a good run (pytorch/pytorch#190489)
        gc.collect()  # the trainers' DDP wrappers hold the group too
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
