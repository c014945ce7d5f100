"""Top-K (topk_kl, K=20) against binary TV: step time and peak memory, side by side, on SmolLM2 and a tiny model.

The extra memory top-K needs is the kept set per completion token: K+1 ids and log-probs recorded from the sampler
and K+1 trainer log-probs, of order batch x length x (K+1) x 8 bytes; the trainer side never materialises a
full-vocabulary tensor (see trl_dppo/topk.py). Peak tensor memory is measured exactly on one profiled step.

    .venv/bin/python benchmarks/topk_vs_binary.py [--repeats 2]
Writes benchmarks/results/topk_vs_binary.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from harness import ROOT, SMOLLM2, markdown_table, run_variants


# Every completion is 32 tokens long (no early end of sequence), so the variants generate the same amount
CONFIG = dict(
    per_device_train_batch_size=8,
    num_generations=8,
    max_completion_length=32,
    learning_rate=1e-4,
    generation_kwargs={"min_new_tokens": 32},
)
TOPK = dict(CONFIG, divergence="topk_kl", divergence_topk=20)


def tiny_model(path: Path) -> str:
    sys.path.insert(0, str(ROOT))
    from tests.conftest import build_tiny_model

    from trl_dppo.jobs.default_model import smollm2_tokenizer

    tokenizer = smollm2_tokenizer()
    build_tiny_model(tokenizer, hidden_size=64).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


MODELS = {"smollm2": "SmolLM2-135M-Instruct", "tiny": "tiny model (2 layers, hidden 64)"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    args = parser.parse_args()
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    for name in args.models:
        model = SMOLLM2 if name == "smollm2" else tiny_model(Path("/tmp/trl-dppo-bench-tiny"))
        variants = {
            "binary_tv": dict(trainer="dppo", model=model, config=CONFIG, warmup=1, steps=4, profile_memory=True),
            "topk_kl K=20": dict(trainer="dppo", model=model, config=TOPK, warmup=1, steps=4, profile_memory=True),
        }
        run_variants(variants, args.repeats, out / f"topk_vs_binary_{name}.json")
    # The report covers every model measured so far (a model can be rerun alone with --models)
    texts = [
        "# topk_kl (K=20) vs binary_tv (transformers generation, LoRA r=16, CPU)\n",
        "Median of interleaved trials per variant (count in the JSON), each in a fresh process; 8 completions x 32 "
        "tokens per step. Budget for the kept sets: 8 x 32 x 21 x 8 bytes = 0.04 MB.\n",
    ]
    for name, label in MODELS.items():
        path = out / f"topk_vs_binary_{name}.json"
        if not path.exists():
            continue
        summary = json.loads(path.read_text())
        extra = summary["topk_kl K=20"]["peak_step_tensor_mb"] - summary["binary_tv"]["peak_step_tensor_mb"]
        trials = len(summary["binary_tv"]["step_times_s"])
        texts.append(
            f"\n## {label} ({trials} trial(s) per variant)\n\n{markdown_table(summary, 'binary_tv')}\n\n"
            f"Extra peak tensor memory of top-K in the profiled step: {extra:.3f} MB\n"
        )
    (out / "topk_vs_binary.md").write_text("\n".join(texts))
    print("\n".join(texts))


if __name__ == "__main__":
    main()
