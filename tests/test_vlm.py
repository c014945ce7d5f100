"""DPPOTrainer on a vision-language model with images in the prompt, on transformers generation.

The tiny Idefics3 of `vision.py` answers "What colour is this?" about solid-colour images, LoRA on its language model
only. At learning rate 0 the trainer's pi is the distribution the sampler drew from, so every completion token's
recorded mu is compared with it, with the image in both forward passes. GRPOTrainer suppresses the image token during
transformers generation (a sampled one would have no image features), so the sampler's chain does more than the
temperature: DPPO records mu_base = softmax(logits / T) beside the renormalised mu the token was drawn from
(`docs/recording.md`), and mu_base is what equals pi.
"""

from __future__ import annotations

import pytest
import torch

from .conftest import forward_logprob_atol, make_trainer, spy_on_trust_region
from .vision import FORWARD_LAYERS, HIDDEN_SIZE, IMAGE_SEQ_LEN, VLM_LOGIT_SIZE, colour_prompts, colour_reward


TEMPERATURE = 0.7
TOPK = 5
# LoRA on the language model: the vision tower has q_proj / v_proj of its own, left alone
LANGUAGE_MODEL_LORA = dict(r=4, lora_alpha=8, target_modules=r".*text_model.*\.(q_proj|v_proj)")


def vlm_trainer(tmp_path, model_dir, **overrides):
    from transformers import AutoProcessor

    settings = dict(temperature=TEMPERATURE, max_completion_length=10, divergence_topk=TOPK, log_completions=True)
    settings.update(overrides)
    return make_trainer(
        tmp_path,
        model_dir,
        colour_prompts(),
        AutoProcessor.from_pretrained(model_dir),
        reward_funcs=colour_reward,
        lora=LANGUAGE_MODEL_LORA,
        **settings,
    )


def vlm_logprob_atol(vocab_size: int, logps: torch.Tensor) -> float:
    """`conftest.forward_logprob_atol` for the tiny VLM: its vision tower, connector and Llama each sum dot products
    of up to `HIDDEN_SIZE` terms in another order in the sampler's and the trainer's passes."""
    magnitude = logps[torch.isfinite(logps)].abs().max().item()
    return forward_logprob_atol(vocab_size, magnitude, HIDDEN_SIZE, FORWARD_LAYERS, VLM_LOGIT_SIZE)


def full_logps(trainer, inputs, with_images: bool = True) -> torch.Tensor:
    """log softmax(logits / T) over the vocabulary at every completion position, `(B, T, V)`: a forward pass of its
    own with the batch's image fields (or without them: the image tokens then embed as plain tokens)."""
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    images = {key: inputs[key] for key in ("pixel_values", "pixel_attention_mask")} if with_images else {}
    with torch.no_grad():
        logits = trainer.model(input_ids=input_ids, attention_mask=attention_mask, **images).logits
    completion_logits = logits[:, inputs["prompt_ids"].size(1) - 1 : -1].float()
    return torch.log_softmax(completion_logits / TEMPERATURE, dim=-1)


@pytest.fixture(scope="module", params=["binary_tv", "topk_tv"])
def lr0_run(request, vlm_model_dir, tmp_path_factory):
    trainer = vlm_trainer(
        tmp_path_factory.mktemp(f"vlm-{request.param}"),
        vlm_model_dir,
        divergence=request.param,
        learning_rate=0.0,
        max_steps=1,
    )
    seen = spy_on_trust_region(trainer)
    trainer.train()
    return trainer, seen, request.param


def test_at_learning_rate_0_mu_base_is_pi_on_every_completion_token(lr0_run):
    trainer, seen, _ = lr0_run
    vocab_size = trainer.model.config.text_config.vocab_size
    assert len(seen) == 1
    for mu, pi, mask, inputs in seen:
        assert mask.any()
        base = inputs["sampler_base_logps"]
        gap = (base - pi).abs()[mask]
        assert gap.max() <= vlm_logprob_atol(vocab_size, base[mask]), gap.max()
        # The token was drawn with the image token suppressed: renormalised over the rest, never below mu_base
        assert ((mu - base)[mask] >= -vlm_logprob_atol(vocab_size, mu[mask])).all()
        # The test can see misalignment: the peaked model's mu_base shifted by one token is far from pi
        shifted = (base[:, 1:] - pi[:, :-1]).abs()[mask[:, 1:] & mask[:, :-1]]
        assert shifted.max() > 0.1


def test_the_image_is_in_what_mu_and_pi_condition_on(lr0_run):
    """A forward pass with the batch's pixels gives the recorded mu_base again; without them it is far off."""
    trainer, seen, _ = lr0_run
    _, pi, mask, inputs = seen[0]
    sampled = inputs["completion_ids"][..., None]
    with_image = full_logps(trainer, inputs).gather(-1, sampled).squeeze(-1)
    without_image = full_logps(trainer, inputs, with_images=False).gather(-1, sampled).squeeze(-1)
    atol = vlm_logprob_atol(trainer.model.config.text_config.vocab_size, pi[mask])
    assert (with_image - inputs["sampler_base_logps"]).abs()[mask].max() <= atol
    assert (without_image - inputs["sampler_base_logps"]).abs()[mask].max() > 100 * atol


def test_topk_kept_sets_are_the_models_top_k_given_the_image(lr0_run):
    trainer, seen, divergence = lr0_run
    _, pi, mask, inputs = seen[0]
    if divergence == "binary_tv":
        assert "sampler_kept_ids" not in inputs
        return
    ids, logps = inputs["sampler_kept_ids"], inputs["sampler_kept_logps"]
    assert ids.shape[-1] == TOPK + 1
    reference = full_logps(trainer, inputs)
    top_ids = reference.topk(TOPK, dim=-1).indices
    assert torch.equal(ids[..., :TOPK].long().sort(-1).values[mask], top_ids.sort(-1).values[mask])
    filled = mask[..., None] & (ids >= 0)
    kept = reference.gather(-1, ids.clamp(min=0).long())
    atol = vlm_logprob_atol(trainer.model.config.text_config.vocab_size, logps[filled])
    assert (kept - logps).abs()[filled].max() <= atol


def test_image_and_prompt_tokens_never_enter_the_loss(lr0_run, vlm_model_dir):
    """The loss mask spans the completion only; the prompt holds the image tokens, the completion none."""
    trainer, seen, _ = lr0_run
    image_token_id = trainer.model.config.image_token_id
    for _, _, mask, inputs in seen:
        assert mask.shape == inputs["completion_ids"].shape
        assert ((inputs["prompt_ids"] == image_token_id).sum(1) == IMAGE_SEQ_LEN).all()
        assert not (inputs["completion_ids"] == image_token_id)[mask].any()


def test_log_completions_logs_each_prompts_image_as_grpo_does(lr0_run):
    trainer, _, _ = lr0_run
    logs = trainer._logs
    assert len(logs["images"]) == len(logs["prompt"]) == 8  # one generation batch
    assert all(len(images) == 1 and images[0].size == (32, 32) for images in logs["images"])


def test_lora_on_the_language_model_trains_with_images(vlm_model_dir, tmp_path):
    trainer = vlm_trainer(tmp_path, vlm_model_dir, learning_rate=1e-2, max_steps=2, log_completions=False)
    adapters = {name: p.detach().clone() for name, p in trainer.model.named_parameters() if p.requires_grad}
    assert adapters and all("text_model" in name and "lora" in name for name in adapters)
    trainer.train()
    assert all(not torch.equal(p, dict(trainer.model.named_parameters())[n]) for n, p in adapters.items())
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 2 and all(entry["mismatch/missing_sampler_logps"] == 0 for entry in logs)


def test_async_dppo_refuses_prompts_with_images_at_start(vlm_model_dir, tmp_path):
    """TRL's asynchronous rollout worker sends the server token ids only: the images would be dropped silently."""
    from trl_dppo import AsyncDPPOConfig, AsyncDPPOTrainer

    args = AsyncDPPOConfig(output_dir=str(tmp_path), report_to="none", bf16=False)
    with pytest.raises(ValueError, match="cannot train on prompts with images.*DPPOTrainer"):
        AsyncDPPOTrainer(vlm_model_dir, reward_funcs=colour_reward, args=args, train_dataset=colour_prompts())
    # ... and so are image parts in the prompt messages without an image column
    inline = colour_prompts().map(
        lambda row: {"prompt": [{**m, "content": [{"type": "image", "image": row["image"]}]} for m in row["prompt"]]},
        remove_columns=["image"],
    )
    with pytest.raises(ValueError, match="cannot train on prompts with images"):
        AsyncDPPOTrainer(vlm_model_dir, reward_funcs=colour_reward, args=args, train_dataset=inline)
