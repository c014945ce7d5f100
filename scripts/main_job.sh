#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh), fine-tunes SmolLM2-135M-Instruct with LoRA and DPPO on arithmetic, offline,
# then draws the run's plots. Extra arguments go to `trl-dppo math` (e.g. --max_steps 20).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# OpenMP threads that spin while they wait slow CPU matmuls when other processes share the cores
export HF_HUB_OFFLINE=1 OMP_WAIT_POLICY=PASSIVE
out=outputs/dppo-math
.venv/bin/trl-dppo math --output_dir "$out" "$@"
.venv/bin/trl-dppo plot "$out"
