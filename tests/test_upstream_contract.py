"""The GRPOTrainer behaviour DPPOTrainer relies on, pinned so that a TRL change fails here, loudly.

Each test names the override (see docs/overrides.md) that breaks if it fails. The end-to-end tests check the
behaviour too; these say which upstream assumption moved.
"""

from __future__ import annotations

import inspect

from trl import GRPOConfig, GRPOTrainer
from trl.generation.vllm_generation import VLLMGeneration

from trl_dppo import DPPOTrainer


def params(fn):
    return list(inspect.signature(fn).parameters)


def source(fn):
    return inspect.getsource(fn)


def test_generate_single_turn_signature_and_return():
    """`_generate_single_turn` override: same arguments, returns (completion_ids, logprobs)."""
    assert params(GRPOTrainer._generate_single_turn) == [
        "self",
        "prompt_ids",
        "images",
        "multimodal_fields",
        "num_generations",
        "has_tool_images",
    ]
    assert params(DPPOTrainer._generate_single_turn) == params(GRPOTrainer._generate_single_turn)
    assert "return completion_ids, logprobs" in source(GRPOTrainer._generate_single_turn)
    # transformers generation is called on the unwrapped model, where the recorder is attached
    assert "unwrapped_model.generate(" in source(GRPOTrainer._generate_single_turn)
    # vLLM: TRL keeps entry 0 of each token's log-probabilities, which the wrapped backend makes the sampled token's
    assert "lp[0] for lp in seq" in source(GRPOTrainer._generate_single_turn)


def test_rollout_logprobs_are_threaded_into_the_batch():
    """`_generate` / `_generate_and_score_completions` overrides: logprobs are item 4 of `_generate`'s result and
    reach the batch as `sampling_per_token_logps` whenever they are not None."""
    assert params(GRPOTrainer._generate) == ["self", "prompts"]
    src = source(GRPOTrainer._generate)
    assert (
        "return prompt_ids, completion_ids, tool_mask, completions, logprobs, extra_fields, images, tool_images" in src
    )
    src = source(GRPOTrainer._generate_and_score_completions)
    assert 'output["sampling_per_token_logps"] = sampling_per_token_logps' in src
    assert "if sampling_per_token_logps is not None:" in src


def test_scoring_and_loss_forwards_go_through_get_per_token_logps():
    """`_get_per_token_logps_and_entropies` override: old log-probs, reference and loss forwards all call it."""
    assert params(GRPOTrainer._get_per_token_logps_and_entropies)[:5] == [
        "self",
        "model",
        "input_ids",
        "attention_mask",
        "logits_to_keep",
    ]
    scoring = source(GRPOTrainer._generate_and_score_completions)
    assert "old_per_token_logps, _, _ = self._get_per_token_logps_and_entropies(" in scoring
    assert (
        "self.model," in scoring.split("old_per_token_logps, _, _ = self._get_per_token_logps_and_entropies(")[1][:80]
    )
    # the fused LM head computes the policy's hidden states through the backbone, where the top-K hook sits
    assert "fused_lm_head=True" in source(GRPOTrainer._get_per_token_logps_and_entropies)


def test_loss_reads_per_token_advantages_after_the_policy_forward():
    """`_compute_loss` override: the loss takes `(B, T)` advantages, reads them after the forward, and without old
    log-probabilities anchors the ratio at the detached log-probs (value 1, gradient grad log pi)."""
    src = source(GRPOTrainer._compute_loss)
    forward_at = src.index("self._get_per_token_logps_and_entropies(")
    advantages_at = src.index('advantages = inputs["advantages"]')
    assert forward_at < advantages_at
    assert "if advantages.dim() == 1:" in src
    assert "per_token_logps.detach() if old_per_token_logps is None else old_per_token_logps" in src
    # the loss mask is read from `tool_mask`, which the override uses to drop tokens without a sampler log-prob
    assert 'mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]' in src


def test_vllm_backend_contract():
    """`record_vllm_logprobs` and `sync_weights_in_place`: VLLMGeneration's generate returns four lists including
    the token ids of the log-probabilities, and it iterates its weights under the names vLLM expects."""
    assert params(VLLMGeneration.generate)[:4] == ["self", "prompts", "images", "num_generations"]
    assert "return prompt_ids, completion_ids, logprobs, logprob_token_ids" in source(VLLMGeneration.generate)
    assert hasattr(VLLMGeneration, "_iter_named_params") and hasattr(VLLMGeneration, "sync_weights")
    assert "self.logprobs" in source(VLLMGeneration.generate)


def test_grpo_config_fields_dppo_sets_apart():
    fields = GRPOConfig.__dataclass_fields__
    for name in (
        "vllm_importance_sampling_correction",
        "importance_sampling_level",
        "loss_type",
        "off_policy_mask_threshold",
        "use_transformers_continuous_batching",
        "delta",
    ):
        assert name in fields, name


def test_checkpoint_hooks_where_the_masked_token_counts_are_saved_and_restored():
    """`_save_checkpoint` / `_load_optimizer_and_scheduler` overrides: the same arguments, and transformers calls the
    loader with the checkpoint's path when resuming (GRPOTrainer restores its entropy controller there too)."""
    from transformers import Trainer

    assert params(DPPOTrainer._save_checkpoint) == params(GRPOTrainer._save_checkpoint) == ["self", "model", "trial"]
    assert params(DPPOTrainer._load_optimizer_and_scheduler) == ["self", "checkpoint"]
    assert "self._load_optimizer_and_scheduler(resume_from_checkpoint)" in source(Trainer._prepare_for_training)


def test_float_lists_carry_record_rows_through_trl():
    """`records.SamplerRecords` tags: TRL only concatenates and slices the per-token floats (tool calls), and builds
    `sampling_per_token_logps` with `torch.tensor` (float32, rounding the tag bits away)."""
    src = source(GRPOTrainer._tool_call_loop)
    assert "logprobs[idx_with_tool] += [0.0] * tool_length + post_tool_logprobs[idx]" in src
    assert "post_tool_logprobs[idx] = post_tool_logprobs[idx][:new_len]" in src
    src = source(GRPOTrainer._generate_and_score_completions)
    assert 'torch.tensor([float("nan") if x is None else x for x in logps])' in src


def test_transformers_samples_from_softmax_of_the_processor_chain():
    """`rollout.recording_generate` hooks `_get_logits_processor`: generate() builds the chain there, and `_sample`
    draws each token from softmax of the chain's output (pinned for transformers 5.x)."""
    from transformers.generation.utils import GenerationMixin

    assert "prepared_logits_processor = self._get_logits_processor(" in source(GenerationMixin.generate)
    src = source(GenerationMixin._sample)
    assert "next_token_scores = logits_processor(input_ids, next_token_logits)" in src
    assert "probs = nn.functional.softmax(next_token_scores, dim=-1)" in src
    assert "next_tokens = torch.multinomial(probs, num_samples=1)" in src
    assert "generation_config" in params(GenerationMixin._get_logits_processor)
