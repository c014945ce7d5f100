"""The GRPOTrainer behaviour DPPOTrainer relies on, pinned so that a TRL change fails here, loudly.

Each test names the override (see docs/overrides.md) that breaks if it fails. The end-to-end tests check the
behaviour too; these say which upstream assumption moved.
"""

from __future__ import annotations

import inspect

import torch
from trl import GRPOConfig, GRPOTrainer
from trl.generation.vllm_generation import VLLMGeneration
from trl.trainer.utils import shuffle_sequence_dict, split_tensor_dict

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


def test_a_list_per_completion_travels_with_the_buffered_batch_until_the_next_generation():
    """`_generate_and_score_completions` override with `true_divergence_fraction`: the whole-vocabulary records are a
    list per completion in the batch, which GRPOTrainer's shuffle and split carry row for row, and its buffer of
    training batches is rebuilt only after a new generation (the override drops the old records when one starts)."""
    batch = {"rows": torch.arange(6), "per_row": [torch.full((1,), i) for i in range(6)], "count": torch.tensor(6)}
    for part in split_tensor_dict(shuffle_sequence_dict(batch), 3):
        assert [int(value) for value in part["per_row"]] == part["rows"].tolist()
    src = source(GRPOTrainer._prepare_inputs)
    assert "generation_batch = self._generate_and_score_completions(generation_batch)" in src
    assert "self._buffered_inputs = [" in src
    assert "inputs = self._buffered_inputs[self._step % self.args.steps_per_generation]" in src


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
    # `images.feeding_vllm_unexpanded_images`: the colocated engine gets one dict per prompt, the processor's ids (its
    # image placeholders expanded) beside the images, and TRL ignores the prompt ids vLLM returns
    src = source(VLLMGeneration.generate)
    assert 'row = {"prompt_token_ids": ids}' in src and 'row["multi_modal_data"] = {"image":' in src
    assert "self.llm.generate(vllm_prompts, sampling_params=sampling_params" in src
    assert "_, completion_ids, logprobs, _ = self.vllm_generation.generate(" in source(
        GRPOTrainer._generate_single_turn
    )


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


def test_log_averages_each_window_list_and_logs_none_where_only_nan_is_left():
    """`log` override: GRPOTrainer's `log` reads the window lists of `self._metrics[mode]` (the mode from
    `self.model.training`, as the override reads it), logs each list's mean without its NaNs (None when none is left:
    DPPO's rate over no token) and clears the window. A list of one value, DPPO's reduced window, logs that value."""
    src = source(GRPOTrainer.log)
    assert params(DPPOTrainer.log) == params(GRPOTrainer.log) == ["self", "logs", "start_time"]
    assert 'mode = "train" if self.model.training else "eval"' in src
    assert "for key, val in self._metrics[mode].items():" in src
    assert "valid = [v for v in val if not math.isnan(v)]" in src
    assert "metrics[key] = sum(valid) / len(valid) if valid else None" in src
    assert "self._metrics[mode].clear()" in src


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


# --- AsyncDPPOTrainer on trl.experimental.async_grpo.AsyncGRPOTrainer ------------------------------------------------


def test_async_loss_takes_log_pi_from_the_forward_and_weights_the_ratio_by_the_advantages():
    """`AsyncDPPOTrainer.compute_loss`: TRL's loss reads each term's log pi from the forward's `log_probs` at
    `token_index` (where the hook takes it), multiplies the ratio by the advantages (zero advantages: no gradient), and
    normalises by the tokens of all processes and the gradient-accumulation steps (the trust region's term copies it)."""
    from trl.experimental.async_grpo import AsyncGRPOTrainer

    src = source(AsyncGRPOTrainer.compute_loss)
    assert params(AsyncGRPOTrainer.compute_loss) == ["self", "model", "inputs", "return_outputs", "num_items_in_batch"]
    assert 'selected = inputs["token_index"] >= 0' in src
    assert 'token_index = inputs["token_index"][selected]' in src
    assert "fused_lm_head=True" in src and src.count("model(") == 1
    assert "log_probs = outputs.log_probs.flatten()[token_index]" in src
    assert "per_token_loss1 = coef_1 * advantages" in src and "per_token_loss2 = coef_2 * advantages" in src
    assert 'global_n_tokens = inputs["global_n_tokens"][0]' in src
    assert "tokens_per_rank = (global_n_tokens / world_size).clamp(min=1.0)" in src
    assert "loss = loss / tokens_per_rank.to(torch.float32)" in src
    assert "loss = loss / self.current_gradient_accumulation_steps" in src
    assert AsyncGRPOTrainer.loss_is_scaled_for_ga


def test_async_training_forward_the_weight_sync_probe_scores_its_tokens_with():
    """`AsyncDPPOTrainer._trainer_probe_log_probs` packs the probe's samples in TRL's `TreeRow` and calls the model as
    TRL's loss does: the tree attention's keyword arguments from the packed row, and `log_probs` at `token_index`."""
    from trl.experimental.async_grpo import AsyncGRPOTrainer
    from trl.experimental.async_grpo.packing import TreeRow

    src = source(AsyncGRPOTrainer.compute_loss)
    for key in ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k"):
        assert f'"{key}"' in src
    assert 'tree_kwargs["tree_max_seqlen_q"], tree_kwargs["tree_max_seqlen_k"] = inputs["tree_max_seqlens"][0]' in src
    assert "shift_labels=shift_labels" in src and "position_ids=position_ids" in src
    assert set(params(TreeRow.add)) == {"self", "sample"}
    packed = source(TreeRow.pack)
    for key in ("input_ids", "position_ids", "shift_labels", "tree_max_seqlens", "token_index"):
        assert f'"{key}"' in packed


def test_async_samples_reach_the_collator_with_their_metrics_and_in_segment_order():
    """`_QueueWithPolicyVersions` / `_collate_policy_versions`: the dataset takes samples from `self.rollout_queue`
    with `get` and passes `sample.metrics` (the same dict) into the examples; the collator gets one micro-batch of
    rows, and a loss term's `segment_id` is its sample's index in the row."""
    from transformers.data.data_collator import DataCollatorMixin
    from trl.experimental.async_grpo import AsyncGRPOTrainer, async_grpo_trainer
    from trl.experimental.async_grpo.packing import TreeRow

    assert "rollout_queue=self.rollout_queue," in source(AsyncGRPOTrainer.get_train_dataloader)
    src = source(async_grpo_trainer.RolloutQueueDataset.__iter__)
    assert "sample = self.queue.get(timeout=self.poll_interval_s)" in src
    assert '"metrics": sample.metrics,' in src
    assert "(rows,) = examples" in source(async_grpo_trainer.DataCollatorForRollout.torch_call)
    assert "return self.torch_call(features)" in source(DataCollatorMixin.__call__)
    src = source(TreeRow.pack)
    assert "enumerate(zip(self.samples, self.sample_nodes, strict=True))" in src and "segment_id.append(i)" in src


def test_async_policy_versions_move_on_the_main_process_at_each_weight_sync():
    """`AsyncDPPOTrainer._sync_weight`: TRL calls `_sync_weight` on every process (at train begin and every
    `weight_sync_steps`) and counts versions on the main process only."""
    from trl.experimental.async_grpo import AsyncGRPOTrainer, async_grpo_trainer

    assert "self._trainer._sync_weight()" in source(async_grpo_trainer._TrainBeginCallback.on_train_begin)
    assert "StepIntervalCallback(self._sync_weight, self.args.weight_sync_steps)" in source(AsyncGRPOTrainer.__init__)
    assert "self.model_version += 1" in source(AsyncGRPOTrainer._sync_weight_merged)
    assert "self.model_version = version" in source(AsyncGRPOTrainer._sync_weight_lora)


def test_async_adapter_sync_loads_this_versions_folder_under_the_name_the_worker_requests():
    """`AsyncDPPOTrainer._check_adapter_sync` (`adapter_sync.py`): TRL's adapter sync saves the adapter of
    `_adapter_name` to a folder and has the main process's client load it as `{_lora_name}-v{version}`, once per sync,
    before `model_version` becomes that version; the worker requests `{lora_name}-v{model_version}`; the file's names
    are PEFT's."""
    from trl.experimental.async_grpo import AsyncGRPOTrainer, async_grpo_trainer, async_rollout_worker

    sync = source(AsyncGRPOTrainer._sync_weight_lora)
    assert "save_lora_adapter(model, self.accelerator, self._adapter_name, adapter_dir)" in sync
    assert 'self.vllm_client.load_lora_adapter(f"{self._lora_name}-v{version}", adapter_dir)' in sync
    assert sync.index("load_lora_adapter") < sync.index("self.model_version = version")
    assert 'return f"{self.lora_name}-v{self.model_version}"' in source(
        async_rollout_worker._AsyncRolloutLoop._request_model.fget
    )
    assert "model.save_pretrained(tmp_dir, selected_adapters=[adapter_name]" in source(
        async_grpo_trainer.save_lora_adapter
    )


def test_async_log_reduces_pairs_and_words_and_passes_one_value_on():
    """`AsyncDPPOTrainer.log`: AsyncGRPOTrainer's `log` reduces the window lists of `self._metrics[mode]` (the mode
    from `self.model.training`) with `_reduce_metric` after dropping NaNs (None when none is left, as GRPOTrainer):
    pairs as sum over sum, but a count whose name has no `total` word (DPPO's `mismatch/missing_sampler_logps`,
    `trust_region/ratio_limited_tokens`) as a mean, which is why DPPO reduces its own first. A list of one value logs
    that value, whatever the key's words."""
    from trl.experimental.async_grpo import AsyncGRPOTrainer, async_grpo_trainer

    from trl_dppo import AsyncDPPOTrainer

    src = source(AsyncGRPOTrainer.log)
    assert params(AsyncDPPOTrainer.log) == params(AsyncGRPOTrainer.log) == ["self", "logs", "start_time"]
    assert 'mode = "train" if self.model.training else "eval"' in src
    assert "for key, val in self._metrics[mode].items():" in src
    assert "valid = [v for v in val if isinstance(v, tuple) or not math.isnan(v)]" in src
    assert "metrics[key] = _reduce_metric(key, valid) if valid else None" in src
    assert "self._metrics[mode].clear()" in src
    reduce = async_grpo_trainer._reduce_metric
    assert reduce("trust_region/masked_fraction", [(1.0, 2.0), (0.0, 0.0), (3.0, 2.0)]) == 1.0
    assert reduce("mismatch/missing_sampler_logps", [0.0, 2.0]) == 1.0
    for key in ("staleness/lag_max", "tokens_by_mu/<0.001/total", "trust_region/ratio_limited_tokens"):
        assert reduce(key, [3.0]) == 3.0, key


def test_async_cuda_assumptions_the_trainer_replaces_on_other_devices():
    """`AsyncDPPOTrainer.__init__`: TRL decides at init whether syncs publish adapter files (`_lora_sync`) or stream
    weights over NCCL, registers its tree attention under `TREE_ATTENTION`, and reads the device's peak FLOPs through
    the module's `get_peak_flops_per_device`; `tree_attention.tree_attention` takes the kernel function's arguments."""
    from trl.experimental.async_grpo import AsyncGRPOTrainer, packing

    from trl_dppo.tree_attention import tree_attention

    src = source(AsyncGRPOTrainer.__init__)
    assert "self._lora_sync = lora_sync" in src  # adapter files rather than NCCL, decided (and broadcast) at init
    assert "register_tree_attention()" in src
    assert "self._peak_flops_per_device = get_peak_flops_per_device(self.accelerator, dtype)" in src
    assert "attn_implementation=TREE_ATTENTION" in src
    assert "AttentionInterface.register(TREE_ATTENTION, tree_attention)" in source(packing.register_tree_attention)
    assert params(tree_attention) == params(packing.tree_attention)


def test_async_rollout_worker_records_the_sampled_tokens_log_prob_with_the_configs_sampling():
    """`AsyncDPPOConfig`: the worker asks vLLM for the sampled token's log-probability only (binary divergences), with
    the config's temperature and truncation (what the config refuses); a missing log-probability becomes NaN."""
    from trl.experimental.async_grpo.async_rollout_worker import _AsyncRolloutLoop

    src = source(_AsyncRolloutLoop._generate_one_turn)
    assert '"logprobs": 0,' in src
    for option in ("temperature", "top_p", "top_k", "repetition_penalty", "min_p"):
        assert f'"{option}"' in src, option
    assert 'return choice["token_ids"], choice["logprobs"]["token_logprobs"]' in src
    assert "old_log_probs=np.asarray(seq.old_log_probs, dtype=np.float32)" in source(_AsyncRolloutLoop._score_group)


def test_moe_generation_and_the_training_step_router_replay_relies_on():
    """MoE overrides: transformers generation left-pads the prompts and calls `generate` once per turn (the routing
    recorder cuts its prefill and decoding steps per completion); the backward pass runs inside `training_step`, after
    `compute_loss` (the replayed routes stay armed until it returns, for gradient checkpointing's recomputation);
    TRL adds the MoE auxiliary loss by asking the loss forward for router logits."""
    from transformers import Trainer

    src = source(GRPOTrainer._generate_single_turn)
    assert 'padding_side="left"' in src and src.count("unwrapped_model.generate(") == 1
    assert 'prompt_length = generate_inputs["input_ids"].size(1)' in src
    assert params(DPPOTrainer.training_step) == params(GRPOTrainer.training_step)
    trainer_step = source(Trainer.training_step)
    assert trainer_step.index("self.compute_loss(") < trainer_step.index("self.accelerator.backward(")
    assert 'model_inputs["output_router_logits"] = True' in source(GRPOTrainer._get_per_token_logps_and_entropies)


def test_image_paths_dppo_patches_or_refuses():
    """`resetting_encoder_cache`: TRL's colocate sync resets vLLM's prefix cache and not its encoder cache.
    `images.refuse_tool_images`: GRPOTrainer says when a tool returned an image. `images.refuse_images_in_async_prompts`:
    TRL's rollout worker renders each prompt with the tokenizer and sends the server token ids alone."""
    from trl.experimental.async_grpo import async_rollout_worker

    sync = source(VLLMGeneration.sync_weights)
    assert "self.llm.reset_prefix_cache()" in sync and "encoder_cache" not in sync
    assert params(GRPOTrainer._generate_single_turn)[-1] == "has_tool_images"
    worker = inspect.getsource(async_rollout_worker)
    assert "self.tokenizer.apply_chat_template(" in worker and "multi_modal_data" not in worker
    assert "images" not in params(async_rollout_worker._AsyncRolloutLoop._generate_one_turn)


def test_prompt_tokenization_and_the_step_hooks_the_start_and_step_checks_call():
    """`__init__`'s prompt-length check calls GRPOTrainer's `_tokenize_prompts` (prompts in, token-id lists first
    out) and no TRL 1.16 option truncates prompts; `StopOnNonFinite` wraps transformers' `training_step` and
    `_maybe_log_save_evaluate`, which the loop calls after each optimizer step with its gradient norm, before saving."""
    from transformers import Trainer

    assert params(GRPOTrainer._tokenize_prompts) == ["self", "prompts"]
    assert "return prompt_ids, images, multimodal_fields" in source(GRPOTrainer._tokenize_prompts)
    assert "max_prompt_length" not in GRPOConfig.__dataclass_fields__
    assert params(Trainer._maybe_log_save_evaluate)[:3] == ["self", "tr_loss", "grad_norm"]
    loop = source(Trainer._run_epoch)  # the optimizer-step loop `_inner_training_loop` runs per epoch
    assert "self.optimizer.step()" in loop and "self._maybe_log_save_evaluate(" in loop
    assert loop.index("self.optimizer.step()") < loop.index("self._maybe_log_save_evaluate(")
    assert "self._save_checkpoint(" in source(Trainer._maybe_log_save_evaluate)
