"""`DPPOTrainer(tools=...)` (binary) and `DPPOTrainer(environment_factory=...)` (top-K) on vLLM colocate, for real.

The model is a tiny one trained in the session to answer with the tool call three times in four (`multi_turn.py` says
why nothing forces the call here): vLLM samples the call, TRL executes it, vLLM samples the turn after the tool's
answer. The engine runs the checkpoint in fp32 (TRL passes no dtype, and vLLM downcasts an fp32 checkpoint to bf16 by
default: |pi - mu| up to 4e-2, README's Precision, which would hide a wrong mu), so mu and pi compare token by token.
As in `test_tools.py`: two optimizer steps per generation batch and three steps, learning rate 1e-2.
"""

from __future__ import annotations

import functools
import os


os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: weights are reloaded in place
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the tests need little

import pytest
import torch
from datasets import Dataset

from .conftest import make_trainer, require_vllm
from .multi_turn import (
    PROMPT,
    CallsSeen,
    assert_every_model_token_carries_a_record_row,
    assert_kept_sets_are_the_models_top_k,
    assert_mu_is_pi_on_the_weights_that_sampled,
    assert_the_mask_acts_only_off_policy,
    assert_tool_called_and_answered_in_every_generation,
    assert_tool_results_leave_the_loss,
    divergence_settings,
    tool_source,
    train_and_record,
    train_tool_caller,
)


require_vllm()


pytestmark = pytest.mark.vllm

# fp32 on both sides, vLLM's CPU kernels against torch's: 1.3e-5 in probability measured here; 2.5e-4 leaves room on
# any CPU and still fails on a mu off by 1e-3
TOLERANCE = 2.5e-4
RUNS = [("tools", "binary_tv"), ("environment", "topk_tv")]


@pytest.fixture(scope="module")
def tool_caller_dir(tool_tokenizer, tmp_path_factory):
    path = tmp_path_factory.mktemp("tool-caller")
    train_tool_caller(tool_tokenizer).save_pretrained(path)
    tool_tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module", params=RUNS, ids=["-".join(run) for run in RUNS])
def vllm_tool_run(request, tool_caller_dir, tool_tokenizer, tmp_path_factory):
    import trl.generation.vllm_generation as vllm_generation

    source, divergence = request.param
    calls = CallsSeen()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(vllm_generation, "LLM", functools.partial(vllm_generation.LLM, dtype="float32"))
        trainer = make_trainer(
            tmp_path_factory.mktemp(f"vllm-{source}-{divergence}"),
            tool_caller_dir,
            Dataset.from_dict({"prompt": [PROMPT] * 16}),
            tool_tokenizer,
            trainer_kwargs=tool_source(source),
            reward_funcs=calls.reward,
            use_vllm=True,
            vllm_mode="colocate",
            vllm_max_model_length=512,
            vllm_gpu_memory_utilization=0.3,
            per_device_train_batch_size=4,
            steps_per_generation=2,
            max_steps=3,
            max_completion_length=72,
            temperature=0.8,
            learning_rate=1e-2,
            **divergence_settings(divergence),
        )
    return train_and_record(trainer), calls, divergence


def test_a_tool_call_sampled_by_vllm_is_made_and_answered_in_every_generation(vllm_tool_run):
    run, calls, _ = vllm_tool_run
    assert_tool_called_and_answered_in_every_generation(run, calls)


def test_tool_result_tokens_leave_the_loss(vllm_tool_run, tool_tokenizer):
    run, *_ = vllm_tool_run
    assert_tool_results_leave_the_loss(run, tool_tokenizer)


def test_model_tokens_carry_record_rows_when_the_batch_needs_records(vllm_tool_run):
    """Top-K: every model token's float carries its kept set's row, after TRL's stitching of two engine calls. Binary:
    vLLM's log-probability is all DPPO needs, and the batch carries no records."""
    run, _, divergence = vllm_tool_run
    if divergence.startswith("topk"):
        assert_every_model_token_carries_a_record_row(run)
    else:
        assert not any({"sampler_kept_ids", "sampler_base_logps"} & seen.inputs.keys() for seen in run.losses)


def test_on_the_weights_that_sampled_mu_equals_pi_token_by_token(vllm_tool_run):
    """Every completion token but the tool's answer was sampled by vLLM from the model's own distribution at
    temperature 0.8: its mu is pi, and with top-K its kept set is the model's top K."""
    run, _, divergence = vllm_tool_run
    assert run.trainer.vllm_generation.llm.llm_engine.model_config.dtype == torch.float32
    assert_mu_is_pi_on_the_weights_that_sampled(run, TOLERANCE)
    if divergence.startswith("topk"):
        assert_kept_sets_are_the_models_top_k(run, TOLERANCE)


def test_the_mask_acts_after_an_update_and_not_on_the_weights_that_sampled(vllm_tool_run):
    run, *_ = vllm_tool_run
    assert_the_mask_acts_only_off_policy(run, TOLERANCE)
