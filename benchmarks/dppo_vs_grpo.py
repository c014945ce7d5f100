"""DPPOTrainer (binary TV) against GRPOTrainer on transformers generation: step time and peak memory, side by side.

Two configurations on SmolLM2-135M-Instruct with LoRA r=16, 8 completions x 32 tokens per step, 2 CPU threads:
- aligned (one generation per optimizer step): GRPO runs no recomputation either, so the ratio is DPPO's overhead
  (recording mu during generation, the divergence and the mask); target <= 1.05;
- steps_per_generation=2 with gradient_accumulation_steps=1: GRPO recomputes old log-probabilities, DPPO does not.

    .venv/bin/python benchmarks/dppo_vs_grpo.py [--repeats 2]
Writes benchmarks/results/dppo_vs_grpo.{json,md}.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from harness import SMOLLM2, markdown_table, run_variants


# Every completion is 32 tokens long (no early end of sequence), so the variants generate the same amount
BASE = dict(
    per_device_train_batch_size=8,
    num_generations=8,
    max_completion_length=32,
    learning_rate=1e-4,
    generation_kwargs={"min_new_tokens": 32},
)
STALE = dict(BASE, steps_per_generation=2, gradient_accumulation_steps=1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    variants = {
        "grpo, aligned": dict(trainer="grpo", model=SMOLLM2, config=BASE, warmup=1, steps=4),
        "dppo binary_tv, aligned": dict(trainer="dppo", model=SMOLLM2, config=BASE, warmup=1, steps=4),
        "grpo, steps_per_generation=2": dict(trainer="grpo", model=SMOLLM2, config=STALE, warmup=2, steps=4),
        "dppo binary_tv, steps_per_generation=2": dict(trainer="dppo", model=SMOLLM2, config=STALE, warmup=2, steps=4),
    }
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    summary = run_variants(variants, args.repeats, out / "dppo_vs_grpo.json")
    aligned = {k: v for k, v in summary.items() if "aligned" in k}
    stale = {k: v for k, v in summary.items() if "aligned" not in k}
    text = (
        "# DPPOTrainer vs GRPOTrainer (transformers generation, SmolLM2-135M + LoRA, CPU)\n\n"
        f"Median of {args.repeats} interleaved trials per variant, each in a fresh process.\n\n"
        "## Aligned (one generation per optimizer step)\n\n"
        + markdown_table(aligned, "grpo, aligned")
        + "\n\n## steps_per_generation=2, gradient_accumulation_steps=1\n\n"
        + markdown_table(stale, "grpo, steps_per_generation=2")
        + "\n"
    )
    (out / "dppo_vs_grpo.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
