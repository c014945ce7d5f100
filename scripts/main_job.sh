#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh), fine-tunes SmolLM2-135M-Instruct with LoRA and DPPO on arithmetic, offline,
# then draws the run's plots. Extra arguments go to examples/dppo_math_lora.py (e.g. --max_steps 20).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1
out=outputs/dppo-math
.venv/bin/python examples/dppo_math_lora.py --output_dir "$out" "$@"
.venv/bin/python -m trl_dppo.plots "$out"
