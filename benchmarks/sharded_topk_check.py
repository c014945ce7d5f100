"""Top-K under a sharding engine on a GPU: the trainer's kept-set log-probabilities equal the sampler's at lr 0.

Run by benchmarks/gpu_check.sh, once per engine, under `accelerate launch` (DeepSpeed ZeRO-3:
examples/accelerate_configs/zero3.yaml; FSDP2: fsdp2.yaml), fp32 on both sides:

    python benchmarks/sharded_topk_check.py prepare MODEL_DIR [MODEL]    # an untied copy of MODEL (default SmolLM2)
    accelerate launch --config_file CONFIG --num_processes 1 --mixed_precision no \
        benchmarks/sharded_topk_check.py check MODEL_DIR OUT_JSON

The copy has its own LM-head weight (SmolLM2 ties it to the embeddings), so the head is a parameter of its own and
the engine shards it like any other. At learning rate 0 the trainer's log pi at the sampler's kept ids (read through
`lm_head_kept_logps`, outside the head's forward pass) must equal the sampler's records; a shard or an empty
ZeRO-3 placeholder read as the whole head would give gaps of order 1, or fail. The check also records what the head's
weight was when it was read: a ZeRO-3 placeholder, an FSDP2 DTensor shard, or the whole tensor (accelerate's FSDP2
wrapping keeps the head's group unsharded between forward and backward; the DTensor case is tested on CPU in
tests/test_sharded_topk.py).
"""

from __future__ import annotations

import json
import sys

import torch


TOLERANCE = 1e-2  # fp32 generation against the fp32 training forward; a wrong read is off by order 1


def prepare(model_dir: str, model: str = "SmolLM2-135M-Instruct") -> None:
    from transformers import AutoModelForCausalLM

    from trl_dppo.default_model import resolve_model, smollm2_tokenizer

    source = AutoModelForCausalLM.from_pretrained(resolve_model(model), dtype=torch.float32)
    source.config.tie_word_embeddings = False
    untied = AutoModelForCausalLM.from_config(source.config, dtype=torch.float32)
    untied.load_state_dict(source.state_dict(), strict=False)
    with torch.no_grad():
        untied.lm_head.weight.copy_(source.get_output_embeddings().weight)
    untied.save_pretrained(model_dir)
    smollm2_tokenizer().save_pretrained(model_dir)


def weight_form(weight: torch.Tensor) -> str:
    from torch.distributed.tensor import DTensor

    if isinstance(weight, DTensor):
        return "fsdp2 dtensor shard"
    if hasattr(weight, "ds_id"):
        return f"zero3 parameter, {weight.numel()} local elements"
    return "whole tensor"


def check(model_dir: str, out_json: str) -> None:
    import trl_dppo.trainer as trainer_module
    from trl_dppo import DPPOConfig, DPPOTrainer
    from trl_dppo.arithmetic import arithmetic_dataset, exact_answer_reward

    args = DPPOConfig(
        output_dir="/tmp/sharded-topk-check",
        report_to="none",
        bf16=False,
        learning_rate=0.0,
        per_device_train_batch_size=8,
        num_generations=8,
        max_completion_length=32,
        max_steps=2,
        logging_steps=1,
        save_strategy="no",
        divergence="topk_kl",
        topk=20,
        seed=0,
    )
    trainer = DPPOTrainer(
        model=model_dir, reward_funcs=exact_answer_reward, args=args, train_dataset=arithmetic_dataset(64, seed=0)
    )
    reads = []  # (the head's weight when read, the kept-set log-probabilities read)
    read_head = trainer_module.lm_head_kept_logps

    def spy_read(head, *args, **kwargs):
        form = weight_form(head.weight)
        reads.append((form, read_head(head, *args, **kwargs)))
        return reads[-1][1]

    gaps = []
    set_weights = trainer._set_trust_region_advantages

    def spy_weights(context, trainer_logps, hidden):
        set_weights(context, trainer_logps, hidden)
        inputs = context.inputs
        mask = (inputs["completion_mask"] * inputs.get("tool_mask", 1)).bool()
        slots = mask[..., None] & (inputs["sampler_kept_ids"] >= 0)
        gaps.append((reads[-1][1] - inputs["sampler_kept_logps"]).abs()[slots].max().item())

    trainer_module.lm_head_kept_logps = spy_read
    trainer._set_trust_region_advantages = spy_weights
    trainer.train()
    result = {
        "distributed_type": trainer.accelerator.distributed_type.value,
        "head_weight_when_read": sorted({form for form, _ in reads}),
        "max_kept_logp_gap": max(gaps, default=None),
        "loss_computations": len(gaps),
        # Only a sharding engine makes this a check of the sharded read
        "passed": trainer.accelerator.distributed_type.value in ("DEEPSPEED", "FSDP") and max(gaps) < TOLERANCE,
    }
    if trainer.accelerator.is_main_process:
        with open(out_json, "w") as f:
            json.dump(result, f, indent=1)
        print(json.dumps(result))
    if not result["passed"]:
        raise SystemExit(f"top-K check failed: {result}")


if __name__ == "__main__":
    {"prepare": prepare, "check": check}[sys.argv[1]](*sys.argv[2:])
