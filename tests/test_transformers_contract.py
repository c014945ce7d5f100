"""transformers behaviour the recorded mu relies on, pinned so that a new transformers release that changes it fails.

`SamplerLogprobRecorder` is a logits processor passed to `generate()`: it assumes transformers runs the processors
passed in after its own (penalties) and before its sampling warpers, and that the warpers are temperature, top-k,
top-p, min-p in that order (`trl_dppo.rollout.sampling_warpers`). Then the recorded mu equals the distribution
`generate()` samples from, which it reports as its processed scores.
"""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from trl_dppo.rollout import SamplerLogprobRecorder, recording_generate

from .conftest import build_tiny_model


@pytest.mark.parametrize(
    "options",
    [
        dict(temperature=0.7, top_k=20, top_p=0.9, min_p=0.02, repetition_penalty=1.3),
        dict(temperature=1.3, top_k=0, top_p=0.8),
    ],
)
def test_recorded_mu_is_the_distribution_generate_samples_from(tokenizer, options):
    model = build_tiny_model(tokenizer, head_scale=10.0).eval()
    prompt = tokenizer(["Hello there", "A longer prompt"], return_tensors="pt", padding=True, padding_side="left")
    config = GenerationConfig(
        do_sample=True, max_new_tokens=8, pad_token_id=tokenizer.pad_token_id, eos_token_id=None, **options
    )
    recorder = SamplerLogprobRecorder(config)
    torch.manual_seed(0)
    with torch.no_grad(), recording_generate(model, recorder):
        out = model.generate(**prompt, generation_config=config, output_scores=True, return_dict_in_generate=True)
    completion = out.sequences[:, prompt["input_ids"].size(1) :]
    records = recorder.finish(completion.tolist())
    # generate() reports the scores after every processor and warper: the distribution each token was drawn from
    sampled = torch.stack([torch.log_softmax(s.float(), -1) for s in out.scores], 1)
    expected = sampled.gather(-1, completion[..., None]).squeeze(-1)
    recorded = torch.tensor([[float(r) for r in row] for row in records])
    torch.testing.assert_close(recorded, expected, atol=1e-5, rtol=0)
