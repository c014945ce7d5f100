"""AsyncDPPOTrainer's loss and its inputs, without a server: samples go through TRL's own queue, planner and collator.

A stub rollout worker holds the queue and no weight transfer runs, so the tests build the trainer on the tiny model of
`conftest.py` and call `compute_loss` on batches from `get_train_dataloader()`. TRL's loss is the reference: with
per-token advantages w_t and the old log-probabilities set to pi itself (ratio 1, inside the clip), its gradient is
-sum_t w_t grad log pi over TRL's token count, which is what AsyncDPPOTrainer's must be.
"""

from __future__ import annotations

import inspect
import math

import numpy as np
import pytest
import torch
from peft import LoraConfig
from trl.experimental.async_grpo import AsyncGRPOTrainer
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

from trl_dppo import AsyncDPPOConfig, AsyncDPPOTrainer
from trl_dppo.async_trainer import POLICY_VERSION
from trl_dppo.corrections import CORRECTIONS, apply_corrections
from trl_dppo.divergence import binary_divergence
from trl_dppo.trust_regions import TRUST_REGIONS, TrustRegionInput

from .conftest import LORA, NoWeightTransfer, StubRolloutWorker, length_reward


def stub_trainer(tmp_path, model_dir, tokenizer, prompts, samples_per_batch: int = 6, **overrides):
    settings = dict(
        output_dir=str(tmp_path / "out"),
        report_to="none",
        bf16=False,
        per_device_train_batch_size=samples_per_batch,
        token_budget=0,  # a fixed number of samples per batch, and no server to ask for its maximum length
        max_staleness=10,
        learning_rate=0.0,
        gradient_checkpointing=False,
    )
    settings.update(overrides)
    trainer = AsyncDPPOTrainer(
        model=model_dir,
        reward_funcs=length_reward,
        args=AsyncDPPOConfig(**settings),
        train_dataset=prompts,
        processing_class=tokenizer,
        peft_config=LoraConfig(**LORA),
        rollout_worker=StubRolloutWorker(),
        weight_transfer=NoWeightTransfer(),
    )
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop, which these tests do not run
    return trainer


def published_every_update(trainer, versions: int) -> None:
    """The trainer's state after TRL published versions 0 .. `versions` - 1 at steps 0 .. `versions` - 1
    (`weight_sync_steps=1`), at the last of those steps."""
    trainer._published_at = {version: version for version in range(versions)}
    trainer.state.global_step = versions - 1


def sample(tokenizer, group_id: int, reply: list[int], advantage: float, version: int, log_mu: list[float]):
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Count to {group_id}."}], add_generation_prompt=True, return_dict=False
    )
    ids = prompt + reply
    return RolloutSample(
        prompt=[],
        completion=[],
        input_ids=np.array(ids, dtype=np.int64),
        completion_mask=np.array([0] * len(prompt) + [1] * len(reply), dtype=np.int64),
        old_log_probs=np.array([0.0] * len(prompt) + log_mu, dtype=np.float32),
        advantage=advantage,
        model_version=version,
        group_id=group_id,
        metrics={"reward": 0.0},
    )


def replies(seed: int = 0) -> list[tuple[int, list[int], float, int]]:
    """(group, reply, advantage, version) of six replies to one prompt, some sharing their first tokens. One group:
    TRL's planner keeps a group's samples in the order they came, so the loss terms follow this list."""
    rng = np.random.default_rng(seed)
    opening = rng.integers(100, 1000, 3).tolist()
    return [
        (0, opening + rng.integers(100, 1000, 4).tolist(), 1.0, 3),
        (0, opening + rng.integers(100, 1000, 2).tolist(), -1.0, 2),
        (0, rng.integers(100, 1000, 5).tolist(), 0.5, 3),
        (0, rng.integers(100, 1000, 4).tolist(), -0.5, 1),
        (0, opening + rng.integers(100, 1000, 3).tolist(), 1.5, 0),
        (0, rng.integers(100, 1000, 6).tolist(), -1.5, 3),
    ]


def next_batch(trainer, samples) -> dict[str, torch.Tensor]:
    """The first batch of `samples` through TRL's data path. accelerate's dispatcher fetches the next batch before it
    hands out the current one, so the queue gets a second copy for it."""
    for s in [*samples, *samples]:
        trainer.rollout_worker.rollout_buffer.put(s)
    return next(iter(trainer.get_train_dataloader()))


def trainer_log_probs(trainer, batch) -> torch.Tensor:
    """log pi of every loss term, from TRL's own forward (through its loss, with the hook the trainer uses)."""
    captured = []
    hook = trainer.model.register_forward_hook(lambda module, args, output: captured.append(output.log_probs))
    with torch.no_grad():
        AsyncGRPOTrainer.compute_loss(trainer, trainer.model, batch)
    hook.remove()
    terms = batch["token_index"] >= 0
    return captured[0].flatten()[batch["token_index"][terms]]


def gradient(trainer, loss_fn, batch) -> list[torch.Tensor]:
    trainer.model.zero_grad()
    loss_fn(trainer, trainer.model, batch).backward()
    return [p.grad.clone() for p in trainer.model.parameters() if p.requires_grad]


def with_mu_near_pi(trainer, tokenizer, raised: set[int] = frozenset(), seed: int = 0) -> list[RolloutSample]:
    """The six samples with mu close to pi (log mu = log pi + 0.05, ratio 0.95), except at the term indices `raised`,
    where mu = pi + 0.3: D = 0.3 > delta, and PPO's ratio far below 1 - epsilon. pi comes from a first pass."""
    draft = [sample(tokenizer, g, r, a, v, [0.0] * len(r)) for g, r, a, v in replies(seed)]
    pi = trainer_log_probs(trainer, next_batch(trainer, draft)).double()
    log_mu = (pi + 0.05).tolist()
    for term in raised:
        log_mu[term] = float(torch.log(pi[term].exp() + 0.3))
    samples, start = [], 0
    for group, reply, advantage, version in replies(seed):
        samples.append(sample(tokenizer, group, reply, advantage, version, log_mu[start : start + len(reply)]))
        start += len(reply)
    return samples


def reference_batch(batch, pi, weights, missing=None):
    """The batch as TRL's own loss must see it to give DPPO's gradient: advantages w_t, old log-probabilities pi."""
    terms = batch["token_index"] >= 0
    reference = dict(batch)
    reference["advantages"] = batch["advantages"].clone()
    reference["advantages"][terms] = weights
    reference["old_log_probs"] = batch["old_log_probs"].clone()
    reference["old_log_probs"][terms] = pi
    if missing is not None:
        reference["global_n_tokens"] = batch["global_n_tokens"] - missing
    return reference


# Every method that needs only the sampled tokens' log-probabilities (not minirl's recomputed anchor)
SAMPLED_TOKEN_METHODS = [name for name, method in TRUST_REGIONS.items() if not method.recomputes_anchor]


# Tight enough to act on `with_mu_near_pi`'s samples (ratio 0.95, far below it where mu was raised, 1.22 at one term)
CORRECTION_SETTINGS = {
    "icepop": {"low": 0.9, "high": 1.1},
    "geometric_sequence_mask": {"low": 0.9, "high": 1.1},
    "off_policy_sequence_mask": {"delta": 0.1},
    "truncated_importance_weights": {"cap": 1.1},
    "kl_to_sampler": {"tau": 0.01},
}


def by_completion(terms: torch.Tensor, fill) -> torch.Tensor:
    """The flat loss terms of `replies()`' six samples (laid out sample by sample) as one row per completion."""
    lengths = [len(reply) for _, reply, _, _ in replies()]
    return torch.nn.utils.rnn.pad_sequence(list(torch.split(terms, lengths)), batch_first=True, padding_value=fill)


@pytest.mark.parametrize(
    ("trust_region", "corrections"),
    [(name, ()) for name in SAMPLED_TOKEN_METHODS] + [("dppo", tuple(CORRECTIONS)), ("grpo", tuple(CORRECTIONS))],
)
def test_the_gradient_is_trls_loss_with_the_trust_regions_per_token_advantages(
    trust_region, corrections, tmp_path, tiny_model_dir, tokenizer, prompts
):
    trainer = stub_trainer(
        tmp_path,
        tiny_model_dir,
        tokenizer,
        prompts,
        trust_region=trust_region,
        trust_region_corrections=list(corrections),
        trust_region_corrections_kwargs={name: CORRECTION_SETTINGS[name] for name in corrections},
    )
    published_every_update(trainer, versions=4)
    # mu = pi + 0.3 on tokens of each advantage sign: DPPO's mask and PPO's clip block it where A < 0 (pi would move
    # further below mu) and keep it where A > 0
    lengths = [len(reply) for _, reply, _, _ in replies()]
    first = np.cumsum([0, *lengths])[:-1].tolist()  # each sample's first term
    raised = {first[0], first[0] + 1, first[1], first[3] + 1, first[4], first[5] + 2}
    samples = with_mu_near_pi(trainer, tokenizer, raised)
    completion_start = int((samples[2].completion_mask == 0).sum())
    samples[2].old_log_probs[completion_start + 1] -= 0.25  # a ratio of 0.95 e^0.25 = 1.22 for the truncation
    batch = next_batch(trainer, samples)
    terms = batch["token_index"] >= 0
    pi, mu = trainer_log_probs(trainer, batch), batch["old_log_probs"][terms]
    ours = gradient(trainer, AsyncDPPOTrainer.compute_loss, batch)
    # the weights the loss used, from the registry and the corrections, on one row per completion as DPPOTrainer has
    setup = trainer._trust_region
    rows = by_completion(torch.ones_like(pi, dtype=torch.bool), False)
    grid_pi, grid_mu = by_completion(pi, 0.0), by_completion(mu, 0.0)
    grid_advantages = by_completion(batch["advantages"][terms], 0.0)
    x = TrustRegionInput(
        grid_pi, grid_mu, grid_mu, grid_advantages, binary_divergence(grid_mu, grid_pi, setup.kind), grid_pi, rows
    )
    grid_weights, keep = setup.method(x, **setup.settings)
    grid_weights, outputs = apply_corrections(setup.corrections, x, grid_weights)
    weights = grid_weights[rows]
    if trust_region in ("dppo", "grpo"):
        assert 0 < (~keep[rows]).sum() < keep[rows].sum()  # the trust region blocks some tokens, not all
    for name, output in outputs.items():
        if output.affected is not None:
            assert output.affected[rows].any(), f"{name} acted on no token"
        metric = "penalty_mean" if output.affected is None else "token_fraction"
        assert f"corrections/{name}/{metric}" in trainer._metrics["train"]
    reference = gradient(trainer, AsyncGRPOTrainer.compute_loss, reference_batch(batch, pi, weights))
    for mine, theirs in zip(ours, reference, strict=True):
        # the same float32 operations on the same values, summed in another order: float32 rounding
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6 * theirs.abs().max().item())
    if trust_region == "grpo" and not corrections:
        # PPO's clip as TRL computes it: TRL's own loss on the batch as sampled has the same gradient
        theirs = gradient(trainer, AsyncGRPOTrainer.compute_loss, batch)
        for mine, trl in zip(ours, theirs, strict=True):
            torch.testing.assert_close(mine, trl, rtol=1e-5, atol=1e-6 * trl.abs().max().item())


def test_tokens_without_a_sampler_log_prob_leave_the_loss_and_are_counted(
    tmp_path, tiny_model_dir, tokenizer, prompts
):
    trainer = stub_trainer(tmp_path, tiny_model_dir, tokenizer, prompts)
    published_every_update(trainer, versions=4)
    samples = with_mu_near_pi(trainer, tokenizer)
    completion_start = int((samples[0].completion_mask == 0).sum())
    samples[0].old_log_probs[completion_start + 1] = np.nan  # vLLM returned no log-probability
    samples[5].old_log_probs[completion_start + 2] = -9999.0  # vLLM's JSON for -inf
    batch = next_batch(trainer, samples)
    terms = batch["token_index"] >= 0
    mu = batch["old_log_probs"][terms]
    missing = ~torch.isfinite(mu) | (mu <= -9999.0)
    assert missing.sum() == 2
    loss = AsyncDPPOTrainer.compute_loss(trainer, trainer.model, batch)
    assert torch.isfinite(loss)
    ours = gradient(trainer, AsyncDPPOTrainer.compute_loss, batch)
    pi = trainer_log_probs(trainer, batch)
    setup = trainer._trust_region
    mu = torch.where(missing, pi, mu)
    advantages = batch["advantages"][terms]
    weights, _ = setup.method(
        TrustRegionInput(pi, mu, mu, advantages, binary_divergence(mu, pi, setup.kind), pi), **setup.settings
    )
    reference = reference_batch(batch, pi, weights * ~missing, missing=2)
    for mine, theirs in zip(ours, gradient(trainer, AsyncGRPOTrainer.compute_loss, reference), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6 * theirs.abs().max().item())
    assert trainer._metrics["train"]["mismatch/missing_sampler_logps"][-1] == 2


def test_every_loss_term_carries_the_policy_version_that_sampled_it(tmp_path, tiny_model_dir, tokenizer, prompts):
    trainer = stub_trainer(tmp_path, tiny_model_dir, tokenizer, prompts)
    samples = [sample(tokenizer, g, r, a, v, [-1.0] * len(r)) for g, r, a, v in replies()]
    batch = next_batch(trainer, samples)
    terms = batch["token_index"] >= 0
    expected = torch.tensor([s.model_version for s in samples for _ in range(int(s.completion_mask.sum()))])
    assert torch.equal(batch[POLICY_VERSION][terms], expected)  # pack() lays the terms out sample by sample
    assert not any(key.startswith("_dppo") for key in trainer._metrics["train"])  # TRL's collator logged no version


def test_the_trust_region_metrics_are_logged_by_lag_bucket(tmp_path, tiny_model_dir, tokenizer, prompts):
    trainer = stub_trainer(tmp_path, tiny_model_dir, tokenizer, prompts)
    published_every_update(trainer, versions=4)  # the samples' versions 3, 2, 3, 1, 0, 3: lags 0, 1, 0, 2, 3, 0
    batch = next_batch(trainer, with_mu_near_pi(trainer, tokenizer))
    trainer._metrics["train"].clear()
    AsyncDPPOTrainer.compute_loss(trainer, trainer.model, batch)
    metrics = trainer._metrics["train"]
    lengths = [len(reply) for _, reply, _, _ in replies()]
    tokens = {"0": lengths[0] + lengths[2] + lengths[5], "1": lengths[1], "2": lengths[3], "3plus": lengths[4]}
    for bucket, count in tokens.items():
        assert metrics[f"staleness/token_fraction_lag_{bucket}"] == [(count, sum(lengths))]
        ((diff, n),) = metrics[f"mismatch/abs_prob_diff_mean_lag_{bucket}"]
        assert n == count and 0 < diff / n < 0.06  # |pi - mu| with log mu = log pi + 0.05
    assert metrics["staleness/lag_mean"] == [(tokens["1"] + 2 * tokens["2"] + 3 * tokens["3plus"], sum(lengths))]
    assert metrics["staleness/lag_max"] == [3.0]
    assert metrics["trust_region/masked_fraction"] == [(0.0, sum(lengths))]


def test_a_lag_counts_updates_when_a_version_is_published_every_two(tmp_path, tiny_model_dir, tokenizer, prompts):
    """With `weight_sync_steps=2` TRL publishes versions 0, 1, 2, 3 at steps 0, 2, 4, 6: at step 7 a sample of the
    newest version trains on weights one update past those that sampled it, not at lag 0 (the weights that sampled)."""
    trainer = stub_trainer(tmp_path, tiny_model_dir, tokenizer, prompts, weight_sync_steps=2)
    trainer._published_at = {version: 2 * version for version in range(4)}
    trainer.state.global_step = 7
    batch = next_batch(trainer, with_mu_near_pi(trainer, tokenizer))
    trainer._metrics["train"].clear()
    AsyncDPPOTrainer.compute_loss(trainer, trainer.model, batch)
    metrics = trainer._metrics["train"]
    lengths = [len(reply) for _, reply, _, _ in replies()]  # of versions 3, 2, 3, 1, 0, 3: lags 1, 3, 1, 5, 7, 1
    assert metrics["staleness/token_fraction_lag_1"] == [(lengths[0] + lengths[2] + lengths[5], sum(lengths))]
    assert metrics["staleness/token_fraction_lag_3plus"] == [(lengths[1] + lengths[3] + lengths[4], sum(lengths))]
    assert "staleness/token_fraction_lag_0" not in metrics and "staleness/token_fraction_lag_2" not in metrics
    assert metrics["staleness/lag_max"] == [7.0]


def test_samples_of_a_version_the_trainer_never_published_stop_the_loss(tmp_path, tiny_model_dir, tokenizer, prompts):
    trainer = stub_trainer(tmp_path, tiny_model_dir, tokenizer, prompts)
    trainer._published_at = {0: 0, 1: 1}
    batch = next_batch(trainer, with_mu_near_pi(trainer, tokenizer))
    with pytest.raises(RuntimeError, match=r"policy versions \[2, 3\] reached the loss"):
        AsyncDPPOTrainer.compute_loss(trainer, trainer.model, batch)


def test_init_takes_async_grpo_trainers_parameters():
    ours = inspect.signature(AsyncDPPOTrainer.__init__).parameters
    theirs = inspect.signature(AsyncGRPOTrainer.__init__).parameters
    assert [(n, p.kind, p.default) for n, p in ours.items()] == [(n, p.kind, p.default) for n, p in theirs.items()]


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"divergence": "topk_tv"}, "asks vLLM for the sampled token's only"),
        ({"trust_region": "minirl"}, "runs no such pass"),
        ({"top_p": 0.9}, "top_p with vLLM generation changes the sampling distribution"),
        ({"repetition_penalty": 1.1}, "repetition_penalty with vLLM generation"),
        ({"weight_sync_check": "warn"}, "weight_sync_check='warn' is not one of raise, log, off"),
    ],
)
def test_settings_whose_mu_cannot_be_right_are_refused(setting, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        AsyncDPPOConfig(output_dir=str(tmp_path), bf16=False, **setting)


def test_dropout_is_off_by_default_where_async_grpo_leaves_it_on(
    tmp_path, tiny_model_dir, tokenizer, prompts, monkeypatch
):
    """AsyncGRPOConfig has no disable_dropout and AsyncGRPOTrainer trains with the model's dropout; the server samples
    without it, so AsyncDPPOTrainer zeroes it unless told otherwise (as DPPOConfig's disable_dropout)."""
    monkeypatch.setitem(LORA, "lora_dropout", 0.1)

    def dropout_probabilities(trainer):
        return {m.p for m in trainer.model.modules() if isinstance(m, torch.nn.Dropout)}

    assert AsyncDPPOConfig(output_dir=str(tmp_path), bf16=False).disable_dropout is True
    assert dropout_probabilities(stub_trainer(tmp_path, tiny_model_dir, tokenizer, prompts)) == {0.0}
    with pytest.warns(UserWarning, match="disable_dropout=False with dropout in the model"):
        kept = stub_trainer(tmp_path, tiny_model_dir, tokenizer, prompts, disable_dropout=False)
    assert dropout_probabilities(kept) == {0.1}


@pytest.mark.parametrize("trust_region", ["cppo", "ipo"])
def test_cppo_and_ipo_with_every_correction_train_through_trls_loop(
    trust_region, tmp_path, tiny_model_dir, tokenizer, prompts
):
    """Two optimizer steps of TRL's own training loop on queued samples (the second one update stale), every
    correction stacked: the loss is finite and each method's and correction's metrics are logged."""
    trainer = stub_trainer(
        tmp_path,
        tiny_model_dir,
        tokenizer,
        prompts,
        trust_region=trust_region,
        trust_region_corrections=list(CORRECTIONS),
        learning_rate=1e-3,
        max_steps=2,
        logging_steps=1,
    )
    samples = with_mu_near_pi(trainer, tokenizer)
    for s in samples:
        s.model_version = 1  # the version TRL publishes when training starts
    for s in samples * 6:
        trainer.rollout_worker.rollout_buffer.put(s)
    trainer.train()
    logged = [e for e in trainer.state.log_history if "loss" in e]
    assert len(logged) == 2 and all(math.isfinite(e["loss"]) for e in logged)
    for entry in logged:
        assert 0 <= entry["trust_region/masked_fraction"] <= 1
        for name, correction in CORRECTIONS.items():
            for metric in correction.metrics:
                assert math.isfinite(entry[f"corrections/{name}/{metric}"]), (name, metric)
