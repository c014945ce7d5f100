"""`trust_region_step`: the method, the corrections stacked on its weights and DPPO's own mask, in one pure function
both trainers call, and the setup it reads, built once from either trainer's config."""

from __future__ import annotations

import torch

from trl_dppo import DPPOConfig
from trl_dppo.async_config import AsyncDPPOConfig
from trl_dppo.corrections import apply_corrections, resolve_corrections
from trl_dppo.divergence import binary_divergence, trust_region_mask
from trl_dppo.trust_region_step import TrustRegionSetup, trust_region_step
from trl_dppo.trust_regions import TrustRegionInput, get_trust_region


def batch() -> TrustRegionInput:
    """Two completions of four tokens: pi moves far from mu up on row 0 (A > 0) and down on row 1 (A < 0)."""
    mu = torch.tensor([[0.5, 0.3, 0.6, 0.2], [0.5, 0.7, 0.4, 0.9]]).log()
    pi = torch.tensor([[0.9, 0.35, 0.61, 0.1], [0.1, 0.72, 0.2, 0.95]]).log()
    mask = torch.tensor([[True, True, True, True], [True, True, True, False]])
    return TrustRegionInput(pi, mu, mu, torch.tensor([[1.0], [-1.0]]), binary_divergence(mu, pi), pi, mask)


def setup(method: str, settings: dict, corrections=(), delta: float = 0.15) -> TrustRegionSetup:
    chosen = resolve_corrections(list(corrections), {}, method, settings)
    return TrustRegionSetup(get_trust_region(method), settings, chosen, "tv", delta, delta)


def test_for_dppo_the_dppo_mask_is_the_methods_keep():
    x = batch()
    step = trust_region_step(setup("dppo", {"delta_low": 0.15, "delta_high": 0.15, "ratio_cap": None}), x)
    assert step.dppo_keep is step.keep
    expected = trust_region_mask(x.divergence, x.base_logps, x.trainer_logps, x.advantages, 0.15, 0.15)
    assert torch.equal(step.keep, expected)
    assert step.keep.tolist() == [[False, True, True, True], [False, True, False, True]]
    assert step.corrections == {}


def test_for_another_method_the_dppo_mask_is_computed_at_the_setups_thresholds():
    x = batch()
    step = trust_region_step(setup("cispo", {"ratio_cap": 3.0}), x)
    assert step.keep.all()  # CISPO blocks nothing
    assert step.dppo_keep.tolist() == [[False, True, True, True], [False, True, False, True]]
    wider = trust_region_step(setup("cispo", {"ratio_cap": 3.0}, delta=0.35), x)
    assert wider.dppo_keep.tolist() == [[False, True, True, True], [False, True, True, True]]


def test_the_weights_are_the_methods_with_the_corrections_stacked_and_their_outputs_returned():
    x = batch()
    settings = {"epsilon_low": 0.2, "epsilon_high": 0.2}
    chosen = setup("grpo", settings, corrections=["icepop", "kl_to_sampler"])
    step = trust_region_step(chosen, x)
    weights, keep = get_trust_region("grpo")(x, **settings)
    weights, outputs = apply_corrections(chosen.corrections, x, weights)
    assert torch.equal(step.weights, weights) and torch.equal(step.keep, keep)
    assert list(step.corrections) == ["icepop", "kl_to_sampler"] == list(outputs)
    assert step.corrections["icepop"].affected.any()  # pi / mu = 0.2 on row 1's first token, below IcePop's 0.5
    assert step.corrections["kl_to_sampler"].penalty is not None


def test_the_setup_reads_either_trainers_config(tmp_path):
    common = dict(output_dir=str(tmp_path), report_to="none", bf16=False)
    sync = TrustRegionSetup.from_args(DPPOConfig(**common, trust_region="cispo", delta_low=0.1, delta_high=0.3))
    assert (sync.method.name, sync.settings, sync.corrections) == ("cispo", {"ratio_cap": 3.0}, [])
    assert (sync.kind, sync.delta_low, sync.delta_high) == ("tv", 0.1, 0.3)
    async_setup = TrustRegionSetup.from_args(AsyncDPPOConfig(**common, trust_region_corrections=["icepop"]))
    assert async_setup.method.name == "dppo"
    assert [correction.name for correction, _ in async_setup.corrections] == ["icepop"]
