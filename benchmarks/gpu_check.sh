#!/usr/bin/env bash
# One prepared GPU check (about 5-8 minutes on one H200-class GPU): DPPOTrainer against GRPOTrainer with its
# importance-sampling correction, and DPPO with top-K, vLLM colocate on CUDA. Needs a CUDA machine
# with this package installed with vLLM (`pip install -e ".[vllm,examples]"`) and the model reachable: set MODEL to a
# local folder when the hub is not reachable (default: the embedded SmolLM2-135M-Instruct, converted offline).
#
#     MODEL=Qwen/Qwen2.5-0.5B-Instruct bash benchmarks/gpu_check.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/results/gpu}
mkdir -p "$out"
model=${MODEL:-SmolLM2-135M-Instruct}
python - "$model" "$out" <<'PY'
import json, sys, time
from pathlib import Path

sys.path.insert(0, "benchmarks")
import torch
from harness import markdown_table, run_variants

model, out = sys.argv[1], Path(sys.argv[2])
assert torch.cuda.is_available(), "gpu_check.sh needs a CUDA GPU"
base = dict(per_device_train_batch_size=16, num_generations=8, max_completion_length=256, learning_rate=1e-5,
            bf16=True, use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.35,
            vllm_max_model_length=1024)
variants = {
    "grpo + IS correction": dict(trainer="grpo", model=model, warmup=2, steps=8,
                                 config=dict(base, vllm_importance_sampling_correction=True)),
    "dppo binary_tv": dict(trainer="dppo", model=model, warmup=2, steps=8, config=base),
    "dppo topk_kl K=20": dict(trainer="dppo", model=model, warmup=2, steps=8,
                              config=dict(base, divergence="topk_kl", topk=20)),
}
summary = run_variants(variants, 1, out / "gpu_dppo_vs_grpo.json")
text = (f"# GPU: {torch.cuda.get_device_name()} — {model}, vLLM colocate\n\n"
        + markdown_table(summary, "grpo + IS correction") + "\n")
(out / "gpu_dppo_vs_grpo.md").write_text(text)
print(text)
PY
