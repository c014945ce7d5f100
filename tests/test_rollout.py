"""Recording the sampler's probabilities: transformers generation (after its own processor chain) and vLLM's output."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import LogitsProcessor, LogitsProcessorList

from trl_dppo.records import VOID_ID, SamplerRecords, tagged_rows
from trl_dppo.rollout import (
    SamplerLogprobRecorder,
    check_recordable_sampling,
    record_vllm_logprobs,
    recording_generate,
)

from .conftest import build_tiny_model, log_softmax_atol


TEMPERATURE = 0.8


class BanEveryThirdToken(LogitsProcessor):
    """A user's logits processor: bans token ids divisible by 3."""

    def __call__(self, input_ids, scores):
        return scores.masked_fill(torch.arange(scores.size(-1)) % 3 == 0, -float("inf"))


@pytest.fixture(scope="module")
def model_and_prompt(tokenizer):
    # head_scale 30: peaked enough that a wrong mu shows, spread enough that truncation removes real mass
    model = build_tiny_model(tokenizer, head_scale=30.0).eval()
    prompt = tokenizer(["Hello there", "Count to five"], return_tensors="pt", padding=True, padding_side="left")
    return model, prompt


# Each option transformers can take (GenerationConfig fields, as TRL's `generation_kwargs` passes them)
OPTIONS = {
    "temperature": {},
    "top_k": {"top_k": 5},
    "top_p": {"top_p": 0.8},
    "min_p": {"min_p": 0.1},
    "typical_p": {"typical_p": 0.9},
    "epsilon_cutoff": {"epsilon_cutoff": 3e-4},
    "eta_cutoff": {"eta_cutoff": 1e-3},
    "repetition_penalty": {"repetition_penalty": 1.5},
    "no_repeat_ngram_size": {"no_repeat_ngram_size": 1},
    "bad_words_ids": {"bad_words_ids": [[i] for i in range(0, 2000, 7)]},
    "suppress_tokens": {"suppress_tokens": list(range(1, 3000, 5))},
    "all_truncations": {"top_k": 20, "top_p": 0.8, "min_p": 0.1},
}


# What `recording_generate` replaces for the duration of a call, on the instance
HOOKED = ("generate", "_get_logits_processor")


def generate_and_record(model, prompt, topk=0, logits_processor=None, records=None, **options):
    settings = dict(do_sample=True, temperature=TEMPERATURE, max_new_tokens=6, top_k=0, pad_token_id=0)
    config = GenerationConfig(**{**settings, "eos_token_id": None, **options})
    recorder = SamplerLogprobRecorder(topk, TEMPERATURE)
    records = SamplerRecords(topk) if records is None else records
    own = [vars(model).get(name) for name in HOOKED]
    with torch.no_grad(), recording_generate(model, recorder):
        out = model.generate(
            **prompt,
            generation_config=config,
            logits_processor=logits_processor,
            output_scores=True,
            output_logits=True,
            return_dict_in_generate=True,
        )
    assert [vars(model).get(name) for name in HOOKED] == own  # hooks removed, the instance's own attributes back
    completion = out.sequences[:, prompt["input_ids"].size(1) :]
    values = recorder.finish(completion.tolist(), records)
    # transformers' own record of the distribution it sampled from, and of the raw logits
    processed = torch.log_softmax(torch.stack(out.scores, 1), -1)
    base = torch.log_softmax(torch.stack(out.logits, 1) / TEMPERATURE, -1)
    return completion, values, records, processed, base


def at(logps, tokens):
    return logps.gather(-1, tokens[..., None]).squeeze(-1)


@pytest.mark.parametrize("option", list(OPTIONS) + ["user_logits_processor"])
def test_recorded_mu_is_what_transformers_sampled_from(model_and_prompt, option):
    """mu = softmax of the scores `_sample` draws from (generate's `output_scores`), whatever the option."""
    model, prompt = model_and_prompt
    options = OPTIONS.get(option, {})
    processors = LogitsProcessorList([BanEveryThirdToken()]) if option == "user_logits_processor" else None
    torch.manual_seed(0)
    completion, values, records, processed, base = generate_and_record(model, prompt, 3, processors, **options)
    mu = torch.tensor(values, dtype=torch.float64).float()  # as GRPOTrainer turns them into a tensor
    # The recorder's log-softmax (logsumexp of the same scores) against transformers' `log_softmax`
    expected = at(processed, completion)
    torch.testing.assert_close(mu, expected, atol=log_softmax_atol(model.vocab_size, expected.abs().max()), rtol=0)
    records.rollout_logprobs = values
    batch = records.batch_tensors(completion, mu, torch.ones_like(completion))
    sampled_base = at(base, completion)
    if option == "temperature":  # nothing beyond the trainer's temperature: nothing extra is stored
        assert "sampler_base_logps" not in batch
    else:  # mu_base = log_softmax(logits / T), the distribution the trainer's pi is, and the top-K under it
        atol = log_softmax_atol(model.vocab_size, sampled_base.abs().max())
        torch.testing.assert_close(batch["sampler_base_logps"], sampled_base, atol=atol, rtol=0)
        assert (processed - base).nan_to_num(nan=0.0).abs().max() > 0.1  # the option changed the distribution
    top_logps, top_ids = base.topk(3, -1)
    assert batch["sampler_kept_ids"][..., :3].tolist() == top_ids.tolist()
    atol = log_softmax_atol(model.vocab_size, top_logps.abs().max())
    torch.testing.assert_close(batch["sampler_kept_logps"][..., :3], top_logps, atol=atol, rtol=0)


def test_the_recorder_runs_after_every_processor_and_warper(model_and_prompt):
    """Pins transformers' order: the chain `_get_logits_processor` returns ends with the warpers (then
    LogitNormalization); the recorder's hook is appended after all of them, and the raw-logits hook put first."""
    model, _ = model_and_prompt
    recorder = SamplerLogprobRecorder(0, TEMPERATURE)
    config = GenerationConfig(
        do_sample=True, temperature=0.5, top_p=0.8, repetition_penalty=1.2, renormalize_logits=True
    )
    with recording_generate(model, recorder):
        chain = model._get_logits_processor(generation_config=config, logits_processor=[BanEveryThirdToken()])
    names = [type(p).__name__ for p in chain]
    assert names == [
        "_Hook",
        "RepetitionPenaltyLogitsProcessor",
        "BanEveryThirdToken",
        "TemperatureLogitsWarper",
        "TopPLogitsWarper",
        "LogitNormalization",
        "_Hook",
    ]


@pytest.mark.parametrize(
    "options, named",
    [
        ({"do_sample": False}, "do_sample"),
        ({"do_sample": True, "num_beams": 2}, "num_beams"),
        ({"do_sample": True, "prompt_lookup_num_tokens": 3}, "prompt_lookup_num_tokens"),
        ({"do_sample": True, "dola_layers": "low"}, "dola_layers"),
    ],
)
def test_options_that_bypass_multinomial_sampling_are_refused_by_name(options, named):
    with pytest.raises(ValueError, match=named):
        check_recordable_sampling(GenerationConfig(**options))


def test_an_assistant_model_is_refused_at_generate(model_and_prompt):
    model, prompt = model_and_prompt
    with recording_generate(model, SamplerLogprobRecorder()), pytest.raises(ValueError, match="assistant_model"):
        model.generate(**prompt, do_sample=True, assistant_model=model, max_new_tokens=2)


def test_vllm_records_find_the_sampled_token_by_id_not_by_rank():
    """vLLM lists each token's entries by rank; TRL keeps entry 0. The wrapper puts the sampled token's there."""
    ids = [[[11, 12, 13], [21, 22]], [[31, 32]]]  # 13 ranks 3rd (outside top 2); 22 and 31 are among the top 2
    logps = [[[-0.1, -2.0, -5.0], [-0.5, -1.0]], [[None, -0.25]]]  # vLLM reports a NaN log-prob as None

    def generate(*args, **kwargs):
        return [[1, 2], [3]], [[13, 22], [31]], logps, ids

    store = SamplerRecords(topk=2)
    _, _, entries, _ = record_vllm_logprobs(generate, topk=2, records=lambda: store)()
    sampled = [[lp[0] for lp in seq] for seq in entries]  # what GRPOTrainer keeps
    assert sampled[0][0] == pytest.approx(-5.0) and sampled[0][1] == pytest.approx(-1.0) and math.isnan(sampled[1][0])
    store.rollout_logprobs = sampled
    completion_ids = torch.tensor([[13, 22], [31, 0]])
    loss_mask = torch.tensor([[1, 1], [1, 0]])
    batch = store.batch_tensors(completion_ids, torch.tensor([[-5.0, -1.0], [math.nan, 0.0]]), loss_mask)
    kept_ids = [[[11, 12, 13], [21, 22, VOID_ID]], [[31, 32, VOID_ID], [VOID_ID] * 3]]
    assert batch["sampler_kept_ids"].tolist() == kept_ids
    assert batch["sampler_kept_logps"][0, 0].tolist() == [pytest.approx(-0.1), -2.0, -5.0]
    assert math.isnan(batch["sampler_kept_logps"][1, 0, 0])  # a NaN leaves the token out of the loss


def test_vllm_binary_output_passes_through_untouched():
    """With logprobs=0 entry 0 is already the sampled token: no per-token work, no rows."""
    output = ([[1]], [[5, 6]], [[[-0.5], [None]]], [[[5], [6]]])
    assert record_vllm_logprobs(lambda: output, topk=0)() == output
    with pytest.raises(RuntimeError, match="no log-probabilities"):
        record_vllm_logprobs(lambda: ([[1]], [[5]], None, None), topk=0)()


def test_vllm_binary_output_with_ranked_entries_takes_the_sampled_tokens_by_id():
    """Asked for logprobs=N, vLLM lists N or N + 1 entries per token by rank, the most likely first: the sampled token's
    entry is found by its id and moved to slot 0, which GRPOTrainer keeps."""
    ids = [[[7, 5], [6, 9, 8]], [[4]]]  # 5 ranks 2nd; 8 is outside the top 2 (listed last); 4 is the most likely
    logps = [[[-0.2, -1.9], [-0.1, -2.5, -4.0]], [[-0.3]]]
    output = ([[1], [2]], [[5, 8], [4]], logps, ids)
    _, _, entries, entry_ids = record_vllm_logprobs(lambda: output, topk=0)()
    assert [[lp[0] for lp in seq] for seq in entries] == [[-1.9, -4.0], [-0.3]]
    assert [[t[0] for t in seq] for seq in entry_ids] == [[5, 8], [4]]
    missing = ([[1]], [[5]], [[[-0.2]]], [[[7]]])
    with pytest.raises(RuntimeError, match="no log-probability for the sampled token 5 at position 0 of completion 0"):
        record_vllm_logprobs(lambda: missing, topk=0)()


def test_vllm_flat_records_take_the_sampled_tokens_entry_only_where_vllm_put_it():
    """vLLM's flat log-probabilities list, per token, the sampled token's entry and then the top K: an entry whose id
    is not the sampled token's stops the call rather than becoming mu."""
    from types import SimpleNamespace

    from trl_dppo.rollout import _flat_kept_sets

    def output(tokens, flat_ids, flat_logps):
        return SimpleNamespace(token_ids=tokens, logprobs=SimpleNamespace(token_ids=flat_ids, logprobs=flat_logps))

    good = output([5, 7], [5, 5, 7, 3], [-0.1, -0.1, -2.0, -0.5])  # K = 1: 5 is its own top 1; 7 is outside it
    sampled, kept_ids, _ = _flat_kept_sets([good], topk=1)
    assert sampled.tolist() == pytest.approx([-0.1, -2.0]) and kept_ids.tolist() == [[5, VOID_ID], [3, 7]]
    ranked = output([5, 7], [5, 5, 3, 7], [-0.1, -0.1, -0.5, -2.0])  # the second token's top 1 listed first
    with pytest.raises(
        RuntimeError, match="list token 3 first at the 1-th token of the call, whose sampled token is 7"
    ):
        _flat_kept_sets([ranked], topk=1)


def test_transformers_binary_records_are_plain_floats_without_rows(model_and_prompt):
    model, prompt = model_and_prompt
    torch.manual_seed(0)
    completion, values, records, processed, _ = generate_and_record(model, prompt)
    assert records.rows == 0 and (tagged_rows(values, 6) == -1).all()
    expected = at(processed, completion)
    atol = log_softmax_atol(model.vocab_size, expected.abs().max())
    torch.testing.assert_close(torch.tensor(values), expected, atol=atol, rtol=0)


def test_a_generate_set_on_the_instance_survives_every_recorded_call(model_and_prompt):
    """A library's or a user's wrapper on the model instance is what the recorder calls through, and what the instance
    has again after each recorded call; the class's methods are never replaced."""
    model, prompt = model_and_prompt
    class_methods = [getattr(type(model), name) for name in HOOKED]
    calls = []

    def wrapper(*args, **kwargs):
        calls.append(kwargs["generation_config"].max_new_tokens)
        return type(model).generate(model, *args, **kwargs)

    model.generate = wrapper
    try:
        for seed in range(3):
            torch.manual_seed(seed)
            _, values, _, _, _ = generate_and_record(model, prompt)
            assert vars(model)["generate"] is wrapper and "_get_logits_processor" not in vars(model)
            assert [len(v) for v in values] == [6, 6]
    finally:
        del model.generate
    assert calls == [6, 6, 6]
    assert [getattr(type(model), name) for name in HOOKED] == class_methods


def test_nested_recordings_restore_the_outer_hooks_then_the_class_methods(model_and_prompt):
    model, _ = model_and_prompt
    with recording_generate(model, SamplerLogprobRecorder()):
        outer = [vars(model)[name] for name in HOOKED]
        with recording_generate(model, SamplerLogprobRecorder()):
            assert [vars(model)[name] for name in HOOKED] != outer
        assert [vars(model)[name] for name in HOOKED] == outer
    assert not [name for name in HOOKED if name in vars(model)]


def test_a_generate_that_bypasses_transformers_sampling_fails_naming_the_cause(model_and_prompt):
    """A replaced `generate` that returns tokens it did not sample through transformers' loop leaves nothing to record
    as mu: the error says so and what to do, instead of blaming the processor chain."""
    model, prompt = model_and_prompt
    length = prompt["input_ids"].size(1)
    model.generate = lambda input_ids, **kwargs: torch.cat([input_ids, torch.full((len(input_ids), 3), 7)], 1)
    recorder = SamplerLogprobRecorder()
    try:
        with recording_generate(model, recorder):
            out = model.generate(**prompt, do_sample=True, max_new_tokens=3)
    finally:
        del model.generate
    with pytest.raises(RuntimeError, match="bypassed transformers' sampling") as error:
        recorder.finish(out[:, length:].tolist(), SamplerRecords())
    assert "no distribution was recorded as mu" in str(error.value)
    assert "a wrapper should call the one it replaces" in str(error.value)


def test_a_call_without_processors_tags_its_tokens_after_one_that_recorded_mu_base(model_and_prompt):
    """Two calls of one generation batch (a tool call between them), a user's processor in the first only: the second
    records no mu_base of its own, and still tags its tokens, since such a batch needs a row for every model token
    (its mu_base is its mu)."""
    model, prompt = model_and_prompt
    records = SamplerRecords(0)
    torch.manual_seed(0)
    _, first, _, _, _ = generate_and_record(model, prompt, 0, LogitsProcessorList([BanEveryThirdToken()]), records)
    _, second, _, _, _ = generate_and_record(model, prompt, 0, None, records)
    assert records.has_base
    assert (tagged_rows(first, 6) >= 0).all() and (tagged_rows(second, 6) >= 0).all()
    records.rollout_logprobs = [row + [0.0] + more for row, more in zip(first, second, strict=True)]
    sampling = torch.tensor(records.rollout_logprobs, dtype=torch.float64).float()
    loss_mask = torch.ones(2, 13)
    loss_mask[:, 6] = 0  # the tool result
    batch = records.batch_tensors(torch.zeros(2, 13, dtype=torch.long), sampling, loss_mask)
    assert torch.equal(batch["sampler_base_logps"][:, 7:], sampling[:, 7:])
