#!/usr/bin/env bash
# The stability test (benchmarks/stability.py) as one prepared GPU script: the seven methods of the ladder, each
# for 60 steps, vLLM colocate serving in bf16 against an fp32 trainer, 4 optimizer steps per generation batch,
# lr 5e-4, 4 prompts x 8 completions x 64 tokens per step. Sized for under 8 minutes on one H200-class GPU (an
# estimate: not yet run). Needs a CUDA machine with this package installed with vLLM (`pip install -e
# ".[vllm,examples]"`). MODEL: a model of 0.5-1.5B parameters (hub id or local folder) when one can be had; default
# the embedded SmolLM2-135M-Instruct, converted offline.
#
#     MODEL=Qwen/Qwen2.5-0.5B-Instruct bash benchmarks/gpu_stability.sh
# Writes benchmarks/results/stability_gpu/ (logs, reward.png, mismatch.png, staleness.png, results.md).
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch; assert torch.cuda.is_available(), 'gpu_stability.sh needs a CUDA GPU'"
args=(--profile gpu --steps "${STEPS:-60}" --seeds 0)
if [ -n "${MODEL:-}" ]; then args+=(--model "$MODEL"); fi
python benchmarks/stability.py "${args[@]}"
