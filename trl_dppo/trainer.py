"""`DPPOTrainer`: GRPOTrainer with DPPO's divergence trust region anchored to the sampler's recorded probabilities.

Everything GRPO does (data, rewards, advantages, generation backends, PEFT, the reference-model KL, loss
normalisation, logging, checkpoints) is GRPOTrainer's own, reached through `super()`. DPPO changes three things, each
in one small override:

- `_generate_single_turn`: on transformers generation, records mu while `generate()` samples (`rollout.py`); on vLLM
  the backend is wrapped at init instead (`record_vllm_logprobs`; on a colocated engine, the engine's own `generate`:
  `record_vllm_flat_logprobs` with top-K, `record_vllm_distributions` with `true_divergence_fraction`). GRPOTrainer
  threads the records into `sampling_per_token_logps`.
- `_get_per_token_logps_and_entropies`: during scoring, skips GRPOTrainer's recomputation of old log-probabilities
  (the trust region's anchor is mu); during the loss, turns the forward pass's log pi into per-token advantages
  w_t = M_t * (pi/mu) * A_t (or another method's weight, `trust_region`, see `trust_regions.py`). GRPOTrainer's
  loss accepts `(B, T)` advantages and, with no old log-probabilities, has the gradient -w_t * grad log pi: DPPO's
  gradient, normalised the GRPO way.
- `_compute_loss`: hands the previous override what it needs for one loss computation, in one `_LossContext` set
  for the duration of `super()._compute_loss` and cleared after, and takes tokens without a sampler log-probability
  out of the loss.

A non-finite loss, gradient norm or parameter stops training at its optimizer step (`stop_on_non_finite`): the
`training_step` and `_maybe_log_save_evaluate` of `non_finite.StopOnNonFinite`, a base class shared with
AsyncDPPOTrainer.

What the trainer logs about its trust region (metrics, masked-token counts) is `diagnostics.py`'s, called once per
loss; checkpoints carry the masked-token counts through `_save_checkpoint` / `_load_optimizer_and_scheduler`, and
`log` reduces its metrics over the logging window (rates as sums over sums, maxima, totals) before GRPOTrainer's.

Two objects carry state between calls, each set and cleared in one place: the generation batch's `SamplerRecords`
(`_sampler_records`, while `_generate_and_score_completions` runs: its presence also says "scoring") and the
`_LossContext` (`_loss_context`, while `_compute_loss` runs).

`_generate` and `_generate_and_score_completions` additionally carry the sampler's records beyond the float TRL keeps
into the batch (`records.py`): the top-K when the divergence is top-K, and log mu_base, the sampler's distribution
before truncation or penalties, when the sampler's chain had any; a loss token whose record was lost stops the batch.
The divergence and the direction test compare pi with mu_base (like with like: pi is softmax(logits / T)); the ratio
pi/mu keeps the mu the token was drawn from.
`docs/overrides.md` lists every override and `tests/test_upstream_contract.py` pins the GRPOTrainer behaviour each
relies on.
"""

from __future__ import annotations

import functools
import os
import textwrap
import warnings
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import trl
from accelerate.utils import is_peft_model
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOConfig, GRPOTrainer

from .checkpoints import accept_indexed_cpu_device, complete_deepspeed_checkpoint_on_this_machine
from .config import DPPOConfig
from .datasets_check import check_prompt_lengths, check_prompts, first_prompt_rows
from .diagnostics import TrustRegionDiagnostics, reduce_dppo_metrics
from .divergence import binary_divergence, topk_divergence
from .extras import INSTALL_VLLM, require_extra
from .images import feeding_vllm_unexpanded_images, refuse_images_in_server_mode, refuse_tool_images
from .moe import (
    RouteReplay,
    RoutingRecorder,
    check_router_replay_support,
    generating_without_router_logits,
    refuse_untrained_aux_loss,
)
from .non_finite import StopOnNonFinite
from .records import MissingRecordsError, SamplerRecords
from .rollout import (
    SamplerLogprobRecorder,
    check_recordable_sampling,
    checking_rollout_logprobs,
    engines_allowing_whole_distributions,
    record_vllm_distributions,
    record_vllm_flat_logprobs,
    record_vllm_logprobs,
    recording_generate,
)
from .server_watch import ServerWatch
from .topk import check_topk_sharding, check_topk_support, gathered_lm_head, lm_head_kept_logps
from .true_divergence import divergences_from_hidden, true_divergence_sums
from .trust_region_step import TrustRegionSetup, trust_region_step
from .trust_regions import TrustRegion, TrustRegionInput
from .vllm_server import refuse_unprocessed_logprobs, refuse_weight_transfer_without_cuda
from .weight_sync import (
    WeightSyncCheck,
    counting_unchecked_syncs,
    gathering_module_by_module,
    resetting_encoder_cache,
    sync_weights_in_place,
    warn_unchecked_syncs,
)


if TYPE_CHECKING:
    from datasets import Dataset, DatasetDict, IterableDataset, IterableDatasetDict
    from peft import PeftConfig, PeftModel
    from transformers import BitsAndBytesConfig, PreTrainedModel, PreTrainedTokenizerBase, ProcessorMixin
    from trl.trainer.grpo_trainer import EnvironmentFactory, RewardFunc, RolloutFunc

__all__ = ["DPPOTrainer", "check_training_dropout"]

# The server `trl vllm-serve` starts, for the error that refuses a server with other log-probabilities
SERVER_RESTART_EXAMPLE = (
    "    VLLM_SERVER_DEV_MODE=1 vllm serve {model} --logprobs-mode processed_logprobs --max-logprobs -1 "
    """--weight-transfer-config '{{"backend": "nccl"}}'\n\n"""
    "(`trl vllm-serve --model {model}` starts the same server with these flags)."
)


def refuse_unrecorded_distributions(args: DPPOConfig, rollout_func, tools, environment_factory) -> None:
    """Refuse `true_divergence_fraction` > 0 with a generation path that hands the trainer no whole distributions
    (`DPPOConfig` refuses the vLLM settings that record none)."""
    if rollout_func is not None:
        path = "a rollout_func returns the sampled tokens' log-probabilities only"
    elif tools or environment_factory:
        path = (
            "with tools or environments each turn is a generation call of its own and TRL stitches the turns, so no "
            "record covers a completion"
        )
    else:
        return
    raise ValueError(
        f"true_divergence_fraction={args.true_divergence_fraction} needs the sampler's whole next-token "
        f"distribution at the recorded tokens, and {path}. Set true_divergence_fraction=0, or measure it on a run "
        "with transformers or colocated vLLM generation."
    )


def check_training_dropout(model: torch.nn.Module, disable_dropout: bool) -> None:
    """Refuse dropout that `disable_dropout` cannot turn off, and warn about dropout kept on with it: the sampler
    generates without dropout, so with dropout in the training forward pi and mu are different functions of the same
    weights (`benchmarks/results/dropout_gap/`)."""
    # Llama-style attention applies it as an argument of the attention kernel, not through a torch.nn.Dropout
    attention_dropout = getattr(model.config, "attention_dropout", 0.0) or 0.0
    if disable_dropout and attention_dropout > 0:
        raise ValueError(
            f"The model's attention_dropout={attention_dropout} applies in the training forward but not in the "
            "sampler's, and disable_dropout (which zeroes torch.nn.Dropout modules) does not reach it: pi and mu "
            "would be different functions (attention_dropout=0.1 put max |pi - mu| at 0.18 before any update on a "
            "tiny Llama, above delta=0.15). Load the model with attention_dropout=0.0 (for a model given by name: "
            "model_init_kwargs={'attention_dropout': 0.0}), or set disable_dropout=False to train with it anyway."
        )
    active = any(isinstance(module, torch.nn.Dropout) and module.p > 0 for module in model.modules())
    if not disable_dropout and (active or attention_dropout > 0):
        warnings.warn(
            "disable_dropout=False with dropout in the model (LoRA's lora_dropout counts): the training forward is "
            "noisy while the sampler's was not, and the noise enters the trust region's divergence and pi/mu "
            "directly (lora_dropout=0.1 put max |pi - mu| at 1.6e-2 before any update within 4 steps on SmolLM2-135M). "
            "Leave disable_dropout at its default (True) unless you mean it.",
            UserWarning,
            stacklevel=3,
        )


@dataclass(frozen=True)
class _LossContext:
    """What `_compute_loss` hands to the loss's forward pass (`_get_per_token_logps_and_entropies`) for one loss."""

    inputs: dict[str, Any]  # the micro-batch (a shallow copy): its advantages become the trust region's weights
    anchor_logps: torch.Tensor | None  # pi_old recomputed by GRPOTrainer, for trust regions that recompute an anchor
    missing_sampler_logps: torch.Tensor  # loss tokens without a sampler log-probability, taken out of the loss


class DPPOTrainer(StopOnNonFinite, GRPOTrainer):
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
        """Refuse what DPPO cannot train, `super().__init__`, then set up the recording of mu and the trust region.

        Refusals before `super()` are those TRL would reach late, or never (each names what to set instead); those after
        it read what GRPOTrainer built (the model's dropout and routers, the LM head's sharding, the generation config).
        """
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
        # The environment's `reset()` supplies the prompts where there is one; otherwise each row must have one
        prompt_rows = None
        if environment_factory is None and train_dataset is not None:
            columns, prompt_rows = first_prompt_rows(train_dataset)
            check_prompts(columns, prompt_rows, "DPPOTrainer")
        if args.max_completion_length is None and (tools or environment_factory):
            raise ValueError(
                "max_completion_length=None with tools or an environment: TRL measures each turn against the "
                "completion budget max_completion_length, which must then be a number. Set max_completion_length."
            )
        if args.true_divergence_fraction > 0:
            refuse_unrecorded_distributions(args, rollout_func, tools, environment_factory)
        if args.use_vllm and args.vllm_mode == "server":
            refuse_images_in_server_mode(train_dataset)
        if args.use_vllm:  # after the refusals that do not depend on it, before TRL's, which names TRL's extra
            require_extra("vllm", f"use_vllm=True (vllm_mode={args.vllm_mode!r})", INSTALL_VLLM)
        if args.use_vllm and args.vllm_mode == "server":
            refuse_weight_transfer_without_cuda(args.device)
        engine = nullcontext()
        if args.true_divergence_fraction > 0 and args.use_vllm and args.vllm_mode == "colocate":
            engine = engines_allowing_whole_distributions()  # `record_vllm_distributions` asks for logprobs=-1
        with engine:
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
        accept_indexed_cpu_device(self.args.device)  # a resume on several CPU processes loads onto `cpu:0`
        check_training_dropout(self.model, args.disable_dropout)  # after GRPOTrainer's `disable_dropout`
        refuse_untrained_aux_loss(self.aux_loss_enabled, self.args)  # after GRPOTrainer's checkpointing settings
        if prompt_rows and not self.use_vllm and self.rollout_func is None and not self._is_vlm:
            self._check_prompt_lengths(prompt_rows)
        self._trust_region = TrustRegionSetup.from_args(args)  # the method, its settings and corrections
        if args.recorded_topk:
            check_topk_support(self._causal_lm())
            check_topk_sharding(self.accelerator)
            if self.rollout_func is not None:
                raise ValueError(
                    f"divergence={args.divergence!r} needs the sampler's top-K at every token, and a `rollout_func` "
                    "returns only the sampled token's log-probability, so the top-K divergence would read 0 and mask "
                    "nothing. Use a binary divergence (divergence='binary_tv' or 'binary_kl') with a rollout_func."
                )
        # With `true_divergence_fraction`: draws the completions whose whole distributions the sampler keeps
        self._true_divergence_draws = None
        if args.true_divergence_fraction > 0:
            remedy = "Set true_divergence_fraction=0."
            check_topk_support(self._causal_lm(), "true_divergence_fraction", remedy)
            check_topk_sharding(self.accelerator, "true_divergence_fraction", remedy)
            self._true_divergence_draws = torch.Generator().manual_seed(args.seed + self.accelerator.process_index)
        # Hooks on the MoE routers that replay the sampler's routes in the loss's forward (`use_rollout_routing_replay`)
        self._route_replay = RouteReplay(self._check_router_replay()) if args.use_rollout_routing_replay else None
        self._loss_context: _LossContext | None = None  # set while a loss is computed (`_computing_loss`)
        # The optimizer step at which the training batch in use was generated: the loss runs on the weights that
        # sampled it (`mismatch/at_sync_*`) while `state.global_step` still equals it
        self._generated_at_step: int | None = None
        # The sampler's records of the generation batch in progress: set when one starts, cleared once in the batch
        self._sampler_records: SamplerRecords | None = None
        self.diagnostics = TrustRegionDiagnostics(self)
        self.add_callback(self.diagnostics.callback())
        if self.rollout_func is not None:
            self.rollout_func = checking_rollout_logprobs(self.rollout_func)
        if self.use_vllm:
            self._wrap_vllm_backend()
        elif self.rollout_func is None:
            check_recordable_sampling(self.generation_config)

    def _check_prompt_lengths(self, rows: list[dict[str, Any]]) -> None:
        """On transformers generation (vLLM refuses a prompt longer than its model itself), the first rows' prompts
        tokenized as GRPOTrainer tokenizes them, against the model's positions (`datasets_check.py`)."""
        prompt_ids, _, _ = self._tokenize_prompts([row["prompt"] for row in rows])
        positions = getattr(self._causal_lm().config.get_text_config(), "max_position_embeddings", None)
        check_prompt_lengths(prompt_ids, self._tokenizer.pad_token_id, positions, self.args.max_completion_length)

    def _check_router_replay(self) -> list[torch.nn.Module]:
        """The routers to replay, or an error for a model or a rollout path that cannot replay them."""
        routers = check_router_replay_support(self._causal_lm())
        path = None
        if self.rollout_func is not None:
            path = "a rollout_func, which returns no routes"
        elif self.tools or self.environment_factories:
            path = (
                "tool calls or environments: each turn is a generation call of its own, whose prefill routes the "
                "earlier turns and tool results again, so no single record covers a completion"
            )
        if path is not None:
            raise ValueError(
                f"use_rollout_routing_replay=True is not supported with {path}. Set use_rollout_routing_replay=False."
            )
        if self._trust_region.method.recomputes_anchor:
            raise ValueError(
                f"use_rollout_routing_replay=True with trust_region={self.args.trust_region!r}: its anchor pi_old is "
                "recomputed by a forward that does not replay the sampler's routes. Use trust_region='dppo'."
            )
        return routers

    # ----------------------------------------------------------------------------------------------- generation

    def _wrap_vllm_backend(self) -> None:
        """Record mu (the top-K, and with `true_divergence_fraction` on a colocated engine the whole distributions of
        the completions chosen) from vLLM's output, and sync weights in place on vLLM's CPU backend, checked; any
        other sync is said unchecked at start and logged as `weight_sync/unchecked`. In server mode, refuses a server
        without processed log-probabilities (TRL checks it only with the importance-sampling correction DPPO turns off)
        and bounds each request by a `ServerWatch` (TRL's have no timeout)."""
        backend = self.vllm_generation
        gathering_module_by_module(backend)  # under ZeRO-3 with PEFT, one module gathered at a time, not the model
        if backend.mode == "server":  # TRL checks the mode only with `vllm_importance_sampling_correction`
            # TRL creates the server's client on the main process only
            client = backend.vllm_client if self.accelerator.is_main_process else None
            refuse_unprocessed_logprobs(self.accelerator, client, client and client.base_url, SERVER_RESTART_EXAMPLE)
            if client is not None:  # TRL's requests to the server have no timeout: each waits while the server answers
                watch = ServerWatch(client.base_url, self.args.vllm_server_stall_timeout, "vllm_server_stall_timeout")
                client.session.request = functools.partial(watch.call, client.session.request)
        if self._true_divergence_draws is not None and backend.mode == "colocate":
            # Innermost: the wrappers below read the output as it would be without the whole distributions
            backend.generation_kwargs = {**backend.generation_kwargs, "flat_logprobs": True}
            vocab_size = backend.llm.llm_engine.model_config.get_vocab_size()
            backend.llm.generate = record_vllm_distributions(
                backend.llm.generate, self._true_divergence_choice(), self._current_sampler_records, vocab_size
            )
        topk = self.args.recorded_topk
        topk_in_lists = topk
        if topk:
            backend.logprobs = topk
            if backend.mode == "colocate":  # the top-K is taken from vLLM's flat output, before TRL's lists
                backend.generation_kwargs = {**backend.generation_kwargs, "flat_logprobs": True}
                backend.llm.generate = record_vllm_flat_logprobs(
                    backend.llm.generate, topk, self._current_sampler_records
                )
                topk_in_lists = 0
        backend.generate = record_vllm_logprobs(backend.generate, topk_in_lists, self._current_sampler_records)
        if backend.mode == "colocate":
            from vllm.platforms import current_platform

            multimodal = backend.llm.llm_engine.model_config.is_multimodal_model
            if multimodal:
                backend.llm.generate = feeding_vllm_unexpanded_images(backend.llm.generate, self.processing_class)
            if current_platform.is_cpu():
                check = None
                if self.args.weight_sync_check != "off":
                    check = WeightSyncCheck(
                        backend,
                        self.args.weight_sync_check,
                        self.args.weight_sync_check_layers,
                        self.args.seed,
                        self._log_weight_sync,
                    )
                # the check reads the trainer's weights as they stream to the engine: one gather per sync
                backend.sync_weights = functools.partial(sync_weights_in_place, backend, check)
                if check is not None:
                    return  # checked: the one path with a check so far
            elif multimodal:
                backend.sync_weights = resetting_encoder_cache(backend.sync_weights, backend.llm)
            unchecked_path = f"TRL's per-parameter load into the colocated engine ({current_platform.device_type})"
        else:
            unchecked_path = "TRL's full-weight sync to the vLLM server (NCCL)"
        if self.args.weight_sync_check != "off" and self.accelerator.is_main_process:
            warn_unchecked_syncs(unchecked_path)
        backend.sync_weights = counting_unchecked_syncs(backend.sync_weights, self._log_weight_sync)

    def _log_weight_sync(self, name: str, value: float) -> None:
        self._metrics["train" if self.model.training else "eval"][name].append(value)

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """Return the sampler's log-probabilities with the completions, which GRPOTrainer threads (through tool calls)
        into `sampling_per_token_logps`; refuses a tool that returned an image (`images.refuse_tool_images`).

        On vLLM the wrapped backend already returns them. On transformers generation, `super()` runs with
        `rollout.recording_generate` around transformers' own processor chain: mu is recorded from the scores
        `_sample` draws from, and mu_base from the raw logits when the chain truncates or penalises (no extra forward,
        `(batch, vocab)` tensors of memory); an MoE generates without router logits
        (`moe.generating_without_router_logits`) and, with router replay, each router's choice per token is recorded
        (`moe.RoutingRecorder`) into the generation batch's store.
        """
        if has_tool_images:
            refuse_tool_images()
        if self.use_vllm:  # the wrapped backend already returns the sampler's records
            return super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        recorder = SamplerLogprobRecorder(self.args.recorded_topk, self.temperature, self._true_divergence_choice())
        routing = RoutingRecorder(self._route_replay.routers) if self._route_replay else None
        model = self.accelerator.unwrap_model(self.model_wrapped)
        with (
            recording_generate(model, recorder),
            generating_without_router_logits(model),
            routing.recording() if routing else nullcontext(),
        ):
            completion_ids, _ = super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        records = self._current_sampler_records()
        if routing is not None:
            records.add_routes(*routing.sequence_routes(prompt_ids, completion_ids))
        return completion_ids, recorder.finish(completion_ids, records)

    def _true_divergence_choice(self) -> Callable[[int], torch.Tensor] | None:
        """With `true_divergence_fraction`, the draw of which of a generation call's `n` completions keep their whole
        distributions: `(n,)` bool, from the run's seed (one generator per process)."""
        if self._true_divergence_draws is None:
            return None
        fraction = self.args.true_divergence_fraction
        return lambda n: torch.rand(n, generator=self._true_divergence_draws) < fraction

    def _current_sampler_records(self) -> SamplerRecords:
        if self._sampler_records is None:
            raise RuntimeError(
                "The sampler's records are kept per generation batch: generate through "
                "`_generate_and_score_completions`."
            )
        return self._sampler_records

    def _generate(self, prompts: list):
        """`super()`, keeping its float lists in the generation batch's `SamplerRecords` when the batch needs more than
        the float: each float carries its token's row in the store (low mantissa bits that TRL's float32 tensor drops),
        so after TRL's tool-call stitching and truncation the lists still say which record each token has."""
        output = super()._generate(prompts)
        if self._sampler_records is not None and self._sampler_records.needed:
            # The float lists after tool-call stitching say which record each completion token has
            self._sampler_records.rollout_logprobs = output[4]
        return output

    def _generate_and_score_completions(self, inputs):
        """`super()` with the generation batch's record store set (`_sampler_records`), then its records added to the
        batch as tensors (kept sets, mu_base, routes), so that shuffling and `steps_per_generation` splits carry them; a
        loss token without its record stops training (`MissingRecordsError`), and tokens without mu leave
        `num_items_in_batch`."""
        if self.model.training:
            self._generated_at_step = self.state.global_step
            self._release_recorded_distributions()
        self._sampler_records = SamplerRecords(topk=self.args.recorded_topk)
        try:
            output = super()._generate_and_score_completions(inputs)
            if "sampling_per_token_logps" not in output:
                raise RuntimeError(
                    "DPPO needs the sampler's log-probability of every sampled token (mu), but the rollout returned "
                    "none. A `rollout_func` must return them under 'logprobs': one list per completion with "
                    "log mu(y_t) of each completion token, taken from the distribution it sampled from."
                )
            loss_mask = output["completion_mask"] * output.get("tool_mask", 1)
            try:
                records = self._sampler_records.batch_tensors(
                    output["completion_ids"], output["sampling_per_token_logps"], loss_mask
                )
            except MissingRecordsError as error:
                raise MissingRecordsError(f"{error} Generation path: {self._generation_path()}.") from None
            output.update(records)
            if self._true_divergence_draws is not None:
                # A list per completion, which GRPOTrainer's shuffles and splits carry: freed with the batch
                output["sampler_distributions"] = self._sampler_records.batch_distributions(output["completion_ids"])
            if self._route_replay:
                routes = self._sampler_records.batch_routes(
                    output["prompt_ids"], output["prompt_mask"], output["completion_ids"]
                )
                output["sampler_routes"] = routes.to(output["completion_ids"].device)
            # GRPOTrainer's `dapo` normaliser counts the generation batch's loss tokens over all processes; those
            # without a sampler log-probability leave the loss (`_compute_loss`), so they leave the count too
            missing = self.accelerator.gather(self._missing_sampler_logps(output).sum()).sum()
            output["num_items_in_batch"] = output["num_items_in_batch"] - missing
        finally:
            self._sampler_records = None
        return output

    def _release_recorded_distributions(self) -> None:
        """Drop the whole-vocabulary records (`true_divergence_fraction`) from the training batches GRPOTrainer buffers:
        a new training generation starts after the previous one's last optimizer step, so none is read again, and
        GRPOTrainer would hold them until the new batch replaces its buffer."""
        for batch in getattr(self, "_buffered_inputs", None) or []:
            batch.pop("sampler_distributions", None)

    def _generation_path(self) -> str:
        """The rollout code that produced the batch, for errors."""
        if self.rollout_func is not None:
            backend = "a rollout_func"
        elif self.use_vllm:
            backend = f"vLLM {self.vllm_generation.mode}"
        else:
            backend = "transformers generate()"
        tools = " with tool calls" if self.tools or self.environment_factories else ""
        return f"{backend}{tools}, through TRL {trl.__version__}'s GRPOTrainer._generate"

    # --------------------------------------------------------------------------------------------------- loss

    @property
    def trust_region(self) -> TrustRegion:
        """The registered method the config chose (`trust_regions.py`)."""
        return self._trust_region.method

    @property
    def trust_region_settings(self) -> dict[str, Any]:
        """The method's resolved settings."""
        return self._trust_region.settings

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
        """While scoring, skip GRPOTrainer's recomputation of old log-probabilities (DPPO's anchor is the sampler's
        record; a method with `recomputes_anchor` keeps it); in the loss, turn the forward's log pi into the trust region's
        per-token advantages (`_set_trust_region_advantages`). With no old log-probabilities GRPOTrainer's per-token term
        is -A_t with gradient -A_t * grad log pi: DPPO's gradient, normalised as `loss_type` says, with GRPO's entropy, KL
        and auxiliary terms unchanged (on reused batches with `use_bias_correction_kl=True` the KL ratio reads 1)."""
        scoring = self._sampler_records is not None  # a generation batch is being scored
        if scoring and not self._trust_region.method.recomputes_anchor and self._is_policy(model):
            # GRPOTrainer's recomputation of old log-probabilities; DPPO's anchor is the sampler's record instead
            return None, None, None
        if self._loss_context is None:
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
            )
        hidden = []
        handle = None
        if self.args.recorded_topk or self._true_divergence_draws is not None:
            # The hidden states feeding the fused LM head, for pi at the kept ids (see topk.py) or over the vocabulary
            backbone = self._causal_lm().base_model
            handle = backbone.register_forward_hook(lambda m, a, out: hidden.append(out.last_hidden_state.detach()))
        if self._route_replay and self._is_policy(model):
            self._route_replay.arm(self._loss_context.inputs["sampler_routes"])
        try:
            logps, entropies, aux_loss = super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
            )
        finally:
            if handle is not None:
                handle.remove()
            if not torch.is_grad_enabled():  # no backward pass will run the forward again (`training_step`)
                self._finish_route_replay()
        hidden = torch.cat(hidden, dim=0)[:, -logits_to_keep - 1 : -1] if hidden else None
        self._set_trust_region_advantages(self._loss_context, logps.detach(), hidden)
        return logps, entropies, aux_loss

    def training_step(self, model, inputs, num_items_in_batch):
        """`super()` (through `StopOnNonFinite`), then disarms the router replay the loss's forward armed and logs
        `routing/differing_expert_sets`: gradient checkpointing (on by default in GRPOConfig) runs each layer's forward
        again in the backward pass, which `Trainer.training_step` runs after `compute_loss`, and that recomputation must
        route as the forward did."""
        try:
            return super().training_step(model, inputs, num_items_in_batch)
        finally:
            # After the backward pass, whose gradient checkpointing recomputes the forward with the same routes
            self._finish_route_replay()

    def _finish_route_replay(self) -> None:
        replayed = self._route_replay.disarm() if self._route_replay else None
        if replayed is not None:
            self.diagnostics.record_replayed_routes("train" if self.model.training else "eval", replayed)

    def _compute_loss(self, model, inputs):
        """`super()` on a shallow copy of the batch (GRPOTrainer reuses the buffered batch over `num_iterations`
        passes), inside `_computing_loss`, which hands the loss's forward its `_LossContext`: GRPOTrainer calls the
        forward with fixed arguments, so the batch reaches it through the trainer, set and cleared in one place. Tokens
        without a sampler log-probability leave the loss through `tool_mask`, so no NaN reaches it; minirl's recomputed
        anchor is taken out of the batch, so GRPOTrainer's ratio reads 1."""
        # GRPOTrainer reuses a buffered batch over `num_iterations` passes, so work on a shallow copy
        inputs = dict(inputs)
        mask = inputs["completion_mask"] * inputs.get("tool_mask", 1)
        missing = self._missing_sampler_logps(inputs)
        if missing.any():  # `tool_mask` only masks the loss, so this takes the tokens out without touching attention
            inputs["tool_mask"] = inputs.get("tool_mask", torch.ones_like(mask)) * (~missing).long()
        # Only a trust region that recomputes its anchor (minirl) has them; GRPOTrainer's loss must see none, so its
        # ratio is 1
        anchor_logps = inputs.pop("old_per_token_logps", None)
        with self._computing_loss(_LossContext(inputs, anchor_logps, missing.sum())):
            return super()._compute_loss(model, inputs)

    def _missing_sampler_logps(self, inputs: dict[str, Any]) -> torch.Tensor:
        """The loss tokens of `inputs` without a sampler log-probability (or without its records): they leave the
        loss."""
        missing = ~torch.isfinite(inputs["sampling_per_token_logps"])
        if self.args.recorded_topk:
            missing |= torch.isnan(inputs["sampler_kept_logps"]).any(-1)
        if "sampler_base_logps" in inputs:
            missing |= ~torch.isfinite(inputs["sampler_base_logps"])
        return missing & (inputs["completion_mask"] * inputs.get("tool_mask", 1)).bool()

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
        """Replace the batch's advantages by the trust region's per-token weights (DPPO: M_t * pi/mu * A_t) with the
        corrections stacked on them, and hand what both did to the diagnostics. The weights come from
        `trust_region_step`, the one function AsyncDPPOTrainer's `_trust_region_loss` calls too; with top-K, pi at the
        kept ids is read from the backbone's hidden states (`topk.lm_head_kept_logps`)."""
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
        kind = self._trust_region.kind
        if self.args.recorded_topk:
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
            divergence = topk_divergence(sampler_kept, trainer_kept, kind)
        else:
            divergence = binary_divergence(base_logps, trainer_logps, kind)
        batch = TrustRegionInput(
            trainer_logps=trainer_logps,
            sampler_logps=sampler_logps,
            base_logps=base_logps,
            advantages=advantages,
            divergence=divergence,
            anchor_logps=trainer_logps if context.anchor_logps is None else context.anchor_logps,
            loss_mask=mask,  # each row is one completion
        )
        step = trust_region_step(self._trust_region, batch)
        inputs["advantages"] = step.weights * mask
        # The loss runs on the weights that sampled the batch while `global_step` still equals the generation's
        at_sync = self.model.training and self.state.global_step == self._generated_at_step
        mode = "train" if self.model.training else "eval"
        self.diagnostics.record(
            mode,
            at_sync,
            inputs["completion_ids"],
            mask,
            step.keep,
            step.dppo_keep,
            advantages,
            sampler_logps,
            base_logps,
            trainer_logps,
            context.missing_sampler_logps,
        )
        self.diagnostics.record_corrections(mode, mask, step.corrections)
        if self._true_divergence_draws is not None:
            self._record_true_divergence(mode, inputs, batch, step.dppo_keep, hidden)
        if at_sync and self.use_vllm and self.args.vllm_allow_truncated_sampling:
            self.diagnostics.record_truncation_gap(mask, sampler_logps, trainer_logps)

    @torch.no_grad()
    def _record_true_divergence(
        self, mode: str, inputs: dict[str, Any], batch: TrustRegionInput, dppo_keep: torch.Tensor, hidden: torch.Tensor
    ) -> None:
        """With `true_divergence_fraction`: on the loss tokens whose completion the sampler kept whole distributions of,
        the trainer's pi over the vocabulary from the LM head on the hooked hidden states, compared with them
        (`true_divergence.py`), and logged. Every process calls it (the LM head's gather and the sums are
        collective), recorded tokens or not."""
        rows, positions, sampler = [], [], []
        for b, logps in enumerate(inputs["sampler_distributions"]):
            if logps is None:
                continue
            recorded = batch.loss_mask[b, : logps.size(0)].nonzero().squeeze(-1)
            rows.append(torch.full_like(recorded, b))
            positions.append(recorded)
            sampler.append(logps[recorded.cpu()])
        head = self._causal_lm().get_output_embeddings()
        if rows:
            rows, positions, sampler = torch.cat(rows), torch.cat(positions), torch.cat(sampler)
        else:
            rows = positions = torch.zeros(0, dtype=torch.long, device=hidden.device)
            sampler = torch.zeros(0, head.out_features)
        with gathered_lm_head(head) as (weight, bias):
            divergences = divergences_from_hidden(
                hidden[rows, positions],
                weight,
                bias,
                sampler,
                inputs["completion_ids"][rows, positions],
                self.args.divergence_topk,
                self.temperature,
            )
        setup = self._trust_region
        sums = true_divergence_sums(
            divergences,
            batch.divergence[rows, positions],
            dppo_keep[rows, positions],
            batch.base_logps[rows, positions],
            batch.trainer_logps[rows, positions],
            batch.advantages.expand_as(batch.loss_mask)[rows, positions],
            setup.kind,
            setup.delta_low,
            setup.delta_high,
        )
        self.diagnostics.record_true_divergence(mode, sums)

    # ------------------------------------------------------------------------------------------- checkpoints

    def _save_checkpoint(self, model, trial):
        """`super()`, then the masked-token counts behind `masked_tokens.json` (summed over processes) into the
        checkpoint's `dppo_masked_token_counts.json`: they are training state, which a resumed run continues, as
        GRPOTrainer keeps its entropy controller's. Under DeepSpeed with `save_on_each_node`, also writes DeepSpeed's
        `latest` where DeepSpeed did not (`checkpoints.complete_deepspeed_checkpoint_on_this_machine`): DeepSpeed
        writes it on the global rank 0 only, and without it another machine's resume fails ("[deepspeed] failed to
        resume from checkpoint")."""
        super()._save_checkpoint(model, trial)
        # The masked-token counts are training state: a resumed run continues them (summed over processes)
        folder = os.path.join(self._get_output_dir(trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        self.diagnostics.save_counts(folder, self.args.should_save)
        if self.is_deepspeed_enabled and self.args.save_on_each_node and self.args.should_save:
            complete_deepspeed_checkpoint_on_this_machine(folder)  # each machine resumes from its own copy

    def _load_optimizer_and_scheduler(self, checkpoint):
        """`super()`, then the masked-token counts `_save_checkpoint` wrote: called only when resuming."""
        super()._load_optimizer_and_scheduler(checkpoint)  # called only when resuming, with the checkpoint's path
        self.diagnostics.load_counts(checkpoint)

    # ------------------------------------------------------------------------------------------------ logging

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Reduce each of DPPO's metrics over the logging window to one value (`diagnostics.reduce_dppo_metrics`), then
        `super()`.

        GRPOTrainer's `log` logs each list's mean: over several micro-batches a mean of per-micro-batch rates is wrong
        (an empty denominator pulls it toward 0), and a mean of maxima or counts is neither. A rate is logged as
        (numerator, denominator) pairs, which GRPOTrainer's NaN filter (`math.isnan` on every value) cannot take, and
        reduced to its sums' ratio first: NaN over no token, which the filter then logs as None.
        """
        # GRPOTrainer logs each metric's window mean: DPPO's rates are pairs to sum, its maxima and counts no means
        reduce_dppo_metrics(self._metrics["train" if self.model.training else "eval"])
        super().log(logs, start_time)
