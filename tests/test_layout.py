"""The package's layout: the algorithm in `trl_dppo`, the shipped jobs in `trl_dppo.jobs`, each importable alone."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import trl_dppo


def test_the_public_names_import_from_the_package():
    from trl_dppo import DPPOConfig, DPPOTrainer
    from trl_dppo.config import DPPOConfig as config_class
    from trl_dppo.trainer import DPPOTrainer as trainer_class

    assert (DPPOConfig, DPPOTrainer) == (config_class, trainer_class)
    assert trl_dppo.DPPOTrainer is trainer_class
    assert all(getattr(trl_dppo, name) is not None for name in trl_dppo.__all__)
    assert set(trl_dppo.__all__) <= set(dir(trl_dppo))
    assert trl_dppo.__version__
    with pytest.raises(AttributeError, match="no attribute 'DPPOTrainr'"):
        trl_dppo.DPPOTrainr  # noqa: B018


def test_plotting_a_log_loads_neither_torch_nor_trl():
    """`trl-dppo plot` reads a JSON log; importing the package for it must not pull in the training stack."""
    check = "import sys, trl_dppo.jobs.plots; print(sorted({'torch', 'trl', 'transformers'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_the_algorithm_imports_nothing_from_the_jobs():
    """The jobs build on the algorithm, never the other way round."""
    for module in Path(trl_dppo.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(module.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                imported = [getattr(node, "module", None) or "", *(alias.name for alias in node.names)]
                assert not any("jobs" in name.split(".") for name in imported), f"{module.name} imports {imported}"


def test_nothing_in_the_package_assigns_to_a_config_field_after_construction():
    """A training config (`args`, `training_args`) is settled when built (its __post_init__ resolves defaults); the
    trainers and the jobs only read it."""
    assignment = re.compile(r"(?<![\w.])(?:self\.)?(?:args|training_args)\.\w+\s*(?:=(?!=)|\+=|-=)")
    for module in Path(trl_dppo.__file__).parent.rglob("*.py"):
        for number, line in enumerate(module.read_text().splitlines(), 1):
            assert not assignment.search(line), f"{module.name}:{number}: {line.strip()}"
