#!/usr/bin/env bash
# The GPU checks that need no vLLM, in one go on one H200-class GPU, for a machine where neither vLLM (its wheel is
# too large to carry) nor SmolLM2's weights can be had: the model is SmolLM2-135M's shape with random weights and an
# untied LM head scaled 10x, so next-token distributions are peaked (mean top probability ~0.46; a near-uniform random
# head would hide a misaligned mu), and SmolLM2's tokenizer. Run on one H200 on 2026-11-30: 317 s (results and reading
# in benchmarks/results/gpu_transformers/); at most 9 minutes (each part has its own time limit; one part's failure
# leaves the others to run):
#  1. DPPOTrainer on CUDA with transformers generation (benchmarks/gpu_transformers.py alignment; ~1 min, limit
#     150 s): 48 arithmetic prompts, 8 completions of 64 tokens, 4 steps per generation, 8 steps. At lr 0 in fp32 the
#     trainer's pi equals the recorded mu (mismatch/abs_prob_diff_max and at_sync < 1e-3, expected ~1e-5), binary_tv
#     and topk_kl K=20 (the kept set's log-probabilities too); the same with TRL's default bf16=True is measured, not
#     judged; lr 1e-5 shows training proceeds (finite loss, masked fraction logged).
#  2. The recorder in generate() (gpu_transformers.py recorder; ~2 min, limit 220 s): no recorder, binary and top-20
#     recorder at batch 64 x 256 new tokens, fp32 and bf16, 3 interleaved trials each, against the target
#     (at most +5%); then fp32 at 256 x 1024, 2 trials, if its estimate fits the 150 s budget (likely not: decoding
#     there is launch-bound, ~25 ms a token). A measurement: it passes by finishing; rows are written as they come.
#  3. Top-K under FSDP2, one process (benchmarks/sharded_topk_check.py check under accelerate launch with
#     examples/accelerate_configs/fsdp2.yaml; ~40 s, limit 120 s). ZeRO-3 is skipped: deepspeed is not on the machine.
# Needs: the GPU image's torch, transformers, accelerate and peft; the rest travels in CARRY (default .gpu_carry,
# ignored by git): wheels of trl 1.16.0, datasets 5.2.0, dill 0.4.1, multiprocess 0.70.19 (pip download ... --no-deps,
# Python 3.12) and SmolLM2-135M-Instruct/ with config.json and the tokenizer files (no weights). They are installed
# into SITE (default /tmp/site), which shadows none of the image's packages. Results (7 files, flat) go to $OUT if set,
# else benchmarks/results/gpu_transformers/: results.md, run.log, dppo_alignment.{json,md},
# recorder_overhead.{json,md}, sharded_topk_fsdp2.json. Exit status 0 only if every part passed.
#
#     bash benchmarks/gpu_transformers.sh
#     PYTHON=.venv/bin/python CARRY=... bash benchmarks/gpu_transformers.sh --smoke   # tiny sizes on CPU: a dry run
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
CARRY=${CARRY:-.gpu_carry}
SITE=${SITE:-/tmp/site}
out=${OUT:-benchmarks/results/gpu_transformers}
mkdir -p "$out"
options=()
smoke=false
if [ "${1:-}" = --smoke ]; then
    smoke=true
    options=(--smoke --device cpu)
fi

part() {  # part NAME SECONDS COMMAND...: run with a time limit, report, remember a failure
    local name=$1 limit=$2
    shift 2
    echo "=== $name (limit ${limit} s)"
    local started=$SECONDS
    if timeout "$limit" "$@"; then
        echo "=== $name: PASSED ($((SECONDS - started)) s)"
        summary+=("- $name: passed ($((SECONDS - started)) s)")
    else
        local rc=$? why=""
        [ $rc = 124 ] && why=", stopped at its time limit"
        status=1
        echo "=== $name: FAILED, exit $rc$why ($((SECONDS - started)) s)"
        summary+=("- $name: FAILED, exit $rc$why ($((SECONDS - started)) s)")
    fi
}

main() {
    status=0
    summary=()
    if compgen -G "$CARRY/*.whl" >/dev/null; then
        "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
            --python-version 3.12 --only-binary=:all: "$CARRY"/*.whl || return 1
        export PYTHONPATH="$PWD:$SITE"
    else
        export PYTHONPATH="$PWD"
    fi
    export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 TQDM_DISABLE=1
    "$PYTHON" - <<'PY'
import importlib
for name in ("torch", "transformers", "accelerate", "peft", "trl", "datasets", "pyarrow", "fsspec", "huggingface_hub"):
    try:
        module = importlib.import_module(name)
        print(f"{name} {module.__version__} {module.__file__}")
    except Exception as error:  # reported; the parts that need it fail on their own
        print(f"{name}: {type(error).__name__}: {error}")
import torch
print("cuda:", torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else "")
PY
    if ! $smoke && ! "$PYTHON" -c "import torch; assert torch.cuda.is_available()"; then
        echo "gpu_transformers.sh needs a CUDA GPU (or --smoke for a dry run on CPU)"
        return 1
    fi
    model=$(mktemp -d)
    shape="$CARRY/SmolLM2-135M-Instruct"
    if $smoke; then  # the same code on a 2-layer copy of the shape, so that the dry run stays short on CPU
        shape="$model/shape"
        cp -r "$CARRY/SmolLM2-135M-Instruct" "$shape"
        "$PYTHON" -c "import json, sys; p = sys.argv[1]; c = json.load(open(p)); c['num_hidden_layers'] = 2
json.dump(c, open(p, 'w'))" "$shape/config.json"
    fi
    part "model: SmolLM2-135M's shape, random, peaked head" 120 \
        "$PYTHON" benchmarks/sharded_topk_check.py prepare "$model/model" "$shape" --random-init
    part "1. DPPOTrainer alignment on $($smoke && echo cpu || echo cuda)" "${ALIGNMENT_S:-150}" \
        "$PYTHON" benchmarks/gpu_transformers.py alignment "$model/model" "$out" "${options[@]}"
    part "2. recorder in generate()" "${RECORDER_S:-220}" \
        "$PYTHON" benchmarks/gpu_transformers.py recorder "$model/model" "$out" --budget-s 150 "${options[@]}"
    if $smoke; then  # accelerate shards on GPUs only: on CPU the check runs unsharded and must report failure
        echo "=== 3. top-K check, unsharded (smoke: the code path only; it reports passed: false off a GPU)"
        timeout 300 "$PYTHON" benchmarks/sharded_topk_check.py check "$model/model" "$out/sharded_topk_fsdp2.json"
        summary+=("- 3. top-K check: smoke, unsharded, exit $? (expected 1 off a GPU)")
    else
        part "3. top-K under FSDP2, one process" "${SHARDED_S:-120}" \
            "$PYTHON" -m accelerate.commands.launch --config_file examples/accelerate_configs/fsdp2.yaml \
            --num_processes 1 --mixed_precision no --main_process_port 29541 \
            benchmarks/sharded_topk_check.py check "$model/model" "$out/sharded_topk_fsdp2.json"
    fi
    summary+=("- 3. top-K under DeepSpeed ZeRO-3: skipped, deepspeed is not on the machine")
    rm -rf "$model"
    {
        echo "# GPU checks without vLLM: benchmarks/gpu_transformers.sh$($smoke && echo ' --smoke')"
        echo
        printf '%s\n' "${summary[@]}"
        for fragment in dppo_alignment.md recorder_overhead.md; do
            [ -e "$out/$fragment" ] && echo && cat "$out/$fragment"
        done
        if [ -e "$out/sharded_topk_fsdp2.json" ]; then
            echo
            echo "## Top-K under FSDP2 (one process, fp32, lr 0): sharded_topk_check.py"
            echo
            echo "    $(tr -d '\n' <"$out/sharded_topk_fsdp2.json")"
        fi
    } >"$out/results.md"
    cat "$out/results.md"
    return $status
}

main 2>&1 | tee "$out/run.log"
exit "${PIPESTATUS[0]}"
