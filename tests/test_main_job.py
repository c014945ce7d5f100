"""The main job: arithmetic data and reward, the run summary, and the example script under accelerate (2 processes)."""

from __future__ import annotations

import json
import os
import sys
from fractions import Fraction
from pathlib import Path

import pytest

from trl_dppo.jobs.arithmetic import arithmetic_dataset, exact_answer_reward, extract_final_number
from trl_dppo.jobs.script_utils import summarize_log_history

from .conftest import free_port, run_bounded


REPO = Path(__file__).resolve().parents[1]
SUMMARY_KEYS = {"reward_first", "reward_last", "steps", "masked_fraction_mean", "model", "seed", "runtime_s"}


@pytest.mark.parametrize(
    ("completion", "reward"),
    [
        ("27", 1.0),
        ("The answer is 27.", 1.0),
        ("13 + 14 = 27", 1.0),
        ("**27**", 1.0),
        ("\\boxed{27}", 1.0),
        ("27.0", 1.0),
        ("27\n", 1.0),
        ("It is 27, not 26", 0.0),  # the final number counts
        ("27 is what 13 + 14 equals", 0.0),
        ("2 7", 0.0),
        ("270", 0.0),
        ("twenty-seven", 0.0),
        ("", 0.0),
    ],
)
def test_exact_answer_reward_on_text(completion: str, reward: float) -> None:
    assert exact_answer_reward([completion], ["27"]) == [reward]


def test_exact_answer_reward_on_conversational_completions() -> None:
    completions = [
        [{"role": "assistant", "content": "1,024"}],
        [{"role": "assistant", "content": "Result: -3"}],
        [{"role": "assistant", "content": "12-3"}],  # a dash between numbers is not a minus sign
        [{"role": "assistant", "content": None}],
    ]
    assert exact_answer_reward(completions, ["1024", "-3", "-3", "1"]) == [1.0, 1.0, 0.0, 0.0]


def test_extract_final_number() -> None:
    assert extract_final_number("x = -5, y = 2.50") == Fraction(5, 2)
    assert extract_final_number("no digits") is None


def test_arithmetic_dataset_is_deterministic_and_correct() -> None:
    data = arithmetic_dataset(50, seed=3, num_operands=3, operators="+-*", max_value=12)
    assert data["answer"] == arithmetic_dataset(50, seed=3, num_operands=3, operators="+-*", max_value=12)["answer"]
    assert data["answer"] != arithmetic_dataset(50, seed=4, num_operands=3, operators="+-*", max_value=12)["answer"]
    for prompt, answer in zip(data["prompt"], data["answer"], strict=True):
        assert [m["role"] for m in prompt] == ["system", "user"]
        expression = prompt[-1]["content"].split("What is ")[1].split("?")[0]
        assert eval(expression) == int(answer) >= 0  # Python's precedence is the intended one
    with pytest.raises(ValueError, match="operators"):
        arithmetic_dataset(1, operators="/")


def test_summary_windows() -> None:
    history = [{"step": i, "reward": float(i), "trust_region/masked_fraction": 0.1} for i in range(1, 21)]
    history.append({"step": 20, "train_runtime": 1.0})
    summary = summarize_log_history(history)
    assert summary["reward_first"] == 1.5 and summary["reward_last"] == 19.5  # 10% of 20 logged steps = 2
    assert summary["masked_fraction_mean"] == pytest.approx(0.1)
    one = summarize_log_history([{"step": 1, "reward": 0.25}])
    assert one["reward_first"] == one["reward_last"] == 0.25
    assert summarize_log_history([])["reward_first"] is None


@pytest.mark.launch
@pytest.mark.slow
def test_math_script_under_accelerate_with_two_processes(tiny_model_dir: str, tmp_path: Path) -> None:
    """`accelerate launch` with two gloo processes and a YAML config, on a tiny random model."""
    config = tmp_path / "run.yaml"
    config.write_text("max_completion_length: 8\nnum_examples: 64\nlora_target_modules: [q_proj, v_proj]\n")
    out = tmp_path / "run"
    command = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(REPO / "examples/accelerate_configs/cpu_2proc.yaml"),
        "--main_process_port", str(free_port()),  # CI runs two suites at once
        str(REPO / "examples/dppo_math_lora.py"),
        "--config", str(config),
        "--model_name_or_path", tiny_model_dir,
        "--max_steps", "2",
        "--per_device_train_batch_size", "4",
        "--num_generations", "4",
        "--steps_per_generation", "2",
        "--output_dir", str(out),
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = run_bounded(command, env, timeout_s=600, cwd=REPO)  # past it: the workers' stacks, and none left
    assert result.returncode == 0, result.stderr[-4000:]
    assert "DPPO math | model:" in result.stdout
    summary = json.loads((out / "dppo_summary.json").read_text())
    assert SUMMARY_KEYS <= set(summary)
    assert summary["steps"] == 2 and summary["num_processes"] == 2
    assert summary["reward_first"] is not None
    history = json.loads((out / "log_history.json").read_text())
    assert any("trust_region/masked_fraction" in entry for entry in history)
