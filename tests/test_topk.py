"""Top-K divergence end to end: the trainer's log-probabilities at the sampler's kept set, and training with it."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import GemmaConfig, GemmaForCausalLM

from trl_dppo.rollout import VOID_ID
from trl_dppo.topk import check_topk_support, lm_head_kept_logps, topk_logps_from_hidden

from .conftest import forward_logprob_atol, make_trainer, spy_on_trust_region, tiny_model_logprob_atol


@pytest.mark.parametrize("with_bias", [False, True])
def test_kept_logps_from_hidden_equal_a_direct_log_softmax_and_gather(with_bias):
    torch.manual_seed(0)
    B, T, H, V, K = 3, 7, 16, 300, 5
    hidden = torch.randn(B, T, H)
    weight = torch.randn(V, H)
    bias = torch.randn(V) if with_bias else None
    temperature = 0.7
    logits = (hidden @ weight.T + (bias if bias is not None else 0)) / temperature
    full = torch.log_softmax(logits, -1)
    sampled = torch.randint(V, (B, T))
    kept = full.topk(K, -1).indices
    extra = torch.where((kept == sampled[..., None]).any(-1), VOID_ID, sampled)
    kept = torch.cat([kept, extra[..., None]], -1)
    sampled_logps = full.gather(-1, sampled[..., None]).squeeze(-1)

    got = topk_logps_from_hidden(hidden, weight, bias, sampled, sampled_logps, kept, temperature)

    want = full.gather(-1, kept.clamp_min(0)).masked_fill(kept < 0, -math.inf)
    # The reference's log-softmax, and the logits recomputed as dot products over H in another order
    atol = forward_logprob_atol(V, want[kept >= 0].abs().max(), H, 1, logits.abs().max() * temperature)
    torch.testing.assert_close(got, want, atol=atol, rtol=0)


def test_models_whose_logits_are_not_the_lm_head_alone_are_rejected():
    config = GemmaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        final_logit_softcapping=30.0,
    )
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        check_topk_support(GemmaForCausalLM(config))


def test_trainer_and_sampler_kept_sets_agree_at_learning_rate_zero(tmp_path, tiny_model_dir, prompts, tokenizer):
    """Same ids, same log-probabilities: the kept set is recorded aligned with the completion tokens."""
    trainer = make_trainer(
        tmp_path,
        tiny_model_dir,
        prompts,
        tokenizer,
        learning_rate=0.0,
        divergence="topk_kl",
        divergence_topk=5,
        temperature=0.9,
    )
    seen = spy_on_trust_region(trainer)
    captured = []
    original = lm_head_kept_logps

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        captured.append(out)
        return out

    import trl_dppo.trainer as trainer_module

    trainer_module.lm_head_kept_logps = spy
    try:
        trainer.train()
    finally:
        trainer_module.lm_head_kept_logps = original
    assert len(captured) == len(seen) > 0
    for trainer_kept, (_, _, mask, inputs) in zip(captured, seen, strict=True):
        sampler_kept = inputs["sampler_kept_logps"]
        ids = inputs["sampler_kept_ids"]
        assert ids.shape[-1] == 6
        slots = mask[..., None] & (ids >= 0)
        assert slots.any()
        gap = (trainer_kept - sampler_kept).abs()[slots]
        assert gap.max() <= tiny_model_logprob_atol(tokenizer, sampler_kept[slots]), gap.max()
        # The sampled token is in every kept set (as one of the top K or in the last slot)
        sampled = inputs["completion_ids"]
        assert ((ids == sampled[..., None]).any(-1) | ~mask).all()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert logs and all(entry["mismatch/missing_sampler_logps"] == 0 for entry in logs)


def test_topk_training_moves_the_lora_weights(tmp_path, tiny_model_dir, prompts, tokenizer):
    trainer = make_trainer(
        tmp_path,
        tiny_model_dir,
        prompts,
        tokenizer,
        divergence="topk_tv",
        divergence_topk=20,
        steps_per_generation=2,
        gradient_accumulation_steps=2,
        max_steps=2,
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters() if p.requires_grad)
    assert all("trust_region/masked_fraction" in e for e in trainer.state.log_history if "loss" in e)
