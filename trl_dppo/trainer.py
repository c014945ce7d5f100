"""`DPPOTrainer`: GRPOTrainer with DPPO's divergence trust region anchored to the sampler's recorded probabilities.

Everything GRPO does (data, rewards, advantages, generation backends, PEFT, the reference-model KL, loss
normalisation, logging, checkpoints) is GRPOTrainer's own, reached through `super()`. DPPO changes three things, each
in one small override:

- `_generate_single_turn`: on transformers generation, records mu while `generate()` samples (`rollout.py`); on vLLM
  the backend is wrapped at init instead (`record_vllm_logprobs`). GRPOTrainer threads the records into
  `sampling_per_token_logps`.
- `_get_per_token_logps_and_entropies`: during scoring, skips GRPOTrainer's recomputation of old log-probabilities
  (the trust region's anchor is mu); during the loss, turns the forward pass's log pi into per-token advantages
  w_t = M_t * min(pi/mu, C) * A_t. GRPOTrainer's loss accepts `(B, T)` advantages and, with no old log-probabilities,
  has the gradient -w_t * grad log pi: DPPO's gradient, normalised the GRPO way.
- `_compute_loss`: arms the previous override for one loss computation, and takes tokens without a sampler
  log-probability out of the loss.

`_generate` and `_generate_and_score_completions` additionally carry the sampler's top-K into the batch when the
divergence is top-K. `docs/overrides.md` lists every override and `tests/test_upstream_contract.py` pins the
GRPOTrainer behaviour each relies on.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Any

import torch
from trl import GRPOTrainer
from accelerate.utils import is_peft_model
from trl.trainer.utils import maybe_gather_lm_head_ctx

from .config import DPPOConfig
from .divergence import binary_divergence, topk_divergence, trust_region_mask
from .losses import dppo_gradient_weights
from .rollout import (
    SamplerLogprobRecorder,
    kept_set_tensors,
    record_vllm_logprobs,
    recording_generate,
    sync_weights_in_place,
)
from .topk import check_topk_support, topk_logps_from_hidden

__all__ = ["DPPOTrainer", "MU_BUCKETS"]

# Sampler-probability buckets for the masked/kept token counts (`tokens_by_mu/<label>/...` metrics)
MU_BUCKET_EDGES = (1e-3, 1e-2, 1e-1, 0.5, 0.9)
MU_BUCKETS = ("<0.001", "0.001-0.01", "0.01-0.1", "0.1-0.5", "0.5-0.9", ">=0.9")


@contextmanager
def _without_grpo_two_sided_clip(args: DPPOConfig):
    """Hide `args.delta` from GRPOTrainer's loss for the duration of the block.

    GRPOConfig's `delta` is GRPO's two-sided clipping bound on the ratio; DPPOConfig reuses the name for the
    divergence threshold, which GRPOTrainer's loss must not read as a ratio bound.
    """
    delta = args.delta
    args.delta = None
    try:
        yield
    finally:
        args.delta = delta


class DPPOTrainer(GRPOTrainer):
    """Divergence Proximal Policy Optimization on top of TRL's [`~trl.GRPOTrainer`].

    Takes the same arguments as GRPOTrainer, with `args` a [`DPPOConfig`]. See the module docstring for what differs.
    """

    _tag_names = ["trl", "dppo"]
    _name = "DPPO"

    def __init__(self, model, reward_funcs, args: DPPOConfig | None = None, *pargs, **kwargs):
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = DPPOConfig(f"{name.split('/')[-1]}-DPPO")
        if not isinstance(args, DPPOConfig):
            raise TypeError(
                f"DPPOTrainer needs a DPPOConfig, got {type(args).__name__}: build it with "
                "`DPPOConfig(**your_grpo_config.to_dict())` or pass the DPPO fields there."
            )
        super().__init__(model, reward_funcs, args, *pargs, **kwargs)
        self.kind = args.divergence.split("_")[1]
        self.topk = args.topk if args.divergence.startswith("topk") else 0
        if self.topk:
            check_topk_support(self._causal_lm())
        self._loss_inputs: dict[str, Any] | None = None  # set while a loss is computed
        self._scoring = False  # set while a generation batch is scored
        self._rollout_logprobs: list | None = None
        if self.use_vllm:
            self._wrap_vllm_backend()

    # ----------------------------------------------------------------------------------------------- generation

    def _wrap_vllm_backend(self) -> None:
        """Record mu (and the top-K) from vLLM's output, and sync weights in place on vLLM's CPU backend."""
        backend = self.vllm_generation
        backend.generate = record_vllm_logprobs(backend.generate, self.topk)
        if self.topk:
            backend.logprobs = self.topk
        if backend.mode == "colocate":
            from vllm.platforms import current_platform

            if current_platform.is_cpu():
                backend.sync_weights = functools.partial(sync_weights_in_place, backend)

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if self.use_vllm:  # the wrapped backend already returns the sampler's records
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        recorder = SamplerLogprobRecorder(self.generation_config, self.topk)
        with recording_generate(self.accelerator.unwrap_model(self.model_wrapped), recorder):
            completion_ids, _ = super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        return completion_ids, recorder.finish(completion_ids)

    def _generate(self, prompts: list):
        output = super()._generate(prompts)
        self._rollout_logprobs = output[4]  # the records after tool-call stitching, for the top-K kept sets
        return output

    def _generate_and_score_completions(self, inputs):
        self._scoring = True
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            self._scoring = False
        if "sampling_per_token_logps" not in output:
            raise RuntimeError(
                "DPPO needs the sampler's log-probability of every sampled token, but the rollout returned none. "
                "A custom `rollout_func` must return them under 'logprobs'."
            )
        if self.topk:
            ids, logps = kept_set_tensors(
                self._rollout_logprobs, output["completion_ids"].size(1), self.topk, output["completion_ids"].device
            )
            output["sampler_kept_ids"], output["sampler_kept_logps"] = ids, logps
        self._rollout_logprobs = None
        return output

    # --------------------------------------------------------------------------------------------------- loss

    def _causal_lm(self) -> torch.nn.Module:
        model = self.accelerator.unwrap_model(self.model)
        return model.get_base_model() if is_peft_model(model) else model

    def _is_policy(self, model) -> bool:
        """Whether a scoring forward runs the trained policy (as opposed to the reference model or base weights)."""
        model = self.accelerator.unwrap_model(model)
        if model is not self.accelerator.unwrap_model(self.model):
            return False
        if is_peft_model(model):
            return not model._adapters_disabled and model.active_adapter != "ref"
        return True

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        if self._scoring and self._is_policy(model):
            # GRPOTrainer's recomputation of old log-probabilities; DPPO's anchor is the sampler's record instead
            return None, None, None
        if self._loss_inputs is None:
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
            )
        hidden = []
        handle = None
        if self.topk:
            # The hidden states feeding the fused LM head, for pi at the kept ids (see topk.py)
            backbone = self._causal_lm().base_model
            handle = backbone.register_forward_hook(lambda m, a, out: hidden.append(out.last_hidden_state.detach()))
        try:
            logps, entropies, aux_loss = super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
            )
        finally:
            if handle is not None:
                handle.remove()
        hidden = torch.cat(hidden, dim=0)[:, -logits_to_keep - 1 : -1] if self.topk else None
        self._set_trust_region_advantages(self._loss_inputs, logps.detach(), hidden)
        return logps, entropies, aux_loss

    def _compute_loss(self, model, inputs):
        # GRPOTrainer reuses a buffered batch over `num_iterations` passes, so work on a shallow copy
        inputs = dict(inputs)
        mask = inputs["completion_mask"] * inputs.get("tool_mask", 1)
        missing = ~torch.isfinite(inputs["sampling_per_token_logps"])
        if self.topk:
            missing |= torch.isnan(inputs["sampler_kept_logps"]).any(-1)
        missing &= mask.bool()
        if missing.any():  # `tool_mask` only masks the loss, so this takes the tokens out without touching attention
            inputs["tool_mask"] = inputs.get("tool_mask", torch.ones_like(mask)) * (~missing).long()
        self._missing_sampler_logps = missing.sum()
        self._loss_inputs = inputs
        try:
            with _without_grpo_two_sided_clip(self.args):
                return super()._compute_loss(model, inputs)
        finally:
            self._loss_inputs = None

    @torch.no_grad()
    def _set_trust_region_advantages(self, inputs, trainer_logps: torch.Tensor, hidden: torch.Tensor | None) -> None:
        """Replace `inputs["advantages"]` by the per-token weights M_t * min(pi/mu, C) * A_t and log the metrics."""
        mask = (inputs["completion_mask"] * inputs.get("tool_mask", 1)).bool()
        advantages = inputs["advantages"]
        advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
        # Tokens outside the loss get a neutral anchor so that no NaN reaches the loss
        sampler_logps = torch.where(mask, inputs["sampling_per_token_logps"], trainer_logps)
        if self.topk:
            causal_lm = self._causal_lm()
            head = causal_lm.get_output_embeddings()
            with maybe_gather_lm_head_ctx(head.weight, head.bias):
                trainer_kept = topk_logps_from_hidden(
                    hidden,
                    head.weight,
                    head.bias,
                    inputs["completion_ids"],
                    trainer_logps,
                    inputs["sampler_kept_ids"],
                    self.temperature,
                )
            sampler_kept = inputs["sampler_kept_logps"].masked_fill(~mask[..., None], -float("inf"))
            trainer_kept = trainer_kept.masked_fill(~mask[..., None], -float("inf"))
            divergence = topk_divergence(sampler_kept, trainer_kept, self.kind)
        else:
            divergence = binary_divergence(sampler_logps, trainer_logps, self.kind)
        keep = trust_region_mask(
            divergence, sampler_logps, trainer_logps, advantages, self.args.delta_low, self.args.delta_high
        )
        weights = dppo_gradient_weights(trainer_logps, sampler_logps, advantages, keep, self.args.ratio_cap)
        inputs["advantages"] = weights * mask
        self._log_trust_region(mask, keep, advantages, sampler_logps, trainer_logps)

    def _log_trust_region(self, mask, keep, advantages, sampler_logps, trainer_logps) -> None:
        mode = "train" if self.model.training else "eval"
        advantages = advantages.expand_as(mask)
        masked = (~keep & mask).float()
        pos, neg = (advantages > 0) & mask, (advantages < 0) & mask
        prob_diff = (trainer_logps.exp() - sampler_logps.exp()).abs()
        log_ratio = trainer_logps - sampler_logps
        # k3 estimator r - 1 - log r of KL(mu || pi) on tokens drawn from mu: unbiased and never negative
        kl = torch.expm1(log_ratio) - log_ratio
        sums = torch.stack(
            [
                masked.sum(),
                mask.sum(),
                (masked * pos).sum(),
                pos.sum(),
                (masked * neg).sum(),
                neg.sum(),
                (prob_diff * mask).sum(),
                (kl * mask).sum(),
                self._missing_sampler_logps.float(),
            ]
        ).float()
        # Where DPPO's mask and PPO's ratio clip (at this config's epsilon) act, by the sampler's probability
        ppo_clipped = ((advantages > 0) & (log_ratio.exp() > 1 + self.epsilon_high)) | (
            (advantages < 0) & (log_ratio.exp() < 1 - self.epsilon_low)
        )
        bucket = torch.bucketize(sampler_logps.exp(), torch.tensor(MU_BUCKET_EDGES, device=mask.device), right=True)
        by_bucket = torch.stack(
            [
                torch.stack([in_b.sum(), (in_b & ~keep).sum(), (in_b & ppo_clipped).sum()])
                for in_b in ((bucket == b) & mask for b in range(len(MU_BUCKETS)))
            ]
        ).float()
        stats = self.accelerator.reduce(torch.cat([sums, by_bucket.flatten()]), reduction="sum")
        sums, by_bucket = stats[: sums.numel()], stats[sums.numel() :].view_as(by_bucket)
        local_max = prob_diff[mask].max() if mask.any() else prob_diff.new_zeros(())
        global_max = self.accelerator.gather(local_max.reshape(1)).max()

        def fraction(num, den):
            return (num / den.clamp(min=1.0)).item()

        metrics = self._metrics[mode]
        metrics["trust_region/masked_fraction"].append(fraction(sums[0], sums[1]))
        metrics["trust_region/masked_fraction_pos_adv"].append(fraction(sums[2], sums[3]))
        metrics["trust_region/masked_fraction_neg_adv"].append(fraction(sums[4], sums[5]))
        metrics["mismatch/abs_prob_diff_mean"].append(fraction(sums[6], sums[1]))
        metrics["mismatch/abs_prob_diff_max"].append(global_max.item())
        metrics["mismatch/kl_mean"].append(fraction(sums[7], sums[1]))
        metrics["mismatch/missing_sampler_logps"].append(sums[8].item())
        for label, (total, masked_count, clipped_count) in zip(MU_BUCKETS, by_bucket.tolist()):
            metrics[f"tokens_by_mu/{label}/total"].append(total)
            metrics[f"tokens_by_mu/{label}/masked"].append(masked_count)
            metrics[f"tokens_by_mu/{label}/ppo_clipped"].append(clipped_count)
