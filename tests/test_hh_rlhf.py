"""The HH-RLHF example: prompt parsing, reward-model loading, clear errors, and a 2-step smoke run on CPU."""

from __future__ import annotations

import importlib
import json
import re
import shlex
from pathlib import Path

import pytest
from transformers import AutoTokenizer, LlamaForSequenceClassification

from trl_dppo.jobs.hh_rlhf import (
    HH_PLAIN_TEMPLATE,
    hh_prompt_messages,
    load_hh_prompts,
    load_policy_tokenizer,
    load_reward_model,
    parse_hh_dialogue,
)
from trl_dppo.jobs.script_utils import parse_with_defaults

from .conftest import DATA, needs_data


def _load_script():
    return importlib.import_module("trl_dppo.jobs.hh_rlhf_lora")


def test_parse_hh_dialogue() -> None:
    text = "\n\nHuman: Hi there\n\nAssistant: Hello!\n\nHuman: How are you?\n\nHuman: Still there?\n\nAssistant: Fine."
    assert parse_hh_dialogue(text) == [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "How are you?\n\nStill there?"},  # same-role turns merged
        {"role": "assistant", "content": "Fine."},
    ]
    assert hh_prompt_messages(text) == parse_hh_dialogue(text)[:-1]
    assert hh_prompt_messages("\n\nHuman: no reply yet") is None
    assert hh_prompt_messages("no markers at all") is None


@needs_data
def test_load_hh_prompts_from_the_local_file(tokenizer) -> None:
    prompts = load_hh_prompts(str(DATA), num_examples=50)
    assert 45 <= len(prompts) <= 50
    for messages in prompts["prompt"]:
        assert messages[-1]["role"] == "user"
        assert {m["role"] for m in messages} <= {"user", "assistant"}
    short = load_hh_prompts(str(DATA), tokenizer=tokenizer, max_prompt_length=64, num_examples=50)
    assert 0 < len(short) < len(prompts)


def test_missing_data_path_says_what_to_pass(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="--data_path"):
        load_hh_prompts(str(tmp_path / "nope.jsonl.gz"))


def test_unloadable_reward_model_says_what_to_pass(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--reward_model_name_or_path"):
        load_reward_model(str(tmp_path / "no-such-reward-model"))
    with pytest.raises(ValueError, match="No reward model given"):
        load_reward_model(None)


def test_policy_without_chat_template_says_what_to_pass(tokenizer, tmp_path: Path) -> None:
    plain = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    plain.chat_template = None
    plain.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(ValueError, match="no chat template"):
        load_policy_tokenizer(str(tmp_path))


def test_reward_tokenizer_without_template_gets_hh_plain_text(reward_model_dir: str, tmp_path: Path) -> None:
    plain = AutoTokenizer.from_pretrained(reward_model_dir)
    plain.chat_template = None
    plain.save_pretrained(reward_model_dir + "-plain")
    (Path(reward_model_dir + "-plain") / "chat_template.jinja").unlink(missing_ok=True)
    LlamaForSequenceClassification.from_pretrained(reward_model_dir).save_pretrained(reward_model_dir + "-plain")
    model, rm_tokenizer = load_reward_model(reward_model_dir + "-plain")
    assert rm_tokenizer.chat_template == HH_PLAIN_TEMPLATE
    text = rm_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}], tokenize=False
    )
    assert text == "\n\nHuman: Hi\n\nAssistant: Hello"
    assert model.config.num_labels == 1


def test_documented_gpu_command_parses() -> None:
    """The paper-scale command in the script's docstring names only existing arguments, consistently."""
    script = _load_script()
    command = re.search(r"accelerate launch .*?--output_dir \S+", script.__doc__, re.S).group(0)
    args = shlex.split(command.replace("\\\n", " "))
    args = args[args.index("examples/hh_rlhf_lora.py") + 1 :]
    parsed = parse_with_defaults(script.make_parser(), script.cli_defaults(), args)
    script_args, training_args, model_args = parsed
    assert script_args.reward_model_name_or_path == "Skywork/Skywork-Reward-Llama-3.1-8B-v0.2"
    assert model_args.model_name_or_path == "Qwen/Qwen3-4B-Instruct-2507" and model_args.use_peft
    # 128 prompts x 8 samples; the script's steps_per_generation default gave way
    assert training_args.generation_batch_size == 1024
    assert (training_args.learning_rate, training_args.divergence_delta, training_args.divergence) == (
        1e-5, 0.15, "binary_tv"
    )  # fmt: skip
    assert (script_args.max_prompt_length, training_args.max_completion_length) == (1024, 512)


def test_no_reward_model_fails_before_loading_anything() -> None:
    script = _load_script()
    parsed = parse_with_defaults(script.make_parser(), script.cli_defaults(), ["--data_path", "missing.jsonl"])
    with pytest.raises(ValueError, match="No reward model given"):
        script.main(*parsed)


@needs_data
@pytest.mark.slow
def test_two_step_smoke_run(tiny_model_dir: str, reward_model_dir: str, tmp_path: Path) -> None:
    script = _load_script()
    out = tmp_path / "run"
    args = [
        "--model_name_or_path", tiny_model_dir,
        "--reward_model_name_or_path", reward_model_dir,
        "--data_path", str(DATA),
        "--num_examples", "32",
        "--max_prompt_length", "256",
        "--max_steps", "2",
        "--per_device_train_batch_size", "4",
        "--num_generations", "4",
        "--steps_per_generation", "2",
        "--max_completion_length", "8",
        "--lora_target_modules", "q_proj", "v_proj",
        "--save_strategy", "no",
        "--output_dir", str(out),
    ]  # fmt: skip
    summary = script.main(*parse_with_defaults(script.make_parser(), script.cli_defaults(), args))
    assert summary is not None and summary["steps"] == 2
    saved = json.loads((out / "dppo_summary.json").read_text())
    assert saved["reward_model"] == reward_model_dir and saved["reward_first"] is not None
    history = json.loads((out / "log_history.json").read_text())
    assert any("trust_region/masked_fraction" in entry for entry in history)
    assert (out / "adapter_config.json").is_file()
