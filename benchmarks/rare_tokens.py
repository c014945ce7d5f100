"""The paper's efficiency probe at small scale: does PPO's ratio clip slow learning when the reward needs rare tokens?

The task (benchmarks/task_job.py, `--task rare_tokens`): the main job's arithmetic prompts, and a reward of 1.0 when
the reply opens with `RARE_MARKER`, an opening SmolLM2-135M-Instruct samples with probability of order 0.01-0.1
(`--measure` measures it: results/rare_tokens/start.md). Learning the task means raising that token. Three trust
regions at equal settings, in DPPOTrainer (`--trust_region`), with 4 optimizer steps per generation batch so that
steps 2-4 of a batch are off-policy and a ratio clip can bind:

- `grpo_clip_higher`: PPO's clip of r = pi/mu at mu, epsilon 0.2 / epsilon_high 0.28 (DAPO's Clip-Higher);
- `relaxed_clip`: the same clip, except tokens with mu < 0.1 are never clipped (the paper's section 6 probe);
- `dppo_tv`: DPPO's binary-TV mask, delta 0.15.

The rest is the main job's (SmolLM2-135M-Instruct, LoRA r=16, 8 completions of one prompt per step, temperature 1,
transformers generation in fp32 on the CPU, so mu is exact) with lr 5e-4 (the stability study's) and replies cut at
16 tokens (only the opening matters). The decisive measure, pre-registered in results/rare_tokens/README.md: the
mean reward over the first 6 generation batches (steps 1-21), per seed.

    python benchmarks/rare_tokens.py --measure                    # the starting distribution (a few minutes)
    python benchmarks/rare_tokens.py --steps 32 --seeds 0 1 2     # the study (see the README for the time)
    python benchmarks/rare_tokens.py --report-only                # redraw from the logs
    python benchmarks/rare_tokens.py --smoke                      # 4 steps per method into runs/smoke/

Each run's trimmed log, command and runtime go to benchmarks/results/rare_tokens/logs/; runs already logged are
skipped, so an interrupted study resumes. Runs are sequential (2 cores). `--profile gpu` is the GPU version
(benchmarks/gpu_studies.sh).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter
from pathlib import Path

from curves import commands_section, fmt, levels_reached, load_runs, mean_of, plot_metric
from harness import ROOT
from stability import ENV, RUNS, run_logged

from trl_dppo.diagnostics import MU_BUCKETS


RESULTS = ROOT / "benchmarks" / "results"
METHODS: dict[str, list[str]] = {
    "grpo_clip_higher": ["--trust_region", "grpo", "--epsilon", "0.2", "--epsilon_high", "0.28"],
    "relaxed_clip": [
        "--trust_region", "relaxed_clip", "--epsilon", "0.2", "--epsilon_high", "0.28", "--trust_region_kwargs", '{"alpha": 0.1}',
    ],
    "dppo_tv": ["--trust_region", "dppo", "--divergence", "binary_tv", "--divergence_delta", "0.15"],
}  # fmt: skip
COMMON = [
    "--task", "rare_tokens", "--steps_per_generation", "4", "--learning_rate", "5e-4", "--max_completion_length", "16",
    "--log_tokens_by_mu", "true",
]  # fmt: skip
# CPU: transformers generation in fp32 (mu exact: the clip is the only thing that differs). GPU: vLLM colocate in
# bf16 against an fp32 trainer, 4 prompts x 8 completions per step, as benchmarks/gpu_stability.sh runs.
PROFILES: dict[str, list[str]] = {
    "cpu": [],
    "gpu": [
        "--use_vllm", "true", "--vllm_mode", "colocate",
        "--vllm_max_model_length", "512", "--vllm_gpu_memory_utilization", "0.3",
        "--bf16", "false", "--dtype", "float32", "--per_device_train_batch_size", "32",
    ],
}  # fmt: skip
LEVELS = (0.25, 0.5, 0.75)
# The decisive measure: mean reward over the first generation batches (the area under the early learning curve). In
# pilots the marker was learned within 4-5 batches, so steps to a level move in whole batches of 4 steps.
DECISIVE_BATCHES = 6
RARE = MU_BUCKETS[:3]  # the buckets with mu < 0.1: "<0.001", "0.001-0.01", "0.01-0.1"


def command(profile: str, method: str, steps: int, seed: int, run_dir: Path) -> list[str]:
    return [
        "python", "benchmarks/task_job.py", *COMMON, *PROFILES[profile], *METHODS[method],
        "--max_steps", str(steps), "--seed", str(seed), "--output_dir", str(run_dir.relative_to(ROOT)),
    ]  # fmt: skip


def blocked(log: list[dict], buckets: tuple[str, ...]) -> tuple[float, float]:
    """(tokens the trust region blocked, tokens) in `buckets`, summed over the run's steps."""
    total = sum(e.get(f"tokens_by_mu/{b}/total", 0.0) for e in log for b in buckets)
    masked = sum(e.get(f"tokens_by_mu/{b}/masked", 0.0) for e in log for b in buckets)
    return masked, total


def blocked_fraction(logs: list[list[dict]], buckets: tuple[str, ...]) -> float | None:
    masked, total = (sum(x) for x in zip(*(blocked(log, buckets) for log in logs), strict=True))
    return masked / total if total else None


def rare_blocked_series(log: list[dict]) -> list[dict]:
    """Per step, the fraction of the tokens with mu < 0.1 that the trust region blocked."""
    out = []
    for entry in log:
        masked, total = blocked([entry], RARE)
        if total:
            out.append({"step": entry["step"], "rare_blocked": masked / total})
    return out


def report(out: Path) -> str:
    meta = load_runs(out / "logs")
    runs = {m: [r["log"] for r in meta[m]] for m in METHODS if m in meta}
    plot_metric(
        runs, "reward", out / "reward.png",
        "Rare-token task: reward = the reply opens with the rare marker\n(4 optimizer steps per generation batch)",
        "reward (3-batch moving average)", window=3,
    )  # fmt: skip
    plot_metric(
        {m: [rare_blocked_series(log) for log in logs] for m, logs in runs.items()}, "rare_blocked",
        out / "rare_blocked.png", "Tokens with sampler probability mu < 0.1 that the trust region blocked",
        "fraction of mu < 0.1 tokens (4-step avg.)", window=4,
    )  # fmt: skip
    plot_metric(runs, "entropy", out / "entropy.png", "Policy entropy", "mean token entropy (nats)")
    common = [b for b in MU_BUCKETS if b not in RARE]
    lines = [
        f"| method | seeds | reward, first {DECISIVE_BATCHES} batches (decisive) | "
        + " | ".join(f"step to {level}" for level in LEVELS)
        + " | reward, last 3 batches | blocked, mu < 0.1 | blocked, mu >= 0.1 | entropy, last 3 steps | s/run |",
        "|---|---|---|" + "---|" * len(LEVELS) + "---|---|---|---|---|",
    ]
    for method, logs in runs.items():
        early = [mean_of(log, "reward", first=DECISIVE_BATCHES) for log in logs]
        last = [mean_of(log, "reward", last=3) for log in logs]
        lines.append(
            f"| {method} | {len(logs)} | {fmt(statistics.fmean(early))} ({', '.join(fmt(v, '.3f') for v in early)}) | "
            f"{' | '.join(levels_reached(logs, level, window=1) for level in LEVELS)} | "
            f"{fmt(statistics.fmean(last))} ({', '.join(fmt(v, '.2f') for v in last)}) | "
            f"{fmt(blocked_fraction(logs, RARE), '.4f')} | {fmt(blocked_fraction(logs, tuple(common)), '.4f')} | "
            f"{fmt(statistics.fmean(mean_of(log, 'entropy', last=3) for log in logs), '.3f')} | "
            f"{statistics.fmean(r['runtime_s'] for r in meta[method]):.0f} |"
        )
    text = (
        "# Rare-token task: results\n\n"
        "Generated by `benchmarks/rare_tokens.py` from the logs in `logs/`; the hypothesis and the reading are in "
        "README.md.\n\n"
        + "\n".join(lines)
        + "\n\nReward: fraction of a generation batch's replies (4 prompts x 8 completions) that open with the "
        f"marker, logged every 4th step; first {DECISIVE_BATCHES} batches: its mean over steps 1-{4 * DECISIVE_BATCHES - 3}, "
        "per seed in brackets. Step to level: first step whose generation batch reaches the level, per seed. Blocked: tokens the trust region gave no gradient (clip or mask), over all steps and seeds, as a "
        "fraction of the tokens the sampler drew with mu < 0.1 / mu >= 0.1 (`tokens_by_mu` metrics)."
        + commands_section(meta, ENV)
    )
    (out / "results.md").write_text(text)
    return text


def measure_start(out: Path, num_prompts: int = 64, sampled_prompts: int = 16, samples: int = 8) -> str:
    """The base model's first-token distribution on the task's prompts and its reward rate when sampled.

    Probabilities are the fp32 model's at temperature 1 (the CPU profile's sampler); the reward rate is measured on
    `sampled_prompts` x `samples` replies drawn as the trainer draws them (full distribution, 16 tokens).
    """
    import torch
    from task_job import RARE_MARKER, RARE_PROMPTS, arithmetic_dataset, completion_text, marker_reward
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_dppo.jobs.default_model import DEFAULT_MODEL, resolve_model

    torch.manual_seed(0)
    path = resolve_model(DEFAULT_MODEL)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = arithmetic_dataset(**RARE_PROMPTS)["prompt"]
    marker_id = tokenizer.encode(RARE_MARKER, add_special_tokens=False)[0]
    first_token = []  # per prompt: the distribution of the reply's first token
    replies = []
    with torch.no_grad():
        for i, messages in enumerate(prompts[:num_prompts]):
            # Tokenized as GRPOTrainer does
            ids = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
            )["input_ids"]
            first_token.append(model(ids).logits[0, -1].float().softmax(-1))
            if i < sampled_prompts:
                generated = model.generate(
                    ids, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=16,
                    num_return_sequences=samples, pad_token_id=tokenizer.pad_token_id,
                )  # fmt: skip
                replies += tokenizer.batch_decode(generated[:, ids.shape[1] :], skip_special_tokens=True)
    probs = torch.stack(first_token)
    marker = probs[:, marker_id]
    mean = probs.mean(0)
    top = mean.topk(25)
    rewards = marker_reward(replies)
    openings = Counter((completion_text(r).split() or [""])[0] for r in replies)
    result = {
        "marker": RARE_MARKER,
        "marker_first_token": tokenizer.decode([marker_id]),
        "prompts": num_prompts,
        "marker_first_token_probability": {
            "mean": marker.mean().item(),
            "median": marker.median().item(),
            "min": marker.min().item(),
            "max": marker.max().item(),
        },
        "sampled_replies": len(replies),
        "sampled_reward_rate": statistics.fmean(rewards),
        "first_tokens_by_mean_probability": [
            {"token": tokenizer.decode([i]), "mean_probability": p}
            for p, i in zip(top.values.tolist(), top.indices.tolist(), strict=True)
        ],
        "sampled_opening_words": openings.most_common(25),
        "sample_replies": replies[:16],
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "start.json").write_text(json.dumps(result, indent=1))
    p = result["marker_first_token_probability"]
    rows = "\n".join(
        f"| {t['token']!r} | {t['mean_probability']:.4f} |" for t in result["first_tokens_by_mean_probability"]
    )
    text = (
        "# Rare-token task: the starting distribution\n\n"
        "Generated by `python benchmarks/rare_tokens.py --measure` (SmolLM2-135M-Instruct, fp32, temperature 1, the "
        "main job's arithmetic prompts); raw numbers in start.json.\n\n"
        f"- Marker: replies must open with {RARE_MARKER!r} (first token {result['marker_first_token']!r}).\n"
        f"- Probability of that first token at the reply's first position, over {num_prompts} prompts: mean "
        f"{p['mean']:.4f}, median {p['median']:.4f}, range {p['min']:.4f}-{p['max']:.4f}.\n"
        f"- Reward rate of the base model: {result['sampled_reward_rate']:.3f} over {len(replies)} sampled replies "
        f"({sampled_prompts} prompts x {samples}, full distribution, 16 tokens).\n\n"
        "First tokens of the reply by mean probability:\n\n| token | mean probability |\n|---|---|\n"
        + rows
        + "\n\nOpening words of the sampled replies: "
        + ", ".join(f"{w!r} {n}" for w, n in result["sampled_opening_words"])
        + "\n"
    )
    (out / "start.md").write_text(text)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--profile", choices=list(PROFILES), default="cpu")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--measure", action="store_true", help="Measure the starting distribution and stop.")
    parser.add_argument("--smoke", action="store_true", help="4 steps, seed 0, into runs/smoke/ (a pipeline check).")
    args = parser.parse_args()
    name = "rare_tokens" if args.profile == "cpu" else f"rare_tokens_{args.profile}"
    out, runs = RESULTS / name, RUNS / name
    if args.smoke:
        out, runs, args.steps, args.seeds = RUNS / "smoke" / name, RUNS / "smoke" / name / "runs", 4, [0]
    if args.measure:
        print(measure_start(out))
        return
    if not args.report_only:
        for seed in args.seeds:
            for method in args.methods:
                cmd = command(args.profile, method, args.steps, seed, runs / f"{method}-seed{seed}")
                run_logged(cmd, out / "logs" / f"{method}-seed{seed}.json", f"{method} seed {seed}", seed)
    print(report(out))


if __name__ == "__main__":
    main()
