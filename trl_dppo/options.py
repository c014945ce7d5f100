"""What DPPO does with each option a TRL user can set: the option map.

Every field of TRL's `GRPOConfig` and `AsyncGRPOConfig`, every field of vLLM's `SamplingParams` (which
`generation_kwargs` reaches), and every field of transformers' `TrainingArguments`, each with what DPPO does with it:

- `inherited`: DPPO's trainer uses it as GRPO's does (for a loss option: DPPO's loss sees it as GRPO's does);
- `changed`: DPPO does something else with it, said in the reason;
- `refused`: some or all of its values stop the run at config or start, with an error naming what to set instead;
  the reason names the values and the check;
- `opt_in`: it changes the distribution vLLM samples from, and vLLM reports the changed (truncated, penalised)
  probability, which the trainer's pi = softmax(logits / T) lacks: refused with vLLM generation unless
  `vllm_allow_truncated_sampling=True` (transformers generation records the untruncated mu and takes it as is).

`TrainingArguments`' fields that reach the loss, the precision, the processes or the optimizer step are classified one
by one (`TRAINING_ARGUMENTS_OPTIONS`); the rest, logging, saving, evaluation scheduling, data loading, the optimizer's
own settings and the Hub, stand as one inherited group (`TRAINING_ARGUMENTS_INHERITED`). `unmapped_options` lists the
fields the installed TRL, transformers and vLLM have that the map does not classify, and the entries they no longer
have; `tests/test_options.py` fails on any of them, and `docs/options.md` is `options_table()`'s output.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterable
from dataclasses import dataclass


__all__ = [
    "ASYNC_GRPO_CONFIG_OPTIONS",
    "GRPO_CONFIG_OPTIONS",
    "SAMPLING_PARAMS_OPTIONS",
    "TRAINING_ARGUMENTS_INHERITED",
    "TRAINING_ARGUMENTS_OPTIONS",
    "TREATMENTS",
    "OptionRule",
    "options_table",
    "unmapped_options",
]

TREATMENTS = ("inherited", "changed", "refused", "opt_in")


@dataclass(frozen=True)
class OptionRule:
    """What DPPO does with one option: `treatment` (one of `TREATMENTS`) and why, in one line."""

    treatment: str
    reason: str

    def __post_init__(self):
        if self.treatment not in TREATMENTS:
            raise ValueError(f"treatment must be one of {TREATMENTS}, got {self.treatment!r}.")


def _rules(table: dict[str, tuple[str, str] | OptionRule]) -> dict[str, OptionRule]:
    return {name: rule if isinstance(rule, OptionRule) else OptionRule(*rule) for name, rule in table.items()}


I, C, R, O = TREATMENTS  # noqa: E741 (the tables' shorthand: inherited, changed, refused, opt_in)

# Every field GRPOConfig declares beyond TrainingArguments' (TRL 1.16)
GRPO_CONFIG_OPTIONS = _rules({
    "model_init_kwargs": (R, "a model it leaves with attention_dropout > 0 is refused while disable_dropout=True (trainer.check_training_dropout)"),
    "trust_remote_code": (I, "how the model and its processor are loaded"),
    "router_aux_loss_coef": (R, "an MoE auxiliary loss that would not train (reentrant gradient checkpointing) is refused: moe.refuse_untrained_aux_loss"),
    "disable_dropout": (C, "on by default (GRPOConfig: off): the sampler draws without dropout, so dropout in the training forward makes pi another function than mu"),
    "cast_lm_head_to_fp32": (I, "the LM head's precision in the training forward, as in GRPOTrainer"),
    "num_generations": (I, "completions per prompt, and the group the advantages are normalised over"),
    "num_generations_eval": (I, "completions per prompt in evaluation"),
    "max_completion_length": (R, "None is refused with loss_type='dr_grpo' (DPPOConfig) and with tools or environments (DPPOTrainer), where TRL needs a number; otherwise inherited"),
    "ds3_gather_for_generation": (I, "how ZeRO-3 gathers the weights for generation; mu is recorded from whatever generates"),
    "shuffle_dataset": (I, "the order of the training prompts"),
    "pad_to_multiple_of": (I, "padding of the training batch; padded positions leave the loss and the trust region"),
    "generation_batch_size": (C, "as GRPOTrainer's, but a batch reused after an update is judged against the sampler's mu, with no recomputed pi_old"),
    "steps_per_generation": (C, "as GRPOTrainer's, but a batch reused after an update is judged against the sampler's mu, with no recomputed pi_old"),
    "temperature": (R, "<= 0 is refused, and < 0.01 with vLLM (which samples at 0.01); otherwise the sampler draws at it and pi divides by it"),
    "top_p": (O, "truncates sampling; vLLM reports the truncated mu. Transformers generation records mu and mu_base (softmax(logits / T)) for the divergence"),
    "top_k": (O, "truncates sampling; vLLM reports the truncated mu. Transformers generation records mu and mu_base for the divergence"),
    "min_p": (O, "truncates sampling; vLLM reports the truncated mu. Transformers generation records mu and mu_base for the divergence"),
    "generation_kwargs": (C, "with vLLM each key is classified in SAMPLING_PARAMS_OPTIONS; with transformers, decoding other than sampling is refused (rollout.check_recordable_sampling)"),
    "chat_template_kwargs": (I, "how prompts are rendered"),
    "repetition_penalty": (O, "penalises sampling; vLLM reports the penalised mu. Transformers generation records mu and mu_base for the divergence"),
    "cache_implementation": (I, "transformers generation's KV cache; the recorded scores are those it samples from"),
    "use_vllm": (I, "mu is vLLM's processed log-probability of each sampled token, taken by its id"),
    "vllm_mode": (R, "'server' is refused on processes without CUDA (vllm_server.refuse_weight_transfer_without_cuda) and on a server without processed log-probabilities"),
    "vllm_model_impl": (I, "which model implementation vLLM runs"),
    "vllm_enable_sleep_mode": (I, "frees the colocated engine's memory between generations"),
    "vllm_structured_outputs_regex": (O, "masks tokens outside the regex; vLLM reports the masked mu, which pi lacks"),
    "vllm_server_base_url": (I, "where the server is"),
    "vllm_server_host": (I, "where the server is"),
    "vllm_server_port": (I, "where the server is"),
    "vllm_server_timeout": (I, "how long the trainer waits for the server to start; a stalled server is bounded by vllm_server_stall_timeout"),
    "vllm_group_port": (I, "the weight-transfer group's port"),
    "vllm_gpu_memory_utilization": (I, "the colocated engine's memory"),
    "vllm_max_model_length": (I, "the colocated engine's context length"),
    "vllm_tensor_parallel_size": (R, "> 1 with weight_sync_check on the CPU backend is refused (weight_sync): each rank holds a slice the check does not place"),
    "beta": (I, "GRPO's KL term to the reference model, added to DPPO's loss as GRPOTrainer adds it"),
    "num_iterations": (C, "as GRPOTrainer's, but each reuse is judged against the sampler's mu, with no recomputed pi_old"),
    "epsilon": (C, "PPO's ratio clip: read by the trust regions that clip (grpo, minirl, relaxed_clip) and the ppo_clipped diagnostics; not DPPO's threshold (it warns)"),
    "delta": (R, "GRPO's two-sided ratio clip is refused (DPPOConfig): DPPO's threshold is divergence_delta"),
    "epsilon_high": (C, "PPO's upper ratio clip: read by the trust regions that clip and the ppo_clipped diagnostics; not DPPO's threshold (it warns)"),
    "sapo_temperature_neg": (I, "read only by loss_type='sapo', which is refused; ignored otherwise, as in GRPOTrainer"),
    "sapo_temperature_pos": (I, "read only by loss_type='sapo', which is refused; ignored otherwise, as in GRPOTrainer"),
    "vespo_k_pos": (I, "read only by loss_type='vespo', which is refused; ignored otherwise, as in GRPOTrainer"),
    "vespo_lambda_pos": (I, "read only by loss_type='vespo', which is refused; ignored otherwise, as in GRPOTrainer"),
    "vespo_k_neg": (I, "read only by loss_type='vespo', which is refused; ignored otherwise, as in GRPOTrainer"),
    "vespo_lambda_neg": (I, "read only by loss_type='vespo', which is refused; ignored otherwise, as in GRPOTrainer"),
    "importance_sampling_level": (R, "'sequence' is refused (DPPOConfig): DPPO's mask and ratio are per token"),
    "reward_weights": (I, "how the rewards are combined into the advantage"),
    "multi_objective_aggregation": (I, "how the rewards are combined into the advantage"),
    "scale_rewards": (I, "how the advantages are scaled; DPPO weights them as GRPO does"),
    "loss_type": (R, "'cispo', 'sapo' and 'vespo' are refused (DPPOConfig), trust regions of their own; the normalisations grpo, bnpo, dr_grpo, dapo, luspo inherited"),
    "mask_truncated_completions": (I, "truncated completions leave the loss and the trust region's rates"),
    "sync_ref_model": (I, "the reference model of the KL term"),
    "ref_model_mixup_alpha": (I, "the reference model of the KL term"),
    "ref_model_sync_steps": (I, "the reference model of the KL term"),
    "top_entropy_quantile": (I, "GRPO's entropy mask multiplies DPPO's per-token loss as it multiplies GRPO's"),
    "entropy_coef": (I, "GRPO's entropy bonus, added to DPPO's loss as to GRPO's"),
    "use_adaptive_entropy": (I, "GRPO's adaptive entropy bonus, added to DPPO's loss as to GRPO's"),
    "entropy_coef_min": (I, "bounds of GRPO's adaptive entropy coefficient"),
    "entropy_coef_max": (I, "bounds of GRPO's adaptive entropy coefficient"),
    "entropy_coef_delta": (I, "step of GRPO's adaptive entropy coefficient"),
    "entropy_target": (I, "target of GRPO's adaptive entropy coefficient"),
    "max_tool_calling_iterations": (I, "tool turns per completion; tool results leave the loss, model tokens carry mu"),
    "vllm_importance_sampling_correction": (R, "True is refused (DPPOConfig): DPPO anchors its trust region to mu and runs no recomputation to correct"),
    "vllm_importance_sampling_mode": (I, "read only with vllm_importance_sampling_correction, which is refused"),
    "vllm_importance_sampling_clip_max": (I, "read only with vllm_importance_sampling_correction, which is refused"),
    "vllm_importance_sampling_clip_min": (I, "read only with vllm_importance_sampling_correction, which is refused"),
    "vllm_importance_sampling_cap": (I, "deprecated name of vllm_importance_sampling_clip_max; read only with the correction, which is refused"),
    "off_policy_mask_threshold": (R, "refused (DPPOConfig): stack trust_region_corrections=['off_policy_sequence_mask'] instead"),
    "use_bias_correction_kl": (C, "on batches reused after an update the ratio reads 1 (no recomputed pi_old): the on-policy KL term, with a warning"),
    "log_completions": (I, "logging"),
    "log_multimodal": (I, "logging"),
    "num_completions_to_print": (I, "logging"),
    "log_unique_prompts": (I, "logging"),
    "log_completions_hub_repo": (I, "logging"),
    "use_transformers_continuous_batching": (R, "refused (DPPOConfig): continuous batching records no per-token log-probabilities"),
    "transformers_continuous_batching_config": (I, "read only with use_transformers_continuous_batching, which is refused"),
    "use_transformers_paged": (R, "refused (DPPOConfig): paged generation records no per-token log-probabilities"),
})  # fmt: skip

# TrainingArguments' fields that reach the loss, the precision, the processes or the optimizer step
TRAINING_ARGUMENTS_OPTIONS = _rules({
    "bf16": (I, "autocasts the training forward, not transformers generation: the gap it opens is logged as mismatch/at_sync_* (docs/precision.md)"),
    "fp16": (I, "autocasts the training forward, not the sampler; a step the loss scaler skips is no non-finite stop"),
    "bf16_full_eval": (I, "evaluation's precision"),
    "fp16_full_eval": (I, "evaluation's precision"),
    "tf32": (I, "CUDA matmul precision on both sides of a colocated run"),
    "torch_compile": (I, "compiles the training forward; pi is the compiled model's"),
    "torch_compile_backend": (I, "compiles the training forward; pi is the compiled model's"),
    "torch_compile_mode": (I, "compiles the training forward; pi is the compiled model's"),
    "use_liger_kernel": (I, "Liger's layer kernels in the trained model, as GRPOTrainer applies them (its own fused LM head kept)"),
    "liger_kernel_config": (I, "Liger's layer kernels; TRL refuses fused_linear_cross_entropy"),
    "activation_checkpointing": (I, "newer transformers' name of gradient_checkpointing, kept equal to it"),
    "activation_checkpointing_kwargs": (I, "newer transformers' name of gradient_checkpointing_kwargs, kept equal to it"),
    "gradient_checkpointing": (I, "recomputes activations in the backward pass; with an MoE auxiliary loss see router_aux_loss_coef"),
    "gradient_checkpointing_kwargs": (I, "reentrant checkpointing with an MoE auxiliary loss is refused (see router_aux_loss_coef)"),
    "neftune_noise_alpha": (R, "refused (DPPOConfig, AsyncDPPOConfig): noise on the training forward's embeddings, absent in the sampler's, makes pi another function than mu"),
    "label_smoothing_factor": (I, "unused by GRPO's loss, and by DPPO's"),
    "learning_rate": (I, "the optimizer step"),
    "max_grad_norm": (I, "the optimizer step; a non-finite gradient norm stops the run (stop_on_non_finite)"),
    "gradient_accumulation_steps": (I, "the optimizer step; with steps_per_generation it decides which batches are reused after an update"),
    "average_tokens_across_devices": (I, "the loss's normaliser across processes, as in GRPOTrainer"),
    "per_device_train_batch_size": (I, "completions per process and step"),
    "max_steps": (I, "the run's length"),
    "num_train_epochs": (I, "the run's length"),
    "seed": (I, "sampling and initialisation; DPPO's own choices (weight sync check layers) use it too"),
    "full_determinism": (I, "deterministic kernels"),
    "use_cpu": (I, "processes on the CPU; several processes need it on a machine without GPUs (refused otherwise, DPPOTrainer)"),
    "deepspeed": (I, "ZeRO-1/2/3 and offload; top-K gathers the LM head under ZeRO-3"),
    "fsdp": (R, "top-K under FSDP1 is refused (topk.check_topk_sharding); FSDP2 and binary inherited"),
    "fsdp_config": (R, "top-K under FSDP1 is refused (topk.check_topk_sharding); FSDP2 and binary inherited"),
    "parallelism_config": (I, "accelerate's parallelism layout"),
    "accelerator_config": (I, "accelerate's settings"),
    "ddp_backend": (I, "the process group's backend"),
    "ddp_timeout": (I, "the process group's timeout"),
    "ddp_find_unused_parameters": (I, "DDP's settings"),
    "ddp_bucket_cap_mb": (I, "DDP's settings"),
    "ddp_broadcast_buffers": (I, "DDP's settings"),
    "ddp_static_graph": (I, "DDP's settings"),
    "local_rank": (I, "the process's rank, set by the launcher"),
    "resume_from_checkpoint": (I, "resumes with the trust-region and sampler state saved in the checkpoint"),
    "auto_find_batch_size": (I, "halves the batch on an out-of-memory error, as for GRPOTrainer"),
    "torch_empty_cache_steps": (I, "frees the accelerator's cache"),
    "optim": (I, "the optimizer; under ZeRO optimizer offload DeepSpeed's CPU Adam"),
})  # fmt: skip

# TrainingArguments' other fields, inherited as a group: logging, saving, evaluation scheduling, data loading, the
# optimizer's and the scheduler's own settings, reporting and the Hub
TRAINING_ARGUMENTS_INHERITED = frozenset({
    "adam_beta1", "adam_beta2", "adam_epsilon", "batch_eval_metrics", "data_seed", "dataloader_drop_last",
    "dataloader_in_order", "dataloader_multiprocessing_context", "dataloader_num_workers",
    "dataloader_persistent_workers", "dataloader_pin_memory", "dataloader_prefetch_factor", "debug", "disable_tqdm",
    "do_eval", "do_predict", "do_train", "enable_jit_checkpoint", "eval_accumulation_steps", "eval_delay",
    "eval_do_concat_batches", "eval_on_start", "eval_steps", "eval_strategy", "eval_use_gather_object",
    "greater_is_better", "hub_always_push", "hub_model_id", "hub_private_repo", "hub_revision", "hub_strategy",
    "hub_token", "ignore_data_skip", "include_for_metrics", "include_num_input_tokens_seen", "label_names",
    "length_column_name", "load_best_model_at_end", "log_level", "log_level_replica", "log_on_each_node",
    "logging_first_step", "logging_nan_inf_filter", "logging_steps", "logging_strategy", "lr_scheduler_kwargs",
    "lr_scheduler_type", "metric_for_best_model", "optim_args", "optim_target_modules", "output_dir",
    "per_device_eval_batch_size", "prediction_loss_only", "project", "push_to_hub", "remove_unused_columns",
    "report_to", "restore_callback_states_from_checkpoint", "run_name", "save_on_each_node", "save_only_model",
    "save_steps", "save_strategy", "save_total_limit", "skip_memory_metrics", "trackio_bucket_id",
    "trackio_space_id", "trackio_static_space_id", "train_sampling_strategy", "use_cache", "warmup_steps",
    "weight_decay",
})  # fmt: skip

# Every field AsyncGRPOConfig declares beyond TrainingArguments' (TRL 1.16). TRL's rollout worker asks the server's
# OpenAI completions endpoint for `logprobs: 0` and reads `token_logprobs`, which vLLM looks up by the sampled token's id
# Fields that some of the releases pyproject.toml accepts have and others lack (transformers 5.17 has neither of these,
# 5.24 both): an entry of the map is missing from the installed release's fields only where it is not one of them
FIELDS_OF_SOME_RELEASES = frozenset({"activation_checkpointing", "activation_checkpointing_kwargs"})

ASYNC_GRPO_CONFIG_OPTIONS = _rules({
    "model_init_kwargs": GRPO_CONFIG_OPTIONS["model_init_kwargs"],
    "dtype": (I, "the trained model's dtype; the server's own --dtype opens the gap logged as mismatch/*"),
    "trust_remote_code": GRPO_CONFIG_OPTIONS["trust_remote_code"],
    "router_aux_loss_coef": GRPO_CONFIG_OPTIONS["router_aux_loss_coef"],
    "num_generations": GRPO_CONFIG_OPTIONS["num_generations"],
    "max_completion_length": (I, "the worker's max_tokens for each turn"),
    "temperature": (R, "<= 0 and < 0.01 are refused (vLLM samples greedily, or at 0.01); otherwise the server samples at it and pi divides by it"),
    "top_p": (R, "< 1 is refused (AsyncDPPOConfig, config.refuse_vllm_truncated_sampling): vLLM reports the truncated mu"),
    "top_k": (R, "> 0 is refused (AsyncDPPOConfig, config.refuse_vllm_truncated_sampling): vLLM reports the truncated mu"),
    "min_p": (R, "> 0 is refused (AsyncDPPOConfig, config.refuse_vllm_truncated_sampling): vLLM reports the truncated mu"),
    "repetition_penalty": (R, "!= 1 is refused (AsyncDPPOConfig, config.refuse_vllm_truncated_sampling): vLLM reports the penalised mu"),
    "chat_template_kwargs": (I, "how prompts are rendered; the server and the trainer see the same token ids"),
    "max_tool_calling_iterations": (I, "tool turns per completion; tool results are context, outside the loss"),
    "fork_threshold_tokens": (I, "forked samples keep each trained token's own log-probability and prefix"),
    "vllm_server_base_url": (R, "a server without --logprobs-mode processed_logprobs is refused at start (vllm_server.refuse_unprocessed_logprobs)"),
    "vllm_server_timeout": (I, "how long the trainer waits for the server to start"),
    "request_timeout": (I, "the worker's per-request timeout"),
    "weight_sync_timeout": (I, "bounds TRL's full-weight transfer"),
    "epsilon": (C, "PPO's ratio clip: read by the trust regions that clip and the ppo_clipped diagnostics; not DPPO's threshold (it warns)"),
    "epsilon_high": GRPO_CONFIG_OPTIONS["epsilon_high"],
    "token_budget": (I, "tokens per training batch"),
    "max_inflight_tasks": (I, "the worker's concurrent requests"),
    "max_staleness": (I, "samples older than it are dropped; younger ones are judged against their own mu, and their lag logged (staleness/*)"),
    "queue_maxsize": (I, "the rollout queue's size"),
    "weight_sync_steps": (I, "optimizer steps between syncs; the lag is counted in updates"),
    "heartbeat_stale_after_s": (C, "also bounds a silent server's /health and the adapter probe's request (AsyncDPPOTrainer)"),
    "log_completions": GRPO_CONFIG_OPTIONS["log_completions"],
    "num_completions_to_print": GRPO_CONFIG_OPTIONS["num_completions_to_print"],
})  # fmt: skip

# Every field of vLLM's SamplingParams (vLLM 0.31), which `generation_kwargs` reaches with use_vllm=True: the colocated
# engine builds SamplingParams from TRL's settings updated by generation_kwargs, and TRL's server client adds them to
# its request the same way, so a key here overrides what TRL or DPPO set
SAMPLING_PARAMS_OPTIONS = _rules({
    "n": (R, "TRL sets it: 1 per prompt copy (colocate), num_generations (server); another value misaligns TRL's completions with prompts"),
    "presence_penalty": (O, "penalises tokens already generated; vLLM reports the penalised (processed) mu, pi lacks the penalty"),
    "frequency_penalty": (O, "penalises tokens by their count so far; vLLM reports the penalised (processed) mu, pi lacks the penalty"),
    "repetition_penalty": (O, "overrides TRL's repetition_penalty; rescales logits of prompt/output tokens; vLLM reports the penalised mu"),
    "temperature": (O, "equal to the config's temperature: taken; else opt-in (mu at this T, pi at the config's); below 0.01 refused (greedy, or raised)"),
    "watermarking": (I, "only opts a request out of (False) or into (True, default) an engine-level watermark; TRL's engines configure none"),
    "top_p": (O, "overrides TRL's top_p; nucleus truncation; vLLM reports the truncated, renormalised mu"),
    "top_k": (O, "overrides TRL's top_k; top-k truncation; vLLM reports the truncated, renormalised mu"),
    "min_p": (O, "overrides TRL's min_p; drops tokens below min_p * max prob; vLLM reports the truncated, renormalised mu"),
    "seed": (R, "mu unchanged, but colocate sends each prompt num_generations times with n=1: one seed gives identical completions per group"),
    "stop": (I, "stop strings end generation; tokens are drawn from the same distribution and token_ids/logprobs stay aligned"),
    "stop_token_ids": (I, "extra tokens that end generation; the distribution is unchanged (min_tokens is what suppresses them)"),
    "ignore_eos": (I, "EOS no longer ends generation but stays sampleable; distribution and reported logprobs unchanged"),
    "max_tokens": (R, "TRL sets it from max_completion_length, which is the option to set; an override lets completions outrun it"),
    "min_tokens": (O, "masks EOS and stop_token_ids until min_tokens are generated; vLLM reports the masked, renormalised mu"),
    "logprobs": (R, "DPPO sets it (0, or K for top-K; -1 for the completions true_divergence_fraction chooses); changes what vLLM reports, not what it samples; a user value overrides DPPO's"),
    "prompt_logprobs": (I, "adds log-probs of the prompt tokens to the output, which TRL does not read; sampling unchanged"),
    "prompt_logprob_token_ids": (I, "scores given ids at prompt positions (Model Runner V2 only; V1 raises); output TRL does not read"),
    "prompt_logprob_start": (I, "first prompt row scored by prompt_logprob_token_ids (which it requires); output TRL does not read"),
    "logprob_token_ids": (R, "replaces the top-K with the listed ids, ranked 1..N: TRL's rank sort puts a listed id, not the sampled one, first"),
    "flat_logprobs": (R, "output container of the logprobs; DPPO sets it itself (True on colocate with top-K or true_divergence_fraction); sampling unchanged"),
    "detokenize": (I, "whether vLLM builds the text; TRL uses token ids only (stop strings need True); sampling unchanged"),
    "skip_special_tokens": (I, "detokenized text only; token ids, sampling and logprobs unchanged"),
    "spaces_between_special_tokens": (I, "detokenized text only; token ids, sampling and logprobs unchanged"),
    "include_stop_str_in_output": (I, "whether the returned text keeps the stop string; token ids, sampling and logprobs unchanged"),
    "output_kind": (I, "streaming granularity; vLLM overrides it on every TRL path (LLM.generate and the servers: FINAL_ONLY)"),
    "stream_interval": (I, "how many tokens each streamed output batches; no effect on sampling or on a final output"),
    "skip_clone": (R, "internal flag: vLLM shallow-copies TRL's one SamplingParams across all prompts (shared mutable state); sampling unchanged"),
    "output_text_buffer_length": (R, "internal: set by __post_init__ from stop (characters of text held back); not an input"),
    "_eos_token_id": (R, "private: set by the engine from the tokenizer's EOS (update_from_generation_config)"),
    "_all_stop_token_ids": (R, "private: engine-built set of EOS and stop ids that min_tokens suppresses"),
    "structured_outputs": (O, "grammar/regex/JSON bitmask applied to logits before the sampler; vLLM reports the masked, renormalised mu"),
    "logit_bias": (O, "adds a bias to given tokens' logits; vLLM reports the biased (processed) mu"),
    "allowed_token_ids": (O, "masks every other token to -inf; vLLM reports the masked, renormalised mu"),
    "extra_args": (O, "read only by custom/model logits processors (and KV connectors); those change the distribution, reported processed"),
    "bad_words": (O, "bans the last token of each bad word when it would complete it; vLLM reports the masked, renormalised mu"),
    "_bad_words_token_ids": (R, "private: built from bad_words by update_from_tokenizer; a user value bans tokens bypassing it"),
    "skip_reading_prefix_cache": (I, "recompute the prompt's KV instead of reading the prefix cache; same distribution, reported as before"),
    "thinking_token_budget": (O, "forces the end-of-thinking tokens (logit 1e9) after the budget; reported processed mu is ~1 for them"),
    "repetition_detection": (I, "ends generation on a repeated n-gram (finish_reason 'repetition'); a stop condition, distribution unchanged"),
    "routed_experts_prompt_start": (I, "skips prompt positions in the returned MoE routing data; sampling and logprobs unchanged"),
    "trace_decode_token_ids": (R, "forces the given tokens instead of sampling; vLLM still reports their processed logprob, not the forced draw"),
})  # fmt: skip


def _gaps(table: str, names: Iterable[str], mapped: Iterable[str], owner: str) -> list[str]:
    names, mapped = set(names), set(mapped)
    return [f"{owner}.{name}: not classified in trl_dppo.options.{table}" for name in sorted(names - mapped)] + [
        f"{table}[{name!r}]: {owner} has no such field" for name in sorted(mapped - names - FIELDS_OF_SOME_RELEASES)
    ]


def _own_fields(config_cls: type, base: type) -> list[str]:
    """The dataclass fields of `config_cls` that `base` does not have."""
    inherited = {f.name for f in dataclasses.fields(base)}
    return [f.name for f in dataclasses.fields(config_cls) if f.name not in inherited]


def unmapped_options(
    grpo_config: type | None = None, async_grpo_config: type | None = None, sampling_params: type | None = None
) -> list[str]:
    """One line per field of the given classes the option map does not classify, and per entry of the map that the
    class has no field for. Defaults: the installed TRL's `GRPOConfig` and `AsyncGRPOConfig`, transformers'
    `TrainingArguments`; `sampling_params` (vLLM's `SamplingParams`) only when given, vLLM being optional."""
    from transformers import TrainingArguments

    if grpo_config is None:
        from trl import GRPOConfig as grpo_config
    if async_grpo_config is None:
        with warnings.catch_warnings():  # TRL's warning that its experimental module is experimental
            warnings.simplefilter("ignore")
            from trl.experimental.async_grpo import AsyncGRPOConfig as async_grpo_config
    arguments = [f.name for f in dataclasses.fields(TrainingArguments)]
    gaps = _gaps(
        "TRAINING_ARGUMENTS_OPTIONS / TRAINING_ARGUMENTS_INHERITED",
        arguments,
        [*TRAINING_ARGUMENTS_OPTIONS, *TRAINING_ARGUMENTS_INHERITED],
        "TrainingArguments",
    )
    both = set(TRAINING_ARGUMENTS_OPTIONS) & TRAINING_ARGUMENTS_INHERITED
    gaps += [f"TrainingArguments.{name}: in both TRAINING_ARGUMENTS_OPTIONS and the inherited group" for name in both]
    gaps += _gaps(
        "GRPO_CONFIG_OPTIONS", _own_fields(grpo_config, TrainingArguments), GRPO_CONFIG_OPTIONS, grpo_config.__name__
    )
    gaps += _gaps(
        "ASYNC_GRPO_CONFIG_OPTIONS",
        _own_fields(async_grpo_config, TrainingArguments),
        ASYNC_GRPO_CONFIG_OPTIONS,
        async_grpo_config.__name__,
    )
    if sampling_params is not None:
        gaps += _gaps(
            "SAMPLING_PARAMS_OPTIONS", sampling_params.__struct_fields__, SAMPLING_PARAMS_OPTIONS, "SamplingParams"
        )
    return gaps


def options_table() -> str:
    """The option map as the Markdown of `docs/options.md`."""
    sections = [
        ("GRPOConfig", "`DPPOConfig` and `DPPOTrainer`", GRPO_CONFIG_OPTIONS),
        ("AsyncGRPOConfig", "`AsyncDPPOConfig` and `AsyncDPPOTrainer`", ASYNC_GRPO_CONFIG_OPTIONS),
        (
            "vLLM's SamplingParams, through `generation_kwargs`",
            "`DPPOConfig` with `use_vllm=True` (a key that is no field of `SamplingParams` is refused)",
            SAMPLING_PARAMS_OPTIONS,
        ),
        ("TrainingArguments", "both configs", TRAINING_ARGUMENTS_OPTIONS),
    ]
    lines = [
        "# Every option and what DPPO does with it",
        "",
        "Generated from `trl_dppo/options.py` (`python -m trl_dppo.options > docs/options.md`); `tests/test_options.py`",
        "fails when the installed TRL, transformers or vLLM has a field this map does not classify, or when this page",
        "differs from the map. **inherited**: used as GRPO uses it; **changed**: DPPO does what the reason says;",
        "**refused**: the values named stop the run at config or start, with an error naming what to set instead;",
        "**opt_in**: changes the distribution vLLM samples from and reports, refused with vLLM unless",
        "`vllm_allow_truncated_sampling=True` (transformers generation records the untruncated mu beside it).",
    ]
    for title, where, table in sections:
        lines += ["", f"## {title}", "", f"For {where}.", "", "| option | DPPO | why |", "|---|---|---|"]
        lines += [f"| `{name}` | {rule.treatment} | {rule.reason} |" for name, rule in table.items()]
    inherited = ", ".join(f"`{name}`" for name in sorted(TRAINING_ARGUMENTS_INHERITED))
    lines += ["", f"Inherited as a group (logging, saving, evaluation, data loading, the Hub): {inherited}.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    sys.stdout.write(options_table())
