"""The loss step alone, DPPO's against TRL's own code, on the same batch in the same process, variants interleaved.

The loss step is `trainer.compute_loss(model, batch)` and its `.backward()`: no generation, no optimizer step. The
trust region is computed by one function (`trl_dppo/trust_region_step.py`) that both trainers call; this measures what
it, the divergence and DPPO's bookkeeping around it add to TRL's loss. SmolLM2-135M-Instruct with LoRA r=16 (every
linear layer), fp32, 2 CPU threads, one batch of 8 completions x 32 tokens (`min_new_tokens=32`, so no completion
ends early), GRPOConfig's defaults otherwise (loss_type "dapo", beta 0: no reference model), the same settings in
every trainer. Gradient checkpointing is off: `train()` turns it on, and it does not run here; with it on, the
backward re-runs the forward, and the same absolute overhead is a smaller fraction of the step. The batch's
advantages are set to a fixed spread (-1.5 .. 1.5 over the 8 completions): the one prompt's rewards may all be equal,
and the trust region then weighs nothing.
- synchronous: GRPOTrainer against DPPOTrainer with divergence binary_tv and with topk_tv (divergence_topk=20). The
  batch is generated once by the topk_tv trainer's `_generate_and_score_completions` (it records mu and the sampler's
  top-20), and each trainer gets a shallow copy of it;
- asynchronous: AsyncDPPOTrainer's `compute_loss` (binary_tv) against AsyncGRPOTrainer's own `compute_loss` called on
  the same trainer object, on one packed batch that TRL's queue, planner and collator build from the same 8
  completions and mu. No server: a stub rollout worker holds the queue and no weight transfer runs (as in
  tests/test_async_loss.py).

Each trainer is built once; after `--warmup` untimed passes per variant, every round times each variant once, in an
order that rotates from round to round, with the gradients zeroed (outside the timing) before each pass. Reported: the
median seconds per variant, the ratio of medians against TRL's loss in the same mode, and the median of the per-round
paired ratios (the variant's time over TRL's in the same round, which cancels load that changes between rounds); plus
the median time inside `trust_region_step` per DPPO pass.

Target: DPPO's loss step within 1.05x of TRL's (GRPOTrainer's, AsyncGRPOTrainer's) on the same batch, or better.

    .venv/bin/python benchmarks/loss_step.py [--rounds 12] [--warmup 1] [--no-async]
Writes benchmarks/results/loss_step/results.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import dppo_vs_grpo
from harness import ROOT, SMOLLM2, TRIAL_ENV


OUT = Path(__file__).parent / "results" / "loss_step"
THREADS = 2
# dppo_vs_grpo.py's aligned configuration (one generation batch per optimizer step, 8 completions x 32 tokens), in fp32
# on the CPU
BASE = dict(
    dppo_vs_grpo.BASE,
    bf16=False,
    use_cpu=True,
    disable_dropout=True,  # DPPOConfig's default; GRPOConfig's is False (SmolLM2 and the adapter have no dropout)
    report_to="none",
    save_strategy="no",
    seed=0,
    disable_tqdm=True,
)
LORA = dict(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
SYNC_BASELINE, ASYNC_BASELINE = "grpo", "async grpo (TRL's compute_loss)"


def sync_trainers(model: str, tokenizer, dataset, workdir: str) -> dict:
    """GRPOTrainer, DPPOTrainer (binary_tv) and DPPOTrainer (topk_tv, K=20), each from the same initial weights."""
    import torch
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    from trl_dppo import DPPOConfig, DPPOTrainer
    from trl_dppo.jobs.arithmetic import exact_answer_reward

    specs = {
        SYNC_BASELINE: (GRPOTrainer, GRPOConfig, {}),
        "dppo binary_tv": (DPPOTrainer, DPPOConfig, {"divergence": "binary_tv"}),
        "dppo topk_tv (K=20)": (DPPOTrainer, DPPOConfig, {"divergence": "topk_tv", "divergence_topk": 20}),
    }
    trainers = {}
    for name, (trainer_cls, config_cls, extra) in specs.items():
        torch.manual_seed(0)  # the same LoRA initialisation in every trainer
        trainers[name] = trainer_cls(
            model=model,
            reward_funcs=exact_answer_reward,
            args=config_cls(output_dir=f"{workdir}/{len(trainers)}", **BASE, **extra),
            train_dataset=dataset,
            processing_class=tokenizer,
            peft_config=LoraConfig(**LORA),
        )
        trainers[name].current_gradient_accumulation_steps = 1  # set by the training loop, which does not run here
        trainers[name].model.train()
    return trainers


def async_trainer(model: str, tokenizer, dataset, workdir: str):
    """AsyncDPPOTrainer (binary_tv) with a stub rollout worker, in the synchronous trainers' settings."""
    import torch
    from peft import LoraConfig

    from trl_dppo import AsyncDPPOConfig, AsyncDPPOTrainer
    from trl_dppo.jobs.arithmetic import exact_answer_reward

    sys.path.insert(0, str(ROOT))
    from tests.conftest import NoWeightTransfer, StubRolloutWorker

    settings = {k: v for k, v in BASE.items() if k not in ("num_generations", "generation_kwargs")}
    torch.manual_seed(0)
    trainer = AsyncDPPOTrainer(
        model=model,
        reward_funcs=exact_answer_reward,
        args=AsyncDPPOConfig(
            output_dir=f"{workdir}/async",
            divergence="binary_tv",
            token_budget=0,  # a fixed number of samples per batch (8), and no server to ask for its maximum length
            max_staleness=10,
            **settings,
        ),
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=LoraConfig(**LORA),
        rollout_worker=StubRolloutWorker(),
        weight_transfer=NoWeightTransfer(),
    )
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop, which does not run here
    trainer._published_at = {0: 0}  # version 0 published at step 0, the step the samples are trained at
    trainer.state.global_step = 0
    trainer.model.train()
    return trainer


def packed_batch(trainer, batch: dict) -> dict:
    """The synchronous batch's completions as TRL's rollout worker would queue them (prompt without its padding, the
    completion, mu, the completion's advantage, one group), through TRL's planner and collator."""
    import numpy as np
    from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

    samples = []
    for i in range(batch["completion_ids"].shape[0]):
        prompt = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()].tolist()
        completion = batch["completion_ids"][i][batch["completion_mask"][i].bool()].tolist()
        mu = batch["sampling_per_token_logps"][i][: len(completion)].tolist()
        samples.append(
            RolloutSample(
                prompt=[],
                completion=[],
                input_ids=np.array(prompt + completion, dtype=np.int64),
                completion_mask=np.array([0] * len(prompt) + [1] * len(completion), dtype=np.int64),
                old_log_probs=np.array([0.0] * len(prompt) + mu, dtype=np.float32),
                advantage=float(batch["advantages"][i]),
                model_version=0,
                group_id=0,
                metrics={"reward": 0.0},
            )
        )
    # accelerate's dispatcher fetches the next batch before it hands out the current one: queue a second copy for it
    for sample in samples + samples:
        trainer.rollout_worker.rollout_buffer.put(sample)
    return next(iter(trainer.get_train_dataloader()))


def timed_trust_region_step(modules) -> list[float]:
    """Wrap `trust_region_step` where the trainers call it; returns the list each call's seconds are appended to."""
    seconds: list[float] = []
    for module in modules:
        original = module.trust_region_step

        @functools.wraps(original)
        def timed(*args, _original=original, **kwargs):
            start = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                seconds.append(time.perf_counter() - start)

        module.trust_region_step = timed
    return seconds


def loss_step(trainer, batch: dict, compute_loss) -> float:
    """Seconds of one compute_loss + backward on a shallow copy of `batch`, gradients zeroed before (not timed)."""
    trainer.model.zero_grad(set_to_none=True)
    gc.collect()
    inputs = dict(batch)
    start = time.perf_counter()
    loss = compute_loss(trainer, trainer.model, inputs)
    loss.backward()
    return time.perf_counter() - start


def machine() -> dict:
    import torch
    import transformers
    import trl

    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if "model name" in line
        ),
        platform.processor(),
    )
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "torch_threads": torch.get_num_threads(),
        "load_average_at_start": os.getloadavg(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl": trl.__version__,
    }


def summarize(times: dict[str, list[float]], tr_seconds: dict[str, list[float]], baselines: dict[str, str]) -> dict:
    summary = {}
    for name, ts in times.items():
        base = baselines[name]
        entry = {"median_s": statistics.median(ts), "times_s": ts, "baseline": base}
        if name != base:
            entry["ratio_of_medians"] = statistics.median(ts) / statistics.median(times[base])
            entry["median_paired_ratio"] = statistics.median(t / b for t, b in zip(ts, times[base], strict=True))
        if tr_seconds.get(name):
            entry["trust_region_step_median_s"] = statistics.median(tr_seconds[name])
        summary[name] = entry
    return summary


def markdown(summary: dict, info: dict, wall_s: float) -> str:
    lines = [
        "# The loss step: DPPO against TRL's own code (SmolLM2-135M + LoRA r=16, CPU)",
        "",
        "`trainer.compute_loss(model, batch)` + `.backward()` on the same batch (8 completions x 32 tokens), no "
        "generation, no optimizer step; each trainer built once, variants interleaved in one process "
        "(see the docstring of `benchmarks/loss_step.py`).",
        "",
        "**Target**: DPPO's loss step within 1.05x of TRL's (GRPOTrainer's, AsyncGRPOTrainer's), or better.",
        "",
        f"Command: `{info['command']}`",
        "",
        f"Machine: {info['nproc']} CPUs ({info['cpu']}), torch threads {info['torch_threads']}, shared with other "
        f"work (load average at start {', '.join(f'{x:.2f}' for x in info['load_average_at_start'])}); "
        f"{info['date']}; Python {info['python']}, torch {info['torch']}, transformers {info['transformers']}, "
        f"TRL {info['trl']}. {info['rounds']} timed rounds after {info['warmup']} warm-up passes per variant; "
        f"wall time {wall_s:.0f} s (building the trainers and generating the batch included). Gradient checkpointing "
        f"off in every trainer (`train()` turns it on; it does not run here); advantages set to -1.5 .. 1.5; prompt "
        f"{info['prompt_length']} tokens, completions {sorted(set(info['completion_lengths']))} tokens.",
        "",
        "| variant | median (s) | ratio of medians | median paired ratio | trust_region_step median (ms) |",
        "|---|---|---|---|---|",
    ]
    for name, s in summary.items():
        ratio = f"{s['ratio_of_medians']:.3f}" if "ratio_of_medians" in s else "1 (baseline)"
        paired = f"{s['median_paired_ratio']:.3f}" if "median_paired_ratio" in s else ""
        tr = f"{1e3 * s['trust_region_step_median_s']:.2f}" if "trust_region_step_median_s" in s else ""
        lines.append(f"| {name} | {s['median_s']:.3f} | {ratio} | {paired} | {tr} |")
    lines += [
        "",
        "Ratios are against TRL's loss in the same mode (GRPOTrainer for the synchronous rows, AsyncGRPOTrainer's "
        "`compute_loss` on the same trainer for the asynchronous one); the paired ratio is the median over rounds of "
        "the variant's time over TRL's in the same round.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--no-async", action="store_true", help="leave out AsyncDPPOTrainer against AsyncGRPOTrainer")
    args = parser.parse_args()
    started = time.time()

    import torch
    from trl import GRPOTrainer
    from trl.experimental.async_grpo import AsyncGRPOTrainer

    import trl_dppo.async_trainer
    import trl_dppo.trainer
    from trl_dppo.jobs.arithmetic import arithmetic_dataset
    from trl_dppo.jobs.default_model import resolve_model, smollm2_tokenizer

    torch.set_num_threads(THREADS)
    info = machine()
    info.update(command=".venv/bin/python benchmarks/loss_step.py " + " ".join(sys.argv[1:]), **vars(args))
    model, tokenizer = resolve_model(SMOLLM2), smollm2_tokenizer()
    dataset = arithmetic_dataset(64, seed=0)
    workdir = tempfile.mkdtemp(prefix="loss-step-")
    trainers = sync_trainers(model, tokenizer, dataset, workdir)

    # One generation batch: one prompt, 8 completions, recorded by the top-K trainer (mu and the sampler's top-20)
    with torch.no_grad():
        batch = trainers["dppo topk_tv (K=20)"]._generate_and_score_completions([dataset[0]] * 8)
    batch["advantages"] = torch.linspace(-1.5, 1.5, 8)  # see the docstring
    lengths = batch["completion_mask"].sum(1).tolist()
    info["completion_lengths"] = lengths
    info["prompt_length"] = int(batch["prompt_mask"].sum(1).max())
    info["gradient_checkpointing"] = {
        name: bool(getattr(t.accelerator.unwrap_model(t.model), "is_gradient_checkpointing", False))
        for name, t in trainers.items()
    }
    print(f"batch: prompt {info['prompt_length']} tokens, completion lengths {lengths}, {info}", flush=True)

    tr_seconds = timed_trust_region_step([trl_dppo.trainer, trl_dppo.async_trainer])
    dppo_loss = type(trainers["dppo binary_tv"]).compute_loss
    variants = {
        name: (trainer, batch, dppo_loss if "dppo" in name else GRPOTrainer.compute_loss)
        for name, trainer in trainers.items()
    }
    baselines = dict.fromkeys(variants, SYNC_BASELINE)
    if not args.no_async:
        atrainer = async_trainer(model, tokenizer, dataset, workdir)
        packed = packed_batch(atrainer, batch)
        info["packed_batch_shape"] = list(packed["input_ids"].shape)
        info["gradient_checkpointing"]["async"] = bool(
            getattr(atrainer.accelerator.unwrap_model(atrainer.model), "is_gradient_checkpointing", False)
        )
        variants[ASYNC_BASELINE] = (atrainer, packed, AsyncGRPOTrainer.compute_loss)
        variants["async dppo binary_tv"] = (atrainer, packed, type(atrainer).compute_loss)
        baselines.update(dict.fromkeys([ASYNC_BASELINE, "async dppo binary_tv"], ASYNC_BASELINE))

    for trainer, inputs, fn in variants.values():
        for _ in range(args.warmup):
            loss_step(trainer, inputs, fn)
    times: dict[str, list[float]] = {name: [] for name in variants}
    per_variant_tr: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            trainer, inputs, fn = variants[name]
            calls = len(tr_seconds)
            times[name].append(loss_step(trainer, inputs, fn))
            per_variant_tr[name].extend(tr_seconds[calls:])
        print(f"[round {r}] " + ", ".join(f"{n}: {times[n][-1]:.3f} s" for n in names), flush=True)

    wall_s = time.time() - started
    info["wall_s"] = wall_s
    summary = summarize(times, per_variant_tr, baselines)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "results.json").write_text(json.dumps({"machine": info, "variants": summary}, indent=2))
    text = markdown(summary, info, wall_s)
    (OUT / "results.md").write_text(text)
    print(text)


if __name__ == "__main__":
    os.environ.update({k: v for k, v in TRIAL_ENV.items() if k not in os.environ})  # before torch is imported
    main()
