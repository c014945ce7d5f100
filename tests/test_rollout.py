"""Recording the sampler's probabilities: transformers generation and vLLM's output format."""

from __future__ import annotations

import math

import torch
from transformers import GenerationConfig

from trl_dppo.rollout import (
    VOID_ID,
    SampledLogprob,
    SamplerLogprobRecorder,
    kept_set_tensors,
    record_vllm_logprobs,
    recording_generate,
)

from .conftest import build_tiny_model


def test_recorder_records_the_processed_distribution_of_the_sampled_token():
    """mu is log_softmax after temperature and top-p, the distribution the token was drawn from."""
    config = GenerationConfig(do_sample=True, temperature=0.5, top_p=0.9)
    recorder = SamplerLogprobRecorder(config)
    scores = torch.randn(3, 50)
    recorder(torch.zeros(3, 4, dtype=torch.long), scores.clone())
    sampled = torch.tensor([[0], [7], [49]])
    records = recorder.finish(sampled.tolist())
    probs = torch.softmax(scores / 0.5, -1)
    sorted_probs, order = probs.sort(-1, descending=True)
    outside = (sorted_probs.cumsum(-1) - sorted_probs) > 0.9  # tokens top-p removes
    nucleus = probs.clone().scatter_(-1, order, sorted_probs.masked_fill(outside, 0.0))
    expected = (nucleus / nucleus.sum(-1, keepdim=True)).log().gather(-1, sampled)
    for row, want in zip(records, expected.squeeze(-1).tolist()):
        assert len(row) == 1 and isinstance(row[0], SampledLogprob)
        assert (math.isinf(want) and math.isinf(row[0])) or abs(row[0] - want) < 1e-5


def test_kept_set_adds_the_sampled_token_only_when_outside_the_top_k():
    recorder = SamplerLogprobRecorder(GenerationConfig(do_sample=True), topk=3)
    scores = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0], [5.0, 4.0, 3.0, 2.0, 1.0]])
    recorder(torch.zeros(2, 1, dtype=torch.long), scores)
    inside, outside = recorder.finish([[1], [4]])
    logps = torch.log_softmax(scores[0], -1)
    assert inside[0].kept_ids == (0, 1, 2, VOID_ID)
    assert inside[0].kept_logps[3] == -math.inf
    assert outside[0].kept_ids == (0, 1, 2, 4)
    assert abs(outside[0].kept_logps[3] - logps[4].item()) < 1e-6
    assert abs(float(outside[0]) - logps[4].item()) < 1e-6
    assert all(abs(a - b) < 1e-6 for a, b in zip(inside[0].kept_logps[:3], logps[:3].tolist()))


def test_recorder_during_generate_matches_a_full_forward_for_completions_of_different_lengths(tokenizer):
    model = build_tiny_model(tokenizer, head_scale=10.0).eval()
    prompt = tokenizer(
        ["Hello there", "A longer prompt for the second row"], return_tensors="pt", padding=True, padding_side="left"
    )
    torch.manual_seed(0)
    config = GenerationConfig(do_sample=True, temperature=0.8, max_new_tokens=12, pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        probe = model.generate(**prompt, generation_config=config)
    # Make a token that the model emits often the end-of-sequence token, so the rows stop at different steps
    eos = probe[:, prompt["input_ids"].size(1) + 2].tolist()[0]
    config.eos_token_id = eos
    recorder = SamplerLogprobRecorder(config)
    torch.manual_seed(1)
    with torch.no_grad(), recording_generate(model, recorder):
        full = model.generate(**prompt, generation_config=config)
    assert "generate" not in vars(model)  # the wrapper is removed after the block
    completion = full[:, prompt["input_ids"].size(1) :]
    completion_ids = []
    for row in completion.tolist():
        completion_ids.append(row[: row.index(eos) + 1] if eos in row else row)
    records = recorder.finish(completion_ids)
    with torch.no_grad():
        logits = model(
            full,
            attention_mask=(full != tokenizer.pad_token_id)
            | (torch.arange(full.size(1)) >= prompt["input_ids"].size(1)),
        ).logits
    expected = torch.log_softmax(logits[:, prompt["input_ids"].size(1) - 1 : -1] / 0.8, -1)
    expected = expected.gather(-1, completion[..., None]).squeeze(-1)
    for i, row in enumerate(records):
        assert len(row) == len(completion_ids[i])
        torch.testing.assert_close(torch.tensor([float(r) for r in row]), expected[i, : len(row)], atol=1e-4, rtol=0)


def test_vllm_records_find_the_sampled_token_by_id_not_by_rank():
    """vLLM sorts each token's log-probabilities by rank; TRL keeps entry 0. The wrapper puts the sampled token there."""
    ids = [[[11, 12, 13], [21, 22]]]  # position 0: sampled 13 ranks 3rd (outside top-2); position 1: sampled 22
    logps = [[[-0.1, -2.0, -5.0], [-0.5, -1.0]]]

    def generate(*args, **kwargs):
        return [[1, 2]], [[13, 22]], logps, ids

    _, _, records, _ = record_vllm_logprobs(generate, topk=2)()
    first, second = records[0][0][0], records[0][1][0]
    assert float(first) == -5.0 and first.kept_ids == (11, 12, 13) and first.kept_logps == (-0.1, -2.0, -5.0)
    assert float(second) == -1.0 and second.kept_ids == (21, 22, VOID_ID)
    # binary mode: no kept set; a NaN log-prob reported as None stays missing
    _, _, records, _ = record_vllm_logprobs(lambda: ([[1]], [[5]], [[[None]]], [[[5]]]), topk=0)()
    assert math.isnan(records[0][0][0]) and records[0][0][0].kept_ids == ()


def test_kept_sets_pad_tool_tokens_and_padding_with_empty_slots():
    """Tool-result tokens carry plain floats after TRL's tool-call stitching; they and padding get empty slots."""
    rec = SampledLogprob(-0.2, (3, 4, VOID_ID), (-0.2, -1.5, -math.inf))
    records = [[rec, 0.0, 0.0, rec], [rec]]
    ids, logps = kept_set_tensors(records, length=4, topk=2, device=torch.device("cpu"))
    assert ids.shape == (2, 4, 3) and logps.dtype == torch.float32
    assert ids[0, 0].tolist() == [3, 4, VOID_ID] and ids[0, 3].tolist() == [3, 4, VOID_ID]
    assert (ids[0, 1:3] == VOID_ID).all() and (ids[1, 1:] == VOID_ID).all()
    assert torch.isinf(logps[1, 1:]).all()


def test_records_survive_pickling():
    rec = SampledLogprob(-0.3, (1, 2), (-0.3, -2.0))
    import pickle

    copy = pickle.loads(pickle.dumps(rec))
    assert float(copy) == -0.3 and copy.kept_ids == (1, 2) and copy.kept_logps == (-0.3, -2.0)
