"""CPPO and IPO (`trl_dppo.trust_regions`) and the off-policy corrections (`trl_dppo.corrections`), each against a
reference written from its source's equations, token by token in float64, on hand-made cases."""

from __future__ import annotations

import math
import random

import pytest
import torch

from trl_dppo import DPPOConfig
from trl_dppo.corrections import (
    CORRECTIONS,
    CorrectionOutput,
    apply_corrections,
    get_correction,
    register_correction,
    resolve_corrections,
)
from trl_dppo.divergence import binary_divergence
from trl_dppo.losses import loss_from_weights
from trl_dppo.sequences import SequenceLayout
from trl_dppo.trust_regions import TrustRegionInput, cppo_position_weights, get_trust_region


COMMON = dict(report_to="none", bf16=False)
ALL_CORRECTIONS = list(CORRECTIONS)


def batch_of(pi_rows, mu_rows, advantages, divergence=None):
    """A TrustRegionInput of completions given as lists of probabilities (one list per row, rows padded with neutral
    tokens outside the loss) and one advantage per row."""
    width = max(len(row) for row in pi_rows)
    mask = torch.tensor([[t < len(row) for t in range(width)] for row in pi_rows])

    def grid(rows):
        return torch.tensor([[math.log(p) for p in row] + [0.0] * (width - len(row)) for row in rows])

    pi, mu = grid(pi_rows), grid(mu_rows)
    mu = torch.where(mask, mu, pi)
    return TrustRegionInput(
        trainer_logps=pi,
        sampler_logps=mu,
        base_logps=mu,
        advantages=torch.tensor(advantages, dtype=torch.float32)[:, None],
        divergence=binary_divergence(mu, pi, "tv") if divergence is None else divergence,
        anchor_logps=pi,
        loss_mask=mask,
    )


# --- CPPO: arXiv 2606.10968, Eq. 8-11 (mask) and 22 (per-completion budget) ---------------------------------------


def percentile_90(values):
    """Linear interpolation between order statistics (numpy's and torch's default)."""
    ordered = sorted(values)
    position = 0.9 * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def cppo_keep_reference(pi, mu, advantage, delta_low, delta_high, w_min=0.8, delta_b=0.02, adaptive=True):
    """The paper's rule for one completion, one token at a time: keep t iff A (r_t - 1) <= 0 or w_t D_t <= c_t."""
    length = len(pi)
    divergence = [abs(p - m) for p, m in zip(pi, mu, strict=True)]
    budget = min(max(percentile_90(divergence), delta_b), 2 * delta_b) if adaptive else delta_b
    delta = delta_high if advantage > 0 else delta_low
    spent = total_weight = 0.0  # S_{t-1}, W_{t-1}
    keep = []
    for t in range(1, length + 1):
        weight = w_min + (1 - w_min) * (length - t) / max(length - 1, 1)
        z = weight * divergence[t - 1]
        threshold = min(delta, delta + budget * total_weight - spent)
        keep.append(advantage * (pi[t - 1] / mu[t - 1] - 1) <= 0 or z <= threshold)
        spent += z
        total_weight += weight
    return keep


def cppo_keep(pi_rows, mu_rows, advantages, delta_low=0.15, delta_high=0.15, **settings):
    x = batch_of(pi_rows, mu_rows, advantages)
    weights, keep = get_trust_region("cppo")(x, delta_low=delta_low, delta_high=delta_high, **settings)
    return [row[: len(pi)] for row, pi in zip(keep.tolist(), pi_rows, strict=True)], weights, x


def test_cppo_position_weight_falls_linearly_from_1_to_w_min_over_each_completions_own_length():
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)
    torch.testing.assert_close(
        cppo_position_weights(mask, 0.8),
        torch.tensor([[1.0, 0.95, 0.9, 0.85, 0.8], [1.0, 0.9, 0.8, 0, 0], [0.8, 0, 0, 0, 0]], dtype=torch.float64),
    )


def test_cppo_is_stricter_early_than_late_for_the_same_divergence():
    """D = 0.16 > delta = 0.15 at the first token (w = 1) is blocked; at the last (w = 0.8, w D = 0.128) it passes. A
    budget of 1 per token never binds here, so only the position weight acts."""
    pi = [0.66, 0.5, 0.5, 0.5, 0.66]
    mu = [0.5, 0.5, 0.5, 0.5, 0.5]
    settings = dict(delta_b=1.0, adaptive_delta_b=False)
    keep, _, _ = cppo_keep([pi], [mu], [1.0], **settings)
    assert keep == [[False, True, True, True, True]]
    assert keep[0] == cppo_keep_reference(pi, mu, 1.0, 0.15, 0.15, delta_b=1.0, adaptive=False)


def test_cppo_budget_runs_out_along_the_prefix():
    """Every token moves by D = 0.1 < delta: DPPO keeps them all. With a budget of delta_b = 0.02 per token the first
    passes (c_1 = delta), the second meets c_2 = 0.15 + 0.02 * 1 - 0.1 = 0.07 < w_2 D = 0.095, and from then on the
    overspent prefix leaves no room."""
    pi, mu = [0.6] * 5, [0.5] * 5
    keep, weights, x = cppo_keep([pi], [mu], [1.0], adaptive_delta_b=False)
    assert keep == [[True, False, False, False, False]]
    assert keep[0] == cppo_keep_reference(pi, mu, 1.0, 0.15, 0.15, adaptive=False)
    dppo_weights, dppo_kept = get_trust_region("dppo")(x, delta_low=0.15, delta_high=0.15)
    assert dppo_kept.all()
    torch.testing.assert_close(weights, dppo_weights * torch.tensor([[1.0, 0, 0, 0, 0]]))  # w = M r A


def test_cppo_blocks_only_moves_away_from_mu_for_either_sign_of_advantage():
    down, up, base = [0.4] * 4, [0.6] * 4, [0.5] * 4
    for pi, advantage, blocked in [(up, 1.0, True), (down, -1.0, True), (down, 1.0, False), (up, -1.0, False)]:
        keep, _, _ = cppo_keep([pi], [base], [advantage], adaptive_delta_b=False)
        assert keep[0] == cppo_keep_reference(pi, base, advantage, 0.15, 0.15, adaptive=False)
        assert (not all(keep[0])) is blocked, (pi, advantage)


def test_cppo_takes_delta_high_for_positive_and_delta_low_for_negative_advantages():
    pi, mu = [0.7, 0.5], [0.5, 0.5]  # D = 0.2 at the first token
    assert cppo_keep([pi], [mu], [1.0], delta_low=0.1, delta_high=0.25)[0] == [[True, True]]
    assert cppo_keep([[0.3, 0.5]], [mu], [-1.0], delta_low=0.1, delta_high=0.25)[0] == [[False, True]]


def test_cppo_budget_per_completion_is_its_90th_percentile_clamped_to_delta_b_and_twice_that():
    """D = (0.1, 0.03 x 9): the completion's P90 is 0.037, inside [delta_b, 2 delta_b] = [0.02, 0.04], a budget the
    prefix never overspends; with the fixed budget 0.02 it runs out at the 7th token."""
    pi = [0.6] + [0.53] * 9
    mu = [0.5] * 10
    adaptive, _, _ = cppo_keep([pi], [mu], [1.0])
    fixed, _, _ = cppo_keep([pi], [mu], [1.0], adaptive_delta_b=False)
    assert adaptive[0] == cppo_keep_reference(pi, mu, 1.0, 0.15, 0.15)
    assert fixed[0] == cppo_keep_reference(pi, mu, 1.0, 0.15, 0.15, adaptive=False)
    assert adaptive == [[True] * 10] and fixed == [[True] * 6 + [False] * 4]


def test_cppo_matches_the_reference_on_random_completions_and_keeps_prefixes_apart():
    rng = random.Random(0)
    pi_rows, mu_rows, advantages = [], [], []
    for _ in range(12):
        length = rng.randint(1, 14)
        mu_rows.append([rng.uniform(0.05, 0.95) for _ in range(length)])
        pi_rows.append([min(max(m + rng.uniform(-0.25, 0.25), 0.01), 0.99) for m in mu_rows[-1]])
        advantages.append(rng.choice([-1.5, -0.5, 0.0, 0.5, 1.5]))
    keep, _, _ = cppo_keep(pi_rows, mu_rows, advantages, delta_low=0.1, delta_high=0.2)
    for row, pi, mu, advantage in zip(keep, pi_rows, mu_rows, advantages, strict=True):
        assert row == cppo_keep_reference(pi, mu, advantage, 0.1, 0.2)
    assert 0 < sum(not k for row in keep for k in row) < sum(len(row) for row in keep) / 2


def test_cppo_needs_completions_and_refuses_a_batch_without_boundaries():
    x = batch_of([[0.6, 0.5]], [[0.5, 0.5]], [1.0])
    flat = TrustRegionInput(x.trainer_logps, x.sampler_logps, x.base_logps, x.advantages, x.divergence, x.anchor_logps)
    with pytest.raises(ValueError, match="no sequence boundaries: pass TrustRegionInput\\(loss_mask=...\\)"):
        get_trust_region("cppo")(flat, delta_low=0.15, delta_high=0.15)


# --- IPO: prime-rl's ipo_loss_fn -----------------------------------------------------------------------------------


def test_ipo_blocks_any_probability_move_beyond_eps_whatever_the_advantage():
    """|pi - mu| > 0.3 is blocked in both directions and for both signs of A, including moves back toward mu, which
    DPPO always keeps; within eps the weight is r A."""
    pi = [[0.85, 0.75, 0.2, 0.3]]
    mu = [[0.5, 0.5, 0.55, 0.55]]  # moves +0.35, +0.25, -0.35, -0.25
    for advantage in (1.0, -1.0):
        x = batch_of(pi, mu, [advantage])
        weights, keep = get_trust_region("ipo")(x, eps=0.3)
        assert keep.tolist() == [[False, True, False, True]]
        reference = [(p / m) * advantage if abs(p - m) <= 0.3 else 0.0 for p, m in zip(pi[0], mu[0], strict=True)]
        torch.testing.assert_close(weights, torch.tensor([reference]))
    _, dppo_kept = get_trust_region("dppo")(batch_of(pi, mu, [1.0]), delta_low=0.15, delta_high=0.15)
    assert dppo_kept.tolist() == [[False, False, True, True]]  # DPPO: moves back toward mu pass


def test_ipo_defaults_to_prime_rls_eps_and_refuses_other_divergences(tmp_path):
    config = DPPOConfig(output_dir=str(tmp_path), trust_region="ipo", **COMMON)
    assert config.trust_region_settings == {"eps": 0.3}
    with pytest.raises(ValueError, match=r"trust_region='ipo' works with divergence in \('binary_tv',\) only"):
        DPPOConfig(output_dir=str(tmp_path), trust_region="ipo", divergence="binary_kl", **COMMON)


# --- Corrections -----------------------------------------------------------------------------------------------------


def corrections_reference(weights, pi_rows, mu_rows, advantages, settings):
    """Each correction from its equation, one completion at a time, in the documented order (masks and truncation,
    then the KL penalty)."""
    out = []
    for row_weights, pi, mu, advantage in zip(weights, pi_rows, mu_rows, advantages, strict=True):
        ratio = [p / m for p, m in zip(pi, mu, strict=True)]
        log_ratio = [math.log(r) for r in ratio]
        row = list(row_weights[: len(pi)])
        if "icepop" in settings:
            low, high = settings["icepop"]
            row = [0.0 if not low <= r <= high else w for w, r in zip(row, ratio, strict=True)]
        if "geometric_sequence_mask" in settings:
            low, high = settings["geometric_sequence_mask"]
            if not low <= math.exp(sum(log_ratio) / len(log_ratio)) <= high:
                row = [0.0] * len(row)
        if "off_policy_sequence_mask" in settings:
            if advantage < 0 and -sum(log_ratio) / len(log_ratio) > settings["off_policy_sequence_mask"]:
                row = [0.0] * len(row)
        if "truncated_importance_weights" in settings:
            cap = settings["truncated_importance_weights"]
            row = [w * min(1.0, cap / r) for w, r in zip(row, ratio, strict=True)]
        if "kl_to_sampler" in settings:
            tau = settings["kl_to_sampler"]
            row = [w - 2 * tau * lr for w, lr in zip(row, log_ratio, strict=True)]
        out.append(row)
    return out


SETTINGS = {  # tight enough for every correction to act on the cases below
    "icepop": {"low": 0.82, "high": 1.25},
    "geometric_sequence_mask": {"low": 0.95, "high": 1.05},
    "off_policy_sequence_mask": {"delta": 0.05},
    "truncated_importance_weights": {"cap": 1.15},
    "kl_to_sampler": {"tau": 0.1},
}


def chosen(names, trust_region="dppo", trust_region_settings=None):
    """The corrections `names` with the settings above, as the config resolves them."""
    return resolve_corrections(names, {n: SETTINGS[n] for n in names}, trust_region, trust_region_settings or {})


def trust_region_weights(name, x):
    method = get_trust_region(name)
    shared = dict(delta_low=0.15, delta_high=0.15, epsilon_low=0.2, epsilon_high=0.28)
    return method(x, **method.resolve_settings({}, shared))[0]


REFERENCE_SETTINGS = {
    "icepop": (0.82, 1.25),
    "geometric_sequence_mask": (0.95, 1.05),
    "off_policy_sequence_mask": 0.05,
    "truncated_importance_weights": 1.15,
    "kl_to_sampler": 0.1,
}
CASES = dict(  # four completions: ratios drifting up, down, mixed, and one that barely moves
    pi_rows=[[0.6, 0.55, 0.52], [0.4, 0.45, 0.3], [0.7, 0.3], [0.5, 0.51, 0.49, 0.5]],
    mu_rows=[[0.5, 0.5, 0.5], [0.5, 0.5, 0.5], [0.5, 0.5], [0.5, 0.5, 0.5, 0.5]],
    advantages=[1.0, -1.0, -0.5, 0.5],
)


@pytest.mark.parametrize("names", [[name] for name in ALL_CORRECTIONS] + [ALL_CORRECTIONS])
@pytest.mark.parametrize("trust_region", ["dppo", "grpo"])
def test_each_correction_and_all_of_them_stack_on_dppo_and_grpos_clip_as_their_equations_say(trust_region, names):
    x = batch_of(**{k: CASES[k] for k in ("pi_rows", "mu_rows", "advantages")})
    weights = trust_region_weights(trust_region, x)
    corrected, outputs = apply_corrections(chosen(names, trust_region), x, weights)
    expected = corrections_reference(
        weights.double().tolist(), CASES["pi_rows"], CASES["mu_rows"], CASES["advantages"],
        {n: REFERENCE_SETTINGS[n] for n in names},
    )  # fmt: skip
    for row, reference in zip(corrected.tolist(), expected, strict=True):
        assert row[: len(reference)] == pytest.approx(reference, rel=1e-6, abs=1e-7)  # float32 weights
    assert list(outputs) == [n for n in ALL_CORRECTIONS if n in names]
    for name in names:
        if name != "kl_to_sampler":
            assert outputs[name].affected.any(), f"{name} acted on none of the cases"


def test_the_order_listed_does_not_change_the_result_and_the_kl_penalty_reaches_masked_tokens():
    x = batch_of(**{k: CASES[k] for k in ("pi_rows", "mu_rows", "advantages")})
    weights = trust_region_weights("dppo", x)
    forward = apply_corrections(chosen(ALL_CORRECTIONS), x, weights)[0]
    backward = apply_corrections(chosen(ALL_CORRECTIONS[::-1]), x, weights)[0]
    torch.testing.assert_close(forward, backward)
    masks = [n for n in ALL_CORRECTIONS if n != "kl_to_sampler"]
    masked = apply_corrections(chosen(masks), x, weights)[0] == 0
    log_ratio = x.trainer_logps - x.sampler_logps
    assert (masked & x.loss_mask & (log_ratio != 0)).any()
    torch.testing.assert_close(forward[masked], (-2 * 0.1 * log_ratio)[masked])


def test_a_correction_registered_outside_the_package_stacks_before_the_kl_penalty():
    saved = dict(CORRECTIONS)
    try:

        @register_correction("drop_everything", equation="w = 0", source="this test")
        def drop_everything(x, weights, *, reason: str = "none"):
            return CorrectionOutput(torch.zeros_like(weights), affected=x.sequences("drop_everything"))

        chosen = resolve_corrections(["kl_to_sampler", "drop_everything"], None, "dppo", {})
        assert [correction.name for correction, _ in chosen] == ["drop_everything", "kl_to_sampler"]
        x = batch_of(**{k: CASES[k] for k in ("pi_rows", "mu_rows", "advantages")})
        weights, _ = apply_corrections(chosen, x, trust_region_weights("dppo", x))
        log_ratio = (x.trainer_logps - x.sampler_logps).double()
        torch.testing.assert_close(weights, (-2 * 1e-3 * log_ratio).float())  # the penalty alone survives
    finally:
        CORRECTIONS.clear()
        CORRECTIONS.update(saved)


def test_the_kl_penalty_has_the_gradient_of_tau_times_the_squared_log_ratio():
    """-w' * grad log pi (the trainers' loss with the corrected weight) equals the gradient of prime-rl's per-token
    loss -w r / sg(r) + tau (log pi - log mu)^2, by autograd."""
    x = batch_of(**{k: CASES[k] for k in ("pi_rows", "mu_rows", "advantages")})
    weights = trust_region_weights("dppo", x)
    corrected, outputs = apply_corrections([(get_correction("kl_to_sampler"), {"tau": 0.1})], x, weights)
    ours = x.trainer_logps.clone().requires_grad_(True)
    loss_from_weights(ours, corrected).sum().backward()
    theirs = x.trainer_logps.clone().requires_grad_(True)
    (loss_from_weights(theirs, weights) + 0.1 * (theirs - x.sampler_logps) ** 2).sum().backward()
    torch.testing.assert_close(ours.grad, theirs.grad)
    torch.testing.assert_close(outputs["kl_to_sampler"].penalty, 0.1 * (x.trainer_logps - x.sampler_logps) ** 2)


def test_each_correction_counts_what_it_removed():
    x = batch_of([[0.7, 0.5, 0.5], [0.5, 0.5, 0.5]], [[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]], [1.0, 1.0])
    weights = trust_region_weights("grpo", x)
    _, outputs = apply_corrections(chosen(["icepop"], "grpo"), x, weights)
    assert outputs["icepop"].affected.tolist() == [[True, False, False], [False, False, False]]  # r = 1.4 > 1.25


def test_sequence_masks_refuse_a_batch_without_completion_boundaries():
    x = batch_of([[0.6, 0.5]], [[0.5, 0.5]], [-1.0])
    flat = TrustRegionInput(x.trainer_logps, x.sampler_logps, x.base_logps, x.advantages, x.divergence, x.anchor_logps)
    for name in ("geometric_sequence_mask", "off_policy_sequence_mask"):
        assert get_correction(name).needs_sequences
        with pytest.raises(ValueError, match=f"the correction '{name}' reads whole sequences"):
            apply_corrections([(get_correction(name), {})], flat, torch.ones(1, 2))
    apply_corrections([(get_correction("icepop"), {})], flat, torch.ones(1, 2))  # a token mask needs none


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            dict(trust_region="cispo", trust_region_corrections=["truncated_importance_weights"]),
            r"already caps it \(ratio_cap=3.0\).*use trust_region='pg_is'",
        ),
        (
            dict(trust_region_kwargs={"ratio_cap": 10}, trust_region_corrections=["truncated_importance_weights"]),
            "drop ratio_cap from trust_region_kwargs, or drop the correction",
        ),
        (dict(trust_region_corrections=["icepop", "icepop"]), r"lists \['icepop'\] more than once"),
        (dict(trust_region_corrections=["tis"]), "'tis', which is not a correction: they are icepop, "),
        (
            dict(trust_region_corrections_kwargs={"icepop": {"low": 0.5}}),
            r"settings for \['icepop'\], which trust_region_corrections does not list",
        ),
        (
            dict(trust_region_corrections=["icepop"], trust_region_corrections_kwargs={"icepop": {"cap": 2}}),
            r"\['cap'\], which the correction 'icepop' does not take; it takes 'low', 'high'",
        ),
        (
            dict(trust_region_corrections=["icepop"], trust_region_corrections_kwargs={"icepop": {"low": 1.5}}),
            "need 0 <= low < 1 < high",
        ),
        (dict(off_policy_mask_threshold=0.5), r"trust_region_corrections=\['off_policy_sequence_mask'\]"),
    ],
)
def test_contradictory_or_unknown_corrections_are_refused_at_config_time_naming_the_fix(tmp_path, settings, message):
    with pytest.raises(ValueError, match=message):
        DPPOConfig(output_dir=str(tmp_path), **COMMON, **settings)


def test_corrections_and_their_settings_come_from_the_command_line(tmp_path):
    from transformers import HfArgumentParser

    (config,) = HfArgumentParser(DPPOConfig).parse_args_into_dataclasses(
        [
            "--output_dir", str(tmp_path), "--report_to", "none", "--bf16", "false",
            "--trust_region", "cppo", "--trust_region_kwargs", '{"w_min": 0.7}',
            "--trust_region_corrections", "kl_to_sampler", "icepop",
            "--trust_region_corrections_kwargs", '{"kl_to_sampler": {"tau": 0.01}}',
        ]
    )  # fmt: skip
    assert config.trust_region_settings["w_min"] == 0.7
    assert [(c.name, s) for c, s in config.trust_region_correction_settings] == [
        ("icepop", {"low": 0.5, "high": 5.0}),
        ("kl_to_sampler", {"tau": 0.01}),
    ]


def test_packed_loss_terms_are_laid_out_one_completion_per_row_in_their_order():
    """AsyncDPPOTrainer's layout (`sequences.py`): terms of completions 5, 2, 9 (ids in any order, each completion's
    terms in token order) become rows, each term at its rank; a process without terms gets one empty slot."""
    layout = SequenceLayout.from_sequence_ids(torch.tensor([5, 5, 5, 2, 2, 9]))
    values = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    torch.testing.assert_close(
        layout.to_grid(values, 0.0), torch.tensor([[4.0, 5.0, 0.0], [1.0, 2.0, 3.0], [6.0, 0.0, 0.0]])
    )
    torch.testing.assert_close(layout.from_grid(layout.to_grid(values, 0.0)), values)
    empty = SequenceLayout.from_sequence_ids(torch.zeros(0, dtype=torch.long))
    assert empty.shape == (1, 1) and empty.from_grid(empty.to_grid(torch.zeros(0), 0.0)).numel() == 0


# --- In DPPOTrainer --------------------------------------------------------------------------------------------------

TRAINER_SETTINGS = {  # the trainer test's second step is off-policy by one update at lr 1e-3: ratios within ~1%
    "icepop": {"low": 0.995, "high": 1.005},
    "geometric_sequence_mask": {"low": 0.998, "high": 1.002},
    "off_policy_sequence_mask": {"delta": 1e-3},
    "truncated_importance_weights": {"cap": 1.002},
    "kl_to_sampler": {"tau": 0.05},
}


@pytest.mark.parametrize("trust_region", ["dppo", "grpo"])
def test_every_correction_stacks_in_the_trainer_as_its_equation_says_and_logs_its_metric(
    trust_region, tmp_path, tiny_model_dir, prompts, tokenizer
):
    from .conftest import make_trainer

    trainer = make_trainer(
        tmp_path,
        tiny_model_dir,
        prompts,
        tokenizer,
        trust_region=trust_region,
        trust_region_corrections=ALL_CORRECTIONS,
        trust_region_corrections_kwargs=TRAINER_SETTINGS,
        max_steps=2,
        steps_per_generation=2,  # the second step is off-policy, so ratios move away from 1
        gradient_accumulation_steps=1,
    )
    seen = []
    set_weights = trainer._set_trust_region_advantages

    def spy(context, trainer_logps, hidden):
        advantages = context.inputs["advantages"]
        set_weights(context, trainer_logps, hidden)
        seen.append((context.inputs, advantages, trainer_logps))

    trainer._set_trust_region_advantages = spy
    trainer.train()
    assert len(seen) == 2
    reference_settings = {
        "icepop": (0.995, 1.005), "geometric_sequence_mask": (0.998, 1.002), "off_policy_sequence_mask": 1e-3,
        "truncated_importance_weights": 1.002, "kl_to_sampler": 0.05,
    }  # fmt: skip
    for inputs, advantages, trainer_logps in seen:
        mask = inputs["completion_mask"].bool()
        sampler_logps = torch.where(mask, inputs["sampling_per_token_logps"], trainer_logps)
        x = TrustRegionInput(
            trainer_logps, sampler_logps, sampler_logps, advantages[:, None],
            binary_divergence(sampler_logps, trainer_logps, "tv"), trainer_logps, mask,
        )  # fmt: skip
        weights, _ = get_trust_region(trust_region)(x, **trainer.trust_region_settings)
        rows = [(pi[m].double().exp().tolist(), mu[m].double().exp().tolist()) for pi, mu, m in
                zip(trainer_logps, sampler_logps, mask, strict=True)]  # fmt: skip
        expected = corrections_reference(
            [w[m].double().tolist() for w, m in zip(weights, mask, strict=True)],
            [pi for pi, _ in rows], [mu for _, mu in rows], advantages.tolist(), reference_settings,
        )  # fmt: skip
        for got, m, reference in zip(inputs["advantages"], mask, expected, strict=True):
            # float32 weights of float32 log-probabilities, against float64: relative rounding
            assert got[m].tolist() == pytest.approx(reference, rel=1e-5, abs=1e-6)
    logged = [e for e in trainer.state.log_history if "loss" in e]
    for name in ALL_CORRECTIONS:
        for metric in get_correction(name).metrics:
            values = [e[f"corrections/{name}/{metric}"] for e in logged]
            assert all(math.isfinite(v) and v >= 0 for v in values), (name, metric, values)
    off_policy = logged[-1]  # every correction acted there (seed 0: 81%, 88%, 25% and 26% of tokens)
    assert off_policy["corrections/kl_to_sampler/penalty_mean"] > 0
    for name in ALL_CORRECTIONS[:-1]:
        assert off_policy[f"corrections/{name}/token_fraction"] > 0, name
