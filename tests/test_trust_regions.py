"""The trust-region registry: each method one registered function, the config's choices, validation and help and the
docs' table derived from it (tests/test_docs.py), and a method registered from outside the package trained through
DPPOTrainer."""

from __future__ import annotations

import re

import pytest
import torch
from transformers import HfArgumentParser

from trl_dppo import DPPOConfig
from trl_dppo.losses import dppo_gradient_weights
from trl_dppo.trust_regions import TRUST_REGIONS, TrustRegionInput, register_trust_region

from .conftest import make_trainer


COMMON = dict(report_to="none", bf16=False)
LADDER = (
    "dppo",
    "drpo",
    "mask_drpo",
    "grpo",
    "minirl",
    "pg_is",
    "cispo",
    "negative_mask",
    "relaxed_clip",
    "cppo",
    "ipo",
)


@pytest.fixture
def registry():
    """The registry as the package leaves it, restored after the test (which may register methods of its own)."""
    saved = dict(TRUST_REGIONS)
    yield TRUST_REGIONS
    TRUST_REGIONS.clear()
    TRUST_REGIONS.update(saved)


def register_clip_lower():
    """docs/trust_regions.md's example, from outside the package."""

    @register_trust_region("clip_lower", equation="w = M * min(r, cap) * A, M = 0 iff A < 0 and r < 1 - epsilon_low")
    def clip_lower(x: TrustRegionInput, *, epsilon_low: float, cap: float = 10.0):
        """The paper's Clip-Lower probe: only PPO's lower clip bound, and the ratio capped."""
        keep = ~((x.advantages < 0) & (x.ratio < 1 - epsilon_low))
        return dppo_gradient_weights(x.trainer_logps, x.sampler_logps, x.advantages, keep, cap), keep


def test_the_package_registers_the_ladder_drpo_the_relaxed_clip_cppo_and_ipo():
    assert tuple(TRUST_REGIONS) == LADDER
    assert [name for name, method in TRUST_REGIONS.items() if method.recomputes_anchor] == ["minirl"]


def test_the_config_help_lists_every_method_with_its_equation():
    help_text = DPPOConfig.__dataclass_fields__["trust_region"].metadata["help"]
    for name, method in TRUST_REGIONS.items():
        assert f"'{name}': {method.equation}" in help_text


def test_an_unknown_trust_region_is_refused_at_config_time_listing_the_registered_ones(tmp_path):
    with pytest.raises(ValueError, match=re.escape(", ".join(LADDER))):
        DPPOConfig(output_dir=str(tmp_path), trust_region="ppo", **COMMON)


def test_each_method_takes_its_own_settings_from_its_kwargs_and_the_shared_thresholds_from_the_config(tmp_path):
    config = DPPOConfig(
        output_dir=str(tmp_path),
        trust_region="relaxed_clip",
        epsilon=0.1,
        trust_region_kwargs={"alpha": 0.3},
        **COMMON,
    )
    assert config.trust_region_settings == {"epsilon_low": 0.1, "epsilon_high": 0.1, "alpha": 0.3}
    config = DPPOConfig(output_dir=str(tmp_path), delta_low=0.1, delta_high=0.2, **COMMON)
    assert config.trust_region_settings == {"delta_low": 0.1, "delta_high": 0.2, "ratio_cap": None}


def test_a_setting_the_method_does_not_take_is_refused_naming_the_ones_it_does(tmp_path):
    with pytest.raises(
        ValueError, match=r"\['alpha'\], which trust_region='dppo' does not take; it takes 'ratio_cap'"
    ):
        DPPOConfig(output_dir=str(tmp_path), trust_region_kwargs={"alpha": 0.3}, **COMMON)
    with pytest.raises(ValueError, match=r"\['delta_low'\] are DPPOConfig fields.*set them there"):
        DPPOConfig(output_dir=str(tmp_path), trust_region_kwargs={"delta_low": 0.3}, **COMMON)


@pytest.mark.parametrize(("method", "setting"), [("relaxed_clip", "alpha"), ("negative_mask", "drop")])
@pytest.mark.parametrize("value", [0.0, -0.1, 1.5])
def test_probability_settings_are_checked_by_their_method(tmp_path, method, setting, value):
    with pytest.raises(ValueError, match=rf"{setting} must be a probability in \(0, 1\]"):
        DPPOConfig(output_dir=str(tmp_path), trust_region=method, trust_region_kwargs={setting: value}, **COMMON)


@pytest.mark.parametrize("method", ["drpo", "mask_drpo"])
@pytest.mark.parametrize("divergence", ["binary_kl", "topk_tv"])
def test_a_method_declares_the_divergences_it_is_defined_for(tmp_path, method, divergence):
    assert TRUST_REGIONS[method].divergences == ("binary_tv",)
    with pytest.raises(ValueError, match=rf"trust_region='{method}' works with divergence in \('binary_tv',\) only"):
        DPPOConfig(output_dir=str(tmp_path), trust_region=method, divergence=divergence, **COMMON)


def test_settings_must_be_keyword_only_and_names_unique(registry):
    with pytest.raises(TypeError, match="keyword-only"):
        register_trust_region("positional", equation="w = A")(lambda x, delta: (x.advantages, x.advantages > 0))
    with pytest.raises(ValueError, match="already registered"):
        register_trust_region("dppo", equation="w = A")(lambda x: (x.advantages, x.advantages > 0))


def test_a_setting_with_neither_a_value_nor_a_default_fails_at_config_time(registry, tmp_path):
    register_trust_region("needs_beta2", equation="w = A")(lambda x, *, beta2: (x.advantages, x.advantages > 0))
    with pytest.raises(ValueError, match="needs the setting 'beta2': pass it in trust_region_kwargs"):
        DPPOConfig(output_dir=str(tmp_path), trust_region="needs_beta2", **COMMON)
    config = DPPOConfig(
        output_dir=str(tmp_path), trust_region="needs_beta2", trust_region_kwargs={"beta2": 0.5}, **COMMON
    )
    assert config.trust_region_settings == {"beta2": 0.5}


def test_the_command_line_accepts_a_method_registered_after_import_with_its_settings(registry, tmp_path):
    register_clip_lower()
    (config,) = HfArgumentParser(DPPOConfig).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--report_to", "none", "--bf16", "False", "--trust_region", "clip_lower",
         "--trust_region_kwargs", '{"cap": 4.5}']
    )  # fmt: skip
    assert config.trust_region == "clip_lower"
    assert config.trust_region_settings == {"epsilon_low": 0.2, "cap": 4.5}


def test_a_method_registered_outside_the_package_trains_through_the_trainer(
    registry, tmp_path, tiny_model_dir, prompts, tokenizer
):
    register_clip_lower()
    trainer = make_trainer(
        tmp_path,
        tiny_model_dir,
        prompts,
        tokenizer,
        trust_region="clip_lower",
        epsilon=0.1,
        max_steps=2,
        steps_per_generation=2,  # the second step is off-policy, so ratios move away from 1
    )
    seen = []
    set_weights = trainer._set_trust_region_advantages

    def spy(context, trainer_logps, hidden):
        advantages = context.inputs["advantages"].unsqueeze(1)
        set_weights(context, trainer_logps, hidden)
        seen.append((context.inputs, trainer_logps, advantages))

    trainer._set_trust_region_advantages = spy
    trainer.train()
    assert len(seen) == 2
    for inputs, trainer_logps, advantages in seen:
        mask = inputs["completion_mask"].bool()
        sampler_logps = torch.where(mask, inputs["sampling_per_token_logps"], trainer_logps)
        ratio = torch.exp(trainer_logps - sampler_logps)
        keep = ~((advantages < 0) & (ratio < 0.9))  # epsilon_low = epsilon = 0.1
        torch.testing.assert_close(inputs["advantages"], keep * ratio.clamp(max=10.0) * advantages * mask)
