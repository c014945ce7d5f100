#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh) and runs the whole test suite, the vLLM tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
