"""Specification of `DPPOConfig`: GRPOConfig plus DPPO's trust region, with contradicting GRPO options rejected."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
from transformers import HfArgumentParser
from trl import GRPOConfig

from trl_dppo import DPPOConfig


DPPO_FIELDS = (
    "divergence",
    "divergence_delta",
    "delta_low",
    "delta_high",
    "divergence_topk",
    "trust_region",
    "trust_region_kwargs",
    "vllm_importance_sampling_correction",
    "loss_type",
    "importance_sampling_level",
    "off_policy_mask_threshold",
)


@pytest.fixture
def make_config(tmp_path):
    def make(**kwargs) -> DPPOConfig:
        return DPPOConfig(output_dir=str(tmp_path), report_to="none", bf16=False, **kwargs)

    return make


# --- Defaults -----------------------------------------------------------------------------------------------------


def test_defaults(make_config):
    config = make_config()
    assert config.divergence == "binary_tv" and (config.divergence_kind, config.recorded_topk) == ("tv", 0)
    assert config.divergence_delta == config.delta_low == config.delta_high == 0.15
    assert config.delta is None  # GRPOConfig's two-sided ratio clip, unused
    assert config.divergence_topk == 20
    assert (config.trust_region, config.trust_region_kwargs, config.log_tokens_by_mu) == ("dppo", None, False)
    assert config.vllm_importance_sampling_correction is False
    assert config.loss_type == "dapo" == GRPOConfig.loss_type
    assert config.importance_sampling_level == "token"


def test_dropout_is_disabled_by_default_unlike_grpo(make_config):
    """The sampler generates without dropout, so the trainer's forward must not have any either
    (benchmarks/results/dropout_gap); an explicit False is kept."""
    assert make_config().disable_dropout is True
    assert GRPOConfig.disable_dropout is False
    assert make_config(disable_dropout=False).disable_dropout is False


@pytest.mark.parametrize(
    "reuse", [dict(num_iterations=2), dict(steps_per_generation=2)], ids=["num_iterations", "steps_per_generation"]
)
def test_a_bias_corrected_kl_on_reused_batches_warns_that_its_ratio_reads_one(make_config, reuse):
    with pytest.warns(UserWarning, match=r"use_bias_correction_kl=True on batches reused.*ratio reads 1"):
        make_config(beta=0.1, per_device_train_batch_size=8, num_generations=4, **reuse)


@pytest.mark.parametrize(
    "settings",
    [
        dict(beta=0.1, use_bias_correction_kl=False, num_iterations=2),
        dict(beta=0.0, num_iterations=2),
        dict(beta=0.1),
        dict(beta=0.1, gradient_accumulation_steps=2, steps_per_generation=1, num_iterations=2),
    ],
    ids=["uncorrected", "no KL", "not reused", "reused within one optimizer step"],
)
def test_a_kl_term_equal_to_grpos_does_not_warn(make_config, settings):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        make_config(per_device_train_batch_size=8, num_generations=4, **settings)


@pytest.mark.parametrize(
    ("divergence", "delta"), [("binary_tv", 0.15), ("topk_tv", 0.15), ("binary_kl", 0.05), ("topk_kl", 0.05)]
)
def test_default_delta_is_015_for_tv_and_005_for_kl(make_config, divergence, delta):
    config = make_config(divergence=divergence)
    assert config.divergence_delta == config.delta_low == config.delta_high == delta


@pytest.mark.parametrize(
    ("divergence", "kind", "recorded"),
    [("binary_tv", "tv", 0), ("binary_kl", "kl", 0), ("topk_tv", "tv", 7), ("topk_kl", "kl", 7)],
)
def test_the_divergences_kind_and_recorded_k_are_properties_of_the_config(make_config, divergence, kind, recorded):
    config = make_config(divergence=divergence, divergence_topk=7)
    assert (config.divergence_kind, config.recorded_topk) == (kind, recorded)


def test_delta_low_and_delta_high_default_to_divergence_delta(make_config):
    config = make_config(divergence_delta=0.3)
    assert config.delta_low == config.delta_high == 0.3


def test_delta_low_and_delta_high_can_be_set_apart(make_config):
    config = make_config(divergence_delta=0.2, delta_low=0.1, delta_high=0.25)
    assert (config.divergence_delta, config.delta_low, config.delta_high) == (0.2, 0.1, 0.25)
    config = make_config(delta_high=0.3)
    assert (config.divergence_delta, config.delta_low, config.delta_high) == (0.15, 0.15, 0.3)


@pytest.mark.parametrize("epsilon", [0.05, 0.2, 0.3])
@pytest.mark.parametrize(("divergence", "delta"), [("binary_tv", 0.15), ("binary_kl", 0.05)])
def test_epsilon_is_never_copied_into_the_thresholds(make_config, epsilon, divergence, delta):
    config = make_config(divergence=divergence, epsilon=epsilon, epsilon_high=epsilon + 0.08)
    assert config.divergence_delta == config.delta_low == config.delta_high == delta


def test_dppo_has_no_ratio_cap_by_default_as_in_the_paper_and_takes_one_through_its_kwargs(make_config):
    """The paper's U1 gives DPPO C = infinity; a cap is the method's own setting."""
    assert make_config().trust_region_settings == {"delta_low": 0.15, "delta_high": 0.15, "ratio_cap": None}
    capped = make_config(trust_region_kwargs={"ratio_cap": 1.0})
    assert capped.trust_region_settings["ratio_cap"] == 1.0


def test_kl_thresholds_may_exceed_one(make_config):
    """Only total variation is bounded by 1."""
    assert make_config(divergence="binary_kl", divergence_delta=2.0).delta_low == 2.0


def test_divergence_topk_is_not_validated_for_binary_divergences(make_config):
    assert make_config(divergence="binary_tv", divergence_topk=0).recorded_topk == 0


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "luspo"])
def test_normalisation_only_loss_types_are_accepted(make_config, loss_type):
    assert make_config(loss_type=loss_type).loss_type == loss_type


# --- Errors -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("divergence", ["tv", "full_kl", "binary_js", ""])
def test_unknown_divergence_is_rejected_with_the_valid_choices(make_config, divergence):
    with pytest.raises(ValueError, match=r"divergence must be one of .*binary_tv.*topk_kl"):
        make_config(divergence=divergence)


@pytest.mark.parametrize("field", ["divergence_delta", "delta_low", "delta_high"])
@pytest.mark.parametrize("value", [0.0, -0.1, float("nan")])
@pytest.mark.parametrize("divergence", ["binary_tv", "topk_kl"])
def test_non_positive_threshold_is_rejected(make_config, field, value, divergence):
    with pytest.raises(ValueError, match=rf"{field} must be > 0"):
        make_config(divergence=divergence, **{field: value})


@pytest.mark.parametrize("field", ["divergence_delta", "delta_low", "delta_high"])
@pytest.mark.parametrize("value", [1.0, 1.5])
@pytest.mark.parametrize("divergence", ["binary_tv", "topk_tv"])
def test_tv_threshold_of_one_or_more_is_rejected(make_config, field, value, divergence):
    with pytest.raises(ValueError, match=rf"{field}={value} never masks anything.*below 1"):
        make_config(divergence=divergence, **{field: value})


@pytest.mark.parametrize("topk", [0, -3])
@pytest.mark.parametrize("divergence", ["topk_tv", "topk_kl"])
def test_topk_below_one_is_rejected_for_topk_divergences(make_config, topk, divergence):
    with pytest.raises(ValueError, match="divergence_topk must be a positive integer"):
        make_config(divergence=divergence, divergence_topk=topk)


@pytest.mark.parametrize("trust_region", ["dppo", "cispo"])
@pytest.mark.parametrize("ratio_cap", [0.5, 0.0, -1.0])
def test_ratio_cap_below_one_is_rejected(make_config, trust_region, ratio_cap):
    with pytest.raises(ValueError, match=r"ratio_cap must be >= 1 or None"):
        make_config(trust_region=trust_region, trust_region_kwargs={"ratio_cap": ratio_cap})


def test_grpos_two_sided_clip_delta_is_rejected_naming_dppos_threshold(make_config):
    with pytest.raises(ValueError, match=r"delta=0\.2 is GRPOConfig's two-sided ratio clip.*`divergence_delta`"):
        make_config(delta=0.2)


def test_vllm_importance_sampling_correction_is_rejected(make_config):
    with pytest.raises(ValueError, match="Set vllm_importance_sampling_correction=False"):
        make_config(vllm_importance_sampling_correction=True)


@pytest.mark.parametrize("level", ["sequence", "sequence_token"])
def test_sequence_level_importance_sampling_is_rejected(make_config, level):
    with pytest.raises(ValueError, match="importance_sampling_level.*Set importance_sampling_level='token'"):
        make_config(importance_sampling_level=level)


@pytest.mark.parametrize("loss_type", ["cispo", "sapo", "vespo"])
def test_trust_region_loss_types_are_rejected(make_config, loss_type):
    with pytest.raises(ValueError, match=rf"loss_type='{loss_type}'.*Use one of .*'dapo'"):
        make_config(loss_type=loss_type)


def test_the_cispo_loss_type_is_refused_pointing_to_the_cispo_trust_region(make_config):
    with pytest.raises(ValueError, match="For CISPO as a baseline in DPPO's ladder, use trust_region='cispo'"):
        make_config(loss_type="cispo")
    assert make_config(trust_region="cispo").trust_region_settings == {"ratio_cap": 3.0}


def test_off_policy_mask_threshold_is_rejected(make_config):
    with pytest.raises(ValueError, match="off_policy_mask_threshold.*Set off_policy_mask_threshold=None"):
        make_config(off_policy_mask_threshold=0.5)


@pytest.mark.parametrize("field", ["use_transformers_continuous_batching", "use_transformers_paged"])
def test_continuous_batching_generation_is_rejected(make_config, field):
    with pytest.raises(ValueError, match="Set use_transformers_continuous_batching=False"):
        make_config(**{field: True})


# --- Integration with TRL ---------------------------------------------------------------------------------------


def test_is_a_grpo_config_subclass():
    assert issubclass(DPPOConfig, GRPOConfig)
    assert dataclasses.is_dataclass(DPPOConfig)


def test_round_trips_through_to_dict(make_config):
    config = make_config(
        divergence="topk_kl", delta_low=0.02, delta_high=0.08, divergence_topk=7, trust_region_kwargs={"ratio_cap": 5}
    )
    as_dict = config.to_dict()
    # GRPOConfig derives generation_batch_size from steps_per_generation in __post_init__ and rejects receiving both,
    # so only one of the pair is passed back (TrainingArguments itself accepts every other key of to_dict()).
    as_dict.pop("generation_batch_size")
    restored = DPPOConfig(**as_dict)
    for name in DPPO_FIELDS:
        assert getattr(restored, name) == getattr(config, name), name
    assert restored.divergence_delta == 0.05


def test_hf_argument_parser_reads_the_dppo_fields(tmp_path):
    parser = HfArgumentParser(DPPOConfig)
    (config,) = parser.parse_args_into_dataclasses(
        args=[
            "--output_dir", str(tmp_path), "--report_to", "none", "--bf16", "False", "--divergence", "topk_tv",
            "--divergence_delta", "0.2", "--delta_low", "0.1", "--divergence_topk", "5",
            "--trust_region_kwargs", '{"ratio_cap": 4}',
        ]
    )  # fmt: skip
    assert isinstance(config, DPPOConfig)
    assert (config.divergence, config.divergence_delta, config.delta_low, config.delta_high) == (
        "topk_tv", 0.2, 0.1, 0.2
    )  # fmt: skip
    assert (config.divergence_topk, config.trust_region_kwargs) == (5, {"ratio_cap": 4})
    assert config.trust_region_settings["ratio_cap"] == 4


def test_dppo_config_shares_no_field_name_with_grpo_config_in_another_meaning():
    """Every field DPPOConfig declares is new, or GRPOConfig's own with GRPO's meaning (only defaults differ)."""
    grpo = {f.name: f for f in dataclasses.fields(GRPOConfig)}
    declared = DPPOConfig.__annotations__  # the fields DPPOConfig's own body declares
    assert [name for name in declared if name in grpo] == ["vllm_importance_sampling_correction", "disable_dropout"]
    ours = DPPOConfig.__dataclass_fields__["vllm_importance_sampling_correction"].metadata["help"]
    assert "importance-sampling correction" in ours and "Must stay False" in ours
    ours = DPPOConfig.__dataclass_fields__["disable_dropout"].metadata["help"]
    assert "torch.nn.Dropout" in ours and "on by default" in ours


def test_hf_argument_parser_rejects_an_unknown_divergence(tmp_path):
    parser = HfArgumentParser(DPPOConfig)
    with pytest.raises(SystemExit):
        parser.parse_args_into_dataclasses(args=["--output_dir", str(tmp_path), "--divergence", "full_tv"])


def test_the_weight_sync_check_raises_by_default_and_takes_log_or_off(make_config):
    config = make_config()
    assert (config.weight_sync_check, config.weight_sync_check_layers) == ("raise", 2)
    assert make_config(weight_sync_check="log").weight_sync_check == "log"
    with pytest.raises(ValueError, match="weight_sync_check='warn' is not one of raise, log, off"):
        make_config(weight_sync_check="warn")
    with pytest.raises(
        ValueError, match="weight_sync_check_layers must be a positive integer.*weight_sync_check='off'"
    ):
        make_config(weight_sync_check_layers=0)
