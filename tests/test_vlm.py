"""DPPOTrainer on a vision-language model with images in the prompt, on transformers generation.

The tiny Idefics3 of `vision.py` answers "What colour is this?" about solid-colour images, LoRA on its language model
only. At learning rate 0 the trainer's pi is the distribution the sampler drew from, so every completion token's
recorded mu is compared with it, with the image in both forward passes. GRPOTrainer suppresses the image token during
transformers generation (a sampled one would have no image features), so the sampler's chain does more than the
temperature: DPPO records mu_base = softmax(logits / T) beside the renormalised mu the token was drawn from
(`docs/recording.md`), and mu_base is what equals pi.
"""

from __future__ import annotations

import math

import pytest
import torch

from .conftest import spy_on_trust_region
from .vision import IMAGE_SEQ_LEN, TOPK, colour_prompts, colour_reward, full_logps, vlm_logprob_atol, vlm_trainer


@pytest.fixture(scope="module", params=["binary_tv", "topk_tv"])
def lr0_run(request, vlm_model_dir, tmp_path_factory):
    trainer = vlm_trainer(
        tmp_path_factory.mktemp(f"vlm-{request.param}"),
        vlm_model_dir,
        divergence=request.param,
        learning_rate=0.0,
        max_steps=1,
        true_divergence_fraction=1.0 if request.param == "topk_tv" else 0.0,  # the top-K run also measures it
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


def test_vllm_server_mode_with_images_is_refused_at_start(vlm_model_dir, tmp_path):
    """Untested, and TRL resets only the server's prefix cache after a sync (stale vision embeddings): refused before
    any server is contacted."""
    with pytest.raises(ValueError, match="server mode.*vllm_mode='colocate'"):
        vlm_trainer(tmp_path, vlm_model_dir, use_vllm=True, vllm_mode="server")


def test_tools_that_return_images_are_refused_at_the_first_tool_image(lr0_run):
    trainer, *_ = lr0_run
    with pytest.raises(NotImplementedError, match="tools that return images"):
        trainer._generate_single_turn([[1, 2]], None, {}, 1, has_tool_images=True)


def test_a_colocated_sync_on_gpus_empties_vllms_encoder_cache_after_trls_sync():
    """TRL's colocate sync resets the prefix cache only; an image seen again after an update would otherwise be
    embedded with the weights before it (CUDA vLLM, so checked here on the wrapper alone)."""
    from types import SimpleNamespace

    from trl_dppo.weight_sync import resetting_encoder_cache

    calls = []
    llm = SimpleNamespace(llm_engine=SimpleNamespace(reset_encoder_cache=lambda: calls.append("reset encoder cache")))
    resetting_encoder_cache(lambda: calls.append("TRL's sync"), llm)()
    assert calls == ["TRL's sync", "reset encoder cache"]


def test_vllm_gets_one_placeholder_per_image_and_must_expand_it_into_the_trainers_prompt(vlm_model_dir):
    """TRL hands vLLM the processor's expanded prompt, which vLLM 0.31 would expand again (TRL #6294): the wrapper
    sends one `<image>` per image, in the image's place, and stops the batch when vLLM's expansion is not the
    trainer's prompt (checked here on the wrapper alone, with an engine that expands as vLLM does or otherwise)."""
    from types import SimpleNamespace

    from PIL import Image
    from transformers import AutoProcessor

    from trl_dppo.images import feeding_vllm_unexpanded_images

    processor = AutoProcessor.from_pretrained(vlm_model_dir)
    image = Image.new("RGB", (32, 32), (255, 0, 0))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which colour?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    expanded = processor(text=[text], images=[[image]])["input_ids"][0]
    placeholder = processor.tokenizer.convert_tokens_to_ids("<image>")
    unexpanded = processor.tokenizer(text)["input_ids"]
    assert len(expanded) == len(unexpanded) + 6 and unexpanded.count(placeholder) == 1  # 7 tokens in its place

    sent = []

    def engine(prompts, expand=True):
        sent.extend(prompts)
        return [
            SimpleNamespace(
                prompt_token_ids=expanded if expand and "multi_modal_data" in row else row["prompt_token_ids"]
            )
            for row in prompts
        ]

    generate = feeding_vllm_unexpanded_images(engine, processor)
    text_only = processor.tokenizer("no image here")["input_ids"]
    generate([{"prompt_token_ids": expanded, "multi_modal_data": {"image": image}}, {"prompt_token_ids": text_only}])
    assert sent[0]["prompt_token_ids"] == unexpanded and sent[1]["prompt_token_ids"] == text_only
    with pytest.raises(RuntimeError, match="other token ids than the processor"):
        generate([{"prompt_token_ids": expanded, "multi_modal_data": {"image": image}}], expand=False)
    with pytest.raises(RuntimeError, match="no expansion of its image's placeholder"):
        generate([{"prompt_token_ids": unexpanded, "multi_modal_data": {"image": image}}])


def test_the_true_divergence_is_measured_with_the_image_and_sits_at_the_float_floor(lr0_run):
    """With `true_divergence_fraction` (the top-K run), the recorded whole distributions are mu_base given the image
    (the image token unsuppressed, as pi), so at learning rate 0 each token's TV to a forward pass with the batch's
    pixels, and the logged means, sit at the two passes' float floor; off (the binary run), nothing is logged."""
    trainer, seen, divergence = lr0_run
    (entry,) = [e for e in trainer.state.log_history if "loss" in e]
    if divergence != "topk_tv":
        assert not any(name.startswith("true_divergence/") for name in entry)
        return
    _, _, mask, inputs = seen[0]
    vocab_size = trainer.model.config.text_config.vocab_size
    # Each log-probability down to -30 within the passes' atol d, so TV <= e^d - 1, plus the mass below e^-30
    floor = math.expm1(vlm_logprob_atol(vocab_size, torch.tensor([30.0]))) + vocab_size * math.exp(-30)
    pi = full_logps(trainer, inputs).exp().double()
    for b, logps in enumerate(inputs["sampler_distributions"]):
        kept = mask[b, : logps.size(0)]
        tv = 0.5 * (logps[kept].double().exp() - pi[b, : logps.size(0)][kept]).abs().sum(-1)
        assert tv.max() <= floor
    assert entry["true_divergence/recorded_tokens"] == mask.sum()
    assert 0 <= entry["true_divergence/binary_tv_mean"] <= entry["true_divergence/tv_mean"] <= floor
