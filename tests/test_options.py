"""The option map (`trl_dppo/options.py`): every option of the installed TRL, transformers and vLLM classified, the
docs generated from it, and each `generation_kwargs` key treated as the map says."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from trl import GRPOConfig

from trl_dppo import DPPOConfig
from trl_dppo.options import (
    GRPO_CONFIG_OPTIONS,
    SAMPLING_PARAMS_OPTIONS,
    TRAINING_ARGUMENTS_OPTIONS,
    options_table,
    unmapped_options,
)

from .conftest import require_vllm


DOCS = Path(__file__).resolve().parents[1] / "docs" / "options.md"


def test_every_field_of_the_installed_trl_and_transformers_is_classified():
    assert unmapped_options() == []


def test_every_field_of_the_installed_vllms_sampling_params_is_classified():
    require_vllm()
    from vllm import SamplingParams

    assert unmapped_options(sampling_params=SamplingParams) == []


def test_a_field_a_new_release_adds_fails_the_map_naming_it():
    @dataclasses.dataclass
    class NextGRPOConfig(GRPOConfig):
        bypass_the_trust_region: bool = False

    assert unmapped_options(grpo_config=NextGRPOConfig) == [
        "NextGRPOConfig.bypass_the_trust_region: not classified in trl_dppo.options.GRPO_CONFIG_OPTIONS"
    ]

    class NextSamplingParams:
        __struct_fields__ = (*SAMPLING_PARAMS_OPTIONS, "sample_differently")

    assert unmapped_options(sampling_params=NextSamplingParams) == [
        "SamplingParams.sample_differently: not classified in trl_dppo.options.SAMPLING_PARAMS_OPTIONS"
    ]


def test_a_field_a_new_release_removes_fails_the_map_naming_it(monkeypatch):
    monkeypatch.setitem(GRPO_CONFIG_OPTIONS, "removed_option", GRPO_CONFIG_OPTIONS["beta"])
    monkeypatch.setitem(TRAINING_ARGUMENTS_OPTIONS, "removed_argument", TRAINING_ARGUMENTS_OPTIONS["bf16"])
    assert unmapped_options() == [
        "TRAINING_ARGUMENTS_OPTIONS / TRAINING_ARGUMENTS_INHERITED['removed_argument']: TrainingArguments has no "
        "such field",
        "GRPO_CONFIG_OPTIONS['removed_option']: GRPOConfig has no such field",
    ]


def test_the_docs_table_is_the_maps():
    assert DOCS.read_text() == options_table(), "regenerate it: python -m trl_dppo.options > docs/options.md"


def _vllm_config(tmp_path, **settings) -> DPPOConfig:
    return DPPOConfig(output_dir=str(tmp_path), report_to="none", bf16=False, use_vllm=True, **settings)


@pytest.mark.parametrize("key", [k for k, rule in SAMPLING_PARAMS_OPTIONS.items() if rule.treatment == "refused"])
def test_a_refused_sampling_key_is_refused_with_its_reason_even_when_truncation_is_opted_in(tmp_path, key):
    reason = SAMPLING_PARAMS_OPTIONS[key].reason
    for opted_in in (False, True):
        with pytest.raises(ValueError, match=rf"generation_kwargs\['{key}'\] with vLLM generation: .*Remove it"):
            _vllm_config(tmp_path, generation_kwargs={key: 1}, vllm_allow_truncated_sampling=opted_in)
    assert reason


def test_asking_vllm_for_ranked_logprobs_is_refused_as_a_change_of_what_it_reports(tmp_path):
    """`logprobs=N` makes vLLM list the N most likely tokens first, and TRL keeps the first: refused on both modes,
    whatever the opt-in, for what it does (not as a change of the sampling distribution)."""
    for mode in ("colocate", "server"):
        for opted_in in (False, True):
            with pytest.raises(ValueError, match="reports, not what it samples") as error:
                _vllm_config(
                    tmp_path,
                    vllm_mode=mode,
                    generation_kwargs={"logprobs": 3},
                    vllm_allow_truncated_sampling=opted_in,
                )
            assert "changes the sampling distribution" not in str(error.value)


@pytest.mark.parametrize("key", [k for k, rule in SAMPLING_PARAMS_OPTIONS.items() if rule.treatment == "opt_in"])
def test_a_sampling_key_that_changes_the_distribution_needs_the_opt_in(tmp_path, key):
    value = 0.5  # temperature: other than the config's 1.0
    with pytest.raises(ValueError, match=rf"generation_kwargs\['{key}'\].*vllm_allow_truncated_sampling=True"):
        _vllm_config(tmp_path, generation_kwargs={key: value})
    assert _vllm_config(tmp_path, generation_kwargs={key: value}, vllm_allow_truncated_sampling=True).use_vllm


@pytest.mark.parametrize("key", [k for k, rule in SAMPLING_PARAMS_OPTIONS.items() if rule.treatment == "inherited"])
def test_a_sampling_key_that_leaves_mu_alone_is_taken_as_is(tmp_path, key):
    assert _vllm_config(tmp_path, generation_kwargs={key: 1}).generation_kwargs == {key: 1}


def test_a_key_that_is_no_sampling_field_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"generation_kwargs\['truncate_prompt_tokens'\] is not a field of vLLM"):
        _vllm_config(tmp_path, generation_kwargs={"truncate_prompt_tokens": 8}, vllm_allow_truncated_sampling=True)
    # transformers generation takes generation_kwargs as GenerationConfig's fields, which the map does not judge
    config = DPPOConfig(output_dir=str(tmp_path), report_to="none", bf16=False, generation_kwargs={"num_beams": 1})
    assert config.generation_kwargs == {"num_beams": 1}


def test_an_unbounded_completion_length_is_refused_where_trl_needs_a_number(tmp_path):
    with pytest.raises(ValueError, match="max_completion_length=None with loss_type='dr_grpo'.*Set max_completion"):
        DPPOConfig(output_dir=str(tmp_path), bf16=False, loss_type="dr_grpo", max_completion_length=None)
    assert DPPOConfig(output_dir=str(tmp_path), bf16=False, max_completion_length=None).loss_type == "dapo"


def test_embedding_noise_in_the_training_forward_is_refused(tmp_path):
    with pytest.raises(ValueError, match="neftune_noise_alpha=5.0 adds noise .*Set neftune_noise_alpha=None"):
        DPPOConfig(output_dir=str(tmp_path), bf16=False, neftune_noise_alpha=5.0)


def test_temperatures_the_sampler_cannot_record_are_refused(tmp_path):
    with pytest.raises(ValueError, match="temperature=0.0: .*Set a temperature > 0"):
        DPPOConfig(output_dir=str(tmp_path), bf16=False, temperature=0.0)
    with pytest.raises(ValueError, match="temperature=0.005 with vLLM generation: vLLM samples at 0.01"):
        _vllm_config(tmp_path, temperature=0.005)
    assert DPPOConfig(output_dir=str(tmp_path), bf16=False, temperature=0.005).temperature == 0.005
    with pytest.raises(ValueError, match=r"generation_kwargs\['temperature'\]=0: vLLM samples greedily"):
        _vllm_config(tmp_path, generation_kwargs={"temperature": 0}, vllm_allow_truncated_sampling=True)


def test_the_async_config_refuses_what_its_server_cannot_record(tmp_path):
    from trl_dppo import AsyncDPPOConfig

    settings = dict(output_dir=str(tmp_path), bf16=False, use_cpu=True)
    with pytest.raises(ValueError, match="temperature=0.005 with vLLM generation"):
        AsyncDPPOConfig(**settings, temperature=0.005)
    with pytest.raises(ValueError, match="neftune_noise_alpha=5.0 adds noise"):
        AsyncDPPOConfig(**settings, neftune_noise_alpha=5.0)
