r"""DPPO with LoRA on HH-RLHF prompts, scored by a sequence-classification reward model.

Prompts are the dialogues of Anthropic's HH-RLHF up to their last Assistant turn (hub `Anthropic/hh-rlhf`, subset
`--dataset_subset harmless-base` by default, or a local `--data_path` .jsonl/.jsonl.gz file in the same format); the
policy writes the next Assistant turn and the reward model scores the whole conversation, rendered with the reward
model's chat template (or as HH plain text if it has none). Prompts longer than `--max_prompt_length` tokens are
dropped, since GRPO does not truncate prompts. All arguments are TRL-style (DPPOConfig, ModelConfig and the script's
own below), on the command line or in a YAML file passed with `--config`.

The paper's RLHF setting (Qwen3-4B-Instruct-2507 policy, Skywork-Reward-Llama-3.1-8B-v0.2 reward model; Appendix E:
lr 1e-6, or 1e-5 with LoRA; rollout temperature 1.0; train batch 128-256 prompts; mini-batch 16-32 prompts; n = 8-16
samples per prompt; delta 0.2 TV, 0.15 TV for the LoRA configuration, or 0.05 KL), on 8 GPUs with vLLM rollouts:

    accelerate launch --config_file examples/accelerate_configs/multi_gpu.yaml --num_processes 8 \
        examples/hh_rlhf_lora.py \
        --model_name_or_path Qwen/Qwen3-4B-Instruct-2507 --dtype bfloat16 \
        --reward_model_name_or_path Skywork/Skywork-Reward-Llama-3.1-8B-v0.2 \
        --dataset_subset harmless-base \
        --use_peft true --lora_r 16 --lora_alpha 32 --lora_target_modules all-linear \
        --learning_rate 1e-5 --divergence binary_tv --divergence_delta 0.15 \
        --temperature 1.0 --num_generations 8 \
        --generation_batch_size 1024 \
        --per_device_train_batch_size 4 --gradient_accumulation_steps 4 \
        --max_prompt_length 1024 --max_completion_length 512 \
        --use_vllm --vllm_mode colocate --vllm_gpu_memory_utilization 0.3 --vllm_max_model_length 1536 \
        --bf16 true --gradient_checkpointing true --max_steps 400 --save_steps 100 \
        --output_dir runs/hh-qwen3-4b-dppo-lora

Here a rollout is 128 prompts x 8 samples (generation_batch_size 1024 completions) and each optimizer step takes 16
prompts (8 processes x 4 completions x 4 accumulation steps = 128 completions), so one rollout feeds 8 optimizer steps
and all but the first are off-policy: the regime where DPPO's trust region matters. For the other settings of the
table: `--num_generations 16 --generation_batch_size 2048` (n = 16), `--gradient_accumulation_steps 8` (mini-batch 32
prompts), `--divergence binary_kl --divergence_delta 0.05` (KL), or full fine-tuning with `--use_peft false --learning_rate 1e-6
--divergence_delta 0.2` under `--config_file examples/accelerate_configs/zero3.yaml`. On one GPU drop the config file
and raise `--gradient_accumulation_steps` to 32 (the same 128 completions per optimizer step).

The same run from a recipe: `accelerate launch --config_file examples/accelerate_configs/multi_gpu.yaml
--num_processes 8 -m trl_dppo.jobs.cli hh-rlhf --config recipes/hh_rlhf_qwen3_4b_lora.yaml`. With `--load_in_4bit true`
the policy loads 4-bit quantized (QLoRA; bitsandbytes, CUDA only).

A CPU smoke run with the offline default policy (any small local reward model works):

    trl-dppo hh-rlhf --data_path ../shared/data/hh-rlhf/harmless-base-test.jsonl.gz \
        --reward_model_name_or_path path/to/reward_model --max_steps 2 --max_completion_length 32
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from trl import ModelConfig, TrlParser, get_peft_config

from ..config import DPPOConfig
from ..trainer import DPPOTrainer
from .default_model import resolve_model
from .hh_rlhf import REWARD_MODEL_HINT, load_hh_prompts, load_policy_tokenizer, load_reward_model
from .script_utils import (
    COMMON_DEFAULTS,
    device_defaults,
    quantization_config_for,
    run_job,
    train_and_report,
    with_model_init_kwargs,
)


@dataclass
class HHScriptArguments:
    """Where the prompts and the reward come from."""

    reward_model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "Hub id or local folder of a sequence-classification reward model with one output, e.g. "
            "Skywork/Skywork-Reward-Llama-3.1-8B-v0.2 (the paper's)."
        },
    )
    data_path: str | None = field(
        default=None,
        metadata={"help": "Local .jsonl or .jsonl.gz file of HH-RLHF rows ('chosen'/'rejected'); overrides the hub."},
    )
    dataset_name: str = field(default="Anthropic/hh-rlhf", metadata={"help": "Hub data set, when no --data_path."})
    dataset_subset: str | None = field(
        default="harmless-base",
        metadata={"help": "HH-RLHF subset (data_dir on the hub): harmless-base, helpful-base, helpful-online, ..."},
    )
    dataset_split: str = field(default="train", metadata={"help": "Hub split."})
    num_examples: int | None = field(default=None, metadata={"help": "Use only the first N rows."})
    max_prompt_length: int | None = field(
        default=1024,
        metadata={"help": "Drop prompts longer than this many tokens (chat-formatted, policy tokenizer)."},
    )
    reward_model_dtype: str = field(
        default="auto", metadata={"help": "dtype of the reward model: auto (bf16 on CUDA, float32 on CPU), or a name."}
    )


# Defaults below a --config YAML file and the command line; the docstring gives the paper-scale GPU command.
DEFAULTS: dict = {
    **COMMON_DEFAULTS,
    "output_dir": "runs/dppo-hh-rlhf-lora",
    "max_steps": 200,
    "learning_rate": 1e-5,  # the paper's LoRA learning rate
    "max_completion_length": 512,
    "save_strategy": "steps",
    "save_steps": 100,
    "log_tokens_by_mu": True,  # the plots' tokens_by_mu.png
}


def _dtype(name: str) -> torch.dtype | str:
    if name == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return getattr(torch, name)


def make_parser() -> TrlParser:
    return TrlParser((HHScriptArguments, DPPOConfig, ModelConfig), prog="trl-dppo hh-rlhf")


def main(script_args: HHScriptArguments, training_args: DPPOConfig, model_args: ModelConfig) -> dict | None:
    """Train and return the run summary (on the main process; ``None`` on the others)."""
    start = time.time()
    # Fail fast, before anything large loads, on inputs that cannot work
    if not script_args.reward_model_name_or_path:
        raise ValueError(f"No reward model given. {REWARD_MODEL_HINT}")
    quantization_config = quantization_config_for(model_args)
    model_path = resolve_model(model_args.model_name_or_path)
    tokenizer = load_policy_tokenizer(model_path, revision=model_args.model_revision)
    dataset = load_hh_prompts(
        script_args.data_path,
        script_args.dataset_name,
        script_args.dataset_subset,
        script_args.dataset_split,
        tokenizer=tokenizer,
        max_prompt_length=script_args.max_prompt_length,
        num_examples=script_args.num_examples,
    )
    reward_model, reward_tokenizer = load_reward_model(
        script_args.reward_model_name_or_path, dtype=_dtype(script_args.reward_model_dtype)
    )
    training_args = with_model_init_kwargs(training_args, model_args)
    trainer = DPPOTrainer(
        model=model_path,
        reward_funcs=reward_model,
        args=training_args,
        train_dataset=dataset,
        processing_class=tokenizer,
        reward_processing_classes=reward_tokenizer,
        quantization_config=quantization_config,
        peft_config=get_peft_config(model_args),
    )
    hub_source = f"{script_args.dataset_name}/{script_args.dataset_subset}:{script_args.dataset_split}"
    source = script_args.data_path or hub_source
    reward_model_name = script_args.reward_model_name_or_path
    return train_and_report(
        trainer,
        "DPPO HH-RLHF",
        model_args.model_name_or_path,
        f"{source}, {len(dataset)} prompts",
        {"reward_model": reward_model_name},
        start,
        model_note=f" | reward model: {reward_model_name}",
    )


def cli_defaults() -> dict:
    """The script's defaults, with the hardware-dependent ones filled in."""
    defaults = {**DEFAULTS, **device_defaults()}
    defaults["gradient_checkpointing"] = torch.cuda.is_available()  # memory on GPUs; only slows a CPU run down
    return defaults


def cli(argv: Sequence[str] | None = None) -> dict | None:
    """Parse TRL-style arguments (``--config`` YAML included) over the job's defaults, and train."""
    return run_job(main, make_parser(), cli_defaults(), argv)


if __name__ == "__main__":
    cli()
