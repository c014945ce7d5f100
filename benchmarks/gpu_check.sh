#!/usr/bin/env bash
# The prepared GPU checks, in one go on one H200-class GPU (an estimate, not yet run: about 2-3 minutes for the
# sharded top-K checks, then 5-8 for the vLLM comparison):
#  1. top-K under DeepSpeed ZeRO-3 and under FSDP2 (examples/accelerate_configs/zero3.yaml, fsdp2.yaml, one process,
#     fp32): at lr 0 the trainer's kept-set log-probabilities equal the sampler's (benchmarks/sharded_topk_check.py).
#     ZeRO-3 needs `pip install deepspeed`; without it that check is reported as skipped, not passed.
#  2. DPPOTrainer against GRPOTrainer with its importance-sampling correction, and DPPO with top-K, vLLM colocate.
# Needs a CUDA machine with this package installed with vLLM (`pip install -e ".[vllm,examples]"`, and deepspeed) and
# the model reachable: set MODEL to a local folder when the hub is not reachable (default: the embedded
# SmolLM2-135M-Instruct, converted offline; the sharded checks always use an untied copy of SmolLM2).
#
#     MODEL=Qwen/Qwen2.5-0.5B-Instruct bash benchmarks/gpu_check.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/results/gpu}
mkdir -p "$out"
model=${MODEL:-SmolLM2-135M-Instruct}
python -c "import torch; assert torch.cuda.is_available(), 'gpu_check.sh needs a CUDA GPU'"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# 1. Sharded top-K. A failed check is reported and the script goes on; its exit status is the checks' at the end.
sharded_status=0
untied=$(mktemp -d)
python benchmarks/sharded_topk_check.py prepare "$untied"
for engine in zero3 fsdp2; do
    if [ "$engine" = zero3 ] && ! python -c "import deepspeed" 2>/dev/null; then
        echo '{"skipped": "deepspeed is not installed"}' > "$out/sharded_topk_$engine.json"
        echo "sharded top-K, $engine: SKIPPED (pip install deepspeed)"
        continue
    fi
    if timeout 300 python -m accelerate.commands.launch --config_file "examples/accelerate_configs/$engine.yaml" \
        --num_processes 1 --mixed_precision no --main_process_port 29541 \
        benchmarks/sharded_topk_check.py check "$untied" "$out/sharded_topk_$engine.json" \
        > "$out/sharded_topk_$engine.log" 2>&1; then
        echo "sharded top-K, $engine: PASSED $(cat "$out/sharded_topk_$engine.json" | tr -d '\n ')"
    else
        sharded_status=1
        echo "sharded top-K, $engine: FAILED (last lines of $out/sharded_topk_$engine.log below)"
        tail -n 30 "$out/sharded_topk_$engine.log"
    fi
done
rm -rf "$untied"

# 2. DPPO against GRPO with vLLM
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
                              config=dict(base, divergence="topk_kl", divergence_topk=20)),
}
summary = run_variants(variants, 1, out / "gpu_dppo_vs_grpo.json")
text = (f"# GPU: {torch.cuda.get_device_name()} — {model}, vLLM colocate\n\n"
        + markdown_table(summary, "grpo + IS correction") + "\n")
(out / "gpu_dppo_vs_grpo.md").write_text(text)
print(text)
PY
exit $sharded_status
