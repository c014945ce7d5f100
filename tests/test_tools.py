"""`DPPOTrainer(tools=...)` and `DPPOTrainer(environment_factory=...)` trained end to end on transformers generation.

Each run: a tiny peaked model, fp32 on both sides, temperature 0.8, learning rate 1e-2, two optimizer steps per
generation batch and three steps (generations at steps 0 and 2, so loss computations on the weights that sampled, then
after an update, then on fresh weights again). A user's instance-level `generate` wrapper forces the tool call in
every other row of the first turn (`multi_turn.force_on_first_turn`); TRL executes the call and the model samples the
turn after the tool's answer freely. The shared checks are in `multi_turn.py`.
"""

from __future__ import annotations

import pytest
from datasets import Dataset

from .conftest import make_trainer
from .multi_turn import (
    PROMPT,
    TOOL_CALL,
    CallsSeen,
    assert_every_model_token_carries_a_record_row,
    assert_kept_sets_are_the_models_top_k,
    assert_mu_is_pi_on_the_weights_that_sampled,
    assert_the_mask_acts_only_off_policy,
    assert_tool_called_and_answered_in_every_generation,
    assert_tool_results_leave_the_loss,
    divergence_settings,
    force_on_first_turn,
    tool_source,
    train_and_record,
)


# fp32 on both sides and the same kernels: generate()'s incremental forward and the loss's full forward differ by
# rounding only (1e-6 in probability here); 1e-4 leaves room on any CPU and still fails on a mu off by 1e-3
TOLERANCE = 1e-4
RUNS = [("tools", "binary_tv"), ("tools", "topk_tv"), ("environment", "binary_tv"), ("environment", "topk_tv")]


@pytest.fixture(scope="module", params=RUNS, ids=["-".join(run) for run in RUNS])
def tool_run(request, tiny_model_dir, tool_tokenizer, tmp_path_factory):
    source, divergence = request.param
    calls = CallsSeen()
    trainer = make_trainer(
        tmp_path_factory.mktemp(f"{source}-{divergence}"),
        tiny_model_dir,
        Dataset.from_dict({"prompt": [PROMPT] * 16}),
        tool_tokenizer,
        trainer_kwargs=tool_source(source),
        reward_funcs=calls.reward,
        per_device_train_batch_size=4,
        steps_per_generation=2,
        max_steps=3,
        max_completion_length=72,  # the call (34 tokens), the tool's turn (24) and a few tokens after it
        temperature=0.8,
        learning_rate=1e-2,
        **divergence_settings(divergence),
    )
    forced_rows = force_on_first_turn(trainer.model, tool_tokenizer, TOOL_CALL)
    wrapper = trainer.model.generate
    return train_and_record(trainer), calls, forced_rows, wrapper, divergence


def test_a_tool_call_is_made_and_answered_in_every_generation(tool_run):
    run, calls, *_ = tool_run
    assert_tool_called_and_answered_in_every_generation(run, calls)


def test_tool_result_tokens_leave_the_loss(tool_run, tool_tokenizer):
    run, *_ = tool_run
    assert_tool_results_leave_the_loss(run, tool_tokenizer)


def test_every_model_token_of_a_tool_batch_carries_a_record_row(tool_run):
    """The forced turn records mu_base, so the batch needs rows; the post-tool turn, sampled without the processor,
    records none of its own and still tags its tokens."""
    run, *_ = tool_run
    assert all("sampler_base_logps" in seen.inputs for seen in run.losses)
    assert_every_model_token_carries_a_record_row(run)


def test_on_the_weights_that_sampled_mu_equals_pi_token_by_token(tool_run, tool_tokenizer):
    """Forced tokens are drawn from a one-hot distribution: mu = 1 is what the sampler drew them with (the ratio
    pi/mu keeps it), and mu_base = softmax(logits / T), recorded from the raw logits, is what the trust region
    compares with pi; every token the model sampled has mu = mu_base = pi. With top-K, the kept sets (taken under
    mu_base) are the model's top K."""
    run, _, _, _, divergence = tool_run
    forced = tool_tokenizer(TOOL_CALL, add_special_tokens=False)["input_ids"]
    assert_mu_is_pi_on_the_weights_that_sampled(run, TOLERANCE, forced)
    if divergence.startswith("topk"):
        assert_kept_sets_are_the_models_top_k(run, TOLERANCE)
    else:
        assert not any("sampler_kept_ids" in seen.inputs for seen in run.losses)


def test_the_mask_acts_after_an_update_and_not_on_the_weights_that_sampled(tool_run):
    run, *_ = tool_run
    assert_the_mask_acts_only_off_policy(run, TOLERANCE)


def test_the_users_generate_wrapper_survives_every_rollout(tool_run):
    """DPPO's recorder wraps `generate` for each rollout and puts back what the instance had: the wrapper forced the
    call in the first turn of every generation (its post-tool calls force nothing) and is still in place."""
    run, _, forced_rows, wrapper, _ = tool_run
    first_turns = [rows for rows in forced_rows if rows]
    assert len(first_turns) == len(run.generations) == 2
    assert vars(run.trainer.model)["generate"] is wrapper
