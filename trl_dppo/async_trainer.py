"""`AsyncDPPOTrainer`: TRL's `AsyncGRPOTrainer` with DPPO's trust region, anchored to the rollout worker's records.

TRL's asynchronous GRPO keeps a rollout worker generating against a vLLM server while the trainer learns from samples
up to `max_staleness` policy versions old. Each sample carries the log-probabilities the server recorded for the tokens
it sampled (`old_log_probs`): DPPO's mu, which TRL's loss uses for PPO's ratio clip. This trainer changes, each in one
small override (`docs/overrides.md`; `tests/test_upstream_contract.py` pins what each relies on):

- `compute_loss`: TRL's loss runs unchanged (its forward over the packed rows, its ratio, KL and entropy metrics, the
  MoE auxiliary loss) on a copy of the batch whose advantages are 0, so its PPO term adds no gradient. A forward hook
  takes the forward's log pi of every loss term, and the trust region's weights w_t (DPPO: M_t * (pi/mu) * A_t,
  or another registered method, with the corrections stacked on it) enter as -w_t * exp(log pi - sg(log pi)),
  normalised as TRL normalises its own term. The method and corrections see the terms one completion per row
  (`sequences.py`), as in DPPOTrainer.
  Tokens without a sampler log-probability leave the loss and are counted.
- `get_train_dataloader`: each batch also carries, per loss term, the policy version that sampled it, so the trust
  region's diagnostics are logged per policy lag (`staleness.py`); `_sync_weight`: every process learns the optimizer
  step at which each version was published (TRL counts versions on the main process), so a lag counts updates.
- `log`: reduces DPPO's metrics over the logging window by the synchronous trainer's rule (`diagnostics.py`), TRL's
  own reduction of everything else after it.
- `training_step`, `_maybe_log_save_evaluate`: a non-finite loss, gradient norm or parameter stops training at its
  optimizer step (`stop_on_non_finite`; `non_finite.StopOnNonFinite`, shared with DPPOTrainer).
- `__init__`: refuses a server whose log-probabilities are not those it samples from; where TRL's FlashAttention-3
  kernel is not available (no CUDA, or not loadable), uses an exact PyTorch version of TRL's packed tree attention
  (`tree_attention.py`); on a device without CUDA reads no peak-FLOPs figure (TRL reads it through `torch.cuda`) and
  refuses TRL's full-weight sync (NCCL, CUDA only) with what to do instead.
- `_sync_weight`: under ZeRO-3 gathers the adapter for TRL's adapter-file sync, and checks that sync: the adapter the
  server is told to load holds the trainer's tensors exactly, under the name the rollout worker requests, and a probe
  of what the server serves under that name is nearer this version than the previous one (`weight_sync_check`;
  `adapter_sync.py`).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING

import torch
from accelerate.utils import broadcast_object_list
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl.distributed import DistributedBackend
from trl.experimental.async_grpo import AsyncGRPOTrainer, async_grpo_trainer
from trl.experimental.async_grpo.packing import TREE_ATTENTION, TreeRow
from trl.trainer.utils import disable_dropout_in_model

from .adapter_sync import (
    PROBE_PROMPT,
    AdapterProbe,
    ProbeReading,
    adapter_sync_problems,
    recording_adapter_loads,
    served_probe,
)
from .async_config import AsyncDPPOConfig
from .checkpoints import accept_indexed_cpu_device, complete_deepspeed_checkpoint_on_this_machine
from .datasets_check import check_prompts, first_prompt_rows
from .diagnostics import record_correction_sums, reduce_dppo_metrics
from .divergence import binary_divergence
from .extras import INSTALL_VLLM, require_extra
from .images import refuse_images_in_async_prompts
from .losses import loss_from_weights
from .moe import refuse_untrained_aux_loss
from .non_finite import StopOnNonFinite
from .sequences import SequenceLayout
from .server_watch import ServerWatch
from .staleness import record_sums_by_lag, updates_since_sampled
from .trainer import DPPOTrainer, check_training_dropout
from .tree_attention import register_tree_attention_without_kernel
from .trust_region_step import TrustRegionSetup, trust_region_step
from .trust_regions import TrustRegionInput
from .vllm_server import refuse_unprocessed_logprobs
from .weight_sync import WeightSyncMismatchError, warn_unchecked_syncs


if TYPE_CHECKING:
    from datasets import Dataset, IterableDataset
    from peft import PeftConfig
    from torch.utils.data import DataLoader
    from transformers import PreTrainedTokenizerBase, TrainerCallback
    from trl.experimental.async_grpo.async_grpo_trainer import (
        EnvironmentFactory,
        RewardFunc,
        RolloutWorkerProtocol,
        WeightTransferProtocol,
    )

__all__ = ["AsyncDPPOTrainer"]

# The batch key holding, per loss term, the policy version that sampled it
POLICY_VERSION = "policy_version"
# Where the sample's policy version rides from the rollout queue to the collator (see `_QueueWithPolicyVersions`)
_METRICS_KEY = "_dppo/policy_version"
# vLLM's OpenAI server writes a log-probability of -inf as -9999.0; a missing one reaches TRL's array as NaN
VLLM_LOGPROB_FLOOR = -9999.0
# The server the asynchronous trainer needs, for the error that refuses a server with other log-probabilities
SERVER_RESTART_EXAMPLE = (
    "    VLLM_SERVER_DEV_MODE=1 VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 vllm serve {model} "
    "--logprobs-mode processed_logprobs --enable-lora --max-lora-rank R --max-loras N\n\n"
    "(with LoRA adapters of rank up to R, and N the requests TRL keeps in flight, max_staleness x samples per step by "
    "default, so that no request waits for an adapter slot; to sync full weights over NCCL instead, "
    """--weight-transfer-config '{{"backend": "nccl"}}')."""
)


class _QueueWithPolicyVersions:
    """TRL's rollout queue, giving out samples whose `metrics` also hold the policy version that sampled them.

    TRL's `RolloutQueueDataset` keeps `sample.metrics` in the examples it yields but drops `sample.model_version`;
    `_collate_policy_versions` takes the version back out of the metrics before TRL's collator logs them.
    """

    def __init__(self, queue):
        self._queue = queue

    def get(self, *args, **kwargs):
        sample = self._queue.get(*args, **kwargs)
        sample.metrics[_METRICS_KEY] = sample.model_version
        return sample

    def __getattr__(self, name: str):
        return getattr(self._queue, name)


def _collate_policy_versions(torch_call: Callable, examples: list) -> dict[str, torch.Tensor]:
    """TRL's collator (`torch_call`), with `POLICY_VERSION`: the version of each loss term's sample."""
    (rows,) = examples  # one micro-batch: a `packing.TreeRow` per process
    versions = [torch.tensor([sample["metrics"].pop(_METRICS_KEY) for sample in row.samples]) for row in rows]
    batch = torch_call(examples)
    # `segment_id` gives each loss term's sample in its row (0 on padding, which `token_index` < 0 marks)
    batch[POLICY_VERSION] = torch.stack(
        [row_versions[segments] for row_versions, segments in zip(versions, batch["segment_id"], strict=True)]
    )
    return batch


def _check_worker_and_server(check_health: Callable[[float], None], watch: ServerWatch, stale_after_s: float) -> None:
    """TRL's health check of its rollout worker (`check_health`), then whether the vLLM server still answers."""
    check_health(stale_after_s)
    watch.check()


@contextmanager
def _peak_flops_unknown_without_cuda():
    """Without CUDA, the device's peak FLOPs are unknown: TRL reads them through `torch.cuda.get_device_name`, which
    fails elsewhere, and `None` is TRL's own value for a device it has no figure for (its MFU metrics are left out)."""
    original = async_grpo_trainer.get_peak_flops_per_device

    def peak_flops(accelerator, dtype: str) -> float | None:
        return original(accelerator, dtype) if accelerator.device.type == "cuda" else None

    async_grpo_trainer.get_peak_flops_per_device = peak_flops
    try:
        yield
    finally:
        async_grpo_trainer.get_peak_flops_per_device = original


class AsyncDPPOTrainer(StopOnNonFinite, AsyncGRPOTrainer):
    """Divergence Proximal Policy Optimization on TRL's asynchronous GRPO trainer (`trl.experimental.async_grpo`).

    Takes the same arguments as `AsyncGRPOTrainer`, with `args` an [`AsyncDPPOConfig`]. See the module docstring for
    what differs.
    """

    _tag_names = ["trl", "async-dppo"]
    _name = "AsyncDPPO"
    _paper = DPPOTrainer._paper

    # AsyncGRPOTrainer's parameters, spelled out so IDEs and docs show them; all of them go to it unchanged
    def __init__(
        self,
        model: str,
        reward_funcs: RewardFunc | list[RewardFunc] | None = None,
        args: AsyncDPPOConfig | None = None,
        train_dataset: Dataset | IterableDataset | None = None,
        processing_class: PreTrainedTokenizerBase | None = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, torch.optim.lr_scheduler.LambdaLR | None] = (None, None),
        peft_config: PeftConfig | None = None,
        tools: list[Callable] | None = None,
        environment_factory: EnvironmentFactory | dict[str, EnvironmentFactory] | None = None,
        rollout_worker: RolloutWorkerProtocol | None = None,
        weight_transfer: WeightTransferProtocol | None = None,
    ):
        """Refuse what DPPO cannot train, `super().__init__` (TRL's peak-FLOPs lookup answering `None` off CUDA, where
        it would stop the constructor), then DPPO's setup: dropout off, the server's log-probability mode checked and
        watched, the rollout queue wrapped to carry each sample's policy version."""
        if args is None:
            args = AsyncDPPOConfig(f"{model.split('/')[-1]}-AsyncDPPO")
        if not isinstance(args, AsyncDPPOConfig):
            raise TypeError(
                f"AsyncDPPOTrainer needs an AsyncDPPOConfig, got {type(args).__name__}: pass an AsyncDPPOConfig (it "
                "takes every AsyncGRPOConfig field, plus DPPO's trust region)."
            )
        if environment_factory is None and train_dataset is not None:  # else the environment supplies the prompts
            check_prompts(*first_prompt_rows(train_dataset), "AsyncDPPOTrainer")
        refuse_images_in_async_prompts(train_dataset)
        if rollout_worker is None:  # TRL's worker samples from a vLLM server through vLLM's client code
            require_extra("vllm", "AsyncDPPOTrainer's rollout worker", INSTALL_VLLM)
        with _peak_flops_unknown_without_cuda():
            super().__init__(
                model,
                reward_funcs,
                args,
                train_dataset=train_dataset,
                processing_class=processing_class,
                callbacks=callbacks,
                optimizers=optimizers,
                peft_config=peft_config,
                tools=tools,
                environment_factory=environment_factory,
                rollout_worker=rollout_worker,
                weight_transfer=weight_transfer,
            )
        accept_indexed_cpu_device(self.args.device)  # a resume on several CPU processes loads onto `cpu:0`
        if weight_transfer is None and not self._lora_sync and self.accelerator.device.type != "cuda":
            raise ValueError(
                "Without a LoRA adapter the vLLM server can serve, TRL syncs the full weights to it over NCCL, which "
                f"needs CUDA on both sides; this trainer runs on {self.accelerator.device.type}. Train a LoRA adapter "
                "(peft_config, against a server started with --enable-lora) so that each version is published as "
                "adapter files, or pass a `weight_transfer` of your own."
            )
        if args.disable_dropout:  # GRPOTrainer's own step, which AsyncGRPOTrainer lacks
            disable_dropout_in_model(self.model)
        check_training_dropout(self.model, args.disable_dropout)
        refuse_untrained_aux_loss(self.aux_loss_enabled, self.args)
        # TRL's adapter-file sync is checked (`adapter_sync.py`); a full-weight sync (NCCL) has no reader yet
        self._adapter_sync_checked = self._lora_sync and args.weight_sync_check != "off"
        self._adapter_probe = AdapterProbe()
        if self.accelerator.is_main_process and not self._adapter_sync_checked:
            sync = "TRL's adapter-file sync" if self._lora_sync else "the full-weight sync"
            warn_unchecked_syncs(f"AsyncDPPOTrainer's weight sync ({sync} to the server)")
        # Registered after TRL's own registration in `super().__init__`, which it replaces
        register_tree_attention_without_kernel(TREE_ATTENTION, self.accelerator.device)
        # On the main process with TRL's own rollout worker: whether the server it samples from still answers
        self._server_watch: ServerWatch | None = None
        if rollout_worker is None:  # TRL's worker samples from the server; TRL does not check its log-probabilities
            if self.accelerator.is_main_process:
                self.vllm_client.wait_for_server_ready()
                self._server_watch = ServerWatch(
                    args.vllm_server_base_url, args.heartbeat_stale_after_s, "heartbeat_stale_after_s"
                )
            refuse_unprocessed_logprobs(
                self.accelerator, self.vllm_client, args.vllm_server_base_url, SERVER_RESTART_EXAMPLE
            )
        self._trust_region = TrustRegionSetup.from_args(args)  # the method, its settings and corrections
        # The optimizer step at which each policy version was published, on every process (`_sync_weight`)
        self._published_at: dict[int, int] = {}
        if self.accelerator.is_main_process:
            self.rollout_queue = _QueueWithPolicyVersions(self.rollout_queue)

    # ------------------------------------------------------------------------------------- policy versions

    def get_train_dataloader(self) -> DataLoader:
        """`super()`, then on the main process wraps the collator (`_collate_policy_versions`) and the rollout dataset's
        health check (`_check_worker_and_server`).

        TRL keeps `model_version` on the sample, but its `RolloutQueueDataset` drops it from the examples it yields: the
        collator takes each sample's version out of its `metrics` (where the queue wrapper put it) and gives the batch
        `policy_version`, one entry per loss term, for the lag of each term at loss time. The worker's heartbeat stays
        fresh while its generation fails on a dead server, so the health check asks the server too.
        """
        loader = super().get_train_dataloader()
        if self.accelerator.is_main_process:  # the main process alone collates; the others receive its batches
            collator = loader.collate_fn
            collator.torch_call = functools.partial(_collate_policy_versions, collator.torch_call)
            if self._server_watch is not None:
                # TRL's wait for samples checks the worker's heartbeat, which its scoring loop keeps beating while
                # generation fails on a dead server (see server_watch.py): it checks the server too
                dataset = self._rollout_dataset
                dataset.check_health_fn = functools.partial(
                    _check_worker_and_server, dataset.check_health_fn, self._server_watch
                )
        return loader

    def _sync_weight(self):
        """`super()`, with a LoRA adapter inside a gather of it (ZeRO-3 shards) and, with `weight_sync_check` on,
        checked (`_check_adapter_sync`, `_probe_served_adapter`); then broadcasts the version and the step that published
        it, for each process's lags in updates. A server that stops answering ends the run with the server watch's error."""
        # TRL's adapter sync saves `model.state_dict()`'s LoRA tensors as it finds them, which under ZeRO-3 are each
        # process's empty shards: the adapter gathered whole on every process (a collective; a no-op without ZeRO-3)
        adapter = [param for name, param in self.model.named_parameters() if "lora_" in name]
        checked = self._adapter_sync_checked
        recording = checked and self.accelerator.is_main_process  # TRL's client lives on the main process
        try:
            with DistributedBackend(self.accelerator).gather_params(adapter) if self._lora_sync else nullcontext():
                with recording_adapter_loads(self.vllm_client) if recording else nullcontext([]) as loaded:
                    super()._sync_weight()
                if checked:  # in the gather: the trainer's adapter whole, as the sync saved it
                    self._check_adapter_sync(loaded)
            if checked:  # out of it: the probe's forward gathers what it needs under ZeRO-3
                self._probe_served_adapter()
        except (
            OSError
        ) as error:  # as TRL's `requests.ConnectionError`: if the server is gone, say so and how to resume
            if self._server_watch is not None and not self._server_watch.answers():
                raise self._server_watch.error() from error
            raise
        if not checked:
            self._metrics["train"]["weight_sync/unchecked"].append(1.0)
        # TRL counts versions on the main process only; every process's loss needs each version's step for its
        # samples' lag in updates
        version, step = broadcast_object_list([(self.model_version, self.state.global_step)], from_process=0)[0]
        self._published_at[version] = step

    def _check_adapter_sync(self, loaded: list[tuple[str, str]]) -> None:
        """After TRL's adapter sync (`adapter_sync.py`): on the main process, the adapter the server was asked to load
        against the trainer's; on every process, the same metrics and, with `weight_sync_check="raise"`, the same
        error (the others would otherwise wait for the main process in the next collective)."""
        report = None
        if self.accelerator.is_main_process:
            from peft import get_peft_model_state_dict

            model = self.accelerator.unwrap_model(self.model)
            tensors = get_peft_model_state_dict(model, adapter_name=self._adapter_name)
            version = getattr(self.rollout_worker, "model_version", None)
            requested = None if version is None else f"{self._lora_name}-v{version}"
            expected = f"{self._lora_name}-v{self.model_version}"
            report = (*adapter_sync_problems(loaded, tensors, expected, requested), len(tensors), expected)
        problems, mismatched, checked, name = broadcast_object_list([report], from_process=0)[0]
        self._metrics["train"]["weight_sync/checked_parameters"].append(float(checked))
        self._metrics["train"]["weight_sync/mismatched_parameters"].append(float(mismatched))
        if problems and self.args.weight_sync_check == "raise":
            raise WeightSyncMismatchError(
                f"AsyncDPPOTrainer's adapter sync of {name}: {'; '.join(problems)}. The server would sample from "
                "another policy than the trainer's, and mu would describe it. weight_sync_check='log' logs "
                "weight_sync/mismatched_parameters and trains on."
            )

    def _probe_served_adapter(self) -> None:
        """After a checked adapter sync: the server's log-probabilities of the probe under this version's name, set
        beside the trainer's under this version and the previous one (`adapter_sync.ProbeReading`). What the files'
        check cannot see: what the server serves. Every process scores the probe (a collective under ZeRO-3) and
        logs the same metrics; the main process asks the server."""
        probe, url = self._adapter_probe, self.args.vllm_server_base_url
        tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)
        prompt_ids = tokenizer(PROBE_PROMPT)["input_ids"]
        name = samples = served = None
        if self.accelerator.is_main_process:  # this version's name, which TRL counts on the main process alone
            name = f"{self._lora_name}-v{self.model_version}"
            # a server silent past the run's bound ends the run as in TRL's own calls (`_sync_weight`'s `OSError`)
            timeout_s = self.args.heartbeat_stale_after_s
            samples, served = served_probe(url, name, prompt_ids, self.args.temperature, timeout_s)
        name, samples = broadcast_object_list([(name, samples)], from_process=0)[0]
        current = self._trainer_probe_log_probs(prompt_ids, samples)
        reading = None
        if self.accelerator.is_main_process:  # read once, so that every process makes the same decision
            reading = ProbeReading.read(served, current, probe.carried_over(samples))
        reading = broadcast_object_list([reading], from_process=0)[0]
        probe.samples, probe.log_probs = samples, current
        metrics = self._metrics["train"]
        metrics["weight_sync/probe_gap"].append(reading.gap)
        metrics["weight_sync/probe_unresolved"].append(float(not reading.resolved))
        metrics["weight_sync/probe_missing_tokens"].append(float(reading.missing))
        metrics["weight_sync/probe_served_previous"].append(float(reading.serves_previous))
        if reading.resolved:  # a rate: the window's mean position over its resolved syncs
            metrics["weight_sync/probe_position"].append((reading.position, 1.0))
        if reading.serves_previous and self.args.weight_sync_check == "raise":
            raise WeightSyncMismatchError(
                f"AsyncDPPOTrainer's adapter sync of {name}: the server serves the previous version. Its "
                f"log-probabilities of the probe lie at {reading.position:.2f} (standard error "
                f"{reading.standard_error:.2f}) between the trainer's under the previous version (0) and under this "
                "one (1), though the files it was asked to load are this version's. mu would describe the previous "
                "policy. weight_sync_check='log' logs weight_sync/probe_served_previous and trains on."
            )

    def _trainer_probe_log_probs(self, prompt_ids: list[int], samples: list[list[int]]) -> torch.Tensor:
        """The trainer's log-probabilities of the probe's sampled tokens, in one tensor as `served_probe` gives the
        server's: TRL's training forward over them packed in one row (`TreeRow`, its tree attention; the prompt
        forwarded once), as the loss scores samples."""
        row = TreeRow()
        for sample in samples:
            ids = torch.tensor([*prompt_ids, *sample])
            completion = torch.arange(len(ids)) >= len(prompt_ids)
            mask, zeros = completion.long(), torch.zeros(len(ids))
            row.add(
                {"input_ids": ids, "completion_mask": mask, "old_log_probs": zeros, "advantage": 0.0, "group_id": 0}
            )
        packed = {key: value.to(self.accelerator.device) for key, value in row.pack().items()}
        max_q, max_k = packed["tree_max_seqlens"].tolist()
        training = self.model.training
        self.model.eval()
        with torch.no_grad():
            outputs = self.model(
                input_ids=packed["input_ids"][None],
                position_ids=packed["position_ids"][None],
                shift_labels=packed["shift_labels"][None],
                fused_lm_head=True,
                tree_kv_index=packed["tree_kv_index"],
                tree_cu_seqlens_q=packed["tree_cu_seqlens_q"],
                tree_cu_seqlens_k=packed["tree_cu_seqlens_k"],
                tree_max_seqlen_q=max_q,
                tree_max_seqlen_k=max_k,
            )
        self.model.train(training)
        return outputs.log_probs.flatten()[packed["token_index"]].float().cpu()

    # -------------------------------------------------------------------------------------------------- loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's loss on a copy of the batch with zero advantages, plus DPPO's trust-region term from the same forward
        (`_trust_region_loss`).

        TRL's loss offers no seam between its forward and its clip: it reads the advantages and old log-probabilities
        before the forward, and its packed rows share positions between samples, so log pi cannot be replaced per
        position. With zero advantages TRL's PPO term has no gradient while its forward, its `ratio` / `kl` / `entropy`
        metrics (against mu, with a missing mu, NaN or vLLM's floor, read as 0) and the MoE auxiliary loss stay TRL's;
        a forward hook takes the forward's `log_probs`, so no pass is added. TRL's `clip_ratio/*` then read 0.
        """
        terms = inputs["token_index"] >= 0  # this process's loss terms; TRL pads the batch's rows with -1
        no_mu = ~torch.isfinite(inputs["old_log_probs"]) | (inputs["old_log_probs"] <= VLLM_LOGPROB_FLOOR)
        # TRL's PPO term with zero advantages: no gradient, its metrics (ratio, kl, entropy) against finite mu
        ppo_inputs = {
            **inputs,
            "advantages": torch.zeros_like(inputs["advantages"]),
            "old_log_probs": inputs["old_log_probs"].masked_fill(no_mu, 0.0),
        }
        forward = []
        hook = model.register_forward_hook(lambda module, args, output: forward.append(output.log_probs))
        try:
            loss = super().compute_loss(model, ppo_inputs, return_outputs, num_items_in_batch)
        finally:
            hook.remove()
        (log_probs,) = forward  # over the packed positions; each loss term reads its position
        trainer_logps = log_probs.flatten()[inputs["token_index"][terms]]
        sampler_logps, missing = inputs["old_log_probs"][terms], no_mu[terms]
        lag = updates_since_sampled(inputs[POLICY_VERSION][terms], self._published_at, self.state.global_step)
        advantages = inputs["advantages"][terms]
        # Each term's completion: its row's index and its sample within the row (`segment_id`)
        row = torch.arange(terms.shape[0], device=terms.device)[:, None].expand_as(terms)[terms]
        completions = SequenceLayout.from_sequence_ids(
            row * (int(inputs["segment_id"].max()) + 1) + inputs["segment_id"][terms]
        )
        global_n_tokens = inputs["global_n_tokens"][0]
        return loss + self._trust_region_loss(
            trainer_logps, sampler_logps, advantages, lag, missing, global_n_tokens, completions
        )

    def _trust_region_loss(
        self,
        trainer_logps: torch.Tensor,
        sampler_logps: torch.Tensor,
        advantages: torch.Tensor,
        lag: torch.Tensor,
        missing: torch.Tensor,
        global_n_tokens: torch.Tensor,
        completions: SequenceLayout,
    ) -> torch.Tensor:
        """-sum_t w_t * exp(log pi - sg(log pi)) over this process's loss terms (one flat row), normalised like TRL's
        term: over the tokens of all processes less the missing ones, by gradient-accumulation step. The weights come
        from `trust_region_step`, the one function DPPOTrainer's `_set_trust_region_advantages` calls too, which sees the
        terms as the synchronous trainer's batch, one completion per row (`completions`), and gives the same weights.
        Logs the trust region's and the corrections' metrics, overall and by policy lag."""
        setup = self._trust_region
        tokens = ~missing[None]
        with torch.no_grad():
            pi = trainer_logps.detach()[None]
            mu = torch.where(tokens, sampler_logps[None], pi)  # a neutral anchor for tokens without one
            advantages = advantages[None]
            divergence = binary_divergence(mu, pi, setup.kind)
            # On the grid, a slot without a term is outside the loss with neutral values (mu = pi, A = 0)
            grid_pi = completions.to_grid(pi[0], 0.0)
            grid_mu = completions.to_grid(mu[0], 0.0)
            batch = TrustRegionInput(
                trainer_logps=grid_pi,
                sampler_logps=grid_mu,
                base_logps=grid_mu,
                advantages=completions.to_grid(advantages[0], 0.0),
                divergence=completions.to_grid(divergence[0], 0.0),
                anchor_logps=grid_pi,
                loss_mask=completions.to_grid(tokens[0], False),
            )
            step = trust_region_step(setup, batch)
            weights = completions.from_grid(step.weights)[None]
            diagnostics = dict(
                keep=completions.from_grid(step.keep)[None],
                dppo_keep=completions.from_grid(step.dppo_keep)[None],
                advantages=advantages,
                sampler_logps=mu,
                base_logps=mu,  # vLLM reports only mu (truncated sampling is refused)
                trainer_logps=pi,
                epsilon_low=self.epsilon_low,
                epsilon_high=self.epsilon_high,
            )
            metrics = self._metrics["train"]
            sums = record_sums_by_lag(self.accelerator, metrics, lag[None], tokens, diagnostics)
            record_correction_sums(self.accelerator, metrics, batch.loss_mask, step.corrections)
        # TRL's normalisation of its own term, less the tokens that left the loss
        tokens_per_process = (
            (global_n_tokens - sums["missing_sampler_logps"]) / self.accelerator.num_processes
        ).clamp(min=1.0)
        loss = loss_from_weights(trainer_logps[None], weights * tokens).sum()
        return loss / tokens_per_process / self.current_gradient_accumulation_steps

    # ------------------------------------------------------------------------------------------- checkpoints

    def _save_checkpoint(self, model, trial):
        """`super()`, then under DeepSpeed with `save_on_each_node` DeepSpeed's `latest` on every machine, as
        DPPOTrainer's (`checkpoints.complete_deepspeed_checkpoint_on_this_machine`)."""
        super()._save_checkpoint(model, trial)
        if self.is_deepspeed_enabled and self.args.save_on_each_node and self.args.should_save:
            folder = os.path.join(self._get_output_dir(trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
            complete_deepspeed_checkpoint_on_this_machine(folder)  # each machine resumes from its own copy

    # ------------------------------------------------------------------------------------------------ logging

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """DPPO's metrics reduced by DPPOTrainer's rule (`diagnostics.reduce_dppo_metrics`), then `super()`: TRL's
        `_reduce_metric` reduces pairs as DPPO does but averages a count whose name has no `total` word
        (`mismatch/missing_sampler_logps`, `trust_region/ratio_limited_tokens`); one rule gives both trainers the same
        logged values."""
        # TRL reduces pairs as DPPO does but averages counts: DPPO's metrics are reduced by DPPO's one rule first
        reduce_dppo_metrics(self._metrics["train" if self.model.training else "eval"])
        super().log(logs, start_time)
