"""examples/accelerate_configs/ mirrors the accelerate configs TRL ships (trl/accelerate_configs/), plus cpu_2proc."""

from __future__ import annotations

from pathlib import Path

import pytest
import trl
import yaml


REPO = Path(__file__).resolve().parents[1]
OURS = REPO / "examples" / "accelerate_configs"
TRLS = Path(trl.__file__).parent / "accelerate_configs"
# Where a config deliberately differs from TRL's
DIFFERENCES = {"single_gpu.yaml": {"num_processes": 1}}  # TRL's says 8 for one GPU


@pytest.mark.parametrize("name", sorted(p.name for p in TRLS.glob("*.yaml")))
def test_each_trl_config_is_mirrored(name):
    ours = yaml.safe_load((OURS / name).read_text())
    assert ours == {**yaml.safe_load((TRLS / name).read_text()), **DIFFERENCES.get(name, {})}


def test_the_cpu_config_starts_two_gloo_processes():
    config = yaml.safe_load((OURS / "cpu_2proc.yaml").read_text())
    # accelerate 1.15 starts several local processes only through its multi-GPU (torchrun) launcher
    assert (config["distributed_type"], config["num_processes"], config["use_cpu"]) == ("MULTI_GPU", 2, True)
    assert {p.name for p in OURS.glob("*.yaml")} == {p.name for p in TRLS.glob("*.yaml")} | {"cpu_2proc.yaml"}
