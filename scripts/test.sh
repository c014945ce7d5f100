#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh) and runs the whole test suite, the vLLM tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# OpenMP threads that spin while they wait slow CPU matmuls 10-20x when processes share the cores (the 2-process
# accelerate test, vLLM beside the trainer); passive waiting costs nothing otherwise
export HF_HUB_OFFLINE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 OMP_WAIT_POLICY=PASSIVE
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
