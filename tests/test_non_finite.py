"""A run never ends silently with non-finite numbers (`stop_on_non_finite`, `trl_dppo/non_finite.py`).

`learning_rate=1e3` on the tiny model of `conftest.py`, fully fine-tuned, makes the second optimizer step's gradient
norm and then every weight NaN while its loss reads 0 (GRPO's loss is near 0 by construction). Before
`stop_on_non_finite`, both trainers finished such a run "successfully". A NaN loss itself is hidden from the log by
transformers' `logging_nan_inf_filter`, which logs the window's running mean in its place. Now training stops at that
step, naming the step, what was not finite and the last checkpoint, before the step logs or saves.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
from transformers import TrainerCallback
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

from trl_dppo import AsyncDPPOConfig, AsyncDPPOTrainer
from trl_dppo.non_finite import NonFiniteTrainingError, non_finite_error

from .conftest import REPO, NoWeightTransfer, StubRolloutWorker, launch, length_reward, make_trainer


DIVERGING = dict(learning_rate=1e3, max_steps=2, lora=None)


def non_finite_parameters(trainer) -> list[str]:
    return [name for name, param in trainer.model.named_parameters() if not torch.isfinite(param).all()]


def test_dppo_stops_at_the_step_whose_gradient_and_weights_turn_nan(tmp_path, tiny_model_dir, prompts, tokenizer):
    trainer = make_trainer(
        tmp_path, tiny_model_dir, prompts, tokenizer, save_strategy="steps", save_steps=1, **DIVERGING
    )
    with pytest.raises(NonFiniteTrainingError) as stopped:
        trainer.train()
    message = str(stopped.value)
    assert "Training stopped at optimizer step 2: non-finite gradient norm, parameters: model." in message
    assert non_finite_parameters(trainer)[0] in message  # the first parameter that is NaN, by name
    checkpoint = os.path.join(trainer.args.output_dir, "checkpoint-1")
    assert f"The last checkpoint, saved before any non-finite value, is {checkpoint}" in message
    # stopped before the step logged or saved: no NaN checkpoint, and the last log is step 1's, finite
    assert [name for name in os.listdir(trainer.args.output_dir) if name.startswith("checkpoint")] == ["checkpoint-1"]
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["step"] for entry in logged] == [1] and math.isfinite(logged[0]["grad_norm"])


def test_with_the_opt_out_the_run_trains_through_as_transformers_does(tmp_path, tiny_model_dir, prompts, tokenizer):
    """What `stop_on_non_finite=False` gives (transformers' behaviour): the run ends with NaN weights."""
    trainer = make_trainer(tmp_path, tiny_model_dir, prompts, tokenizer, stop_on_non_finite=False, **DIVERGING)
    trainer.train()
    assert non_finite_parameters(trainer)
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["step"] for entry in logged] == [1, 2]
    assert logged[1]["loss"] == 0.0 and math.isnan(logged[1]["grad_norm"])


def with_nan_loss(trainer):
    """The trainer's loss plus a NaN constant: the loss is NaN, its gradient (and so the weights) stay finite."""
    compute_loss = trainer._compute_loss
    trainer._compute_loss = lambda model, inputs: compute_loss(model, inputs) + float("nan")
    return trainer


def test_a_nan_loss_stops_the_step_though_the_log_would_show_a_finite_one(
    tmp_path, tiny_model_dir, prompts, tokenizer
):
    trainer = with_nan_loss(make_trainer(tmp_path, tiny_model_dir, prompts, tokenizer, max_steps=1))
    with pytest.raises(NonFiniteTrainingError, match="at optimizer step 1: non-finite loss. No checkpoint saved yet"):
        trainer.train()
    # opted out, the run logs the NaN loss as the window's running mean: 0 at its first step
    trainer = make_trainer(tmp_path, tiny_model_dir, prompts, tokenizer, max_steps=1, stop_on_non_finite=False)
    with_nan_loss(trainer).train()
    (logged,) = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert logged["loss"] == 0.0 and math.isfinite(logged["grad_norm"])


def test_the_error_says_when_no_checkpoint_was_saved():
    message = non_finite_error(3, ["gradient norm"], 1e-5, None)
    assert message.startswith(
        "Training stopped at optimizer step 3: non-finite gradient norm. No checkpoint saved yet."
    )
    assert "learning_rate=1e-05" in message and "stop_on_non_finite=False" in message


def async_trainer(tmp_path, model_dir, tokenizer, prompts, **overrides) -> AsyncDPPOTrainer:
    """AsyncDPPOTrainer on queued samples (a stub rollout worker, no weight transfer: tests/test_async_loss.py)."""
    settings = dict(
        output_dir=str(tmp_path / "out"),
        report_to="none",
        bf16=False,
        per_device_train_batch_size=4,
        token_budget=0,
        max_staleness=10,
        gradient_checkpointing=False,
        logging_steps=1,
        save_strategy="no",
        learning_rate=1e-3,
        max_steps=2,
    )
    settings.update(overrides)
    return AsyncDPPOTrainer(
        model=model_dir,
        reward_funcs=length_reward,
        args=AsyncDPPOConfig(**settings),
        train_dataset=prompts,
        processing_class=tokenizer,
        rollout_worker=StubRolloutWorker(),
        weight_transfer=NoWeightTransfer(),
    )


def queue_samples(trainer, tokenizer, count: int) -> None:
    """Samples of the version TRL publishes when training starts, with mu a plausible log-probability."""
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Count to 3."}], add_generation_prompt=True, return_dict=False
    )
    generator = torch.Generator().manual_seed(0)
    for index in range(count):
        reply = torch.randint(100, 1000, (6,), generator=generator).tolist()
        trainer.rollout_worker.rollout_buffer.put(
            RolloutSample(
                prompt=[],
                completion=[],
                input_ids=np.array(prompt + reply),
                completion_mask=np.array([0] * len(prompt) + [1] * len(reply)),
                old_log_probs=np.array([0.0] * len(prompt) + [-5.0] * len(reply), dtype=np.float32),
                advantage=1.0 if index % 2 else -1.0,
                model_version=1,
                group_id=index // 2,
                metrics={"reward": 0.0},
            )
        )


class NaNInLmHeadAtStep(TrainerCallback):
    """Writes NaN into one weight of the LM head right after the optimizer step `step` (1-based)."""

    def __init__(self, trainer, step: int):
        self.trainer, self.step = trainer, step

    def on_optimizer_step(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step:  # transformers counts the step after this callback
            with torch.no_grad():
                self.trainer.model.lm_head.weight[0, 0] = float("nan")


def test_async_dppo_stops_at_the_step_whose_weights_turn_nan(tmp_path, tiny_model_dir, tokenizer, prompts):
    """At learning rate 1e3 the async loss on fixed samples saturates (its gradient vanishes) instead of diverging, so
    the NaN weight is written in: TRL's own training loop, with AsyncDPPOTrainer's check, must stop at that step."""
    trainer = async_trainer(tmp_path, tiny_model_dir, tokenizer, prompts)
    trainer.add_callback(NaNInLmHeadAtStep(trainer, step=2))
    queue_samples(trainer, tokenizer, 16)
    with pytest.raises(NonFiniteTrainingError) as stopped:
        trainer.train()
    assert str(stopped.value).startswith(
        "Training stopped at optimizer step 2: non-finite parameters: lm_head.weight. No checkpoint saved yet."
    )
    assert trainer.state.global_step == 2


def test_async_dppo_stops_at_a_nan_loss(tmp_path, tiny_model_dir, tokenizer, prompts):
    trainer = async_trainer(tmp_path, tiny_model_dir, tokenizer, prompts, max_steps=1)
    compute_loss = trainer.compute_loss
    trainer.compute_loss = lambda *args, **kwargs: compute_loss(*args, **kwargs) + float("nan")
    queue_samples(trainer, tokenizer, 8)
    with pytest.raises(NonFiniteTrainingError, match="at optimizer step 1: non-finite loss. No checkpoint saved yet"):
        trainer.train()


@pytest.mark.launch
@pytest.mark.slow
def test_a_nan_loss_on_one_process_stops_every_process_at_that_step(tmp_path, tiny_model_dir):
    """Only the second process's loss is NaN, and its gradient finite: the decision is all-reduced, so the first
    process stops too instead of waiting for the second in the next step's collectives (the launch would time out)."""
    out = tmp_path / "stopped"
    done = launch(
        REPO / "tests" / "non_finite_worker.py", [tiny_model_dir, str(out)], processes=2, timeout_s=300, vllm=False
    )
    assert done.returncode == 0, done.stderr[-4000:]
    for rank in (0, 1):
        outcome = (tmp_path / f"stopped.rank{rank}").read_text()
        assert outcome.startswith("Training stopped at optimizer step 1: non-finite loss. No checkpoint"), outcome
