"""Where the sampler's probabilities are recorded.

DPPO anchors its trust region to mu, the probability the sampler gave each token when it generated it, after the
sampler's own processing (penalties, temperature, top-k/top-p/min-p). This module records mu on both generation
backends of GRPOTrainer, without an extra forward pass:

- transformers `generate()`: `SamplerLogprobRecorder`, a logits processor added to the call by `recording_generate`;
- vLLM: `record_vllm_logprobs` wraps `VLLMGeneration.generate` and picks the sampled token's entry by its token id
  (TRL keeps the first entry, which is the most likely token once more than one log-probability is requested).

Each sampled token's record is a `SampledLogprob`: a float, so GRPOTrainer threads it through its rollout code (tool
calls included) into `sampling_per_token_logps` as it does vLLM's log-probabilities, and it carries the sampler's
top-K along the way.
"""

from __future__ import annotations

import functools
import math
from contextlib import contextmanager
from typing import Callable, Iterator

import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import (
    LogitsProcessor,
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

__all__ = [
    "SampledLogprob",
    "SamplerLogprobRecorder",
    "recording_generate",
    "record_vllm_logprobs",
    "sync_weights_in_place",
    "kept_set_tensors",
]

# A kept-set slot with no token: the sampled token is already among the top K
VOID_ID = -1


class SampledLogprob(float):
    """log mu(y_t) of a sampled token, with the sampler's kept set for the top-K divergence.

    `kept_ids` / `kept_logps` hold K + 1 slots: the sampler's K most likely tokens, then the sampled token when it is
    not among them (else an empty slot, id -1 and log-prob -inf). Empty when top-K was not requested.
    """

    kept_ids: tuple[int, ...]
    kept_logps: tuple[float, ...]

    def __new__(cls, value: float, kept_ids: tuple[int, ...] = (), kept_logps: tuple[float, ...] = ()):
        record = super().__new__(cls, value)
        record.kept_ids = kept_ids
        record.kept_logps = kept_logps
        return record

    def __reduce__(self):  # keep the kept set when a record is pickled (gathered across processes)
        return (SampledLogprob, (float(self), self.kept_ids, self.kept_logps))


def sampling_warpers(generation_config: GenerationConfig) -> LogitsProcessorList:
    """The warpers transformers applies after custom logits processors when it samples, in its order."""
    warpers = LogitsProcessorList()
    if generation_config.temperature is not None and generation_config.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(generation_config.temperature))
    if generation_config.top_k:
        warpers.append(TopKLogitsWarper(top_k=generation_config.top_k))
    if generation_config.top_p is not None and generation_config.top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=generation_config.top_p))
    if generation_config.min_p is not None:
        warpers.append(MinPLogitsWarper(min_p=generation_config.min_p))
    return warpers


class SamplerLogprobRecorder(LogitsProcessor):
    """Records log mu of each token transformers samples, and optionally the sampler's top-K, during `generate()`.

    transformers runs logits processors passed to `generate()` before its sampling warpers, so the recorder applies
    the same warpers to a copy of the scores; it returns the scores unchanged. A token is only known once sampled, so
    the distribution of one step waits (one `(batch, vocab)` tensor) until the next call shows the sampled token;
    `finish` resolves the last step. Memory is of order batch x vocabulary, not length x batch x vocabulary.
    """

    def __init__(self, generation_config: GenerationConfig, topk: int = 0):
        self.warpers = sampling_warpers(generation_config)
        self.topk = topk
        self._pending: torch.Tensor | None = None
        self._logps: list[torch.Tensor] = []
        self._kept_ids: list[torch.Tensor] = []
        self._kept_logps: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self._pending is not None:
            self._resolve(input_ids[:, -1])
        self._pending = torch.log_softmax(self.warpers(input_ids, scores.float().clone()), dim=-1)
        return scores

    def _resolve(self, tokens: torch.Tensor) -> None:
        logps = self._pending
        sampled = logps.gather(-1, tokens[:, None]).squeeze(-1)
        self._logps.append(sampled)
        if self.topk:
            top_logps, top_ids = logps.topk(self.topk, dim=-1)
            in_top = (top_ids == tokens[:, None]).any(-1)
            extra_id = torch.where(in_top, torch.full_like(tokens, VOID_ID), tokens)
            extra_logp = torch.where(in_top, torch.full_like(sampled, -math.inf), sampled)
            self._kept_ids.append(torch.cat([top_ids, extra_id[:, None]], dim=-1))
            self._kept_logps.append(torch.cat([top_logps, extra_logp[:, None]], dim=-1))
        self._pending = None

    def finish(self, completion_ids: list[list[int]]) -> list[list[SampledLogprob]]:
        """Resolve the last step and return the records of each completion (as truncated by the trainer)."""
        if self._pending is not None:
            steps = len(self._logps) + 1
            last = [ids[steps - 1] if len(ids) == steps else 0 for ids in completion_ids]
            self._resolve(torch.tensor(last, device=self._pending.device))
        logps = torch.stack(self._logps, dim=1).tolist() if self._logps else [[] for _ in completion_ids]
        if self.topk:
            kept_ids = torch.stack(self._kept_ids, dim=1).tolist()
            kept_logps = torch.stack(self._kept_logps, dim=1).tolist()
        records = []
        for i, ids in enumerate(completion_ids):
            if self.topk:
                row = [
                    SampledLogprob(v, tuple(ids_t), tuple(lps_t))
                    for v, ids_t, lps_t in zip(logps[i], kept_ids[i], kept_logps[i])
                ]
            else:
                row = [SampledLogprob(v) for v in logps[i]]
            records.append(row[: len(ids)])
        return records


@contextmanager
def recording_generate(model: torch.nn.Module, recorder: LogitsProcessor) -> Iterator[None]:
    """Within the block, `model.generate(...)` also runs `recorder` as a logits processor."""
    original = model.generate

    @functools.wraps(original)
    def generate(*args, **kwargs):
        processors = LogitsProcessorList(kwargs.pop("logits_processor", None) or [])
        processors.append(recorder)
        return original(*args, logits_processor=processors, **kwargs)

    model.generate = generate
    try:
        yield
    finally:
        del model.generate  # back to the class's method


def _record_from_vllm(ids: list[int], logps: list[float | None], token: int, topk: int) -> SampledLogprob:
    """One position of vLLM's output (entries sorted by rank, the sampled token included) as a record."""
    as_float = [math.nan if lp is None else lp for lp in logps]  # vLLM reports a NaN log-prob as None
    value = as_float[ids.index(token)] if token in ids else math.nan
    if not topk:
        return SampledLogprob(value)
    top_ids, top_logps = list(ids[:topk]), as_float[:topk]
    if token in top_ids:
        top_ids.append(VOID_ID)
        top_logps.append(-math.inf)
    else:
        top_ids.append(token)
        top_logps.append(value)
    return SampledLogprob(value, tuple(top_ids), tuple(top_logps))


def record_vllm_logprobs(generate: Callable, topk: int = 0) -> Callable:
    """Wrap `VLLMGeneration.generate` so that entry 0 of each token's log-probabilities is the sampled token's record.

    GRPOTrainer keeps entry 0 of what the backend returns for each token; vLLM sorts the entries by rank, so without
    this wrapper a request for K > 0 log-probabilities would make it keep the most likely token's, not the sampled one.
    """

    @functools.wraps(generate)
    def wrapped(*args, **kwargs):
        prompt_ids, completion_ids, logprobs, logprob_token_ids = generate(*args, **kwargs)
        if logprobs is None or logprob_token_ids is None:
            raise RuntimeError(
                "vLLM returned no log-probabilities; DPPO needs the sampler's log-probability of every sampled token."
            )
        records = [
            [[_record_from_vllm(ids, lps, token, topk)] for ids, lps, token in zip(seq_ids, seq_lps, seq, strict=True)]
            for seq_ids, seq_lps, seq in zip(logprob_token_ids, logprobs, completion_ids, strict=True)
        ]
        return prompt_ids, completion_ids, records, logprob_token_ids

    return wrapped


def sync_weights_in_place(vllm_generation) -> None:
    """Push the training weights into a colocated vLLM engine with the model runner's `reload_weights`.

    TRL's colocate sync calls `load_weights` one parameter at a time, which fails on vLLM's CPU backend (it prepacks
    linear weights: "'Parameter' object has no attribute 'weight_loader'"). `reload_weights` runs vLLM's layerwise
    reload, which handles the prepacked layers. TRL's iterator yields PEFT weights while the adapters are merged and
    unmerges them after its last item; each tensor is copied as it is yielded, because vLLM may hold a layer's tensors
    until the layer is complete, by which time the live tensors would be unmerged again.
    """
    runner = vllm_generation.llm.llm_engine.model_executor.driver_worker.model_runner
    weights = ((name, tensor.detach().clone()) for name, tensor in vllm_generation._iter_named_params())
    runner.reload_weights(weights_iterator=weights)
    vllm_generation.llm.reset_prefix_cache()


def kept_set_tensors(
    records: list[list[float | None]], length: int, topk: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad the kept sets carried by the rollout's records into `(B, length, K + 1)` id and log-prob tensors.

    Tokens that carry no kept set (tool-result tokens, padding) get empty slots (id -1, log-prob -inf).
    """
    void_ids, void_logps = (VOID_ID,) * (topk + 1), (-math.inf,) * (topk + 1)
    ids, logps = [], []
    for row in records:
        kept = list(row[:length]) + [None] * (length - len(row))
        has = [isinstance(r, SampledLogprob) and bool(r.kept_ids) for r in kept]
        ids.append([r.kept_ids if h else void_ids for r, h in zip(kept, has)])
        logps.append([r.kept_logps if h else void_logps for r, h in zip(kept, has)])
    return (
        torch.tensor(ids, dtype=torch.long, device=device).view(len(records), length, topk + 1),
        torch.tensor(logps, dtype=torch.float32, device=device).view(len(records), length, topk + 1),
    )
