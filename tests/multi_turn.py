"""Tool calling and environments under DPPOTrainer as a TRL user runs them: the setup `test_tools*.py` share.

SmolLM2's chat template renders no tools, so the runs give its tokenizer Qwen2.5's (shipped with TRL; ChatML like
SmolLM2's, tool calls written `<tool_call>{json}</tool_call>`, and a response template TRL knows, so GRPOTrainer
parses the calls). A tiny model never writes a tool call by itself; two ways make one happen inside a real sampler:

- transformers generation: `force_on_first_turn` wraps the model's `generate` at instance level, as a library or a
  user would, and passes it a `LogitsProcessor` that forces the call's tokens in every other row of a first turn.
  `_sample` still draws each of them (from a one-hot distribution) and DPPO's recorder records that distribution;
  the post-tool turn is sampled freely. The wrapper must survive DPPO's recorder for the calls to go on happening.
- vLLM: a logits processor that forces tokens changes what vLLM reports as mu (processed log-probabilities are taken
  after vLLM's logits processors, `vllm/v1/sample/sampler.py`, and no untruncated mu_base is returned), and TRL
  creates the engine without a way to pass one. So the vLLM runs use a tiny model trained in the session to write the
  call three times in four (`train_tool_caller`): vLLM samples it from the model's own distribution, like any token.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.generation.logits_process import LogitsProcessor, LogitsProcessorList
from trl.chat_template_utils import add_response_schema, qwen2_5_chat_template

from trl_dppo.records import tagged_rows

from .conftest import build_tiny_model


PROMPT = [{"role": "user", "content": "What is 3 times 4?"}]
TOOL_CALL = '<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call><|im_end|>'
TOOL_RESPONSE = "<tool_response>\n12\n</tool_response>"
TOPK = 5
# DPPO's threshold in these runs: far above the sampler-trainer gap in fp32 (~1e-5) and far below what one update at
# learning rate 1e-2 moves (~1e-2 to 1)
DELTA = 1e-3


def divergence_settings(divergence: str) -> dict[str, Any]:
    return {"divergence": divergence, "divergence_delta": DELTA, "divergence_topk": TOPK}


def with_tool_chat_template(tokenizer):
    """A copy of `tokenizer` that renders and parses tools: Qwen2.5's chat template, and the response template TRL
    pairs with it (the copy would otherwise keep SmolLM2's, which parses replies as plain text: no call is ever
    executed)."""
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = qwen2_5_chat_template
    return add_response_schema(tokenizer)


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a * b


class MultiplyEnvironment:
    """An environment whose one tool is `multiply`; it counts the calls of its rollout and owns part of the reward."""

    def __init__(self):
        self.calls = 0

    def reset(self, **kwargs) -> None:
        self.calls = 0

    def multiply(self, a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        self.calls += 1
        return a * b

    def get_reward(self) -> float:
        return float(self.calls)


def tool_source(source: str) -> dict[str, Any]:
    """DPPOTrainer's arguments for a run whose tool is `multiply`: a plain function, or an environment's method."""
    return {"tools": [multiply]} if source == "tools" else {"environment_factory": MultiplyEnvironment}


def tool_results(completion: list[dict]) -> list[str]:
    """The contents of a conversational completion's tool messages that are not errors."""
    return [m["content"] for m in completion if m["role"] == "tool" and "error" not in m["content"]]


@dataclass
class CallsSeen:
    """What the reward function saw of each rollout: its successful tool results, and its environment's counter."""

    results: list[list[str]] = field(default_factory=list)
    environment_calls: list[int] = field(default_factory=list)

    def reward(self, completions, environments=None, **kwargs) -> list[float]:
        """A reward with spread within each group (tool results and the last message's length)."""
        results = [tool_results(c) for c in completions]
        self.results += results
        if environments is not None:
            self.environment_calls += [environment.calls for environment in environments]
        return [len(r) + len(c[-1].get("content") or "") % 5 for r, c in zip(results, completions, strict=True)]


class ForceTokens(LogitsProcessor):
    """Makes `rows` of one `generate()` call write `token_ids` first: their scores become a one-hot distribution until
    the sequence is written, and `_sample` draws it."""

    def __init__(self, token_ids: list[int], prompt_length: int, rows: list[int]):
        self.token_ids, self.prompt_length, self.rows = token_ids, prompt_length, rows

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        step = input_ids.size(1) - self.prompt_length
        if step >= len(self.token_ids):
            return scores
        forced = torch.full_like(scores[self.rows], -math.inf)
        forced[:, self.token_ids[step]] = 0.0
        scores = scores.clone()
        scores[self.rows] = forced
        return scores


def force_on_first_turn(model, tokenizer, text: str) -> list[list[int]]:
    """Wrap `model.generate` on the instance so that every other row of a first turn (a prompt without a tool response)
    starts with `text`; the other calls get no processor. Returns the forced rows of each call, appended as it runs."""
    token_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    generate = model.generate
    forced_rows = []

    def forcing_generate(*args, input_ids, **kwargs):
        first_turn = ["<tool_response>" not in prompt for prompt in tokenizer.batch_decode(input_ids)]
        rows = [row for row in range(0, len(input_ids), 2) if first_turn[row]]
        forced_rows.append(rows)
        if rows:
            kwargs["logits_processor"] = LogitsProcessorList([ForceTokens(token_ids, input_ids.size(1), rows)])
        return generate(*args, input_ids=input_ids, **kwargs)

    model.generate = forcing_generate
    return forced_rows


def train_tool_caller(tokenizer):
    """A tiny model (wide enough for vLLM's CPU attention) that answers `PROMPT` with `TOOL_CALL` three times in four
    (else "I...") and writes the call's other tokens with probability near 1: its transformer layers are trained on
    that one conversation (the embeddings and the peaked LM head stay as built)."""
    model = build_tiny_model(tokenizer, hidden_size=256, head_scale=10.0)
    prompt = tokenizer.apply_chat_template(
        PROMPT, tools=[multiply], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    call = tokenizer(TOOL_CALL, add_special_tokens=False)["input_ids"]
    alternative = tokenizer("I", add_special_tokens=False)["input_ids"][0]
    input_ids, targets = torch.tensor([prompt + call]), torch.tensor(call)
    model.model.embed_tokens.weight.requires_grad_(False)
    model.lm_head.weight.requires_grad_(False)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(80):  # about 4 s on 2 cores
        hidden = model.model(input_ids=input_ids).last_hidden_state[0, len(prompt) - 1 : -1]
        logps = model.lm_head(hidden).log_softmax(-1)
        at_call = logps.gather(-1, targets[:, None]).squeeze(-1)
        loss = -(at_call[1:].sum() + 0.75 * at_call[0] + 0.25 * logps[0, alternative])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    probs = at_call.detach().exp()
    if not (0.6 < probs[0] < 0.9 and probs[1:].min() > 0.9):
        raise RuntimeError(f"The tool caller did not learn the call: probabilities {probs.tolist()}.")
    return model.requires_grad_(True)


@dataclass
class LossSeen:
    """One loss computation as DPPO's trust region saw it."""

    at_sync: bool  # no update since the batch was sampled: the weights that train are the weights that sampled
    inputs: dict[str, torch.Tensor]  # the micro-batch; `advantages` holds the trust region's weights (0 off the loss)
    trainer_logps: torch.Tensor  # log pi of each completion token
    top_logps: torch.Tensor | None = None  # top-K: the trainer's K + 1 largest log-probabilities at each token
    at_kept_ids: torch.Tensor | None = None  # top-K: the trainer's log-probabilities at the sampler's K kept ids

    @property
    def loss_mask(self) -> torch.Tensor:
        return (self.inputs["completion_mask"] * self.inputs["tool_mask"]).bool()

    @property
    def tool_results(self) -> torch.Tensor:
        return (self.inputs["completion_mask"] * (1 - self.inputs["tool_mask"])).bool()


@dataclass
class Run:
    """A trainer trained with every generation batch and loss computation recorded."""

    trainer: Any
    generations: list[tuple] = field(default_factory=list)  # what `_generate` returned
    losses: list[LossSeen] = field(default_factory=list)

    @property
    def logs(self) -> list[dict]:
        return [entry for entry in self.trainer.state.log_history if "loss" in entry]


def train_and_record(trainer) -> Run:
    run = Run(trainer)
    generate, set_weights = trainer._generate, trainer._set_trust_region_advantages

    def spy_generate(prompts):
        output = generate(prompts)
        run.generations.append(output)
        return output

    def spy_weights(context, trainer_logps, hidden):
        at_sync = trainer.state.global_step == trainer._generated_at_step
        set_weights(context, trainer_logps, hidden)
        seen = LossSeen(at_sync, dict(context.inputs), trainer_logps.clone())
        if hidden is not None:  # top-K: the full distribution pi, from the loss's own hidden states
            head = trainer._causal_lm().get_output_embeddings()
            logps = (head(hidden).float() / trainer.temperature).log_softmax(-1)
            seen.top_logps = logps.topk(TOPK + 1).values
            kept_ids = context.inputs["sampler_kept_ids"][..., :TOPK].long()
            seen.at_kept_ids = logps.gather(-1, kept_ids.clamp_min(0))
        run.losses.append(seen)

    trainer._generate, trainer._set_trust_region_advantages = spy_generate, spy_weights
    trainer.train()
    return run


# ----------------------------------------------------------------------------------------------- shared assertions


def assert_tool_called_and_answered_in_every_generation(run: Run, calls: CallsSeen) -> None:
    """TRL's own checks: the tool-call frequency is positive at every generation and every successful call got its
    result; an environment counted exactly the calls of its rollout."""
    frequencies = [entry["tools/call_frequency"] for entry in run.logs if "tools/call_frequency" in entry]
    assert len(frequencies) == len(run.generations) >= 2 and min(frequencies) > 0, frequencies
    assert all(result == "12" for results in calls.results for result in results)
    assert sum(map(len, calls.results)) > 0
    if calls.environment_calls:
        assert calls.environment_calls == [len(results) for results in calls.results]


def assert_tool_results_leave_the_loss(run: Run, tokenizer) -> None:
    """Tokens with tool_mask 0 are exactly the tool's answer (its chat-template turn), and carry no weight."""
    tool_tokens = 0
    for seen in run.losses:
        results = seen.tool_results
        tool_tokens += int(results.sum())
        assert not (seen.loss_mask & results).any()
        assert (seen.inputs["advantages"][results] == 0).all()
        for ids, row_results in zip(seen.inputs["completion_ids"], results, strict=True):
            if row_results.any():
                assert TOOL_RESPONSE in tokenizer.decode(ids[row_results])
    assert tool_tokens > 0


def assert_every_model_token_carries_a_record_row(run: Run) -> None:
    """In a batch that needs records (top-K kept sets, or mu_base), each model token's float, after TRL's tool-call
    stitching, carries its record's row (`records.tagged_rows`), and no tool-result token does."""
    for _, completion_ids, tool_mask, _, logprobs, *_ in run.generations:
        length = max(map(len, completion_ids))
        rows = tagged_rows(logprobs, length)
        for row, ids, mask in zip(rows, completion_ids, tool_mask, strict=True):
            assert (row[: len(ids)] >= 0).tolist() == [bool(m) for m in mask]


def assert_mu_is_pi_on_the_weights_that_sampled(run: Run, tolerance: float, forced: list[int] | None = None):
    """On the first loss computation after each generation (the weights that sampled, as at learning rate 0), every
    model token's sampler distribution equals the trainer's at the sampled token, within `tolerance` in probability:
    mu_base (log_softmax(logits / T), recorded when the sampler's chain did more than temperature) everywhere, and mu
    itself at every token the model sampled. Tokens a processor forced (`forced` at the start of a row) were drawn
    from a one-hot distribution: their mu is exactly 1, and their mu_base is pi."""
    at_sync = [seen for seen in run.losses if seen.at_sync]
    assert len(at_sync) >= 2
    forced_tokens = 0
    for seen in at_sync:
        mask, pi = seen.loss_mask, seen.trainer_logps.exp()
        mu = seen.inputs["sampling_per_token_logps"]
        base = seen.inputs.get("sampler_base_logps", mu)
        assert (base.exp() - pi).abs()[mask].max() < tolerance
        is_forced = torch.zeros_like(mask)
        if forced:
            n = len(forced)
            is_forced[:, :n] = (seen.inputs["completion_ids"][:, :n] == torch.tensor(forced)).all(-1, keepdim=True)
            assert (mu[is_forced] == 0).all()
            forced_tokens += int(is_forced.sum())
        sampled = mask & ~is_forced
        assert (mu.exp() - pi).abs()[sampled].max() < tolerance
        # The check can see a wrong mu: the records shifted by one token are far from pi
        shifted = (base[:, 1:].exp() - pi[:, :-1]).abs()[mask[:, 1:] & mask[:, :-1]]
        assert shifted.max() > 0.1
    assert forced_tokens > 0 or not forced


def assert_kept_sets_are_the_models_top_k(run: Run, tolerance: float) -> None:
    """On the weights that sampled, the sampler's K kept log-probabilities are the trainer's K largest, and the
    trainer gives the kept ids those log-probabilities (so the ids are its top K, ties within `tolerance` aside)."""
    at_sync = [seen for seen in run.losses if seen.at_sync]
    for seen in at_sync:
        mask = seen.loss_mask
        kept = seen.inputs["sampler_kept_logps"][..., :TOPK]
        assert (kept.exp() - seen.top_logps[..., :TOPK].exp()).abs()[mask].max() < tolerance
        assert (kept.exp() - seen.at_kept_ids.exp()).abs()[mask].max() < tolerance
    assert at_sync


def assert_the_mask_acts_only_off_policy(run: Run, tolerance: float) -> None:
    """On the weights that sampled nothing is masked (the gap is precision, below delta); on the loss computation after
    an update pi has moved away from mu and the mask blocks some model tokens (never a tool-result token: their weight
    is 0 whatever the mask)."""
    assert [seen.at_sync for seen in run.losses] == [True, False, True]
    masked = [entry["trust_region/masked_fraction"] for entry in run.logs]
    assert masked[0] == masked[2] == 0.0 and masked[1] > 0.0, masked
    off_policy = run.losses[1]
    mu = off_policy.inputs.get("sampler_base_logps", off_policy.inputs["sampling_per_token_logps"])
    assert (mu.exp() - off_policy.trainer_logps.exp()).abs()[off_policy.loss_mask].max() > 10 * tolerance
