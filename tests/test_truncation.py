"""Truncated sampling: the trust region compares the trainer's pi with the sampler's untruncated mu_base.

With top_p / top_k / min_p the token is drawn from mu_sampled = mu_base / Z on the kept tokens (Z the kept mass), while
the trainer's pi = softmax(logits / T) is the full distribution. At equal weights |mu_sampled - pi| = pi (1 - Z)/Z,
which alone exceeds delta; DPPO's divergence and direction test therefore use mu_base, and the ratio keeps mu_sampled.
"""

from __future__ import annotations

import pytest
import torch

from trl_dppo import DPPOConfig

from .conftest import log_softmax_atol, make_trainer, spy_on_trust_region, tiny_model_logprob_atol


TRUNCATION = dict(top_p=0.8, top_k=20, min_p=0.1)


def train_at_learning_rate_zero(tmp_path, model_dir, prompts, tokenizer, compare_with_sampled_mu=False):
    trainer = make_trainer(
        tmp_path, model_dir, prompts, tokenizer, learning_rate=0.0, temperature=0.9, max_steps=3, **TRUNCATION
    )
    seen = spy_on_trust_region(trainer)
    if compare_with_sampled_mu:  # what the trust region did before mu_base was recorded
        original = trainer._set_trust_region_advantages

        def without_base(context, trainer_logps, hidden):
            context.inputs.pop("sampler_base_logps")
            return original(context, trainer_logps, hidden)

        trainer._set_trust_region_advantages = without_base
    trainer.train()
    masked = [entry["trust_region/masked_fraction"] for entry in trainer.state.log_history if "loss" in entry]
    return seen, masked


def test_truncation_alone_masks_no_token(tmp_path, tiny_model_dir, prompts, tokenizer):
    seen, masked = train_at_learning_rate_zero(tmp_path, tiny_model_dir, prompts, tokenizer)
    assert len(masked) == 3 and max(masked) == 0.0
    for mu, pi, mask, inputs in seen:
        base = inputs["sampler_base_logps"]
        # mu_base is the trainer's distribution, to the rounding of two forward passes
        assert (base - pi).abs()[mask].max() <= tiny_model_logprob_atol(tokenizer, base[mask])
        # truncation renormalises the kept tokens up (two log-softmaxes of the recorder apart) ...
        assert (mu - base)[mask].min() >= -log_softmax_atol(len(tokenizer), base[mask].abs().max())
        assert (mu.exp() - base.exp())[mask].max() > 0.15  # ... by more than delta on some tokens


def test_the_same_run_masks_tokens_when_the_divergence_uses_the_truncated_mu(
    tmp_path, tiny_model_dir, prompts, tokenizer
):
    _, masked = train_at_learning_rate_zero(tmp_path, tiny_model_dir, prompts, tokenizer, compare_with_sampled_mu=True)
    assert max(masked) > 0.0


@pytest.mark.parametrize(
    "option, value",
    [
        ("top_p", 0.8),
        ("top_k", 20),
        ("min_p", 0.1),
        ("repetition_penalty", 1.1),
        ("generation_kwargs", {"presence_penalty": 0.5}),
        ("generation_kwargs", {"temperature": 0.5}),
        ("generation_kwargs", {"min_tokens": 32}),  # vLLM's processed log-probs are taken with EOS suppressed
    ],
    ids=["top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "kwargs_temperature", "min_tokens"],
)
def test_vllm_refuses_truncated_or_penalised_sampling_unless_opted_in(tmp_path, option, value):
    settings = dict(output_dir=str(tmp_path), bf16=False, use_vllm=True, temperature=1.0, **{option: value})
    named = option if option != "generation_kwargs" else next(iter(value))
    with pytest.raises(ValueError, match=f"{named}.*vllm_allow_truncated_sampling=True"):
        DPPOConfig(**settings)
    assert DPPOConfig(**settings, vllm_allow_truncated_sampling=True).use_vllm
    # transformers generation records mu_base: no opt-in needed
    assert not DPPOConfig(**{**settings, "use_vllm": False}).vllm_allow_truncated_sampling


def test_vllm_accepts_generation_kwargs_that_leave_the_distribution_alone(tmp_path):
    neutral = {"stop": ["\n"], "ignore_eos": False, "skip_special_tokens": True}
    config = DPPOConfig(output_dir=str(tmp_path), bf16=False, use_vllm=True, generation_kwargs=neutral)
    assert config.generation_kwargs == neutral and not config.vllm_allow_truncated_sampling


def test_trust_region_weights_take_the_mask_from_base_and_the_ratio_from_sampled_mu():
    from trl_dppo.trust_regions import TrustRegionInput, get_trust_region

    pi = torch.tensor([0.4]).log()
    base, sampled = torch.tensor([0.4]).log(), torch.tensor([0.8]).log()  # Z = 0.5
    batch = TrustRegionInput(pi, sampled, base, torch.tensor([-1.0]), torch.tensor([0.0]), pi)
    weights, keep = get_trust_region("dppo")(batch, delta_low=0.15, delta_high=0.15, ratio_cap=None)
    assert keep.all() and weights.item() == pytest.approx(-0.5)


def test_opted_in_vllm_truncation_logs_the_spurious_divergence():
    """mu/pi - 1 estimates (1 - Z)/Z while the trainer's weights are the sampler's; the trainer logs it on the first
    step after each generation only, like `mismatch/at_sync_*` (tests/test_precision.py)."""
    from collections import defaultdict
    from types import SimpleNamespace

    from trl_dppo.diagnostics import TrustRegionDiagnostics

    stub = SimpleNamespace(
        args=SimpleNamespace(delta_low=0.15),
        accelerator=SimpleNamespace(reduce=lambda t, reduction: t),
        _metrics={"train": defaultdict(list)},
    )
    pi = torch.tensor([[0.4, 0.1, 0.5]])
    mu = pi / 0.8  # top_p kept Z = 0.8 of the mass
    mask = torch.tensor([[True, True, False]])
    TrustRegionDiagnostics(stub).record_truncation_gap(mask, mu.log(), pi.log())
    # Rates as (numerator, denominator) over the two loss tokens, which `log` reduces over the window
    ((gap, tokens),) = stub._metrics["train"]["truncation/kept_mass_gap"]
    assert tokens == 2 and gap / tokens == pytest.approx(0.25)
    assert stub._metrics["train"]["truncation/spurious_tv_over_delta_fraction"] == [(0.0, 2.0)]
    pi = torch.tensor([[0.4, 0.1, 0.5]])
    TrustRegionDiagnostics(stub).record_truncation_gap(mask, (pi / 0.5).log(), pi.log())  # Z = 0.5: 0.4 -> 0.8
    assert stub._metrics["train"]["truncation/spurious_tv_over_delta_fraction"][-1] == (1.0, 2.0)


def test_transformers_generation_options_that_bypass_sampling_are_refused_at_start(
    tmp_path, tiny_model_dir, prompts, tokenizer
):
    with pytest.raises(ValueError, match="num_beams"):
        make_trainer(tmp_path, tiny_model_dir, prompts, tokenizer, generation_kwargs={"num_beams": 2})
