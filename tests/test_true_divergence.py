"""The true divergence beside DPPO's estimates (`true_divergence_fraction`, trl_dppo/true_divergence.py).

The math on tensors (the estimates never exceed the true divergence; the counts behind the rates), then
DPPOTrainer on transformers generation: the lr-0 floor, an independent full-vocabulary computation after updates on
a reused batch, and each refusal. The vLLM colocate path is tests/test_true_divergence_vllm.py; two processes under
DeepSpeed ZeRO are cells of tests/test_zero.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaForCausalLM

from trl_dppo import AsyncDPPOConfig, DPPOConfig
from trl_dppo.divergence import binary_divergence, topk_divergence
from trl_dppo.true_divergence import FULL_VOCABULARY_DIVERGENCES, full_vocabulary_divergences, true_divergence_sums

from .conftest import make_trainer, tiny_model_tv_floor


EPS64 = torch.finfo(torch.float64).eps


def summation_atol(vocab_size: int) -> float:
    """How far a float64 sum over `vocab_size` terms of size at most 1 whose total is at most 2 may be from its exact
    value: each addition rounds by an ulp of the running total, at most 2 * EPS64, so V of them by 2 * V * EPS64;
    4 * V * EPS64 covers the two sums an estimate and the true divergence are compared through (2e-11 at V = 49,152,
    against differences of 1e-3 and up between the estimates of a moved distribution)."""
    return 4 * vocab_size * EPS64


# ----------------------------------------------------------------------------------------------- the math


@pytest.mark.parametrize("scale", [0.5, 4.0, 30.0])  # flat to peaked distributions
def test_the_estimates_never_exceed_the_true_divergence_and_match_dppos_own(scale):
    generator = torch.Generator().manual_seed(0)
    logits = scale * torch.randn(256, 1000, generator=generator)
    sampler = torch.log_softmax(logits, -1)
    trainer = torch.log_softmax(logits + 0.3 * scale * torch.randn(logits.shape, generator=generator), -1)
    sampled = torch.multinomial(sampler.exp(), 1, generator=generator).squeeze(-1)
    out = full_vocabulary_divergences(sampler, trainer, sampled, topk=5)
    atol = summation_atol(1000)
    for kind in ("tv", "kl"):
        assert (out[f"binary_{kind}"] <= out[f"topk_{kind}"] + atol).all()
        assert (out[f"topk_{kind}"] <= out[kind] + atol).all()
        assert (out[f"binary_{kind}"] >= -atol).all()
    # They are DPPO's estimates: its binary and top-K divergences on the same (renormalised) distributions, within
    # float32, which divergence.py returns
    p, q = torch.softmax(sampler.double(), -1), torch.softmax(trainer.double(), -1)
    at_sampled = (p.log().gather(-1, sampled[:, None]).squeeze(-1), q.log().gather(-1, sampled[:, None]).squeeze(-1))
    kept = torch.cat([p.topk(5, -1).indices, sampled[:, None]], -1)
    duplicate = (kept[:, :5] == sampled[:, None]).any(-1)
    kept_p, kept_q = p.log().gather(-1, kept), q.log().gather(-1, kept)
    kept_p[duplicate, 5] = kept_q[duplicate, 5] = -math.inf  # the sampled token already among the top 5
    # divergence.py takes the rest's mass as 1 - p from log p; where p is within 1e-6 of 1 that keeps fewer than 10
    # digits in float64 (the rest bucket here sums the other tokens' mass itself), so compare where it keeps them
    digits = (at_sampled[0].exp() < 1 - 1e-6) & (at_sampled[1].exp() < 1 - 1e-6)
    float32 = 4 * torch.finfo(torch.float32).eps  # divergence.py rounds its float64 result to float32
    for kind in ("tv", "kl"):
        torch.testing.assert_close(
            out[f"binary_{kind}"][digits].float(),
            binary_divergence(*at_sampled, kind)[digits],
            rtol=float32,
            atol=1e-12,
        )
        torch.testing.assert_close(
            out[f"topk_{kind}"].float(), topk_divergence(kept_p, kept_q, kind), rtol=float32, atol=1e-9
        )
    # K as large as the vocabulary keeps every token: the top-K estimate is the true divergence
    whole = full_vocabulary_divergences(sampler, trainer, sampled, topk=1000)
    torch.testing.assert_close(whole["topk_tv"], whole["tv"], rtol=0, atol=atol)
    # and a distribution against itself is at 0 exactly
    same = full_vocabulary_divergences(sampler, sampler, sampled, topk=5)
    assert all((same[name] == 0).all() for name in FULL_VOCABULARY_DIVERGENCES)


def test_the_counts_say_what_the_true_divergence_makes_of_the_masks_decisions():
    # Four tokens, TV, delta 0.2 on both sides. Advantage signs and directions as DPPO's mask reads them
    divergences = {name: torch.zeros(4, dtype=torch.float64) for name in FULL_VOCABULARY_DIVERGENCES}
    divergences["tv"] = torch.tensor([0.5, 0.5, 0.1, 0.3], dtype=torch.float64)  # past delta: tokens 0, 1, 3
    estimate = torch.tensor([0.3, 0.1, 0.05, 0.1])  # the configured estimate puts token 0 past delta only
    base = torch.log(torch.tensor([0.5, 0.5, 0.5, 0.5]))
    trainer = torch.log(torch.tensor([0.9, 0.8, 0.6, 0.3]))  # up, up, up, down
    advantages = torch.tensor([1.0, 1.0, 1.0, 1.0])  # token 3 moves down under A > 0: back toward mu, never blocked
    dppo_keep = torch.tensor([False, True, True, True])  # the estimate blocked token 0
    sums = true_divergence_sums(divergences, estimate, dppo_keep, base, trainer, advantages, "tv", 0.2, 0.2)
    assert sums["tokens"] == 4 and sums["over_delta"] == 3 and sums["caught"] == 1
    assert sums["missed_block"] == 1  # token 1: kept, but the true TV (0.5) past delta moving away
    assert sums["tv"] == pytest.approx(1.4)


# ------------------------------------------------------------------------------------------- the trainer


def logged(trainer) -> list[dict]:
    return [entry for entry in trainer.state.log_history if "loss" in entry]


def test_at_lr_0_the_true_divergence_sits_at_the_float_floor(tmp_path, tiny_model_dir, prompts, tokenizer):
    """A share of 0.5, each batch trained twice at lr 0 (three steps: two generations). Also: a generation batch's
    records are dropped when the next generation starts."""
    loss_tokens, buffered = [], []
    trainer = make_trainer(
        tmp_path,
        tiny_model_dir,
        prompts,
        tokenizer,
        learning_rate=0.0,
        num_iterations=2,
        max_steps=3,
        true_divergence_fraction=0.5,
    )
    original = trainer._set_trust_region_advantages

    def count(context, trainer_logps, hidden):
        inputs = context.inputs
        chosen = torch.tensor([d is not None for d in inputs["sampler_distributions"]])
        loss_tokens.append((int(inputs["completion_mask"].sum()), int(inputs["completion_mask"][chosen].sum())))
        buffered.append(trainer._buffered_inputs[0])
        return original(context, trainer_logps, hidden)

    trainer._set_trust_region_advantages = count
    trainer.train()
    assert buffered[0] is buffered[1] is not buffered[2]
    assert "sampler_distributions" not in buffered[0] and "sampler_distributions" in buffered[2]
    floor = tiny_model_tv_floor(len(tokenizer))
    for entry, (tokens, recorded) in zip(logged(trainer), loss_tokens, strict=True):
        assert entry["true_divergence/recorded_tokens"] == recorded and 0 < recorded < tokens  # a share of 0.5
        assert 0 <= entry["true_divergence/tv_mean"] <= floor
        assert 0 <= entry["true_divergence/kl_mean"] <= floor**2  # KL <= chi^2 ~ (e^d - 1)^2 at this floor
        assert (
            entry["true_divergence/over_delta_fraction"] == 0 and entry["true_divergence/missed_block_fraction"] == 0
        )
        assert entry["true_divergence/caught_fraction"] is None  # no token past delta: the rate has no denominator


def independent_divergences(model_dir, state_dict, other_state_dict, batch, topk: int) -> dict[str, float]:
    """TV means over the batch's loss tokens between the two weights' next-token distributions, from one plain
    forward pass each, written out here without trl_dppo's code."""
    distributions = []
    for weights in (state_dict, other_state_dict):
        model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
        model.load_state_dict(weights)
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
        attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=attention).logits[:, batch["prompt_ids"].size(1) - 1 : -1]
        distributions.append(torch.softmax(logits.double(), -1))
    mask = batch["completion_mask"].bool()
    p, q = (d[mask] for d in distributions)
    sampled = batch["completion_ids"][mask]
    rows = torch.arange(len(sampled))
    kept = torch.zeros_like(p, dtype=torch.bool)
    kept[rows, sampled] = True
    kept.scatter_(-1, p.topk(topk, -1).indices, True)
    rest = lambda d: d.masked_fill(kept, 0).sum(-1)  # noqa: E731
    return {
        "tv_mean": (0.5 * (p - q).abs().sum(-1)).mean().item(),
        "binary_tv_mean": (p[rows, sampled] - q[rows, sampled]).abs().mean().item(),
        "topk_tv_mean": (0.5 * ((p - q).abs().masked_fill(~kept, 0).sum(-1) + (rest(p) - rest(q)).abs()))
        .mean()
        .item(),
    }


def test_after_updates_on_a_reused_batch_the_logged_values_are_an_independent_computations(
    tmp_path, tiny_model_dir, prompts, tokenizer
):
    """Full fine-tuning, top-K, each batch trained twice (num_iterations=2): the second step's pi has moved from the
    weights that sampled. The test keeps the sampler's weights and the trainer's at each step and recomputes."""
    trainer = make_trainer(
        tmp_path,
        tiny_model_dir,
        prompts,
        tokenizer,
        lora=None,
        divergence="topk_tv",
        divergence_topk=5,
        num_iterations=2,
        max_steps=2,
        optim="sgd",
        learning_rate=0.5,
        max_grad_norm=0.0,
        true_divergence_fraction=1.0,
    )
    weights = lambda: {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}  # noqa: E731
    generations, steps = [], []
    generate, set_advantages = trainer._generate_and_score_completions, trainer._set_trust_region_advantages

    def keep_generation(inputs):
        sampler = weights()
        output = generate(inputs)
        generations.append((sampler, {k: v.clone() for k, v in output.items() if isinstance(v, torch.Tensor)}))
        return output

    def keep_step(context, trainer_logps, hidden):
        steps.append(weights())
        return set_advantages(context, trainer_logps, hidden)

    trainer._generate_and_score_completions, trainer._set_trust_region_advantages = keep_generation, keep_step
    trainer.train()
    assert len(generations) == 1 and len(steps) == 2  # one batch, trained at sync and again after one update
    sampler, batch = generations[0]
    # Each side carries one float32 forward's difference from the independent pass (`tiny_floor`)
    atol = 2 * tiny_model_tv_floor(len(tokenizer))
    for step, (entry, trainer_weights) in enumerate(zip(logged(trainer), steps, strict=True)):
        expected = independent_divergences(tiny_model_dir, sampler, trainer_weights, batch, topk=5)
        for name, value in expected.items():
            assert entry[f"true_divergence/{name}"] == pytest.approx(value, abs=atol), (step, name)
        assert entry["true_divergence/recorded_tokens"] == batch["completion_mask"].sum()
    moved = logged(trainer)[1]
    assert moved["true_divergence/tv_mean"] > 30 * atol  # the update moved pi well past the floor
    assert (
        moved["true_divergence/binary_tv_mean"]
        <= moved["true_divergence/topk_tv_mean"]
        <= moved["true_divergence/tv_mean"]
    )
    assert (
        moved["true_divergence/kl_mean"]
        >= moved["true_divergence/topk_kl_mean"]
        >= moved["true_divergence/binary_kl_mean"]
    )


# -------------------------------------------------------------------------------------------- refusals


def dppo_config(tmp_path, **kwargs) -> DPPOConfig:
    return DPPOConfig(output_dir=str(tmp_path), report_to="none", bf16=False, **kwargs)


@pytest.mark.parametrize("value", [-0.1, 1.5, "0.5", float("nan")])
def test_a_share_outside_0_1_is_refused(tmp_path, value):
    with pytest.raises(ValueError, match=r"true_divergence_fraction must be a share of completions in \[0, 1\]"):
        dppo_config(tmp_path, true_divergence_fraction=value)


def test_a_vllm_server_is_refused(tmp_path):
    with pytest.raises(ValueError, match="not recorded here: TRL's client asks a vLLM server.*vllm_mode='colocate'"):
        dppo_config(tmp_path, true_divergence_fraction=0.1, use_vllm=True, vllm_mode="server")


def test_truncated_vllm_sampling_is_refused(tmp_path):
    with pytest.raises(ValueError, match="vLLM reports the truncated distribution, not mu_base"):
        dppo_config(
            tmp_path,
            true_divergence_fraction=0.1,
            use_vllm=True,
            vllm_mode="colocate",
            vllm_allow_truncated_sampling=True,
            top_p=0.9,
        )


def test_vllm_tensor_parallelism_is_refused(tmp_path):
    with pytest.raises(ValueError, match="Set vllm_tensor_parallel_size=1"):
        dppo_config(
            tmp_path, true_divergence_fraction=0.1, use_vllm=True, vllm_mode="colocate", vllm_tensor_parallel_size=2
        )


def test_the_asynchronous_trainer_refuses_it(tmp_path):
    with pytest.raises(ValueError, match="AsyncDPPOTrainer has no whole distribution.*set true_divergence_fraction=0"):
        AsyncDPPOConfig(output_dir=str(tmp_path), report_to="none", bf16=False, true_divergence_fraction=0.1)


def test_a_rollout_func_is_refused(tmp_path, tiny_model_dir, prompts, tokenizer):
    with pytest.raises(ValueError, match="a rollout_func returns the sampled tokens' log-probabilities only"):
        make_trainer(
            tmp_path,
            tiny_model_dir,
            prompts,
            tokenizer,
            true_divergence_fraction=0.1,
            trainer_kwargs={"rollout_func": lambda prompts, trainer: {}},
        )


def test_tools_are_refused(tmp_path, tiny_model_dir, prompts, tokenizer):
    with pytest.raises(ValueError, match="with tools or environments each turn is a generation call of its own"):
        make_trainer(
            tmp_path, tiny_model_dir, prompts, tokenizer, true_divergence_fraction=0.1, trainer_kwargs={"tools": [len]}
        )
