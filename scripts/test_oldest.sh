#!/usr/bin/env bash
# Environment (c) of CI: a fresh .venv-oldest with the oldest releases the lower bounds in pyproject.toml allow, and
# no vLLM; the wheel installed into it, then the suite (scripts/test_installed.sh). torch 2.11 exists on PyPI only as
# a CUDA build (about 2.7 GB with its nvidia-* wheels, well under a minute to download here); it runs on a CPU.
# Usage: bash scripts/test_oldest.sh dist/trl_dppo-VERSION-py3-none-any.whl [pytest arguments]
set -euo pipefail
# The lower bounds of pyproject.toml, each with its reason there; change them together (and OLDEST in
# scripts/check_resolution.py). pyarrow is no dependency of trl-dppo: it is datasets 4.7.0's oldest (pyarrow>=21),
# because pip would pick the newest, which refuses numpy 1.x at import ("pyarrow requires NumPy 2.0 or newer")
VENV=.venv-oldest STACK="torch==2.11.0 transformers==5.17.0 peft==0.18.0 accelerate==1.13.0 datasets==4.7.0 \
    trl==1.16.0 numpy==1.26.4 huggingface_hub==1.5.0 pyarrow==21.0.0" \
    exec bash "$(dirname "$0")/test_installed.sh" "$@"
