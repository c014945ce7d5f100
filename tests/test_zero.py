"""DeepSpeed ZeRO on two CPU processes, for real: `accelerate launch --config_file
examples/accelerate_configs/cpu_zero3.yaml --zero_stage N` (DeepSpeed's CPU accelerator over gloo, fp32), through
tests/launch_worker.py as the DDP cells of tests/test_launch_matrix.py.

Under ZeRO-2 and ZeRO-3, for transformers generation binary and top-K, LoRA and full fine-tuning (ZeRO-1: one cell;
ZeRO-3 with parameters offloaded to CPU: binary with LoRA; with parameters and optimizer offloaded: binary, full
fine-tuning), two optimizer steps: mu on each process is the sampler's at the first step (before any update: the
trainer's weights are the sampler's) and still the sampler's at the second (sampled by the updated, partitioned
weights, pi under the same weights), and the two steps' update equals the one one process makes from the same global
batches. One launch per configuration runs all its cells; one process replays all their batches."""

from __future__ import annotations

import pytest
import torch

from .conftest import (
    assert_updates_agree,
    require_deepspeed,
    run_launch_worker,
    tiny_model_logprob_atol,
    tiny_model_tv_floor,
)


require_deepspeed()
# The module's fixture makes five launches and a replay: 112 s in .ci/run beside its other stream (2 cores)
pytestmark = [pytest.mark.slow, pytest.mark.launch, pytest.mark.timeout(900)]

# Two cells also measure the true divergence (`true_divergence_fraction`): LoRA with binary, full fine-tuning with top-K
TRUE_DIVERGENCE = {"true_divergence_fraction": 1.0}
SGD_CELLS = {
    "binary_tv-lora": {"divergence": "binary_tv", **TRUE_DIVERGENCE},
    "topk_tv-lora": {"divergence": "topk_tv"},
    "binary_tv-full": {"divergence": "binary_tv", "lora": False},
    "topk_tv-full": {"divergence": "topk_tv", "lora": False, **TRUE_DIVERGENCE},
}
# With optimizer offload accelerate hands DeepSpeed its CPU Adam in place of a torch optimizer (AdamW mode for torch's
# AdamW, Adam for any other, SGD included): these cells train with torch's AdamW, which one process replays. An eps far
# above sqrt(v) (the gradient's scale) makes Adam momentum SGD at lr / eps = 0.2, linear in the gradient as the SGD
# cells are, so a mis-scaled or misplaced gradient still moves the update by its own size; the offloaded step runs the
# same code at any eps
ADAM = {"optim": "adamw_torch", "adam_epsilon": 1e3, "learning_rate": 200.0}
ADAM_CELLS = {"binary_tv-full-adam": {**ADAM, "divergence": "binary_tv", "lora": False}}
CELLS = {**SGD_CELLS, **ADAM_CELLS}
# Each launch's flags (after cpu_zero3.yaml) and cells. ZeRO-1 shards the optimizer state only, its gradient reduction
# is DDP's all-reduce: one cell shows it runs. Offload under ZeRO-3 keeps the partitioned parameters, or the optimizer's
# state and step, in CPU memory between uses, through DeepSpeed's offload code (on a CPU-only machine that memory is
# the device's own, so what runs here is that code, not a saving). One trainer per offload launch: a second one in the
# same processes took 72 s against 15 s alone (measured, not traced)
LAUNCHES = {
    "zero1": (("--zero_stage", "1"), ["binary_tv-lora"]),
    "zero2": (("--zero_stage", "2"), list(SGD_CELLS)),
    "zero3": (("--zero_stage", "3"), list(SGD_CELLS)),
    "zero3_offload_params": (("--zero_stage", "3", "--offload_param_device", "cpu"), ["binary_tv-lora"]),
    "zero3_offload": (
        ("--zero_stage", "3", "--offload_param_device", "cpu", "--offload_optimizer_device", "cpu"),
        ["binary_tv-full-adam"],
    ),
}
RUNS = [(launch, name) for launch, (_, names) in LAUNCHES.items() for name in names]


def run_name(launch: str, name: str) -> str:
    return f"{launch}-{name}"


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    """Each launch's runs under two ZeRO processes, then all their batches replayed by one process."""
    tmp_path = tmp_path_factory.mktemp("zero")
    two = {}
    for launch, (flags, names) in LAUNCHES.items():
        spec = {
            "model_dir": tiny_model_dir,
            "runs": {run_name(launch, n): {**CELLS[n], "max_steps": 2} for n in names},
        }
        options = {"accelerate_config": "cpu_zero3.yaml", "launch_flags": flags}
        two.update(run_launch_worker(tmp_path / launch, spec, 2, **options))
    torch.save(two, tmp_path / "zero.pt")
    runs = {run_name(launch, n): {**CELLS[n], "max_steps": 2} for launch, n in RUNS}
    replay = {"model_dir": tiny_model_dir, "runs": runs, "replay": str(tmp_path / "zero.pt")}
    return two, run_launch_worker(tmp_path / "1proc", replay, 1)


@pytest.mark.parametrize("launch, name", RUNS, ids=[run_name(*run) for run in RUNS])
def test_each_zero_process_records_the_samplers_mu_before_and_after_an_update(runs, launch, name, tokenizer):
    run = runs[0][run_name(launch, name)]
    assert run["num_processes"] == 2 and run["distributed_type"] == "DistributedType.DEEPSPEED"
    # ZeRO-3 partitions every parameter, the LM head top-K reads included; ZeRO-1/2 keep them whole
    zero3 = launch.startswith("zero3")
    assert run["partitioned"] == zero3 and (run["lm_head_local_size"] == 0) == zero3
    for seen in run["seen"]:
        assert len(seen) == 2  # one loss per step; step 2 sampled with the weights step 1 updated
        for mu, pi, mask in seen:
            # fp32 on both sides, the same (gathered) weights: float reassociation alone
            torch.testing.assert_close(mu[mask], pi[mask], rtol=0, atol=tiny_model_logprob_atol(tokenizer, pi[mask]))
            shifted = (mu[:, 1:] - pi[:, :-1]).abs()[mask[:, 1:] & mask[:, :-1]]
            assert shifted.mean() > 1.0  # a wrong mu (the neighbouring token's) is far beyond that
    first, second = (seen[0][0] for seen in run["seen"])
    assert not torch.equal(first, second)  # the processes sampled different rows


@pytest.mark.parametrize("launch, name", RUNS, ids=[run_name(*run) for run in RUNS])
def test_zero_makes_the_update_one_process_makes_from_the_same_batches(runs, launch, name):
    """ZeRO's reductions, derived for two fp32 processes: ZeRO-1 all-reduces the gradients as DDP does; ZeRO-2
    reduce-scatters flat gradient buckets and ZeRO-3 reduce-scatters each partitioned gradient, each then averaged.
    Whatever the order, an element of the reduced gradient is g0 + g1 (commutative, so bitwise one sum) scaled by 1/2
    before or after (exact in binary floating point), i.e. DDP's value bit for bit; each process's optimizer then
    applies SGD's p - lr g elementwise to its partition, as DDP does to the whole tensor, and ZeRO-3's gathered
    forward uses the same fp32 values (with optimizer offload, on fp32 copies of the partitions in CPU memory, through
    DeepSpeed's CPU Adam, which computes torch's AdamW elementwise). So ZeRO's update differs from one process's by what DDP's does: the per-row
    gradient sums in another order and the two steps' roundings, which `assert_updates_agree` bounds (a gradient
    averaged twice or over the wrong tokens moves the update by its own size, 1e3 times that bound and more)."""
    two, one = runs
    run, replayed = two[run_name(launch, name)], one[run_name(launch, name)]
    assert replayed["num_processes"] == 1
    for param, before in run["before"].items():
        torch.testing.assert_close(replayed["before"][param], before, rtol=0, atol=0)
    assert run["optimizer"] == ("DeepSpeedCPUAdam" if name in ADAM_CELLS else "SGD")
    assert_updates_agree(run["before"], replayed["update"], run["update"])


TRUE_DIVERGENCE_RUNS = [(launch, name) for launch, name in RUNS if "true_divergence_fraction" in CELLS[name]]


@pytest.mark.parametrize("launch, name", TRUE_DIVERGENCE_RUNS, ids=[run_name(*run) for run in TRUE_DIVERGENCE_RUNS])
def test_zero_measures_the_true_divergence_one_process_measures_on_the_same_batches(runs, launch, name, tokenizer):
    """Each step samples with the weights it trains (a new generation per step), so the true divergence sits at the
    float floor of two fp32 forward passes, gathered over both processes' tokens (ZeRO-3: the LM head gathered outside
    its forward) as one process computes it on the same batches."""
    two, one = runs
    floor = tiny_model_tv_floor(len(tokenizer))
    for entry, replayed in zip(two[run_name(launch, name)]["logs"], one[run_name(launch, name)]["logs"], strict=True):
        assert entry["true_divergence/recorded_tokens"] == replayed["true_divergence/recorded_tokens"] > 0
        for metric in ("tv_mean", "binary_tv_mean", "topk_tv_mean"):
            metric = f"true_divergence/{metric}"
            assert 0 <= entry[metric] <= floor and 0 <= replayed[metric] <= floor, metric
        # Each is one float32 forward's difference from the sampler, on the same tokens
        assert entry["true_divergence/tv_mean"] == pytest.approx(replayed["true_divergence/tv_mean"], abs=2 * floor)
