"""Top-K under a sharding engine on a GPU: the trainer's kept-set log-probabilities equal the sampler's at lr 0.

Run by benchmarks/gpu_check.sh, once per engine, under `accelerate launch` (DeepSpeed ZeRO-3:
examples/accelerate_configs/zero3.yaml; FSDP2: fsdp2.yaml), fp32 on both sides:

    python benchmarks/sharded_topk_check.py prepare MODEL_DIR [MODEL]    # an untied copy of MODEL (default SmolLM2)
    python benchmarks/sharded_topk_check.py prepare MODEL_DIR CONFIG_DIR --random-init  # without the weights
    accelerate launch --config_file CONFIG --num_processes 1 --mixed_precision no \
        benchmarks/sharded_topk_check.py check MODEL_DIR OUT_JSON

The copy has its own LM-head weight (SmolLM2 ties it to the embeddings), so the head is a parameter of its own and
the engine shards it like any other. Where the weights cannot be had (a GPU machine with no hub and no room for the
converted SmolLM2), `--random-init` builds the copy from CONFIG_DIR's config.json and tokenizer instead: random
weights with the LM head scaled so that next-token distributions are peaked (a near-uniform random head would hide a
wrong read behind tiny log-probability gaps). At learning rate 0 the trainer's log pi at the sampler's kept ids (read
through `lm_head_kept_logps`, outside the head's forward pass) must equal the sampler's records; a shard or an empty
ZeRO-3 placeholder read as the whole head would give gaps of order 1, or fail. The check also records what the head's
weight was when it was read: a ZeRO-3 placeholder, an FSDP2 DTensor shard, or the whole tensor (accelerate's FSDP2
wrapping keeps the head's group unsharded between forward and backward; the DTensor case is tested on CPU in
tests/test_sharded_topk.py).
"""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager

import torch


TOLERANCE = 1e-2  # fp32 generation against the fp32 training forward; a wrong read is off by order 1


HEAD_SCALE = 10.0  # random LM head scale-up: on SmolLM2-135M's shape, mean top probability ~0.46, entropy ~2.3 nats


def prepare(model_dir: str, model: str = "SmolLM2-135M-Instruct", *options: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from trl_dppo.jobs.default_model import resolve_model, smollm2_tokenizer

    if set(options) - {"--random-init"}:
        raise SystemExit(f"prepare: unknown options {options}; the only one is --random-init")
    if options:
        config = AutoConfig.from_pretrained(model)
        config.tie_word_embeddings = False
        torch.manual_seed(0)
        untied = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            untied.lm_head.weight.mul_(HEAD_SCALE)
        untied.save_pretrained(model_dir)
        AutoTokenizer.from_pretrained(model).save_pretrained(model_dir)
        return
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


@contextmanager
def kept_set_spy(trainer):
    """Within the block, record per loss computation the form of the LM head's weight when the trainer read its kept
    set, and the largest |trainer - sampler| kept-set log-probability gap over the loss's tokens (benchmarks only: the
    tests spy the same way). Raises if a completion token is missing from its own kept set."""
    import trl_dppo.trainer as trainer_module

    forms, gaps, read = [], [], []
    read_head = trainer_module.lm_head_kept_logps

    def spy_read(head, *args, **kwargs):
        forms.append(weight_form(head.weight))
        read[:] = [read_head(head, *args, **kwargs)]
        return read[0]

    set_weights = trainer._set_trust_region_advantages

    def spy_weights(context, trainer_logps, hidden):
        set_weights(context, trainer_logps, hidden)
        inputs = context.inputs
        mask = (inputs["completion_mask"] * inputs.get("tool_mask", 1)).bool()
        ids = inputs["sampler_kept_ids"]
        if not ((ids == inputs["completion_ids"][..., None]).any(-1) | ~mask).all():
            raise AssertionError("a sampled token is missing from its own kept set")
        slots = mask[..., None] & (ids >= 0)
        gaps.append((read[0] - inputs["sampler_kept_logps"]).abs()[slots].max().item())

    trainer_module.lm_head_kept_logps = spy_read
    trainer._set_trust_region_advantages = spy_weights
    try:
        yield forms, gaps
    finally:
        trainer_module.lm_head_kept_logps = read_head
        del trainer._set_trust_region_advantages  # back to the class's method


def check(model_dir: str, out_json: str) -> None:
    from trl_dppo import DPPOConfig, DPPOTrainer
    from trl_dppo.jobs.arithmetic import arithmetic_dataset, exact_answer_reward

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
        divergence_topk=20,
        seed=0,
    )
    trainer = DPPOTrainer(
        model=model_dir, reward_funcs=exact_answer_reward, args=args, train_dataset=arithmetic_dataset(64, seed=0)
    )
    with kept_set_spy(trainer) as (forms, gaps):
        trainer.train()
    result = {
        "distributed_type": trainer.accelerator.distributed_type.value,
        "head_weight_when_read": sorted(set(forms)),
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
