#!/usr/bin/env bash
# The rare-token study (benchmarks/rare_tokens.py) and the convergence study (benchmarks/convergence.py) as one
# prepared GPU script, each with `--profile gpu`: vLLM colocate serving in bf16 against an fp32 trainer, as
# benchmarks/gpu_stability.sh runs, with 4 prompts x 8 completions per step (16 prompts per generation batch).
#  1. Rare tokens: GRPO Clip-Higher, relaxed clip (alpha 0.1) and DPPO binary TV, 32 steps, seeds 0-2.
#  2. Convergence: a fixed set of 64 problems the base model solves at least once in 16 samples (chosen here, from 128
#     candidates, with the GPU sampler), then PG-IS, GRPO at mu, MiniRL and DPPO binary TV for 64 steps (4 epochs).
# Offline: the model is the embedded SmolLM2-135M-Instruct (converted from the package's GGUF). Each part has a time
# limit, so the whole stays under 10 minutes on one H200 (an estimate, not yet run: each run starts its own vLLM
# engine); a run cut by its limit is not logged, and the reports show the runs that finished (seed 0 of every
# method first). Needs a CUDA machine with this package installed with vLLM (`pip install -e ".[vllm,examples]"`).
#
#     bash benchmarks/gpu_studies.sh
# Writes benchmarks/results/rare_tokens_gpu/ and benchmarks/results/convergence_gpu/ (logs, figures, results.md).
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch; assert torch.cuda.is_available(), 'gpu_studies.sh needs a CUDA GPU'"
export HF_HUB_OFFLINE=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

timeout "${RARE_TOKENS_S:-270}" python benchmarks/rare_tokens.py --profile gpu --steps 32 --seeds 0 1 2 ||
    echo "rare tokens: stopped at its time limit; the report shows the runs that finished"
python benchmarks/rare_tokens.py --profile gpu --report-only

if [ ! -e benchmarks/results/convergence_gpu/train_set.json ]; then
    timeout 90 python benchmarks/convergence.py --profile gpu --select
fi
timeout "${CONVERGENCE_S:-210}" python benchmarks/convergence.py --profile gpu --steps 64 --seeds 0 ||
    echo "convergence: stopped at its time limit; the report shows the runs that finished"
python benchmarks/convergence.py --profile gpu --report-only
