"""Where the sampler's probabilities are recorded.

DPPO anchors its trust region to mu, the probability the sampler gave each token when it generated it. This module
records mu on both generation backends of GRPOTrainer, without an extra forward pass, into the generation batch's
`SamplerRecords` (`records.py`):

- transformers `generate()`: `SamplerLogprobRecorder` hooks transformers' own processor construction
  (`recording_generate`), so it reads exactly the scores `_sample` softmaxes and draws from, after every processor and
  warper transformers builds from the generation config or is given. A second hook reads the raw logits, for
  log mu_base = log_softmax(logits / T) whenever the chain does more than temperature (truncation, penalties, ...).
- vLLM: `record_vllm_logprobs` wraps `VLLMGeneration.generate`. vLLM returns processed (renormalised) log-probs only.

What GRPOTrainer receives are floats (it threads them through tool calls into `sampling_per_token_logps`); when the
batch needs more than that float, each carries its token's row in the store (`records.tag_logps`).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.logits_process import LogitsProcessor, LogitsProcessorList, TemperatureLogitsWarper

from .records import VOID_ID, SamplerRecords


__all__ = [
    "SamplerLogprobRecorder",
    "check_recordable_sampling",
    "recording_generate",
    "record_vllm_logprobs",
    "sync_weights_in_place",
]

# Generation-config fields that select a decoding method other than transformers' multinomial sampling (`_sample`)
_UNRECORDED_OPTIONS = {
    "num_beams": lambda v: v is not None and v > 1,
    "num_beam_groups": lambda v: v is not None and v > 1,
    "prompt_lookup_num_tokens": lambda v: v is not None,
    "assistant_early_exit": lambda v: v is not None,
    "dola_layers": lambda v: v is not None,
    "penalty_alpha": lambda v: v is not None and v > 0,
    "constraints": lambda v: v is not None,
    "force_words_ids": lambda v: v is not None,
}
# `generate()` arguments that replace the sampling loop or the model that proposes tokens
_UNRECORDED_ARGUMENTS = ("assistant_model", "custom_generate")


def check_recordable_sampling(generation_config: GenerationConfig, **generate_kwargs) -> None:
    """Raise, naming the option, unless `generate()` will draw each token from softmax of its processed scores."""
    for name in _UNRECORDED_ARGUMENTS:
        if generate_kwargs.get(name) is not None:
            raise ValueError(
                f"generate({name}=...) replaces transformers' sampling loop, whose distribution DPPO records as mu. "
                f"Remove {name}, or use vLLM generation (use_vllm=True)."
            )
    if generation_config.do_sample is not True:
        raise ValueError(
            f"do_sample={generation_config.do_sample!r}: DPPO needs the probability each token was sampled with, and "
            "greedy decoding samples nothing. Set do_sample=True (in generation_kwargs)."
        )
    for name, unrecorded in _UNRECORDED_OPTIONS.items():
        value = getattr(generation_config, name, None)
        if unrecorded(value):
            raise ValueError(
                f"{name}={value!r} selects a decoding method other than multinomial sampling, so the distribution a "
                f"token was drawn from is not the one DPPO records as mu. Remove {name} from generation_kwargs."
            )
    mode = generation_config.get_generation_mode()
    if mode != GenerationMode.SAMPLE:
        raise ValueError(f"The generation config selects {mode}; DPPO records mu only for plain sampling ('sample').")


class _Hook(LogitsProcessor):
    """A logits processor that hands the scores to a recorder's method and returns them unchanged."""

    def __init__(self, read: Callable[[torch.Tensor, torch.Tensor], None]):
        self.read = read

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.read(input_ids, scores)
        return scores


class SamplerLogprobRecorder:
    """Records log mu of each token transformers samples (and the top-K, and log mu_base when needed) in `generate()`.

    `processors(chain)` returns transformers' chain with a hook on each side: the last one reads the scores `_sample`
    softmaxes, i.e. the sampling distribution after every processor and warper; the first one reads the raw logits and
    is only added when the chain does more than divide by the trainer's temperature. A token is only known once
    sampled, so a step's distributions wait (`(batch, vocab)` tensors) until the next step shows the sampled token;
    `finish` resolves the last step. Memory is of order batch x vocabulary, plus the records themselves.
    """

    def __init__(self, topk: int = 0, temperature: float = 1.0):
        self.topk = topk
        self.temperature = temperature
        self.with_base = False
        self._raw: torch.Tensor | None = None
        self._pending: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self._steps: dict[str, list[torch.Tensor]] = {"sampled": [], "base": [], "top_ids": [], "top_logps": []}

    def processors(self, chain: LogitsProcessorList) -> LogitsProcessorList:
        """transformers' processor chain for one `generate()` call, with the recorder's hooks around it."""
        self.with_base = any(
            not (isinstance(p, TemperatureLogitsWarper) and p.temperature == self.temperature) for p in chain
        )
        hooked = LogitsProcessorList([_Hook(self._read_raw)] if self.with_base else [])
        hooked.extend(chain)
        hooked.append(_Hook(self._read_processed))
        return hooked

    def _read_raw(self, input_ids: torch.Tensor, logits: torch.Tensor) -> None:
        self._resolve(input_ids[:, -1])
        self._raw = torch.log_softmax(logits.float() / self.temperature, dim=-1)

    def _read_processed(self, input_ids: torch.Tensor, scores: torch.Tensor) -> None:
        self._resolve(input_ids[:, -1])
        self._pending = (torch.log_softmax(scores.float(), dim=-1), self._raw)
        self._raw = None

    def _resolve(self, tokens: torch.Tensor) -> None:
        if self._pending is None:
            return
        processed, base = self._pending
        self._steps["sampled"].append(processed.gather(-1, tokens[:, None]).squeeze(-1))
        if base is not None:
            self._steps["base"].append(base.gather(-1, tokens[:, None]).squeeze(-1))
        if self.topk:  # the top-K the trainer's pi is compared with: under mu_base when it differs
            top_logps, top_ids = (processed if base is None else base).topk(self.topk, dim=-1)
            self._steps["top_ids"].append(top_ids.int())
            self._steps["top_logps"].append(top_logps)
        self._pending = None

    def finish(self, completion_ids: list[list[int]], records: SamplerRecords) -> list[list[float]]:
        """Resolve the last step, store the records of each completion (as truncated by the trainer) in `records`
        and return the sampled log-probabilities per completion, tagged with their rows when the batch needs them."""
        if self._pending is not None:
            steps = len(self._steps["sampled"]) + 1
            last = [ids[steps - 1] if len(ids) == steps else 0 for ids in completion_ids]
            self._resolve(torch.tensor(last, device=self._pending[0].device))
        lengths = [len(ids) for ids in completion_ids]
        steps = len(self._steps["sampled"])
        if steps == 0:
            if any(lengths):
                raise RuntimeError(
                    "generate() sampled tokens but the recorder saw no sampling step: its hooks were not in "
                    "transformers' processor chain."
                )
            return [[] for _ in completion_ids]
        kept = torch.arange(steps) < torch.tensor(lengths)[:, None]  # (B, steps), row-major = token order

        def stacked(key: str) -> torch.Tensor | None:
            return torch.stack(self._steps[key], dim=1).cpu()[kept] if self._steps[key] else None

        sampled = stacked("sampled")
        if self.topk or self.with_base:
            values = records.add(sampled, stacked("top_ids"), stacked("top_logps"), stacked("base")).tolist()
        else:
            values = sampled.tolist()
        ends = list(itertools.accumulate(lengths))
        return [values[end - length : end] for end, length in zip(ends, lengths, strict=True)]


@contextmanager
def recording_generate(model: torch.nn.Module, recorder: SamplerLogprobRecorder) -> Iterator[None]:
    """Within the block, `model.generate(...)` runs `recorder`'s hooks around transformers' own processor chain.

    transformers builds the chain in `_get_logits_processor` (processors, the caller's, then the sampling warpers) and
    `_sample` draws each token from softmax of its output; the hooks are added to what that method returns.
    """
    # A PEFT model's generate() runs the base model's, which builds the chain
    generator = model.get_base_model() if hasattr(model, "get_base_model") else model
    original_generate, original_chain = model.generate, generator._get_logits_processor

    @functools.wraps(original_generate)
    def generate(*args, **kwargs):
        for name in _UNRECORDED_ARGUMENTS:
            if kwargs.get(name) is not None:
                check_recordable_sampling(GenerationConfig(do_sample=True), **kwargs)
        return original_generate(*args, **kwargs)

    @functools.wraps(original_chain)
    def get_logits_processor(*args, **kwargs):
        generation_config = kwargs["generation_config"] if "generation_config" in kwargs else args[0]
        check_recordable_sampling(generation_config)
        return recorder.processors(original_chain(*args, **kwargs))

    model.generate, generator._get_logits_processor = generate, get_logits_processor
    try:
        yield
    finally:
        del model.generate, generator._get_logits_processor  # back to the class's methods


# vLLM output is turned into records this many tokens at a time, which bounds the transient arrays
_VLLM_CHUNK_TOKENS = 1 << 14


def _flat_floats(nested: list, count: int) -> np.ndarray:
    """The floats of a list of lists of lists, in order, as float32."""
    chain = itertools.chain.from_iterable
    try:
        return np.fromiter(chain(chain(nested)), dtype=np.float32, count=count)
    except TypeError:  # vLLM reports a NaN log-prob as None
        return np.array([math.nan if v is None else v for v in chain(chain(nested))], dtype=np.float32)


def _vllm_topk_arrays(completion_ids, logprobs, token_ids, topk: int) -> tuple[np.ndarray, ...]:
    """Sampled log-probs `(N,)`, top-K ids `(N, K)` and log-probs `(N, K)` of a run of sequences of vLLM's output.

    vLLM lists each token's entries by rank, K or K + 1 of them (the sampled token is added when outside the top K).
    """
    chain = itertools.chain.from_iterable
    n = sum(map(len, completion_ids))
    widths = np.fromiter(map(len, chain(token_ids)), dtype=np.int64, count=n)
    total = int(widths.sum())
    ids = np.fromiter(chain(chain(token_ids)), dtype=np.int32, count=total)
    logps = _flat_floats(logprobs, total)
    tokens = np.fromiter(chain(completion_ids), dtype=np.int32, count=n)
    starts = np.cumsum(widths) - widths
    cols = np.arange(topk)
    in_row = cols < widths[:, None]
    index = np.minimum(starts[:, None] + cols, max(total - 1, 0))
    top_ids = np.where(in_row, ids[index], np.int32(VOID_ID))
    top_logps = np.where(in_row, logps[index], np.float32(-np.inf))
    match = top_ids == tokens[:, None]
    sampled = top_logps[np.arange(n), match.argmax(1)]
    extra = np.minimum(starts + topk, max(total - 1, 0))  # the (K+1)-th entry, where vLLM added the sampled token
    extra_match = (widths > topk) & (ids[extra] == tokens)
    sampled = np.where(match.any(1), sampled, np.where(extra_match, logps[extra], np.float32(np.nan)))
    return sampled, top_ids, top_logps


def record_vllm_logprobs(generate: Callable, topk: int = 0, records: Callable[[], SamplerRecords] | None = None):
    """Wrap `VLLMGeneration.generate` so that entry 0 of each token's log-probabilities is the sampled token's.

    With `topk = 0` vLLM is asked for the sampled token's log-probability only (`logprobs=0`), which is already entry
    0: the output passes through untouched. With K > 0 vLLM lists each token's entries by rank and GRPOTrainer keeps
    entry 0; the wrapper stores the top-K in `records()` (the generation batch's store) and puts the sampled token's
    log-probability, tagged with its row, in entry 0.
    """

    @functools.wraps(generate)
    def wrapped(*args, **kwargs):
        prompt_ids, completion_ids, logprobs, logprob_token_ids = generate(*args, **kwargs)
        if logprobs is None or logprob_token_ids is None:
            raise RuntimeError(
                "vLLM returned no log-probabilities; DPPO needs the sampler's log-probability of every sampled token."
            )
        if not topk:
            return prompt_ids, completion_ids, logprobs, logprob_token_ids
        store = records()
        start = 0
        while start < len(completion_ids):
            end, tokens = start, 0
            while end < len(completion_ids) and (tokens < _VLLM_CHUNK_TOKENS or end == start):
                tokens += len(completion_ids[end])
                end += 1
            sampled, top_ids, top_logps = _vllm_topk_arrays(
                completion_ids[start:end], logprobs[start:end], logprob_token_ids[start:end], topk
            )
            tagged = store.add(torch.from_numpy(sampled), torch.from_numpy(top_ids), torch.from_numpy(top_logps))
            # Entry 0 of vLLM's own per-token lists (made for this call) takes the record: no new list per token
            for entry, value in zip(itertools.chain.from_iterable(logprobs[start:end]), tagged.tolist(), strict=True):
                entry[0] = value
            start = end
        return prompt_ids, completion_ids, logprobs, logprob_token_ids

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
