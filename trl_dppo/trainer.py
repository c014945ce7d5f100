"""`DPPOTrainer`: GRPOTrainer with DPPO's divergence trust region anchored to the sampler's recorded probabilities.

Everything GRPO does (data, rewards, advantages, generation backends, PEFT, the reference-model KL, loss
normalisation, logging, checkpoints) is GRPOTrainer's own, reached through `super()`. DPPO changes three things, each
in one small override:

- `_generate_single_turn`: on transformers generation, records mu while `generate()` samples (`rollout.py`); on vLLM
  the backend is wrapped at init instead (`record_vllm_logprobs`; with top-K on a colocated engine, the engine's own
  `generate`, `record_vllm_flat_logprobs`). GRPOTrainer threads the records into `sampling_per_token_logps`.
- `_get_per_token_logps_and_entropies`: during scoring, skips GRPOTrainer's recomputation of old log-probabilities
  (the trust region's anchor is mu); during the loss, turns the forward pass's log pi into per-token advantages
  w_t = M_t * min(pi/mu, C) * A_t (or another method's weight, `trust_region`, see `trust_regions.py`). GRPOTrainer's
  loss accepts `(B, T)` advantages and, with no old log-probabilities, has the gradient -w_t * grad log pi: DPPO's
  gradient, normalised the GRPO way.
- `_compute_loss`: hands the previous override what it needs for one loss computation, in one `_LossContext` set
  for the duration of `super()._compute_loss` and cleared after, and takes tokens without a sampler log-probability
  out of the loss.

Two objects carry state between calls, each set and cleared in one place: the generation batch's `SamplerRecords`
(`_sampler_records`, while `_generate_and_score_completions` runs: its presence also says "scoring") and the
`_LossContext` (`_loss_context`, while `_compute_loss` runs).

`_generate` and `_generate_and_score_completions` additionally carry the sampler's records beyond the float TRL keeps
into the batch (`records.py`): the top-K when the divergence is top-K, and log mu_base, the sampler's distribution
before truncation or penalties, when the sampler's chain had any. The divergence and the direction test compare pi
with mu_base (like with like: pi is softmax(logits / T)); the ratio pi/mu keeps the mu the token was drawn from.
`docs/overrides.md` lists every override and `tests/test_upstream_contract.py` pins the GRPOTrainer behaviour each
relies on.
"""

from __future__ import annotations

import functools
import json
import os
import textwrap
from collections import Counter
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from accelerate.utils import gather_object, is_peft_model
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOConfig, GRPOTrainer

from .config import DPPOConfig
from .divergence import binary_divergence, topk_divergence, trust_region_mask
from .losses import ratio_clip_keep
from .records import SamplerRecords
from .rollout import (
    SamplerLogprobRecorder,
    check_recordable_sampling,
    record_vllm_flat_logprobs,
    record_vllm_logprobs,
    recording_generate,
    sync_weights_in_place,
)
from .topk import check_topk_sharding, check_topk_support, lm_head_kept_logps
from .trust_regions import TrustRegionInput, get_trust_region
from .vllm_server import refuse_unprocessed_logprobs


if TYPE_CHECKING:
    from datasets import Dataset, DatasetDict, IterableDataset, IterableDatasetDict
    from peft import PeftConfig, PeftModel
    from transformers import BitsAndBytesConfig, PreTrainedModel, PreTrainedTokenizerBase, ProcessorMixin
    from trl.trainer.grpo_trainer import EnvironmentFactory, RewardFunc, RolloutFunc

__all__ = ["DPPOTrainer", "MU_BUCKETS"]

# In each checkpoint: DPPOTrainer.masked_token_counts summed over processes, restored on resume
MASKED_TOKEN_COUNTS_NAME = "dppo_masked_token_counts.json"
# Sampler-probability buckets for the masked/kept token counts (`tokens_by_mu/<label>/...` metrics)
MU_BUCKET_EDGES = (1e-3, 1e-2, 1e-1, 0.5, 0.9)
MU_BUCKETS = ("<0.001", "0.001-0.01", "0.01-0.1", "0.1-0.5", "0.5-0.9", ">=0.9")
# The server `trl vllm-serve` starts, for the error that refuses a server with other log-probabilities
SERVER_RESTART_EXAMPLE = (
    "    VLLM_SERVER_DEV_MODE=1 vllm serve {model} --logprobs-mode processed_logprobs --max-logprobs -1 "
    """--weight-transfer-config '{{"backend": "nccl"}}'\n\n"""
    "(`trl vllm-serve --model {model}` starts the same server with these flags)."
)


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


@dataclass(frozen=True)
class _LossContext:
    """What `_compute_loss` hands to the loss's forward pass (`_get_per_token_logps_and_entropies`) for one loss."""

    inputs: dict[str, Any]  # the micro-batch (a shallow copy): its advantages become the trust region's weights
    anchor_logps: torch.Tensor | None  # pi_old recomputed by GRPOTrainer, for trust regions that recompute an anchor
    missing_sampler_logps: torch.Tensor  # loss tokens without a sampler log-probability, taken out of the loss
    # The trust region's settings, read before `args.delta` is hidden from GRPOTrainer's loss
    trust_region_settings: dict[str, Any]


def _sum_over_processes(accelerator, values: dict[str, torch.Tensor]) -> dict[str, float]:
    """Each named scalar summed over processes, in one collective."""
    sums = accelerator.reduce(torch.stack(list(values.values())).float(), reduction="sum")
    return dict(zip(values, sums.tolist(), strict=True))


class _MaskedTokensWriter(TrainerCallback):
    """Writes `masked_tokens.json` (the most often masked tokens per advantage sign) at each save and at the end."""

    def __init__(self, trainer: DPPOTrainer):
        self.trainer = trainer

    def _write(self, args, state) -> None:
        report = self.trainer.masked_tokens_report()  # every process takes part: the counts are summed over them
        if state.is_world_process_zero and args.output_dir:
            os.makedirs(args.output_dir, exist_ok=True)
            with open(os.path.join(args.output_dir, "masked_tokens.json"), "w") as f:
                json.dump(report, f, indent=1)

    def on_save(self, args, state, control, **kwargs):
        self._write(args, state)

    def on_train_end(self, args, state, control, **kwargs):
        self._write(args, state)


class DPPOTrainer(GRPOTrainer):
    """Divergence Proximal Policy Optimization on top of TRL's [`~trl.GRPOTrainer`].

    Takes the same arguments as GRPOTrainer, with `args` a [`DPPOConfig`]. See the module docstring for what differs.
    """

    _tag_names = ["trl", "dppo"]
    _name = "DPPO"
    _paper = {
        "title": "Rethinking the Trust Region in LLM Reinforcement Learning",
        "id": "2602.04879",
        # docstyle-ignore
        "citation": textwrap.dedent("""\
            @article{qi2026rethinking,
                title        = {{Rethinking the Trust Region in LLM Reinforcement Learning}},
                author       = {Penghui Qi and Xiangxin Zhou and Zichen Liu and Tianyu Pang and Chao Du and Min Lin and Wee Sun Lee},
                year         = 2026,
                eprint       = {arXiv:2602.04879},
            }"""),
    }

    # GRPOTrainer's parameters, spelled out so IDEs and docs show them; all of them go to GRPOTrainer unchanged
    def __init__(
        self,
        model: str | PreTrainedModel | PeftModel,
        reward_funcs: RewardFunc | list[RewardFunc] | None = None,
        args: DPPOConfig | None = None,
        train_dataset: Dataset | IterableDataset | None = None,
        eval_dataset: Dataset
        | IterableDataset
        | DatasetDict
        | IterableDatasetDict
        | dict[str, Dataset | IterableDataset]
        | None = None,
        processing_class: PreTrainedTokenizerBase | ProcessorMixin | None = None,
        reward_processing_classes: PreTrainedTokenizerBase | list[PreTrainedTokenizerBase] | None = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, torch.optim.lr_scheduler.LambdaLR | None] = (None, None),
        quantization_config: BitsAndBytesConfig | None = None,
        peft_config: PeftConfig | None = None,
        tools: list[Callable] | None = None,
        rollout_func: RolloutFunc | None = None,
        environment_factory: EnvironmentFactory | dict[str, EnvironmentFactory] | None = None,
    ):
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = DPPOConfig(f"{name.split('/')[-1]}-DPPO")
        if not isinstance(args, DPPOConfig):
            fix = "DPPOConfig.from_grpo_config(your_config)" if isinstance(args, GRPOConfig) else "a DPPOConfig"
            raise TypeError(f"DPPOTrainer needs a DPPOConfig, got {type(args).__name__}: pass {fix}.")
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if launched > 1 and args.world_size == 1:
            raise RuntimeError(
                f"{launched} processes were launched, but accelerate found no distributed backend for this device, so "
                "each would train alone on the whole data. On a machine without GPUs set `use_cpu=True` in DPPOConfig "
                "(`--use_cpu true`): the processes then train together over gloo."
            )
        super().__init__(
            model,
            reward_funcs,
            args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            reward_processing_classes=reward_processing_classes,
            callbacks=callbacks,
            optimizers=optimizers,
            quantization_config=quantization_config,
            peft_config=peft_config,
            tools=tools,
            rollout_func=rollout_func,
            environment_factory=environment_factory,
        )
        self.kind = args.divergence.split("_")[1]
        self.topk = args.topk if args.divergence.startswith("topk") else 0
        if self.topk:
            check_topk_support(self._causal_lm())
            check_topk_sharding(self.accelerator)
            if self.rollout_func is not None:
                raise ValueError(
                    f"divergence={args.divergence!r} needs the sampler's top-K at every token, and a `rollout_func` "
                    "returns only the sampled token's log-probability, so the top-K divergence would read 0 and mask "
                    "nothing. Use a binary divergence (divergence='binary_tv' or 'binary_kl') with a rollout_func."
                )
        self._loss_context: _LossContext | None = None  # set while a loss is computed (`_computing_loss`)
        # The optimizer step at which the training batch in use was generated: the loss runs on the weights that
        # sampled it (`mismatch/at_sync_*`) while `state.global_step` still equals it
        self._generated_at_step: int | None = None
        # The sampler's records of the generation batch in progress: set when one starts, cleared once in the batch
        self._sampler_records: SamplerRecords | None = None
        self.masked_token_counts = {"positive": Counter(), "negative": Counter()}
        self.add_callback(_MaskedTokensWriter(self))
        if self.use_vllm:
            self._wrap_vllm_backend()
        elif self.rollout_func is None:
            check_recordable_sampling(self.generation_config)

    # ----------------------------------------------------------------------------------------------- generation

    def _wrap_vllm_backend(self) -> None:
        """Record mu (and the top-K) from vLLM's output, and sync weights in place on vLLM's CPU backend."""
        backend = self.vllm_generation
        if backend.mode == "server":  # TRL checks the mode only with `vllm_importance_sampling_correction`
            refuse_unprocessed_logprobs(
                self.accelerator, backend.vllm_client, backend.vllm_client.base_url, SERVER_RESTART_EXAMPLE
            )
        topk_in_lists = self.topk
        if self.topk:
            backend.logprobs = self.topk
            if backend.mode == "colocate":  # the top-K is taken from vLLM's flat output, before TRL's lists
                backend.generation_kwargs = {**backend.generation_kwargs, "flat_logprobs": True}
                backend.llm.generate = record_vllm_flat_logprobs(
                    backend.llm.generate, self.topk, self._current_sampler_records
                )
                topk_in_lists = 0
        backend.generate = record_vllm_logprobs(backend.generate, topk_in_lists, self._current_sampler_records)
        if backend.mode == "colocate":
            from vllm.platforms import current_platform

            if current_platform.is_cpu():
                backend.sync_weights = functools.partial(sync_weights_in_place, backend)

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if self.use_vllm:  # the wrapped backend already returns the sampler's records
            return super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        recorder = SamplerLogprobRecorder(self.topk, self.temperature)
        with recording_generate(self.accelerator.unwrap_model(self.model_wrapped), recorder):
            completion_ids, _ = super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        return completion_ids, recorder.finish(completion_ids, self._current_sampler_records())

    def _current_sampler_records(self) -> SamplerRecords:
        if self._sampler_records is None:
            raise RuntimeError(
                "The sampler's records are kept per generation batch: generate through "
                "`_generate_and_score_completions`."
            )
        return self._sampler_records

    def _generate(self, prompts: list):
        output = super()._generate(prompts)
        if self._sampler_records is not None and self._sampler_records.needed:
            # The float lists after tool-call stitching say which record each completion token has
            self._sampler_records.rollout_logprobs = output[4]
        return output

    def _generate_and_score_completions(self, inputs):
        if self.model.training:
            self._generated_at_step = self.state.global_step
        self._sampler_records = SamplerRecords(topk=self.topk)
        try:
            output = super()._generate_and_score_completions(inputs)
            if "sampling_per_token_logps" not in output:
                raise RuntimeError(
                    "DPPO needs the sampler's log-probability of every sampled token (mu), but the rollout returned "
                    "none. A `rollout_func` must return them under 'logprobs': one list per completion with "
                    "log mu(y_t) of each completion token, taken from the distribution it sampled from."
                )
            output.update(
                self._sampler_records.batch_tensors(output["completion_ids"], output["sampling_per_token_logps"])
            )
        finally:
            self._sampler_records = None
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
        scoring = self._sampler_records is not None  # a generation batch is being scored
        if scoring and not get_trust_region(self.args.trust_region).recomputes_anchor and self._is_policy(model):
            # GRPOTrainer's recomputation of old log-probabilities; DPPO's anchor is the sampler's record instead
            return None, None, None
        if self._loss_context is None:
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
        self._set_trust_region_advantages(self._loss_context, logps.detach(), hidden)
        return logps, entropies, aux_loss

    def _compute_loss(self, model, inputs):
        # GRPOTrainer reuses a buffered batch over `num_iterations` passes, so work on a shallow copy
        inputs = dict(inputs)
        mask = inputs["completion_mask"] * inputs.get("tool_mask", 1)
        missing = ~torch.isfinite(inputs["sampling_per_token_logps"])
        if self.topk:
            missing |= torch.isnan(inputs["sampler_kept_logps"]).any(-1)
        if "sampler_base_logps" in inputs:
            missing |= ~torch.isfinite(inputs["sampler_base_logps"])
        missing &= mask.bool()
        if missing.any():  # `tool_mask` only masks the loss, so this takes the tokens out without touching attention
            inputs["tool_mask"] = inputs.get("tool_mask", torch.ones_like(mask)) * (~missing).long()
        # Only a trust region that recomputes its anchor (minirl) has them; GRPOTrainer's loss must see none, so its
        # ratio is 1
        anchor_logps = inputs.pop("old_per_token_logps", None)
        context = _LossContext(inputs, anchor_logps, missing.sum(), self.args.trust_region_settings())
        with self._computing_loss(context), _without_grpo_two_sided_clip(self.args):
            return super()._compute_loss(model, inputs)

    @contextmanager
    def _computing_loss(self, context: _LossContext):
        """Hand `context` to the loss's forward pass for the duration of the block; nothing of it outlives the loss."""
        self._loss_context = context
        try:
            yield
        finally:
            self._loss_context = None

    @torch.no_grad()
    def _set_trust_region_advantages(
        self, context: _LossContext, trainer_logps: torch.Tensor, hidden: torch.Tensor | None
    ) -> None:
        """Replace the batch's advantages by the trust region's per-token weights (DPPO: M_t * min(pi/mu, C) * A_t)
        and log the metrics."""
        inputs = context.inputs
        mask = (inputs["completion_mask"] * inputs.get("tool_mask", 1)).bool()
        advantages = inputs["advantages"]
        advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
        # Tokens outside the loss get a neutral anchor so that no NaN reaches the loss
        sampler_logps = torch.where(mask, inputs["sampling_per_token_logps"], trainer_logps)
        # The divergence and the direction of pi's move compare pi with the sampler's untruncated distribution
        # (log_softmax(logits / T), recorded when the sampler truncated or penalised); the ratio keeps what was sampled
        base_logps = sampler_logps
        if "sampler_base_logps" in inputs:
            base_logps = torch.where(mask, inputs["sampler_base_logps"], trainer_logps)
        if self.topk:
            trainer_kept = lm_head_kept_logps(
                self._causal_lm().get_output_embeddings(),
                hidden,
                inputs["completion_ids"],
                trainer_logps,
                inputs["sampler_kept_ids"],
                self.temperature,
            )
            sampler_kept = inputs["sampler_kept_logps"].masked_fill(~mask[..., None], -float("inf"))
            trainer_kept = trainer_kept.masked_fill(~mask[..., None], -float("inf"))
            divergence = topk_divergence(sampler_kept, trainer_kept, self.kind)
        else:
            divergence = binary_divergence(base_logps, trainer_logps, self.kind)
        trust_region = get_trust_region(self.args.trust_region)
        batch = TrustRegionInput(
            trainer_logps=trainer_logps,
            sampler_logps=sampler_logps,
            base_logps=base_logps,
            advantages=advantages,
            divergence=divergence,
            anchor_logps=trainer_logps if context.anchor_logps is None else context.anchor_logps,
        )
        weights, keep = trust_region(batch, **context.trust_region_settings)
        inputs["advantages"] = weights * mask
        # DPPO's own mask, whatever the trust region: the diagnostics compare it with PPO's clip
        dppo_keep = trust_region_mask(
            divergence, base_logps, trainer_logps, advantages, self.args.delta_low, self.args.delta_high
        )
        self._log_trust_region(context, mask, keep, dppo_keep, advantages, base_logps, trainer_logps)
        if self.use_vllm and self.args.vllm_allow_truncated_sampling:
            self._log_truncation_gap(mask, sampler_logps, trainer_logps)

    def _log_truncation_gap(self, mask, sampler_logps, trainer_logps) -> None:
        """With `vllm_allow_truncated_sampling`, log what truncation alone adds to the divergence.

        On the first optimizer step after a generation the trainer's weights are the sampler's, so mu/pi - 1 estimates
        (1 - Z)/Z, Z being the mass the truncation kept, and mu - pi the spurious binary TV, compared with delta.
        """
        if not (self.model.training and self.state.global_step == self._generated_at_step):
            return
        mu, pi = sampler_logps.exp(), trainer_logps.exp()
        over = (mu - pi > self.args.delta_low) & mask
        sums = _sum_over_processes(
            self.accelerator, {"gap": ((mu / pi - 1) * mask).sum(), "over": over.sum(), "tokens": mask.sum()}
        )
        metrics = self._metrics["train"]
        metrics["truncation/kept_mass_gap"].append(sums["gap"] / max(sums["tokens"], 1.0))
        metrics["truncation/spurious_tv_over_delta_fraction"].append(sums["over"] / max(sums["tokens"], 1.0))

    def _log_trust_region(self, context, mask, keep, dppo_keep, advantages, sampler_logps, trainer_logps) -> None:
        """Gather the trust-region, mismatch and diagnostic metrics over processes and record them for logging."""
        mode = "train" if self.model.training else "eval"
        advantages = advantages.expand_as(mask)
        masked = ~keep & mask
        for sign, side in (("positive", advantages > 0), ("negative", advantages < 0)):
            self.masked_token_counts[sign].update(context.inputs["completion_ids"][masked & side].tolist())
        pos, neg = (advantages > 0) & mask, (advantages < 0) & mask
        mu, pi = sampler_logps.exp(), trainer_logps.exp()
        prob_diff = (pi - mu).abs()
        log_ratio = trainer_logps - sampler_logps
        # k3 estimator r - 1 - log r of KL(mu || pi) on tokens drawn from mu: unbiased and never negative
        kl = torch.expm1(log_ratio) - log_ratio
        ppo_clipped = ~ratio_clip_keep(log_ratio.exp(), advantages, self.epsilon_low, self.epsilon_high)
        # The paper's "bad updates" (RQ3): negative advantage and a drop of the sampled token's probability >= 0.5
        bad = (advantages < 0) & (mu - pi >= 0.5) & mask
        counts = {
            "masked": masked.sum(),
            "tokens": mask.sum(),
            "masked_pos_adv": (masked & pos).sum(),
            "pos_adv": pos.sum(),
            "masked_neg_adv": (masked & neg).sum(),
            "neg_adv": neg.sum(),
            "abs_prob_diff": (prob_diff * mask).sum(),
            "kl": (kl * mask).sum(),
            "missing_sampler_logps": context.missing_sampler_logps,
            "bad": bad.sum(),
            "bad_ppo_clipped": (bad & ppo_clipped).sum(),
            "bad_dppo_masked": (bad & ~dppo_keep).sum(),
        }
        if self.args.log_tokens_by_mu:
            # Where the mask and PPO's ratio clip (at this config's epsilon) act, by the sampler's probability
            bucket = torch.bucketize(mu, torch.tensor(MU_BUCKET_EDGES, device=mask.device), right=True)
            for b, label in enumerate(MU_BUCKETS):
                in_bucket = (bucket == b) & mask
                counts[f"tokens_by_mu/{label}/total"] = in_bucket.sum()
                counts[f"tokens_by_mu/{label}/masked"] = (in_bucket & masked).sum()
                counts[f"tokens_by_mu/{label}/ppo_clipped"] = (in_bucket & ppo_clipped).sum()
        sums = _sum_over_processes(self.accelerator, counts)
        local_max = prob_diff[mask].max() if mask.any() else prob_diff.new_zeros(())
        global_max = self.accelerator.gather(local_max.reshape(1)).max().item()

        def fraction(num: str, den: str) -> float:
            return sums[num] / max(sums[den], 1.0)

        metrics = self._metrics[mode]
        metrics["trust_region/masked_fraction"].append(fraction("masked", "tokens"))
        metrics["trust_region/masked_fraction_pos_adv"].append(fraction("masked_pos_adv", "pos_adv"))
        metrics["trust_region/masked_fraction_neg_adv"].append(fraction("masked_neg_adv", "neg_adv"))
        metrics["mismatch/abs_prob_diff_mean"].append(fraction("abs_prob_diff", "tokens"))
        metrics["mismatch/abs_prob_diff_max"].append(global_max)
        metrics["mismatch/kl_mean"].append(fraction("kl", "tokens"))
        metrics["mismatch/missing_sampler_logps"].append(sums["missing_sampler_logps"])
        if mode == "train" and self.state.global_step == self._generated_at_step:
            # No update since the batch was sampled: the gap is the sampler-trainer mismatch alone (precision, kernels)
            metrics["mismatch/at_sync_abs_prob_diff_mean"].append(fraction("abs_prob_diff", "tokens"))
            metrics["mismatch/at_sync_abs_prob_diff_max"].append(global_max)
            metrics["mismatch/at_sync_kl_mean"].append(fraction("kl", "tokens"))
        metrics["diagnostics/bad_update_fraction"].append(fraction("bad", "tokens"))
        metrics["diagnostics/bad_updates_blocked_by_ppo_clip"].append(fraction("bad_ppo_clipped", "bad"))
        metrics["diagnostics/bad_updates_blocked_by_dppo_mask"].append(fraction("bad_dppo_masked", "bad"))
        for name, value in sums.items():
            if name.startswith("tokens_by_mu/"):
                metrics[name].append(value)

    def masked_tokens_report(self, top: int = 20) -> dict[str, list[dict]]:
        """The tokens the trust region masked most often over all processes, decoded, per advantage sign.

        Every process must call it: the counts are gathered.
        """
        return {
            sign: [
                {"token": self.processing_class.decode([token_id]), "id": token_id, "count": count}
                for token_id, count in counter.most_common(top)
            ]
            for sign, counter in self._masked_token_counts_over_processes().items()
        }

    def _masked_token_counts_over_processes(self) -> dict[str, Counter]:
        total = {sign: Counter() for sign in self.masked_token_counts}
        for counts in gather_object([self.masked_token_counts]):
            for sign, counter in counts.items():
                total[sign].update(counter)
        return total

    # ------------------------------------------------------------------------------------------- checkpoints

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        # The masked-token counts are training state: a resumed run continues them (summed over processes)
        counts = self._masked_token_counts_over_processes()
        if self.args.should_save:
            folder = os.path.join(self._get_output_dir(trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
            with open(os.path.join(folder, MASKED_TOKEN_COUNTS_NAME), "w") as f:
                json.dump({sign: dict(counter) for sign, counter in counts.items()}, f)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)  # called only when resuming, with the checkpoint's path
        path = os.path.join(checkpoint, MASKED_TOKEN_COUNTS_NAME) if checkpoint else None
        if path and os.path.isfile(path):
            self.masked_token_counts = {"positive": Counter(), "negative": Counter()}
            if self.accelerator.is_main_process:  # the process that holds the sum; the others count from zero
                with open(path) as f:
                    for sign, counts in json.load(f).items():
                        self.masked_token_counts[sign].update({int(i): c for i, c in counts.items()})
