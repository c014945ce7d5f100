"""AsyncDPPOTrainer's adapter sync check (`trl_dppo/adapter_sync.py`) on TRL's own adapter files: the folder the
server is told to load holds the trainer's adapter exactly, or the check names what differs. The check in a real run
against a vLLM server: tests/test_async.py."""

from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

from trl_dppo.adapter_sync import adapter_file_mismatches, adapter_sync_problems, recording_adapter_loads

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
