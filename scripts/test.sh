#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh) and runs the test suite, the vLLM tests included.
#   bash scripts/test.sh            the whole suite (the README's test command, and CI's)
#   bash scripts/test.sh --quick    the quick tier for everyday work: no end-to-end training run, no vLLM, no launch
# Further arguments go to pytest. docs/development.md has the times.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# OpenMP threads that spin while they wait slow CPU matmuls 10-20x when processes share the cores (the 2-process
# accelerate test, vLLM beside the trainer); passive waiting costs nothing otherwise
export HF_HUB_OFFLINE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 OMP_WAIT_POLICY=PASSIVE
tier=()
if [ "${1:-}" = "--quick" ]; then
    shift
    tier=(-m "not slow and not vllm and not launch")
fi
# Two workers, each running whole modules (module fixtures start once): the launches and servers wait on each other
# and on their bounds about half their time, which the other worker's tests fill (tests/conftest.py orders the modules);
# `-n 0` after the command runs them in one process
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist loadscope --no-loadscope-reorder "${tier[@]}" "$@"
