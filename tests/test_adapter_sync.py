"""AsyncDPPOTrainer's adapter sync check (`trl_dppo/adapter_sync.py`) on TRL's own adapter files: the folder the
server is told to load holds the trainer's adapter exactly, or the check names what differs; and the probe of what the
server serves, on synthetic log-probabilities. The check in a real run against a vLLM server: tests/test_async.py."""

from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

from trl_dppo.adapter_sync import (
    AdapterProbe,
    ProbeReading,
    adapter_file_mismatches,
    adapter_sync_problems,
    recording_adapter_loads,
)

from .conftest import build_tiny_model, require_vllm


require_vllm()  # TRL's adapter writer lives in its asynchronous trainer, which imports vLLM's client code

from trl.experimental.async_grpo.async_grpo_trainer import save_lora_adapter  # noqa: E402


NAME = "trl-policy-v2"
LAYER0_Q = "base_model.model.model.layers.0.self_attn.q_proj"


@pytest.fixture
def model(tokenizer):
    model = get_peft_model(build_tiny_model(tokenizer), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(0)
    for name, param in model.named_parameters():
        if "lora_B" in name:  # PEFT starts B at 0: an adapter that changes the model, as after an update
            param.data.normal_(std=0.1)
    return model


def trained(model) -> None:
    """One more update of every adapter tensor."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.add_(1e-3)


def published(model, folder) -> str:
    save_lora_adapter(model, Accelerator(cpu=True), "default", str(folder))
    return str(folder)


def test_the_files_trl_writes_hold_the_trainers_adapter(model, tmp_path):
    folder = published(model, tmp_path / NAME)
    adapter = get_peft_model_state_dict(model)
    assert adapter_file_mismatches(folder, adapter) == []
    assert adapter_sync_problems([(NAME, folder)], adapter, NAME, NAME) == ([], 0)
    # one element one float32 ulp off, far below what a log-probability resolves, is a difference too
    weight = adapter[f"{LAYER0_Q}.lora_B.weight"]
    weight[0, 0] = torch.nextafter(weight[0, 0], torch.tensor(1.0))
    assert adapter_file_mismatches(folder, adapter) == [f"{LAYER0_Q}.lora_B.weight"]


def test_a_stale_adapter_the_previous_versions_files_is_named_with_every_tensor_that_moved(model, tmp_path):
    previous = published(model, tmp_path / "trl-policy-v1")
    trained(model)
    problems, mismatched = adapter_sync_problems([(NAME, previous)], get_peft_model_state_dict(model), NAME, NAME)
    assert mismatched == len(get_peft_model_state_dict(model)) == 8  # A and B of q and v in 2 layers
    assert problems == [
        f"the files in {previous} that the server loads differ from the trainer's adapter in "
        f"{LAYER0_Q}.lora_A.weight, {LAYER0_Q}.lora_B.weight, "
        "base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight, "
        "base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight, "
        "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight, "
        "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight, "
        "base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight, "
        "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
    ]


def test_a_partial_adapter_one_modules_tensors_left_at_their_old_values_is_named(model, tmp_path):
    old = {name: param.detach().clone() for name, param in model.named_parameters() if name.startswith(LAYER0_Q)}
    trained(model)
    updated = {name: param.detach().clone() for name, param in model.named_parameters() if name in old}
    with torch.no_grad():  # the files are written with that module's tensors as they were
        for name, param in model.named_parameters():
            if name in old:
                param.copy_(old[name])
        folder = published(model, tmp_path / NAME)
        for name, param in model.named_parameters():
            if name in updated:
                param.copy_(updated[name])
    adapter = get_peft_model_state_dict(model)
    assert adapter_file_mismatches(folder, adapter) == [f"{LAYER0_Q}.lora_A.weight", f"{LAYER0_Q}.lora_B.weight"]


def test_a_load_under_another_name_or_a_worker_on_an_older_version_is_named(model, tmp_path):
    folder = published(model, tmp_path / NAME)
    adapter = get_peft_model_state_dict(model)
    problems, mismatched = adapter_sync_problems([("trl-policy-v1", folder)], adapter, NAME, "trl-policy-v1")
    assert mismatched == 0
    assert problems == [
        f"the server was asked to load 'trl-policy-v1', not this version's {NAME!r}",
        f"the rollout worker requests 'trl-policy-v1', not {NAME!r}",
    ]
    assert adapter_sync_problems([], adapter, NAME, NAME)[0] == [
        "the sync asked the server to load 0 adapters ([]), not one"
    ]


def test_the_loads_are_recorded_as_the_client_is_asked_and_the_client_is_left_as_it_was():
    class Client:
        def load_lora_adapter(self, name, path):
            return f"loaded {name}"

    client = Client()
    with recording_adapter_loads(client) as loaded:
        assert client.load_lora_adapter(NAME, "/adapters/v2") == f"loaded {NAME}"
    assert loaded == [(NAME, "/adapters/v2")]
    assert "load_lora_adapter" not in vars(client)


# ----------------------------------------------------------------------------------- the probe of what the server serves
# Synthetic log-probabilities: the trainer's under the previous version and under this one, 64 tokens apart by an
# update, and the server's as one of them plus its own bf16 arithmetic (0.05 per token, as measured on SmolLM2)

TOKENS = 64


def probe_versions(update_size: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    previous = -torch.rand(TOKENS, generator=generator) * 3
    current = previous + update_size * torch.randn(TOKENS, generator=generator)
    engine_noise = 0.05 * torch.randn(TOKENS, generator=generator)
    return previous, current, engine_noise


def test_the_probe_places_a_right_sync_at_this_version_and_a_stale_one_at_the_previous():
    previous, current, noise = probe_versions(update_size=0.3)
    right = ProbeReading.read(current + noise, current, previous)
    stale = ProbeReading.read(previous + noise, current, previous)
    assert right.resolved and not right.serves_previous and abs(right.position - 1) < 0.1
    assert stale.resolved and stale.serves_previous and abs(stale.position) < 0.1
    # the gap is the engine's own against this version: small when right, the update's size when stale
    assert right.gap < 0.06 < 0.2 < stale.gap


def test_an_update_below_the_engines_noise_is_left_unresolved_not_judged():
    previous, current, noise = probe_versions(update_size=0.005)
    for served in (current + noise, previous + noise):
        reading = ProbeReading.read(served, current, previous)
        assert not reading.resolved and not reading.serves_previous
    # and nothing to compare at the first sync, or when nothing moved
    assert ProbeReading.read(current + noise, current, None).position is None
    assert not ProbeReading.read(current + noise, current, current.clone()).resolved


def test_tokens_the_server_gave_no_log_probability_are_counted_and_left_out():
    previous, current, noise = probe_versions(update_size=0.3)
    served = current + noise
    served[:5] = torch.nan
    reading = ProbeReading.read(served, current, previous)
    assert reading.missing == 5 and reading.resolved and not reading.serves_previous


def test_the_previous_syncs_log_probabilities_carry_over_where_each_seed_draws_the_same_tokens():
    probe = AdapterProbe(samples=[[1, 2, 3], [4, 5, 6]], log_probs=torch.tensor([-1.0, -2.0, -3.0, -4.0, -5.0, -6.0]))
    carried = probe.carried_over(
        [[1, 2, 7], [8, 5, 6]]
    )  # the first sample parts at its third token, the second at once
    assert torch.equal(carried.isnan(), torch.tensor([False, False, True, True, True, True]))
    assert carried[:2].tolist() == [-1.0, -2.0]
    assert AdapterProbe().carried_over([[1, 2, 3]]) is None
