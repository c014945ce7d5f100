"""DPPOTrainer end to end on transformers generation, with a tiny peaked model, SmolLM2's tokenizer and LoRA."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from trl import GRPOConfig, GRPOTrainer

from trl_dppo import DPPOConfig, DPPOTrainer, dppo_per_token_loss
from trl_dppo.diagnostics import MU_BUCKETS
from trl_dppo.records import MissingRecordsError

from .conftest import (
    EPS32,
    LORA,
    PolicyForwardCounter,
    build_tiny_model,
    make_trainer,
    spy_on_trust_region,
    tiny_model_logprob_atol,
)
from .multi_turn import force_on_first_turn


REQUIRED_METRICS = [
    "trust_region/masked_fraction",
    "trust_region/masked_fraction_pos_adv",
    "trust_region/masked_fraction_neg_adv",
    "mismatch/abs_prob_diff_mean",
    "mismatch/abs_prob_diff_max",
    "mismatch/kl_mean",
]


def test_recorded_mu_is_the_samplers_own_probability_token_by_token(tmp_path, tiny_model_dir, prompts, tokenizer):
    """At learning rate 0 the trainer's pi equals the recorded mu at every completion token, to the rounding of two
    float32 forward passes (`conftest.forward_logprob_atol`)."""
    trainer = make_trainer(tmp_path, tiny_model_dir, prompts, tokenizer, learning_rate=0.0, temperature=0.7)
    seen = spy_on_trust_region(trainer)
    trainer.train()
    assert seen
    for mu, pi, mask, _ in seen:
        assert mask.any()
        gap = (mu - pi).abs()[mask]
        assert gap.max() <= tiny_model_logprob_atol(tokenizer, mu[mask]), gap.max()
        # The test can see misalignment: the peaked model's mu shifted by one token is far from pi
        shifted = (mu[:, 1:] - pi[:, :-1]).abs()[mask[:, 1:] & mask[:, :-1]]
        assert shifted.max() > 0.1


def test_trains_with_lora_and_logs_the_trust_region_metrics(tmp_path, tiny_model_dir, prompts, tokenizer):
    trainer = make_trainer(tmp_path, tiny_model_dir, prompts, tokenizer, max_steps=3, log_tokens_by_mu=True)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    after = dict(trainer.model.named_parameters())
    assert any(not torch.equal(before[n], after[n]) for n in before), "LoRA weights did not move"
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 3
    for entry in logs:
        for key in REQUIRED_METRICS + [f"tokens_by_mu/{b}/total" for b in MU_BUCKETS]:
            assert key in entry and math.isfinite(entry[key]), key
        assert 0.0 <= entry["trust_region/masked_fraction"] <= 1.0
        assert entry["mismatch/missing_sampler_logps"] == 0


def test_nothing_set_during_a_loss_computation_survives_it(tmp_path, tiny_model_dir, prompts, tokenizer):
    """`_compute_loss` hands the loss's forward pass one `_LossContext`, set for the loss and cleared after it: the
    trainer has the same attributes before and after every loss computation, and no context outside one."""
    trainer = make_trainer(tmp_path, tiny_model_dir, prompts, tokenizer, max_steps=2, steps_per_generation=2)
    handed = []
    set_weights = trainer._set_trust_region_advantages

    def spy(context, trainer_logps, hidden):
        handed.append(trainer._loss_context is context)
        return set_weights(context, trainer_logps, hidden)

    around = []
    compute_loss = trainer._compute_loss

    def watched(model, inputs):
        before = dict(vars(trainer))
        loss = compute_loss(model, inputs)
        around.append((before, dict(vars(trainer))))
        return loss

    trainer._set_trust_region_advantages, trainer._compute_loss = spy, watched
    trainer.train()
    assert handed == [True, True]
    for before, after in around:
        assert after.keys() == before.keys()
        assert before["_loss_context"] is None and after["_loss_context"] is None
    # The bucket metrics are off by default (log_tokens_by_mu)
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert logs and not [key for entry in logs for key in entry if key.startswith("tokens_by_mu/")]


def test_no_old_logprob_recomputation_where_grpo_runs_one(tmp_path, tiny_model_dir, prompts, tokenizer):
    """steps_per_generation=2 with gradient_accumulation_steps=1: GRPOTrainer recomputes old log-probs, DPPO never."""
    settings = dict(steps_per_generation=2, gradient_accumulation_steps=1, max_steps=2, beta=0.04)
    grpo = make_trainer(tmp_path / "grpo", tiny_model_dir, prompts, tokenizer, GRPOTrainer, GRPOConfig, **settings)
    grpo_counter = PolicyForwardCounter(grpo)
    grpo.train()
    assert grpo_counter.count >= 1  # the counter sees a recomputation pass when there is one

    dppo = make_trainer(tmp_path / "dppo", tiny_model_dir, prompts, tokenizer, **settings)
    dppo_counter = PolicyForwardCounter(dppo)
    dppo.train()
    assert dppo_counter.count == 0
    # beta > 0 still runs the reference pass (through the disabled adapters) and logs GRPO's KL
    assert all("kl" in entry for entry in dppo.state.log_history if "loss" in entry)


def test_gradient_is_mask_times_capped_ratio_times_advantage(tmp_path, tiny_model_dir, prompts, tokenizer):
    """The loss's gradient is that of -sum M_t min(r_t, C) A_t / n_tokens (bnpo), with mu perturbed off pi."""
    trainer = make_trainer(
        tmp_path, tiny_model_dir, prompts, tokenizer, loss_type="bnpo", trust_region_kwargs={"ratio_cap": 3.0}
    )
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    batch = trainer._generate_and_score_completions([prompts[0]] * 4 + [prompts[1]] * 4)
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    length = batch["completion_ids"].size(1)
    with torch.no_grad():
        pi, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, input_ids, attention_mask, length)
    generator = torch.Generator().manual_seed(0)
    shift = torch.empty_like(pi).uniform_(-3.0, 3.0, generator=generator)
    batch["sampling_per_token_logps"] = (pi + shift).clamp(max=0.0)
    batch["advantages"] = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 1.5, -1.5])
    params = [p for p in trainer.model.parameters() if p.requires_grad]

    trainer.model.zero_grad()
    trainer.compute_loss(trainer.model, batch).backward()
    dppo_grads = [p.grad.clone() for p in params]

    trainer.model.zero_grad()
    logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, input_ids, attention_mask, length)
    mu, mask = batch["sampling_per_token_logps"], batch["completion_mask"].bool()
    per_token = dppo_per_token_loss(logps, mu, batch["advantages"][:, None], 0.15, 0.15, "tv", ratio_cap=3.0)
    ((per_token * mask).sum() / mask.sum()).backward()
    for got, want in zip(dppo_grads, (p.grad for p in params), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)
    # the perturbation exercised both the mask and the cap
    weights = -per_token.detach()
    ratio = (pi - mu).exp()
    assert ((weights == 0) & mask & (batch["advantages"][:, None] != 0)).any()
    assert ((ratio > 3.0) & (weights != 0) & mask).any()


def test_missing_sampler_logprobs_leave_the_loss_and_are_counted(tmp_path, tiny_model_dir, prompts, tokenizer):
    trainer = make_trainer(tmp_path, tiny_model_dir, prompts, tokenizer)
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    batch = trainer._generate_and_score_completions([prompts[0]] * 4 + [prompts[1]] * 4)
    batch["sampling_per_token_logps"][:, :3] = float("nan")
    batch["advantages"] = torch.tensor([1.0, -1.0] * 4)
    loss = trainer.compute_loss(trainer.model, batch)
    assert torch.isfinite(loss)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in trainer.model.parameters() if p.grad is not None)
    assert trainer._metrics["train"]["mismatch/missing_sampler_logps"][-1] == 3 * 8
    assert "tool_mask" not in batch  # the caller's batch is left as it was


def test_dapo_normalises_over_the_loss_tokens_that_have_a_sampler_logprob(
    tmp_path, tiny_model_dir, prompts, tokenizer
):
    """Tokens whose mu the sampler did not return (NaN, as vLLM's None) leave `dapo`'s normaliser with the loss."""
    trainer = make_trainer(tmp_path, tiny_model_dir, prompts, tokenizer, loss_type="dapo")
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    generate = trainer._generate

    def without_first_logprobs(prompts):
        output = generate(prompts)
        for logps in output[4]:
            logps[:3] = [float("nan")] * min(3, len(logps))
        return output

    trainer._generate = without_first_logprobs
    contexts = []
    set_advantages = trainer._set_trust_region_advantages

    def keep_context(context, *args):
        contexts.append(context)
        return set_advantages(context, *args)

    trainer._set_trust_region_advantages = keep_context
    batch = trainer._generate_and_score_completions([prompts[0]] * 4 + [prompts[1]] * 4)
    mask = batch["completion_mask"].bool()
    kept = mask & torch.isfinite(batch["sampling_per_token_logps"])
    assert (mask & ~kept).sum() == 3 * 8
    assert batch["num_items_in_batch"] == kept.sum()
    batch["advantages"] = torch.tensor([1.0, -1.0] * 4)
    loss = trainer.compute_loss(trainer.model, batch)
    (context,) = contexts
    # GRPOTrainer's per-token loss is -w_t exactly (its ratio exp(log pi - sg(log pi)) is 1.0), so the two differ only
    # by the order of one float32 sum and one division: a few ulps
    expected = -(context.inputs["advantages"] * kept).sum() / kept.sum()
    assert expected != 0
    torch.testing.assert_close(loss, expected, rtol=8 * EPS32, atol=0.0)


def test_truncated_completions_leave_the_loss_as_in_grpo_with_mask_truncated_completions(
    tmp_path, tiny_model_dir, prompts, tokenizer
):
    """A `generate` wrapper ends every other completion after a few tokens (EOS); the others run into
    max_completion_length. On the same first batch DPPO's loss mask is GRPOTrainer's: truncated completions leave the
    loss whole, in attention and in DPPO's trust region, for every step."""
    batches = {}
    for name, trainer_cls, config_cls in (("grpo", GRPOTrainer, GRPOConfig), ("dppo", DPPOTrainer, DPPOConfig)):
        args = (tmp_path / name, tiny_model_dir, prompts, tokenizer, trainer_cls, config_cls)
        trainer = make_trainer(*args, mask_truncated_completions=True)
        force_on_first_turn(trainer.model, tokenizer, "Done.<|im_end|>")
        seen = batches[name] = []
        compute_loss = trainer._compute_loss

        def spy(model, inputs, compute_loss=compute_loss, seen=seen):
            seen.append({key: inputs[key].clone() for key in ("completion_ids", "completion_mask")})
            return compute_loss(model, inputs)

        trainer._compute_loss = spy
        trust_region = spy_on_trust_region(trainer) if name == "dppo" else None
        trainer.train()
    grpo, dppo = batches["grpo"][0], batches["dppo"][0]
    assert torch.equal(grpo["completion_ids"], dppo["completion_ids"])
    assert torch.equal(grpo["completion_mask"], dppo["completion_mask"])
    assert len(trust_region) == len(batches["dppo"]) == 2
    for batch, (_, _, mask, _) in zip(batches["dppo"], trust_region, strict=True):
        ids = batch["completion_ids"]
        ended = (ids == tokenizer.eos_token_id).any(-1)
        assert ended.any() and (~ended).any()
        assert not batch["completion_mask"][~ended].any() and batch["completion_mask"][ended].any()
        assert not mask[~ended].any()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 2 and all(math.isfinite(entry["loss"]) for entry in logs)


def test_checkpoint_saves_and_training_resumes(tmp_path, tiny_model_dir, prompts, tokenizer):
    first = make_trainer(tmp_path, tiny_model_dir, prompts, tokenizer, save_strategy="steps", save_steps=2)
    first.train()
    checkpoint = tmp_path / "out" / "checkpoint-2"
    assert (checkpoint / "adapter_model.safetensors").exists()
    resumed = make_trainer(tmp_path, tiny_model_dir, prompts, tokenizer, max_steps=3)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 3
    assert resumed.args.divergence == "binary_tv"


def test_needs_a_dppo_config(tmp_path, tiny_model_dir, prompts, tokenizer):
    with pytest.raises(TypeError, match="DPPOConfig"):
        make_trainer(tmp_path, tiny_model_dir, prompts, tokenizer, config_cls=GRPOConfig)


def test_records_lost_on_the_way_to_the_batch_stop_training_with_the_path_named(
    tmp_path, tiny_model_dir, prompts, tokenizer
):
    """A rollout path that rounds the floats to float32 before TRL stitches them loses the row tags; with a top-K
    divergence every token would then read an empty kept set (divergence 0, never masked). Training stops instead."""
    trainer = make_trainer(tmp_path, tiny_model_dir, prompts, tokenizer, divergence="topk_tv", divergence_topk=3)
    generate = trainer._generate_single_turn

    def rounding_to_float32(*args, **kwargs):
        completion_ids, logprobs = generate(*args, **kwargs)
        return completion_ids, [torch.tensor(row).tolist() for row in logprobs]

    trainer._generate_single_turn = rounding_to_float32
    with pytest.raises(MissingRecordsError, match=r"loss tokens carry no row.*transformers generate\(\), through TRL"):
        trainer.train()


@pytest.mark.parametrize("disable_dropout", [None, False], ids=["default", "dropout kept"])
def test_dropout_is_off_by_default_so_a_lora_adapters_dropout_leaves_pi_at_mu(
    tmp_path, tiny_model_dir, prompts, tokenizer, monkeypatch, disable_dropout
):
    """The sampler generates without dropout; by default the training forward has none either, so at learning rate 0
    pi equals mu to float32 rounding (`conftest.forward_logprob_atol`) with lora_dropout=0.1, as with 0. Kept on,
    dropout moves pi off mu (what the test would see)."""
    monkeypatch.setitem(LORA, "lora_dropout", 0.1)
    settings = {} if disable_dropout is None else {"disable_dropout": disable_dropout}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = make_trainer(
            tmp_path, tiny_model_dir, prompts, tokenizer, learning_rate=0.0, max_steps=1, **settings
        )
    kept_warning = [w for w in caught if "disable_dropout=False with dropout in the model" in str(w.message)]
    assert len(kept_warning) == (disable_dropout is False)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # an adapter that has moved off B = 0, so that its dropout changes the forward
        for name, param in trainer.model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator))
    seen = spy_on_trust_region(trainer)
    trainer.train()
    ((mu, pi, mask, _),) = seen
    gap = (mu - pi).abs()[mask].max()
    if disable_dropout is None:
        assert gap <= tiny_model_logprob_atol(tokenizer, mu[mask]), gap
    else:
        assert gap > 1e-2  # 1e-2 is far above the rounding bound (1.7e-4) and far below what dropout does here


def test_attention_dropout_that_disable_dropout_cannot_reach_is_refused(tmp_path, tokenizer, prompts):
    """Llama applies `attention_dropout` inside its attention call, where disable_dropout does not reach."""
    model = build_tiny_model(tokenizer)
    model.config.attention_dropout = 0.1
    model.save_pretrained(tmp_path / "model")
    with pytest.raises(ValueError, match=r"attention_dropout=0.1 .*model_init_kwargs=\{'attention_dropout': 0.0\}"):
        make_trainer(tmp_path, str(tmp_path / "model"), prompts, tokenizer)
    trainer = make_trainer(
        tmp_path, str(tmp_path / "model"), prompts, tokenizer, model_init_kwargs={"attention_dropout": 0.0}
    )
    assert trainer.accelerator.unwrap_model(trainer.model).config.attention_dropout == 0.0


def test_an_unbounded_completion_length_trains_as_in_grpo(tmp_path, tiny_model_dir, prompts, tokenizer):
    """max_completion_length=None: generation stops at the generation config's max_length, as for GRPOTrainer, and
    mu is recorded for every token it samples."""
    trainer = make_trainer(tmp_path, tiny_model_dir, prompts, tokenizer, max_completion_length=None, max_steps=1)
    trainer.train()
    (logs,) = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert math.isfinite(logs["loss"]) and logs["completions/mean_length"] > 10  # past make_trainer's usual 10
    assert logs["mismatch/missing_sampler_logps"] == 0.0


def test_an_unbounded_completion_length_is_refused_with_tools(tmp_path, tiny_model_dir, prompts, tokenizer):
    with pytest.raises(
        ValueError, match="max_completion_length=None with tools or an environment.*Set max_completion"
    ):
        make_trainer(
            tmp_path, tiny_model_dir, prompts, tokenizer, max_completion_length=None, trainer_kwargs={"tools": [len]}
        )
