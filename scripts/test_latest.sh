#!/usr/bin/env bash
# Environment (b) of CI: a fresh .venv-latest with the newest releases TRL 1.16 accepts of transformers, peft,
# accelerate and datasets, the same CPU torch as .venv, and no vLLM; the wheel installed into it, then the suite
# (scripts/test_installed.sh). The newest torch is checked by pip's resolver only (scripts/check_resolution.py): the
# only CPU build on these machines is 2.13.
# Usage: bash scripts/test_latest.sh dist/trl_dppo-VERSION-py3-none-any.whl [pytest arguments]
set -euo pipefail
# The newest releases on PyPI when the range in pyproject.toml was last widened; raise them with NEWEST in
# scripts/check_resolution.py
VENV=.venv-latest STACK="torch==2.13.0 transformers==5.24.0 peft==0.21.2 accelerate==1.15.0 datasets==5.2.0" \
    exec bash "$(dirname "$0")/test_installed.sh" "$@"
