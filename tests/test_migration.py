"""Coming from GRPOConfig or from TRL's old `trl.experimental.dppo`: what converts, and the errors that say how."""

from __future__ import annotations

import re

import pytest
from trl import GRPOConfig

from trl_dppo import DPPOConfig, DPPOTrainer
from trl_dppo.config import REMOVED_NAMES


COMMON = dict(report_to="none", bf16=False)


def test_from_grpo_config_on_a_default_grpo_config(tmp_path):
    grpo = GRPOConfig(output_dir=str(tmp_path), learning_rate=2e-5, num_generations=4, **COMMON)
    assert grpo.vllm_importance_sampling_correction  # GRPO's default, which DPPOConfig refuses
    config = DPPOConfig.from_grpo_config(grpo)
    assert type(config) is DPPOConfig and config.vllm_importance_sampling_correction is False
    assert (config.output_dir, config.learning_rate, config.num_generations) == (str(tmp_path), 2e-5, 4)
    assert config.steps_per_generation == grpo.steps_per_generation
    assert config.generation_batch_size == grpo.generation_batch_size
    assert (config.divergence, config.divergence_delta) == ("binary_tv", 0.15)


def test_from_grpo_config_with_vllm_settings_keeps_them_and_the_real_hub_token(tmp_path):
    grpo = GRPOConfig(
        output_dir=str(tmp_path),
        use_vllm=True,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.3,
        vllm_max_model_length=1536,
        per_device_train_batch_size=4,
        generation_batch_size=32,
        hub_token="hf_secret",
        **COMMON,
    )
    config = DPPOConfig.from_grpo_config(grpo, divergence="topk_kl", divergence_topk=5)
    assert (config.use_vllm, config.vllm_mode, config.vllm_gpu_memory_utilization) == (True, "colocate", 0.3)
    assert config.vllm_max_model_length == 1536
    assert (config.generation_batch_size, config.steps_per_generation) == (32, 8)
    assert config.hub_token == "hf_secret"  # to_dict() would have given the placeholder "<HUB_TOKEN>"
    assert (config.divergence, config.divergence_topk, config.divergence_delta) == ("topk_kl", 5, 0.05)


def test_from_grpo_config_turns_grpos_default_dropout_off_and_keeps_an_explicit_choice(tmp_path):
    """GRPOConfig's disable_dropout=False is its default, which a GRPOConfig cannot tell from a choice: it becomes
    DPPOConfig's True; False passed to from_grpo_config is kept."""
    grpo = GRPOConfig(output_dir=str(tmp_path), **COMMON)
    assert grpo.disable_dropout is False
    assert DPPOConfig.from_grpo_config(grpo).disable_dropout is True
    assert DPPOConfig.from_grpo_config(grpo, disable_dropout=False).disable_dropout is False
    grpo = GRPOConfig(output_dir=str(tmp_path), disable_dropout=True, **COMMON)
    assert DPPOConfig.from_grpo_config(grpo).disable_dropout is True


def test_from_grpo_config_refuses_grpos_two_sided_clip_delta(tmp_path):
    grpo = GRPOConfig(output_dir=str(tmp_path), delta=1.5, **COMMON)
    with pytest.raises(ValueError, match=r"two-sided ratio clip.*divergence_delta"):
        DPPOConfig.from_grpo_config(grpo)


def test_from_grpo_config_keeps_dppos_errors_for_contradicting_settings(tmp_path):
    grpo = GRPOConfig(output_dir=str(tmp_path), loss_type="cispo", **COMMON)
    with pytest.raises(ValueError, match="loss_type='cispo' is GRPOTrainer's loss with a trust region of its own"):
        DPPOConfig.from_grpo_config(grpo)


def test_trainer_given_a_grpo_config_names_the_conversion(tmp_path):
    with pytest.raises(TypeError, match=r"got GRPOConfig: pass DPPOConfig\.from_grpo_config\(your_config\)"):
        DPPOTrainer(model="unused", args=GRPOConfig(output_dir=str(tmp_path), **COMMON))


@pytest.mark.parametrize(("old", "new"), list(REMOVED_NAMES.items()))
def test_names_that_are_gone_raise_an_error_naming_what_to_write_instead(tmp_path, old, new):
    with pytest.raises(TypeError, match=re.escape(f"`{old}` is now `{new}`")):
        DPPOConfig(output_dir=str(tmp_path), **{old: 1.0}, **COMMON)


def test_the_removed_names_are_experimental_dppos_fields():
    """trl.experimental.dppo's DPPOConfig (TRL 1.0-1.8) added `divergence_type`, `divergence_topk` and `clip_ratio_c`
    to GRPOConfig (epsilon / epsilon_high were reused as the thresholds); `divergence_topk` keeps its name and meaning
    here, the other two are refused."""
    assert set(REMOVED_NAMES) == {"divergence_type", "clip_ratio_c"}
    assert "divergence_topk" in DPPOConfig.__dataclass_fields__


@pytest.mark.parametrize(
    "settings", [dict(epsilon=0.05), dict(epsilon_high=0.28), dict(epsilon=0.1, divergence_delta=0.1)]
)
def test_epsilon_set_for_dppo_warns_that_the_thresholds_are_delta_low_and_delta_high(tmp_path, settings):
    with pytest.warns(
        UserWarning, match=r"trl\.experimental\.dppo used epsilon / epsilon_high.*delta_low / delta_high"
    ):
        config = DPPOConfig(output_dir=str(tmp_path), **settings, **COMMON)
    assert config.delta_low == config.delta_high == settings.get("divergence_delta", 0.15)


def test_epsilon_for_the_grpo_trust_region_is_its_clip_and_does_not_warn(tmp_path, recwarn):
    DPPOConfig(output_dir=str(tmp_path), trust_region="grpo", epsilon=0.2, epsilon_high=0.28, **COMMON)
    assert not [w for w in recwarn if "epsilon" in str(w.message)]
