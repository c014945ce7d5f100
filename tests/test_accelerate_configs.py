"""examples/accelerate_configs/ mirrors the accelerate configs TRL ships (trl/accelerate_configs/), plus cpu_2proc and cpu_zero3."""

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
CPU_CONFIGS = {"cpu_2proc.yaml", "cpu_zero3.yaml"}  # ours: DDP and DeepSpeed ZeRO on two CPU processes


@pytest.mark.parametrize("name", sorted(p.name for p in TRLS.glob("*.yaml")))
def test_each_trl_config_is_mirrored(name):
    ours = yaml.safe_load((OURS / name).read_text())
    assert ours == {**yaml.safe_load((TRLS / name).read_text()), **DIFFERENCES.get(name, {})}


def test_the_cpu_config_starts_two_gloo_processes():
    config = yaml.safe_load((OURS / "cpu_2proc.yaml").read_text())
    # accelerate 1.15 starts several local processes only through its multi-GPU (torchrun) launcher
    assert (config["distributed_type"], config["num_processes"], config["use_cpu"]) == ("MULTI_GPU", 2, True)
    assert {p.name for p in OURS.glob("*.yaml")} == {p.name for p in TRLS.glob("*.yaml")} | CPU_CONFIGS


def test_the_cpu_zero_config_runs_deepspeed_on_two_cpu_processes():
    config = yaml.safe_load((OURS / "cpu_zero3.yaml").read_text())
    assert (config["distributed_type"], config["num_processes"], config["use_cpu"]) == ("DEEPSPEED", 2, True)
    # fp32, so the update can be compared with DDP's to float rounding (tests/test_launch_matrix.py)
    assert config["mixed_precision"] == "no" and config["deepspeed_config"]["zero_stage"] == 3
