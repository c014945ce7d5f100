"""Side-by-side timing of DPPOTrainer against GRPOTrainer: each trial in a fresh process, variants interleaved.

A trial trains a few steps and reports the mean optimizer-step time after warm-up (GRPOTrainer's `step_time`
metric: generation, scoring and the update), the process's peak resident memory, the number of no-grad forward
passes of the policy outside generation (the old-log-prob recomputation), and, when asked, the peak of live tensor
memory during one profiled step, replayed from torch.profiler's allocation events (each op's allocations net of
its frees, so a transient that lives only inside one op is not seen).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = "SmolLM2-135M-Instruct"
# Passive OpenMP waiting: spinning threads slow CPU matmuls 10-20x whenever another process shares the cores
TRIAL_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_WAIT_POLICY": "PASSIVE"}


def run_variants(variants: dict[str, dict], repeats: int, out_json: Path) -> dict:
    """Run every variant `repeats` times, interleaved, each in its own process; write and return the results."""
    results: dict[str, list[dict]] = {name: [] for name in variants}
    for rep in range(repeats):
        for name, spec in variants.items():
            started = time.time()
            trial = run_trial(name, spec)
            results[name].append(trial)
            print(
                f"[rep {rep}] {name}: {trial['step_time_s']:.2f} s/step, peak RSS {trial['peak_rss_mb']:.0f} MB, "
                f"recompute passes/step {trial['policy_nograd_forwards_per_step']:.2f} ({time.time() - started:.0f} s)",
                flush=True,
            )
    summary = {
        name: {
            "step_time_s": statistics.median(t["step_time_s"] for t in trials),
            "step_times_s": [t["step_time_s"] for t in trials],
            "peak_rss_mb": statistics.median(t["peak_rss_mb"] for t in trials),
            "peak_step_tensor_mb": statistics.median(t["peak_step_tensor_mb"] for t in trials)
            if trials[0]["peak_step_tensor_mb"] is not None
            else None,
            "policy_nograd_forwards_per_step": trials[0]["policy_nograd_forwards_per_step"],
            "completion_length": statistics.mean(t["completion_length"] for t in trials),
            "spec": variants[name],
        }
        for name, trials in results.items()
    }
    out_json.write_text(json.dumps(summary, indent=2))
    return summary


def run_trial(name: str, spec: dict, script: str = __file__) -> dict:
    """One trial of `spec` in a fresh process running `script` (this module's `_trial` by default; another benchmark's
    script takes the spec as its one argument too and prints its measurements as the last line); returns them."""
    proc = subprocess.run(
        [sys.executable, script, json.dumps(spec)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, **TRIAL_ENV},
    )
    if proc.returncode != 0:
        raise RuntimeError(f"trial {name} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _trial(spec: dict) -> dict:
    """One training run in this process (called in the subprocess)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    import torch
    from accelerate.utils import is_peft_model
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    from trl_dppo import DPPOConfig, DPPOTrainer
    from trl_dppo.jobs.arithmetic import arithmetic_dataset, exact_answer_reward
    from trl_dppo.jobs.default_model import resolve_model, smollm2_tokenizer
    from trl_dppo.weight_sync import sync_weights_in_place

    torch.manual_seed(0)
    model = resolve_model(spec["model"])
    dppo = spec["trainer"] == "dppo"
    measured = spec["warmup"] + spec["steps"]
    steps = measured + (1 if spec.get("profile_memory") else 0)  # the profiled step is not timed
    settings = dict(
        output_dir=f"/tmp/bench-{os.getpid()}",
        report_to="none",
        bf16=False,
        save_strategy="no",
        logging_steps=1,
        max_steps=steps,
        seed=0,
        disable_tqdm=True,
    )
    config = (DPPOConfig if dppo else GRPOConfig)(**{**settings, **spec["config"]})
    dataset = arithmetic_dataset(256, seed=0)
    trainer = (DPPOTrainer if dppo else GRPOTrainer)(
        model=model,
        reward_funcs=exact_answer_reward,
        args=config,
        train_dataset=dataset,
        processing_class=smollm2_tokenizer(),
        peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"),
    )
    if not dppo and config.use_vllm and not torch.cuda.is_available():
        # Benchmark-only shim: TRL's per-parameter colocate sync fails on vLLM's CPU backend
        backend = trainer.vllm_generation
        backend.sync_weights = lambda: sync_weights_in_place(backend)

    # Count no-grad policy forwards through the fused LM head (scoring passes, not generation or the reference)
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    causal_lm = unwrapped.get_base_model() if is_peft_model(unwrapped) else unwrapped
    counts = {"n": 0}

    def count(module, args, kwargs):
        adapters_on = not is_peft_model(unwrapped) or not unwrapped._adapters_disabled
        if kwargs.get("fused_lm_head") and not torch.is_grad_enabled() and adapters_on:
            counts["n"] += 1

    causal_lm.register_forward_pre_hook(count, with_kwargs=True)

    peak_tensor = None
    if spec.get("profile_memory"):
        from transformers import TrainerCallback

        class ProfileOneStep(TrainerCallback):
            """Profiles the last step's allocations and replays them for the peak of live tensor bytes."""

            def on_step_begin(self, args, state, control, **kwargs):
                if state.global_step == steps - 1:
                    self.prof = torch.profiler.profile(
                        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
                    )
                    self.prof.__enter__()

            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step == steps:
                    self.prof.__exit__(None, None, None)
                    nonlocal peak_tensor
                    # Each op's own allocations net of its frees, and frees outside ops ("[memory]"), in time order
                    live = peak = 0
                    for e in sorted(self.prof.events(), key=lambda e: e.time_range.start):
                        live += e.self_cpu_memory_usage
                        peak = max(peak, live)
                    peak_tensor = peak / 2**20

        trainer.add_callback(ProfileOneStep())

    trainer.train()
    if spec.get("log_history"):  # the whole run's logged metrics, for reward curves
        Path(spec["log_history"]).write_text(json.dumps(trainer.state.log_history))
    step_times = [e["step_time"] for e in trainer.state.log_history if "step_time" in e][spec["warmup"] : measured]
    lengths = [e["completions/mean_length"] for e in trainer.state.log_history if "completions/mean_length" in e]
    return {
        "step_time_s": statistics.mean(step_times),
        "completion_length": statistics.mean(lengths),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "peak_step_tensor_mb": peak_tensor,
        "policy_nograd_forwards_per_step": counts["n"] / steps,
    }


def markdown_table(summary: dict, baseline: str) -> str:
    """A table of each variant against `baseline` (ratios > 1 are slower / larger)."""
    base = summary[baseline]
    lines = [
        "| variant | step time (s) | ratio | peak RSS (MB) | ratio | peak step tensors (MB) | recompute passes/step |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, s in summary.items():
        tensors = "" if s["peak_step_tensor_mb"] is None else f"{s['peak_step_tensor_mb']:.1f}"
        lines.append(
            f"| {name} | {s['step_time_s']:.2f} | {s['step_time_s'] / base['step_time_s']:.3f} | "
            f"{s['peak_rss_mb']:.0f} | {s['peak_rss_mb'] / base['peak_rss_mb']:.3f} | {tensors} | "
            f"{s['policy_nograd_forwards_per_step']:.2f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(json.dumps(_trial(json.loads(sys.argv[1]))))
