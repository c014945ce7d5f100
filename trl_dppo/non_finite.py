"""Stop training at the first optimizer step whose loss, gradient norm or parameters are not finite.

Left alone, transformers trains on through NaN (`learning_rate=1e3` on a tiny fully fine-tuned model: NaN gradient
norm and weights at step 2, a logged loss of 0, and the run ended normally), and its `logging_nan_inf_filter` (on by
default) logs a non-finite loss as the window's running mean of the earlier ones (0 at the window's first step), so
the log can look fine. `StopOnNonFinite` is a base class of both trainers that adds two `super()`-calling overrides
of transformers' `Trainer`: `training_step` notes whether each micro-batch's loss is finite, and `_maybe_log_save_evaluate`, which the
training loop calls after each optimizer step with the step's gradient norm and before it logs or saves a checkpoint,
decides for the step. The three flags are summed over processes in one all-reduce, so every process stops at the same
step (none waits in a collective for one that raised).
"""

from __future__ import annotations

import math
import os

import torch
from accelerate.utils import gather_object
from torch.nn.utils import get_total_norm
from transformers.trainer_utils import get_last_checkpoint


__all__ = ["NonFiniteTrainingError", "StopOnNonFinite", "non_finite_error"]


class NonFiniteTrainingError(RuntimeError):
    """A loss, gradient norm or parameter was not finite at an optimizer step (`stop_on_non_finite=True`)."""


def non_finite_error(step: int, quantities: list[str], learning_rate: float, checkpoint: str | None) -> str:
    """The error for optimizer step `step` (1-based, as logged) at which `quantities` were not finite."""
    resume = (
        f"The last checkpoint, saved before any non-finite value, is {checkpoint}: resume from it "
        "(`trainer.train(resume_from_checkpoint=...)`) once the cause is fixed."
        if checkpoint
        else "No checkpoint saved yet."
    )
    return (
        f"Training stopped at optimizer step {step}: non-finite {', '.join(quantities)}. {resume} Common causes: a "
        f"learning rate too high for the model (learning_rate={learning_rate:g}), no gradient clipping "
        "(max_grad_norm=0), fp16 overflow (use bf16), a reward function returning NaN or inf. transformers' "
        "logging_nan_inf_filter hides a non-finite loss in the log, so earlier logged losses may look fine. Set "
        "stop_on_non_finite=False to train on regardless."
    )


def _local_parameters(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The trainable parameters this process holds: under DeepSpeed ZeRO-3 its partition (`ds_tensor`; the
    parameter itself is an empty placeholder), otherwise the parameter."""
    held = [
        (name, getattr(param, "ds_tensor", param)) for name, param in model.named_parameters() if param.requires_grad
    ]
    return [(name, tensor) for name, tensor in held if tensor.numel() > 0]  # an empty ZeRO-3 partition holds nothing


class StopOnNonFinite:
    """Mixed into a transformers `Trainer` subclass (before it in the bases): with `args.stop_on_non_finite`, raises
    `NonFiniteTrainingError` at the first optimizer step whose loss, gradient norm or parameters are not finite."""

    # Whether a micro-batch loss since the last optimizer step was non-finite: a device tensor, read once per step
    _non_finite_loss: torch.Tensor | None = None

    def training_step(self, model, inputs, num_items_in_batch=None):
        """`super()`, then ORs whether the micro-batch's loss is finite into a device flag: no synchronisation per
        micro-batch."""
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self.args.stop_on_non_finite:
            bad = ~torch.isfinite(loss)
            self._non_finite_loss = bad if self._non_finite_loss is None else self._non_finite_loss | bad
        return loss

    def _maybe_log_save_evaluate(self, tr_loss, grad_norm, model, *args, **kwargs):
        """Before `super()` logs or saves: stop on a non-finite loss, gradient norm or parameter (`_stop_if_non_finite`).

        The training loop calls this after each optimizer step with the step's gradient norm. Checking before the save
        means no checkpoint of non-finite weights is written, so the one the error names is safe to resume from.
        """
        # Before logging and saving: a checkpoint of non-finite weights is never written
        if self.args.stop_on_non_finite:
            self._stop_if_non_finite(grad_norm)
        return super()._maybe_log_save_evaluate(tr_loss, grad_norm, model, *args, **kwargs)

    def _stop_if_non_finite(self, grad_norm: torch.Tensor | float | None) -> None:
        """Raise `NonFiniteTrainingError` on every process at the same step if the step's loss flag, its gradient norm
        or one fused max |p| over the trainable parameters this process holds (`torch.nn.utils.get_total_norm`,
        inf-norm: under ZeRO-3 the process's partition) is not finite, the three summed over processes in one
        all-reduce. The error names the step, the quantities, the non-finite parameters (found only then, gathered over
        processes) and the last checkpoint in `output_dir`. A step fp16's loss scaler skipped counts neither its loss
        nor its gradient."""
        device = self.accelerator.device
        loss_bad = self._non_finite_loss if self._non_finite_loss is not None else torch.tensor(False, device=device)
        self._non_finite_loss = None
        # A step fp16's loss scaler skipped for overflowing gradients is its normal working: the weights did not move
        skipped = self.accelerator.optimizer_step_was_skipped
        grad_bad = grad_norm is not None and not math.isfinite(float(grad_norm))
        held = _local_parameters(self.accelerator.unwrap_model(self.model))
        # One fused pass: the largest |p| over the parameters is NaN or inf exactly when one of them is
        largest = get_total_norm([tensor for _, tensor in held], float("inf"), foreach=True).to(device)
        flags = torch.stack(
            [loss_bad & (not skipped), torch.tensor(grad_bad and not skipped, device=device), ~largest.isfinite()]
        )
        loss_bad, grad_bad, params_bad = (self.accelerator.reduce(flags.float(), reduction="sum") > 0).tolist()
        if not (loss_bad or grad_bad or params_bad):
            return
        quantities = ["loss"] * loss_bad + ["gradient norm"] * grad_bad
        if params_bad:  # only now, name the parameters that are not finite, over every process's part
            local = [name for name, tensor in held if not torch.isfinite(tensor).all()]
            names = list(dict.fromkeys(gather_object(local)))  # a ZeRO-3 parameter has a part on each process
            more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
            quantities.append(f"parameters: {names[0]}{more}")
        output_dir = self.args.output_dir
        checkpoint = get_last_checkpoint(output_dir) if output_dir and os.path.isdir(output_dir) else None
        raise NonFiniteTrainingError(
            non_finite_error(self.state.global_step, quantities, self.args.learning_rate, checkpoint)
        )
