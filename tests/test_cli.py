"""The `trl-dppo` command: its subcommands, TRL-style flags and `--config` recipes, and the scripts' model options."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import datasets
import huggingface_hub
import pytest
import torch

from trl_dppo.jobs import dppo_math_lora, hh_rlhf_lora
from trl_dppo.jobs.cli import COMMANDS, main
from trl_dppo.jobs.default_model import DEFAULT_MODEL
from trl_dppo.jobs.script_utils import checkpoint_to_resume, parse_with_defaults, resolve_offline_default


REPO = Path(__file__).resolve().parents[1]


def test_console_script_is_declared():
    assert 'trl-dppo = "trl_dppo.jobs.cli:main"' in (REPO / "pyproject.toml").read_text()


def test_help_lists_the_shipped_jobs(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert set(COMMANDS) == {"math", "hh-rlhf", "hh", "hh-reward-model", "plot"}
    assert all(re.search(rf"^\s+{name}\s+\S", out, re.M) for name in COMMANDS)


@pytest.mark.parametrize("command", ["hh", "hh-reward-model"])
def test_the_hh_pipeline_commands_answer_help(capsys, command):
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    assert "--data_path" in capsys.readouterr().out


def test_a_jobs_help_lists_trl_flags(capsys):
    with pytest.raises(SystemExit):
        main(["math", "--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: trl-dppo math")
    for flag in ("--divergence", "--divergence_delta", "--trust_region_kwargs", "--use_vllm", "--load_in_4bit"):
        assert flag in out


def test_math_runs_two_steps_offline_on_the_default_model(tmp_path, monkeypatch):
    """The embedded default model needs nothing from the hub, so the run switches the hub off itself."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    out = tmp_path / "run"
    args = ["--max_steps", "2", "--num_examples", "16", "--num_generations", "4", "--per_device_train_batch_size", "4"]
    main(["math", *args, "--max_completion_length", "6", "--lora_r", "4", "--output_dir", str(out)])
    summary = json.loads((out / "dppo_summary.json").read_text())
    assert summary["steps"] == 2 and summary["model"] == DEFAULT_MODEL
    assert huggingface_hub.constants.HF_HUB_OFFLINE and datasets.config.HF_HUB_OFFLINE
    assert (out / "adapter_config.json").is_file()
    assert "Rethinking the Trust Region in LLM Reinforcement Learning" in (out / "README.md").read_text()


OUTSIDE_METHOD = """
from trl_dppo.losses import dppo_gradient_weights
from trl_dppo.trust_regions import TrustRegionInput, register_trust_region

CAPS_SEEN = []


@register_trust_region("outside_clip_lower", equation="w = M * min(r, cap) * A, M = 0 iff A < 0 and r < 1 - epsilon_low")
def clip_lower(x: TrustRegionInput, *, epsilon_low: float, cap: float = 10.0):
    CAPS_SEEN.append(cap)
    keep = ~((x.advantages < 0) & (x.ratio < 1 - epsilon_low))
    return dppo_gradient_weights(x.trainer_logps, x.sampler_logps, x.advantages, keep, cap), keep
"""


def test_a_trust_region_from_outside_the_package_trains_from_a_yaml_recipe_and_command_line_flags(
    tmp_path, monkeypatch
):
    """The recipe names the method as 'module:name' (the module registers it when imported); the command line sets
    its own setting through --trust_region_kwargs, over the recipe's."""
    import importlib
    import sys

    from trl_dppo.trust_regions import TRUST_REGIONS

    (tmp_path / "outside_methods.py").write_text(OUTSIDE_METHOD)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "outside_methods", raising=False)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("trust_region: outside_methods:outside_clip_lower\ntrust_region_kwargs: {cap: 4.0}\n")
    small = ["--max_steps", "1", "--num_examples", "8", "--num_generations", "4", "--per_device_train_batch_size", "4"]
    try:
        main(["math", "--config", str(recipe), *small, "--max_completion_length", "4", "--lora_r", "4",
              "--trust_region_kwargs", '{"cap": 2.5}', "--output_dir", str(tmp_path / "run")])  # fmt: skip
        assert set(importlib.import_module("outside_methods").CAPS_SEEN) == {2.5}
    finally:
        TRUST_REGIONS.pop("outside_clip_lower", None)  # the registry as the package leaves it


def test_a_hub_model_leaves_the_hub_settings_alone(monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    assert resolve_offline_default("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"
    assert huggingface_hub.constants.HF_HUB_OFFLINE is False


@pytest.mark.skipif(torch.cuda.is_available(), reason="bitsandbytes runs here")
@pytest.mark.parametrize("flag", ["--load_in_4bit", "--load_in_8bit"])
@pytest.mark.parametrize("command", ["math", "hh-rlhf"])
def test_quantized_loading_is_refused_without_cuda(tmp_path, flag, command):
    """QLoRA's bitsandbytes needs CUDA: refused before any model loads, instead of silently training unquantized."""
    rest = ["--reward_model_name_or_path", "unused"] if command == "hh-rlhf" else []
    with pytest.raises(ValueError, match=rf"{flag} quantizes the policy with bitsandbytes, which needs a CUDA GPU"):
        main([command, flag, "true", *rest, "--output_dir", str(tmp_path)])


def test_quantization_config_reaches_the_trainer(monkeypatch, tmp_path):
    """With CUDA, --load_in_4bit becomes the trainer's quantization_config (the model load itself is not run here)."""
    seen = {}

    class Stop(Exception):
        pass

    def fake_trainer(**kwargs):
        seen.update(kwargs)
        raise Stop

    parsed = parse_with_defaults(
        dppo_math_lora.make_parser(),
        dppo_math_lora.cli_defaults(),
        ["--load_in_4bit", "true", "--output_dir", str(tmp_path)],
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: object())
    monkeypatch.setattr(dppo_math_lora, "DPPOTrainer", fake_trainer)
    with pytest.raises(Stop):
        dppo_math_lora.main(*parsed)
    assert seen["quantization_config"].load_in_4bit


def test_flags_that_are_gone_name_what_to_write_instead(tmp_path):
    config = tmp_path / "old.yaml"
    config.write_text("clip_ratio_c: 20.0\n")
    with pytest.raises(ValueError, match="--divergence_type is now --divergence"):
        main(["math", "--divergence_type", "binary_kl"])
    with pytest.raises(ValueError, match='--clip_ratio_c is now --trust_region_kwargs {"ratio_cap": C}'):
        main(["math", "--config", str(config)])


def settings(parsed_dataclass) -> dict:
    """A parsed argument dataclass as a dict (a TrainingArguments' runtime state left out)."""
    return parsed_dataclass.to_dict() if hasattr(parsed_dataclass, "to_dict") else vars(parsed_dataclass)


def test_recipes_name_only_existing_arguments():
    """The README's runs as YAML: the main job's recipe is the job's defaults; the HH one is the documented command."""
    defaults = dppo_math_lora.cli_defaults()
    math_recipe = parse_with_defaults(
        dppo_math_lora.make_parser(), defaults, ["--config", str(REPO / "recipes/math_cpu.yaml")]
    )
    math_defaults = parse_with_defaults(dppo_math_lora.make_parser(), defaults, [])
    assert list(map(settings, math_recipe)) == list(map(settings, math_defaults))

    command = re.search(r"accelerate launch .*?--output_dir \S+", hh_rlhf_lora.__doc__, re.S).group(0)
    args = shlex.split(command.replace("\\\n", " "))
    args = args[args.index("examples/hh_rlhf_lora.py") + 1 :]
    documented = parse_with_defaults(hh_rlhf_lora.make_parser(), hh_rlhf_lora.cli_defaults(), args)
    hh_recipe = parse_with_defaults(
        hh_rlhf_lora.make_parser(),
        hh_rlhf_lora.cli_defaults(),
        ["--config", str(REPO / "recipes/hh_rlhf_qwen3_4b_lora.yaml")],
    )
    assert list(map(settings, hh_recipe)) == list(map(settings, documented))


def test_resume_from_checkpoint_true_resumes_from_the_last_checkpoint():
    """transformers' `Trainer.train` reads `resume_from_checkpoint` only as its argument, and the flag arrives as a
    string: `true` means the last checkpoint in output_dir, anything else is the folder named."""
    assert checkpoint_to_resume("true") is True and checkpoint_to_resume("True") is True
    assert checkpoint_to_resume("runs/x/checkpoint-40") == "runs/x/checkpoint-40"
    assert checkpoint_to_resume(None) is None
