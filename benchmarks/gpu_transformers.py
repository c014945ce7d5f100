"""The GPU checks that need no vLLM: DPPOTrainer on CUDA with transformers generation, and what recording mu costs
in `generate()` there. Run by benchmarks/gpu_transformers.sh (which says why, what sizes and how long), on a model
made by `sharded_topk_check.py prepare MODEL_DIR CONFIG_DIR --random-init` (SmolLM2-135M's shape, random weights, LM
head untied and scaled so that next-token distributions are peaked):

    python benchmarks/gpu_transformers.py alignment MODEL_DIR OUT_DIR [--device cpu] [--smoke]
    python benchmarks/gpu_transformers.py recorder MODEL_DIR OUT_DIR [--device cpu] [--smoke] [--budget-s S]

alignment: at learning rate 0, fp32 on both sides, the trainer's pi must equal the recorded mu (`mismatch/*`, and the
kept set's log-probabilities for top-K); the same with TRL's default bf16=True is recorded, not judged; one run at
lr > 0 shows training proceeds. recorder: `generate()` with no recorder, the binary and the top-20 recorder,
interleaved, fp32 and bf16. `--smoke` runs tiny sizes (a test of the script, e.g. on CPU); each writes
OUT_DIR/<part>.json and OUT_DIR/<part>.md and exits non-zero when its check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

ALIGNED = 1e-3  # fp32 sampler against the fp32 trainer: |pi - mu| and kept-set log-prob gaps (expected ~1e-5)
PEAKED = 0.3  # mean probability of the likeliest next token, below which a misaligned mu would hardly show
RECORDER_CLAIM = 0.05  # the target: the recorder adds at most 5% to generate() at batch 64 x 256 on SmolLM2-135M


def versions() -> dict:
    import accelerate
    import transformers

    found = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "accelerate": accelerate.__version__,
    }
    for name in ("trl", "datasets", "peft", "pyarrow"):
        try:
            found[name] = __import__(name).__version__
        except Exception as error:  # recorded: the parts that need it fail on their own
            found[name] = f"{type(error).__name__}: {error}"
    found["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return found


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------------ alignment


def length_reward(completions, **kwargs):
    """Spread within each group, so that advantages are non-zero (a random model answers no sum)."""
    return [float(len(c[0]["content"]) % 5) for c in completions]


def mean_top_probability(model_dir: str, device: str, prompts: list, new_tokens: int) -> float:
    """Mean over sampled positions of the model's largest next-token probability: how peaked the model is."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    batch = tokenizer.apply_chat_template(
        prompts, add_generation_prompt=True, padding=True, return_tensors="pt", return_dict=True
    ).to(device)
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(
            **batch,
            do_sample=True,
            top_k=0,
            max_new_tokens=new_tokens,
            output_logits=True,
            return_dict_in_generate=True,
        )
    top = torch.stack(out.logits, 1).float().softmax(-1).amax(-1)
    return top.mean().item()


def train_variant(model_dir: str, out_dir: str, device: str, smoke: bool, dataset, **overrides) -> dict:
    from sharded_topk_check import kept_set_spy

    from trl_dppo import DPPOConfig, DPPOTrainer

    settings = dict(
        output_dir=out_dir,
        report_to="none",
        bf16=False,
        learning_rate=0.0,
        per_device_train_batch_size=4 if smoke else 8,
        num_generations=4 if smoke else 8,
        steps_per_generation=2 if smoke else 4,
        max_completion_length=8 if smoke else 64,
        max_steps=2 if smoke else 8,
        logging_steps=1,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
        use_cpu=device == "cpu",
    )
    settings.update(overrides)
    trainer = DPPOTrainer(
        model=model_dir, reward_funcs=length_reward, args=DPPOConfig(**settings), train_dataset=dataset
    )
    start = time.perf_counter()
    spy = kept_set_spy(trainer) if trainer.args.recorded_topk else contextlib.nullcontext(([], []))
    with spy as (_, kept_gaps):
        trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]

    def series(name: str) -> list[float]:
        return [entry[name] for entry in logs if name in entry]

    return {
        "settings": {
            key: settings[key]
            for key in ("bf16", "learning_rate", "divergence", "steps_per_generation")
            if key in settings
        },
        "seconds": time.perf_counter() - start,
        "steps": len(logs),
        "loss": series("loss"),
        "abs_prob_diff_max": series("mismatch/abs_prob_diff_max"),
        "abs_prob_diff_mean": series("mismatch/abs_prob_diff_mean"),
        "at_sync_abs_prob_diff_max": series("mismatch/at_sync_abs_prob_diff_max"),
        "at_sync_abs_prob_diff_mean": series("mismatch/at_sync_abs_prob_diff_mean"),
        "kl_mean": series("mismatch/kl_mean"),
        "missing_sampler_logps": sum(series("mismatch/missing_sampler_logps")),
        "masked_fraction": series("trust_region/masked_fraction"),
        "kept_logp_gap_max": max(kept_gaps, default=None),
    }


def judge_aligned(run: dict) -> bool:
    """At lr 0 in fp32: every step's |pi - mu| and kept-set gap within ALIGNED, no token without its mu."""
    gaps = run["abs_prob_diff_max"] + run["at_sync_abs_prob_diff_max"]
    if run["kept_logp_gap_max"] is not None:
        gaps.append(run["kept_logp_gap_max"])
    return bool(
        run["steps"]
        and run["at_sync_abs_prob_diff_max"]
        and gaps
        and max(gaps) < ALIGNED
        and run["missing_sampler_logps"] == 0
    )


def judge_training(run: dict) -> bool:
    return bool(run["steps"] and all(math.isfinite(x) for x in run["loss"]) and run["masked_fraction"])


def alignment(model_dir: str, out: Path, device: str, smoke: bool) -> bool:
    from trl_dppo.jobs.arithmetic import arithmetic_dataset

    dataset = arithmetic_dataset(16 if smoke else 48, seed=0)
    result = {"versions": versions(), "aligned_below": ALIGNED, "peaked_above": PEAKED}
    result["mean_top_probability"] = mean_top_probability(model_dir, device, dataset[:8]["prompt"], 8 if smoke else 32)
    topk = dict(divergence="topk_kl", divergence_topk=20)
    variants = {  # name: (settings, how it is judged)
        "fp32 binary_tv lr 0": (dict(divergence="binary_tv"), judge_aligned),
        "fp32 topk_kl K=20 lr 0": (topk, judge_aligned),
        "bf16 binary_tv lr 0": (dict(divergence="binary_tv", bf16=True), None),
        "bf16 topk_kl K=20 lr 0": (dict(topk, bf16=True), None),
        "fp32 binary_tv lr 1e-5": (dict(divergence="binary_tv", learning_rate=1e-5), judge_training),
    }
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (settings, judge) in variants.items():
            try:
                run = train_variant(model_dir, f"{tmp}/{len(runs)}", device, smoke, dataset, **settings)
                run["passed"] = judge(run) if judge else None  # None: a measurement
            except Exception as error:  # one variant's failure is reported, the others still run
                run = {"error": f"{type(error).__name__}: {error}", "passed": False}
            runs[name] = run
            print(f"{name}: {json.dumps({k: v for k, v in run.items() if k != 'settings'})}", flush=True)
    result["runs"] = runs
    peaked = result["mean_top_probability"] > PEAKED
    result["passed"] = peaked and all(run["passed"] is not False for run in runs.values())
    (out / "dppo_alignment.json").write_text(json.dumps(result, indent=1))

    def top(values: list) -> str:
        return f"{max(values):.2e}" if values else "-"

    lines = [
        f"## DPPOTrainer on {result['versions']['device']}, transformers generation"
        + (" (smoke sizes)" if smoke else ""),
        "",
        f"Model: SmolLM2-135M's shape, random, peaked LM head (mean top next-token probability "
        f"{result['mean_top_probability']:.2f}; needs > {PEAKED}). Pass: fp32 gaps < {ALIGNED:g}, no missing mu; "
        "bf16 rows are measurements (autocast training forward against fp32 generation).",
        "",
        "| run | steps | max abs_prob_diff_max | mean abs_prob_diff_mean | at_sync max | kept-set gap max "
        "| masked fraction (last) | loss finite | passed |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for name, run in runs.items():
        if "error" in run:
            lines.append(f"| {name} | error: {run['error'][:200]} | | | | | | | False |")
            continue
        mean = f"{statistics.mean(run['abs_prob_diff_mean']):.2e}" if run["abs_prob_diff_mean"] else "-"
        gap = f"{run['kept_logp_gap_max']:.2e}" if run["kept_logp_gap_max"] is not None else "-"
        masked = f"{run['masked_fraction'][-1]:.4f}" if run["masked_fraction"] else "-"
        finite = all(math.isfinite(x) for x in run["loss"])
        lines.append(
            f"| {name} | {run['steps']} | {top(run['abs_prob_diff_max'])} | {mean} | "
            f"{top(run['at_sync_abs_prob_diff_max'])} | {gap} | {masked} | {finite} | {run['passed']} |"
        )
    (out / "dppo_alignment.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    return result["passed"]


# ------------------------------------------------------------------------------------------------- recorder


def recorder_overhead(model, prompt: torch.Tensor, new_tokens: int, repeats: int, temperature: float = 1.0) -> dict:
    """Seconds of `generate()` with no recorder, the binary and the top-20 recorder, interleaved, after a warm-up
    (also `benchmarks/records_scaling.py`'s part 2, on CPU)."""
    from transformers import GenerationConfig

    from trl_dppo.records import SamplerRecords
    from trl_dppo.rollout import SamplerLogprobRecorder, recording_generate

    device = str(prompt.device)
    # Fixed lengths (no eos), plain sampling at the trainer's temperature: the processor chain TRL builds by default,
    # so the recorder adds its one hook and nothing else
    config = GenerationConfig(
        do_sample=True,
        temperature=temperature,
        top_k=0,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=0,
        eos_token_id=None,
    )
    variants = {"no recorder": None, "binary recorder": 0, "top-20 recorder": 20}
    attention_mask = torch.ones_like(prompt)

    def run(topk, generation_config) -> float:
        torch.manual_seed(0)
        synchronize(device)
        start = time.perf_counter()
        with torch.no_grad():
            if topk is None:
                model.generate(prompt, attention_mask=attention_mask, generation_config=generation_config)
            else:
                recorder = SamplerLogprobRecorder(topk, temperature)
                with recording_generate(model, recorder):
                    out = model.generate(prompt, attention_mask=attention_mask, generation_config=generation_config)
                recorder.finish(out[:, prompt.size(1) :].tolist(), SamplerRecords(topk))
        synchronize(device)
        return time.perf_counter() - start

    warm_up = copy.deepcopy(config)
    warm_up.max_new_tokens = warm_up.min_new_tokens = 8
    for topk in variants.values():
        run(topk, warm_up)
    times = {name: [] for name in variants}
    for rep in range(repeats):
        order = list(variants.items()) if rep % 2 == 0 else list(variants.items())[::-1]
        for name, topk in order:
            times[name].append(run(topk, config))
            print(f"[rep {rep}] {name}: {times[name][-1]:.1f} s", flush=True)
    base = statistics.median(times["no recorder"])
    return {
        name: {
            "seconds": t,
            "median_s": statistics.median(t),
            "spread_s": max(t) - min(t),
            "overhead": statistics.median(t) / base - 1,
        }
        for name, t in times.items()
    }


def recorder(model_dir: str, out: Path, device: str, smoke: bool, budget_s: float) -> bool:
    from transformers import AutoModelForCausalLM

    started = time.perf_counter()
    size = (4, 16, 2) if smoke else (64, 256, 3)  # (batch, new tokens, trials)
    large = (8, 32, 1) if smoke else (256, 1024, 2)  # fp32: the model's dtype in TRL's transformers generation
    result = {"versions": versions(), "claim": f"overhead <= {RECORDER_CLAIM:.0%} at batch 64 x 256", "rows": []}

    def measure(dtype: torch.dtype, batch: int, new_tokens: int, repeats: int) -> None:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        prompt = torch.randint(100, 40000, (batch, 16), generator=torch.Generator().manual_seed(0)).to(device)
        times = recorder_overhead(model, prompt, new_tokens, repeats)
        dtype_name = str(dtype).removeprefix("torch.")
        result["rows"].append({"dtype": dtype_name, "batch": batch, "new_tokens": new_tokens, "times": times})
        write_recorder(result, out, smoke)  # what finished is kept if the part is stopped at its time limit
        medians = ", ".join(f"{name} {t['median_s']:.2f} s ({t['overhead']:+.1%})" for name, t in times.items())
        print(f"{dtype_name} {batch} x {new_tokens}: {medians}", flush=True)

    for dtype in (torch.float32, torch.bfloat16):
        measure(dtype, *size)
    # Decoding at these sizes is bound by kernel launches, so time grows with the length, and somewhat with the batch
    small = max(row["times"]["no recorder"]["median_s"] for row in result["rows"])
    estimate = small * large[1] / size[1] * 1.25 * 3 * large[2]
    left = budget_s - (time.perf_counter() - started)
    if estimate < left:
        measure(torch.float32, *large)
    else:
        result["skipped"] = f"fp32 at {large[0]} x {large[1]}: estimated {estimate:.0f} s, {left:.0f} s left"
        write_recorder(result, out, smoke)
    return True  # a measurement: it passes by finishing


def write_recorder(result: dict, out: Path, smoke: bool) -> None:
    first = result["rows"][0]["times"]
    result["claim_holds_fp32_64x256"] = (
        None
        if smoke
        else all(first[name]["overhead"] <= RECORDER_CLAIM for name in ("binary recorder", "top-20 recorder"))
    )
    (out / "recorder_overhead.json").write_text(json.dumps(result, indent=1))
    lines = [
        f"## The mu recorder in generate() on {result['versions']['device']}" + (" (smoke sizes)" if smoke else ""),
        "",
        "SmolLM2-135M's shape (random weights), prompts of 16 random tokens, fixed-length sampling at T = 1, "
        "variants interleaved after a warm-up, CUDA synchronised around each call; the recorder's `finish` (records "
        f"to the CPU) is inside the timing. The target: {result['claim']}.",
        "",
        "| dtype | batch x new tokens | variant | median s | spread s | trials (s) | overhead |",
        "|---|---|---|---:|---:|---|---:|",
    ]
    for row in result["rows"]:
        for name, t in row["times"].items():
            trials = ", ".join(f"{s:.2f}" for s in t["seconds"])
            lines.append(
                f"| {row['dtype']} | {row['batch']} x {row['new_tokens']} | {name} | {t['median_s']:.2f} | "
                f"{t['spread_s']:.2f} | {trials} | {t['overhead']:+.1%} |"
            )
    if "skipped" in result:
        lines += ["", f"Skipped for time: {result['skipped']}."]
    (out / "recorder_overhead.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=["alignment", "recorder"])
    parser.add_argument("model_dir")
    parser.add_argument("out", type=Path)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: a test of the script")
    parser.add_argument("--budget-s", type=float, default=150, help="recorder: time for the optional large size")
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("No CUDA device: pass --device cpu (with --smoke) to test the script without one.")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.part == "alignment":
        passed = alignment(args.model_dir, args.out, args.device, args.smoke)
    else:
        passed = recorder(args.model_dir, args.out, args.device, args.smoke, args.budget_s)
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
