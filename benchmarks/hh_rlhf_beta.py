"""HH-RLHF that a user would keep: DPPO at beta 0 against KL-anchored runs, judged by a reward model never trained on.

The hypothesis, the decisive measure and the rule that says which run is kept were written before the study ran:
results/hh_rlhf_beta/README.md.

    python benchmarks/hh_rlhf_beta.py                         # the study: SETTINGS x seeds 0 1, 100 DPPO steps each
    python benchmarks/hh_rlhf_beta.py --settings beta0 beta0.1    # only some settings
    python benchmarks/hh_rlhf_beta.py --pilot                 # the pilot that picked SETTINGS (PILOT_SETTINGS)
    python benchmarks/hh_rlhf_beta.py --report-only           # results.md, samples.md and plots from the summaries

Each setting is one run of `trl_dppo.jobs.hh_pipeline`, in its own process, on the shared HH-RLHF sample into
runs/hh-rlhf-beta/<setting>/ (its console log beside it, <setting>.log). All settings share the reward model and the
judge in runs/hh-rlhf-beta/ (`--reward_models_dir`): the first run trains them (about 30 minutes on 2 idle cores),
the others reuse them, as does `trl-dppo hh-reward-model --output_dir runs/hh-rlhf-beta` with the same data
arguments. The small results go to benchmarks/results/hh_rlhf_beta/ (the pilot's to pilot/ inside it): per setting
its summary.json and samples.md, each seed's trimmed log in logs/, and the generated results.md, samples.md and plots.
A setting whose summary is there already is skipped, so an interrupted study resumes where it stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from curves import fmt, load_runs, plot_metric, save_run
from harness import ROOT, TRIAL_ENV

from trl_dppo.jobs.plots import load_log_history


DATA = "../shared/data/hh-rlhf/harmless-base-test.jsonl.gz"  # relative to the repository root, as recorded
RUNS = Path("runs/hh-rlhf-beta")  # full outputs (reward models, adapters); not committed
RESULTS = ROOT / "benchmarks" / "results" / "hh_rlhf_beta"
# Settings: the pipeline's arguments beyond COMMON. Every other argument is the pipeline's default (100 DPPO steps,
# seeds 0 and 1, 128 held-out prompts x 2 replies, lr 3e-4, binary TV at delta 0.15). The two beta > 0 values were
# fixed by the pilot (README.md), before the study ran; GRPO's clip runs at the smaller one. beta0.3 is the value the
# pilot named for the case the study met (0.1 drifts into collapse, 0.5 barely moves), added before it ran.
SETTINGS: dict[str, list[str]] = {
    "beta0": ["--beta", "0"],
    "beta0.1": ["--beta", "0.1"],
    "beta0.3": ["--beta", "0.3"],
    "beta0.5": ["--beta", "0.5"],
    "grpo_beta0.1": ["--trust_region", "grpo", "--beta", "0.1"],
}
# The pilot: candidate betas, one seed, a shorter run and half the held-out prompts
PILOT_SETTINGS: dict[str, list[str]] = {
    "beta0": ["--beta", "0"],
    "beta0.1": ["--beta", "0.1"],
    "beta0.5": ["--beta", "0.5"],
}
PILOT_ARGS = ["--seeds", "0", "--max_steps", "32", "--eval_prompts", "64"]
COMMON = ["--data_path", DATA, "--reward_models_dir", str(RUNS)]
ENV = {**TRIAL_ENV, "TOKENIZERS_PARALLELISM": "false"}

# The pre-registered rule (README.md): a run is kept when the judge prefers its replies and they have not collapsed
KEEP_WIN_RATE_LOW = 0.5  # the win rate's 95% interval lies above it
KEEP_LENGTH = 0.2  # mean reply length within +-20% of the base model's
KEEP_CUT = 0.10  # share of replies cut at the limit at most 10 points above the base model's
KEEP_DISTINCT = 0.85  # distinct-1 and distinct-2 at least 85% of the base model's


def run_setting(name: str, args: list[str], out: Path) -> None:
    """One pipeline run (every seed of the setting) unless its summary is in `out` already; copy its results."""
    if (out / name / "summary.json").is_file():
        print(f"{name}: done already ({out / name})", flush=True)
        return
    run_dir = RUNS / ("pilot" if out != RESULTS else "") / name
    command = ["python", "-m", "trl_dppo.jobs.hh_pipeline", *COMMON, *args, "--output_dir", str(run_dir)]
    (ROOT / run_dir).mkdir(parents=True, exist_ok=True)
    console = run_dir.parent / f"{name}.log"  # not with_suffix: "beta0.1" would become "beta0.log"
    started = time.time()
    print(f"{name}: {shlex.join(command)}", flush=True)
    with open(ROOT / console, "w") as log:
        proc = subprocess.run(
            [sys.executable, *command[1:]], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **ENV}
        )
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed; see {console}")
    summary = json.loads((ROOT / run_dir / "summary.json").read_text())
    for seed, run in summary["policy"]["seeds"].items():
        history = load_log_history(ROOT / run_dir / f"seed{seed}")
        save_run(out / "logs" / f"{name}-seed{seed}.json", history, command=summary["command"], seed=int(seed),
                 runtime_s=run["runtime_s"])  # fmt: skip
    (out / name).mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / run_dir / "samples.md", out / name / "samples.md")
    (out / name / "summary.json").write_text(json.dumps(summary, indent=2))  # last: it marks the setting done
    print(f"{name}: {time.time() - started:.0f} s", flush=True)


def kept(after: dict, base: dict) -> dict[str, bool]:
    """The pre-registered rule, criterion by criterion, for one seed's held-out measures against the base model's."""
    return {
        "judge prefers it": after["win_rate_ci95"][0] > KEEP_WIN_RATE_LOW,
        "length": abs(after["length"] / base["length"] - 1) <= KEEP_LENGTH,
        "cut share": after["cut_share"] <= base["cut_share"] + KEEP_CUT,
        "distinct-n": all(after[k] >= KEEP_DISTINCT * base[k] for k in ("distinct_1", "distinct_2")),
    }


def _interval(value: float, ci: list[float], spec: str) -> str:
    return f"{value:{spec}} [{ci[0]:{spec}}, {ci[1]:{spec}}]"


def report(out: Path, names: list[str]) -> str:
    summaries = {
        n: json.loads((out / n / "summary.json").read_text()) for n in names if (out / n / "summary.json").is_file()
    }
    if not summaries:
        raise SystemExit(f"No results in {out} yet.")
    first = next(iter(summaries.values()))
    base = first["policy"]["before"]
    header = (
        "| run | reward | judge | judge change [95% CI] | judge win rate [95% CI] | length (tokens) | cut at limit | "
        "distinct-1 | distinct-2 | entropy | KL to base (per token) | train KL, last 10% | kept? |"
    )
    lines = [header, "|" + "---|" * (header.count("|") - 1)]

    def measures(m: dict) -> str:
        return (
            f"{m['length']:.1f} | {m['cut_share']:.0%} | {m['distinct_1']:.3f} | {m['distinct_2']:.3f} | "
            f"{m['entropy']:.2f} | {fmt(m['kl_to_base'], '.3f')}"
        )

    lines.append(f"| base model | {base['reward']:.3f} | {base['judge']:.3f} | | | {measures(base)} | | |")
    kept_settings = []
    for name, summary in summaries.items():
        if summary["policy"]["before"] != base:
            raise RuntimeError(f"{name}'s base-model measures differ from {next(iter(summaries))}'s: not one split.")
        verdicts = []
        for seed, run in summary["policy"]["seeds"].items():
            after = run["held_out"]
            verdict = kept(after, base)
            verdicts.append(all(verdict.values()))
            failed = ", ".join(k for k, ok in verdict.items() if not ok)
            lines.append(
                f"| {name}, seed {seed} | {after['reward']:.3f} | {after['judge']:.3f} | "
                f"{_interval(after['judge_change'], after['judge_change_ci95'], '+.3f')} | "
                f"{_interval(after['win_rate'], after['win_rate_ci95'], '.2f')} | {measures(after)} | "
                f"{fmt(run['kl_last'], '.3f')} | {'yes' if not failed else 'no: ' + failed} |"
            )
        mean, sd = summary["policy"]["after_mean"], summary["policy"]["after_sd"]
        if len(verdicts) > 1:
            lines.append(
                f"| {name}, mean +- sd | {mean['reward']:.3f} +- {sd['reward']:.3f} | "
                f"{mean['judge']:.3f} +- {sd['judge']:.3f} | {mean['judge_change']:+.3f} | {mean['win_rate']:.2f} | "
                f"{mean['length']:.1f} | {mean['cut_share']:.0%} | {mean['distinct_1']:.3f} | "
                f"{mean['distinct_2']:.3f} | {mean['entropy']:.2f} | {mean['kl_to_base']:.3f} | | |"
            )
        if all(verdicts):
            kept_settings.append((mean["win_rate"], name))
    runs = {name: [r["log"] for r in logs] for name, logs in load_runs(out / "logs").items() if name in summaries}
    plots = {
        "reward": "training reward (reward model, per generation batch)",
        "entropy": "policy entropy (nats per token, training batches)",
        "completions/mean_length": "reply length (tokens, training batches)",
        "kl": "TRL's KL to the reference (beta > 0)",
    }
    for key, label in plots.items():
        plot_metric(runs, key, out / f"{key.replace('/', '_')}.png", f"HH-RLHF DPPO: {label}", label.split(" (")[0])
    scorers = {k: first[k] for k in ("reward_model", "judge")}
    text = "\n".join([
        "# HH-RLHF with a KL anchor: results",
        "",
        "Generated by `benchmarks/hh_rlhf_beta.py` from the pipeline summaries in this folder; the hypothesis and the "
        "reading are in README.md.",
        "",
        f"Data: {first['data']['splits']} pairs ({first['data']['pairs_within_max_length']} within "
        f"{first['arguments']['max_length']} tokens); {first['data']['held_out_eval_prompts']} held-out prompts x "
        f"{first['policy']['eval_samples_per_prompt']} replies, sampled at temperature 1, at most "
        f"{first['arguments']['max_completion_length']} tokens.",
        "",
        "| scorer | training pairs | held-out pairs | pairwise accuracy, untrained -> trained |",
        "|---|---:|---:|---|",
        *(
            f"| {name} | {s['train_pairs']} | {s['trained']['pairs']} | "
            f"{s['untrained']['accuracy']:.3f} -> {s['trained']['accuracy']:.3f} |"
            for name, s in scorers.items()
        ),
        "",
        f"Correlation of the reward model's and the judge's scores on the base model's held-out replies: "
        f"{first['policy']['reward_judge_correlation']:.2f}.",
        "",
        *lines,
        "",
        "Win rate: per prompt, the share of (after, before) reply pairs the judge scores higher (ties half), averaged "
        "over prompts; intervals: percentile bootstrap over prompts (10,000 resamples). Kept: the pre-registered rule "
        f"(win-rate interval above {KEEP_WIN_RATE_LOW}, length within {KEEP_LENGTH:.0%} of the base model's, cut share "
        f"at most {100 * KEEP_CUT:.0f} points above it, distinct-1 and -2 at least {KEEP_DISTINCT:.0%} of it), on "
        "every seed. "
        + (
            f"Settings kept on every seed: {', '.join(n for _, n in sorted(kept_settings, reverse=True))}."
            if kept_settings
            else "No setting was kept on every seed."
        ),
        "",
        "Commands (run from the repository root, env " + str(ENV) + "):",
        "",
        "```",
        *(s["command"] for s in summaries.values()),
        "```",
        "",
    ])  # fmt: skip
    (out / "results.md").write_text(text)
    samples = [(out / n / "samples.md").read_text() for n in summaries]
    (out / "samples.md").write_text(
        "# HH-RLHF held-out replies, every run\n\n"
        + "\n\n".join("\n".join("#" + line if line.startswith("#") else line for line in s.splitlines()) for s in samples)
    )  # fmt: skip
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", nargs="+", help="Run only these settings (default: all).")
    parser.add_argument("--pilot", action="store_true", help="The pilot: PILOT_SETTINGS with PILOT_ARGS.")
    parser.add_argument("--report-only", action="store_true", help="Only rewrite results.md and samples.md.")
    args = parser.parse_args()
    settings = PILOT_SETTINGS if args.pilot else SETTINGS
    out = RESULTS / "pilot" if args.pilot else RESULTS
    chosen = args.settings or list(settings)
    unknown = set(chosen) - set(settings)
    if unknown:
        raise SystemExit(f"Unknown settings {sorted(unknown)}; the settings are {list(settings)}.")
    if not args.report_only:
        for name in chosen:
            run_setting(name, settings[name] + (PILOT_ARGS if args.pilot else []), out)
    print(report(out, list(settings)))


if __name__ == "__main__":
    main()
