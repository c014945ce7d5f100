"""HH-RLHF end to end on one machine: a reward model and a judge trained on preference pairs, then DPPO with LoRA.

    python -m trl_dppo.jobs.hh_pipeline --data_path ../shared/data/hh-rlhf/harmless-base-test.jsonl.gz \
        --output_dir runs/hh --beta 0.3

(or ``--dataset_name Anthropic/hh-rlhf --num_rows N`` for hub data). The pairs are split once by ``--split_seed`` into
four disjoint parts (see `trl_dppo.jobs.hh_reward_model.split_hh_pairs`): the reward model trains on one, the judge
(a second reward model, trained the same way, that DPPO never trains against) on another, DPPO on the prompts of a
third, and the held-out part is used only to measure: both models' pairwise accuracy (against the untrained
backbone's), and the policy on its prompts before and after DPPO (`trl_dppo.jobs.hh_eval`): the optimised reward, the
judge's score and win rate, reply length and the share cut at the limit, distinct-1/2, entropy and KL to the base.
Everything lands in ``--output_dir``:

- ``reward_model/`` and ``judge/`` (in ``--reward_models_dir`` when given): each merged model and tokenizer
  (``examples/hh_rlhf_lora.py --reward_model_name_or_path`` takes them), its training log and ``reward_summary.json``;
  a later run reuses finished ones made with the same data and reward arguments;
- ``seed<S>/``: each DPPO seed's LoRA adapter, ``log_history.json``, ``dppo_summary.json`` and ``plots/``;
- ``samples.md``: per seed, held-out replies before and after DPPO side by side (typical, best and worst by the judge);
- ``summary.json``: the command, the data splits and every number above.
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spinning OpenMP threads stall CPUs shared with other processes

import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, HfArgumentParser, PreTrainedModel, PreTrainedTokenizerBase

from ..config import DPPOConfig
from ..trainer import DPPOTrainer
from .default_model import DEFAULT_MODEL, resolve_model
from .hh_eval import Replies, judge_comparison, reply_measures, sample_replies, samples_section, score_replies
from .hh_reward_model import HHSplits, load_hh_pairs, split_hh_pairs, train_hh_reward_model
from .hh_rlhf import load_policy_tokenizer, load_reward_model
from .plots import plot_run
from .script_utils import write_run_outputs


__all__ = [
    "HHDataArguments",
    "HHPolicyArguments",
    "HHRewardArguments",
    "build_reward_models",
    "main",
    "reward_model_main",
    "run_pipeline",
]

Messages = list[dict[str, str]]
REWARD_SUMMARY = "reward_summary.json"  # written last into a reward model's folder, so it marks a finished one
# Each reward model's folder: the part of the split it trains on, and what is added to --split_seed for its seed (the
# new score head's initial weights and the data order), so the judge shares neither with the reward model
REWARD_MODELS = {"reward_model": ("reward_train", 0), "judge": ("judge_train", 1)}
EVAL_SEED = 1234  # the held-out replies' sampling seed: the same noise before and after, so the change is the policy's


@dataclass
class HHDataArguments:
    """Where the pairs come from, which fit, and how they are split; where the artefacts go."""

    output_dir: str = field(default="runs/hh-rlhf-pipeline", metadata={"help": "Folder for every artefact."})
    data_path: str | None = field(
        default=None,
        metadata={"help": "Local .jsonl/.jsonl.gz HH-RLHF file ('chosen'/'rejected' rows); overrides the hub."},
    )
    dataset_name: str = field(default="Anthropic/hh-rlhf", metadata={"help": "Hub data set, when no --data_path."})
    dataset_subset: str | None = field(default="harmless-base", metadata={"help": "HH-RLHF subset (hub data_dir)."})
    dataset_split: str = field(default="train", metadata={"help": "Hub split."})
    num_rows: int | None = field(default=None, metadata={"help": "Read only the first N rows (e.g. of the hub)."})
    max_length: int = field(
        default=256,
        metadata={
            "help": "Pairs whose chosen or rejected conversation is longer (tokens) are dropped before splitting."
        },
    )
    split_seed: int = field(
        default=0, metadata={"help": "Seed of the one split into held-out/policy/judge/reward-model parts."}
    )
    held_out_pairs: int = field(default=256, metadata={"help": "Pairs nothing trains on (the evaluation's)."})
    policy_pairs: int = field(
        default=160,
        metadata={"help": "Pairs whose prompts DPPO trains on (a step takes num_generations replies of 1 prompt)."},
    )
    judge_train_pairs: int | None = field(
        default=None,
        metadata={
            "help": "The judge's training pairs; default: half of those left after the held-out and policy parts."
        },
    )
    reward_train_pairs: int | None = field(
        default=None, metadata={"help": "Reward-model training pairs; default: every pair left after the other three."}
    )
    reward_models_dir: str | None = field(
        default=None,
        metadata={
            "help": "Folder of reward_model/ and judge/ (default: --output_dir). Runs pointed at one folder (e.g. a "
            "sweep over --beta) train them once: finished ones made with the same data and reward arguments are reused."
        },
    )


@dataclass
class HHRewardArguments:
    """The reward model and the judge: LoRA sequence classifiers trained alike with TRL's RewardTrainer."""

    reward_backbone: str = field(
        default=DEFAULT_MODEL, metadata={"help": "Causal LM the reward model is built on (a new one-output head)."}
    )
    reward_learning_rate: float = field(default=3e-4, metadata={"help": "Reward model's LoRA learning rate."})
    reward_batch_size: int = field(default=8, metadata={"help": "Pairs per reward-model step."})
    reward_epochs: float = field(default=1.0, metadata={"help": "Passes over the reward model's training pairs."})
    reward_max_steps: int = field(
        default=-1, metadata={"help": "Stop the reward model after this many steps (-1: no)."}
    )
    reward_lora_top_layers: int | None = field(
        default=8, metadata={"help": "LoRA on the reward backbone's last N layers only (backward stops there)."}
    )


@dataclass
class HHPolicyArguments:
    """DPPO with LoRA on the policy part's prompts, and the held-out evaluation before and after."""

    model_name_or_path: str = field(default=DEFAULT_MODEL, metadata={"help": "Policy (a chat model) DPPO trains."})
    seeds: list[int] = field(default_factory=lambda: [0, 1], metadata={"help": "One DPPO run per seed."})
    max_steps: int = field(
        default=100, metadata={"help": "DPPO optimizer steps per seed (about 20 min each on 2 idle cores)."}
    )
    learning_rate: float = field(default=3e-4, metadata={"help": "DPPO's LoRA learning rate."})
    per_device_train_batch_size: int = field(default=8, metadata={"help": "Completions per DPPO step."})
    num_generations: int = field(default=8, metadata={"help": "Completions per prompt."})
    steps_per_generation: int = field(
        default=4, metadata={"help": "Optimizer steps per rollout (all but the first are off-policy)."}
    )
    max_prompt_length: int = field(default=128, metadata={"help": "Prompts longer than this (tokens) are dropped."})
    max_completion_length: int = field(default=48, metadata={"help": "Longest reply, in tokens."})
    beta: float = field(
        default=0.0,
        metadata={
            "help": "Weight of the KL to the reference in the loss (TRL's GRPOConfig.beta, a per-token k3 estimate); "
            "with LoRA the reference is the base model, adapters off. 0 (TRL's default) anchors nothing: the policy "
            "may drift as far as the reward pulls it. Start from 0.3: the setting benchmarks/results/hh_rlhf_beta found "
            "the judge prefers with replies near the base model's."
        },
    )
    trust_region: str = field(
        default="dppo",
        metadata={"help": "'dppo' (the mask set by --divergence and --divergence_delta), or 'grpo' (PPO's ratio clip, epsilon "
                  "0.2) to compare at equal beta; see DPPOConfig.trust_region."},
    )  # fmt: skip
    divergence: str = field(default="binary_tv", metadata={"help": "DPPO divergence (see DPPOConfig)."})
    divergence_delta: float = field(
        default=0.15, metadata={"help": "DPPO trust-region threshold (DPPOConfig.divergence_delta)."}
    )
    eval_prompts: int = field(default=128, metadata={"help": "Held-out prompts the policy is measured on."})
    eval_samples: int = field(default=2, metadata={"help": "Sampled replies per held-out prompt (temperature 1)."})
    samples_shown: int = field(
        default=2,
        metadata={"help": "Prompts nearest the median judge change shown per seed in samples.md (beside the best and "
                  "the worst by the judge)."},
    )  # fmt: skip


def _fits(tokenizer: PreTrainedTokenizerBase, prompt: Messages, max_prompt_length: int) -> bool:
    ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False)
    return len(ids) <= max_prompt_length


def _train_policy(
    args: HHPolicyArguments,
    output_dir: Path,
    seed: int,
    policy_path: str,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Dataset,
    reward_model: PreTrainedModel,
    reward_tokenizer: PreTrainedTokenizerBase,
) -> tuple[PreTrainedModel, dict[str, Any]]:
    start = time.time()
    out = output_dir / f"seed{seed}"
    cuda = torch.cuda.is_available()
    config = DPPOConfig(
        output_dir=str(out),
        seed=seed,
        max_steps=args.max_steps,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=4,
        per_device_train_batch_size=args.per_device_train_batch_size,
        num_generations=args.num_generations,
        steps_per_generation=args.steps_per_generation,
        temperature=1.0,
        max_completion_length=args.max_completion_length,
        beta=args.beta,
        trust_region=args.trust_region,
        divergence=args.divergence,
        divergence_delta=args.divergence_delta,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        bf16=cuda,
        use_cpu=not cuda,
        gradient_checkpointing=False,  # a 135M model needs no memory savings; recomputation costs CPU time
        dataloader_num_workers=0,
        log_tokens_by_mu=True,  # plot_run's tokens_by_mu.png
    )
    trainer = DPPOTrainer(
        model=policy_path,
        reward_funcs=reward_model,
        args=config,
        train_dataset=prompts,
        processing_class=tokenizer,
        reward_processing_classes=reward_tokenizer,
        peft_config=LoraConfig(
            r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
        ),
    )
    trainer.train()
    trainer.save_model(str(out))  # the LoRA adapter
    # TRL's `kl` to the reference (logged when beta > 0): 0 at the first step, where the new adapters change nothing
    kl = [entry["kl"] for entry in trainer.state.log_history if "kl" in entry]
    extra = {
        "model": args.model_name_or_path,
        "prompts": len(prompts),
        "learning_rate": args.learning_rate,
        "beta": args.beta,
        "trust_region": args.trust_region,
        "kl_first": kl[0] if kl else None,
        "kl_last": statistics.fmean(kl[-max(1, len(kl) // 10) :]) if kl else None,  # the last 10% of the steps
    }
    summary = write_run_outputs(trainer, extra, runtime_s=time.time() - start)
    plot_run(out)
    return trainer.model.eval(), summary


@dataclass(frozen=True)
class HHData:
    """The pairs as loaded and split, and where they came from."""

    source: str
    rows_read: int
    pairs: Dataset
    splits: HHSplits


def load_hh_data(data_args: HHDataArguments, tokenizer: PreTrainedTokenizerBase) -> HHData:
    """Load the pairs that fit ``max_length`` (rendered by ``tokenizer``) and split them."""
    pairs, rows_read = load_hh_pairs(
        tokenizer,
        data_args.max_length,
        data_args.data_path,
        data_args.dataset_name,
        data_args.dataset_subset,
        data_args.dataset_split,
        data_args.num_rows,
    )
    splits = split_hh_pairs(
        pairs,
        data_args.held_out_pairs,
        data_args.policy_pairs,
        data_args.split_seed,
        judge_train=data_args.judge_train_pairs,
        reward_train=data_args.reward_train_pairs,
    )
    source = data_args.data_path or f"{data_args.dataset_name}/{data_args.dataset_subset}:{data_args.dataset_split}"
    print(f"HH-RLHF | data: {source}, {rows_read} rows, {len(pairs)} pairs within {data_args.max_length} tokens -> "
          f"{splits.sizes()} | output_dir: {data_args.output_dir}", flush=True)  # fmt: skip
    return HHData(source, rows_read, pairs, splits)


def reward_models_dir(data_args: HHDataArguments) -> Path:
    return Path(data_args.reward_models_dir or data_args.output_dir)


def build_reward_models(
    data_args: HHDataArguments, reward_args: HHRewardArguments, data: HHData | None = None
) -> dict[str, dict]:
    """Step 1: train the reward model and the judge into ``reward_model/`` and ``judge/`` of `reward_models_dir`
    (finished ones there are reused), alike, each on its own part of the split.

    Returns their summaries by folder name: held-out pairwise accuracy of the untrained backbone and of the trained
    model, steps, time.
    """
    # What the models and their held-out accuracies depend on: a reused one must match, or its split would leak
    made_with = {**asdict(data_args), **asdict(reward_args)}
    del made_with["output_dir"], made_with["reward_models_dir"]
    summaries = {}
    for name, (part, seed_offset) in REWARD_MODELS.items():
        folder = reward_models_dir(data_args) / name
        done = folder / REWARD_SUMMARY
        if done.is_file():
            summary = json.loads(done.read_text())
            if summary.get("made_with") != made_with:
                raise ValueError(
                    f"The {name} in {folder} was made with other data or reward arguments "
                    f"({summary.get('made_with')}), so its held-out pairs may not be this run's. Pass the same "
                    "arguments, or delete the folder (or choose another --reward_models_dir) to train a new one."
                )
            print(f"Reusing the {name} in {folder} (delete the folder to retrain it).", flush=True)
            summaries[name] = summary
            continue
        backbone = resolve_model(reward_args.reward_backbone)
        if data is None:
            data = load_hh_data(data_args, load_policy_tokenizer(backbone))
        summary = train_hh_reward_model(
            backbone,
            getattr(data.splits, part),
            folder,
            data.splits.held_out,
            max_length=data_args.max_length,
            seed=data_args.split_seed + seed_offset,
            learning_rate=reward_args.reward_learning_rate,
            batch_size=reward_args.reward_batch_size,
            num_train_epochs=reward_args.reward_epochs,
            max_steps=reward_args.reward_max_steps,
            lora_top_layers=reward_args.reward_lora_top_layers,
        )
        summary.update(backbone=reward_args.reward_backbone, made_with=made_with)
        done.write_text(json.dumps(summary, indent=2))
        print(f"{name} ({folder}): {json.dumps(summary)}", flush=True)
        summaries[name] = summary
    return summaries


def _mean_and_sd(runs: Sequence[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Per measure, the mean and the standard deviation over seeds (``None`` for one seed, or a measure without
    values)."""
    means, sds = {}, {}
    for key, value in runs[0].items():
        if isinstance(value, (int, float)):
            values = [run[key] for run in runs]
            means[key] = statistics.fmean(values)
            sds[key] = statistics.stdev(values) if len(values) > 1 else None
    return means, sds


def run_pipeline(
    data_args: HHDataArguments,
    reward_args: HHRewardArguments,
    policy_args: HHPolicyArguments,
    command: str | None = None,
) -> dict[str, Any]:
    """Run both steps and the evaluations; write and return ``summary.json`` (see the module docstring)."""
    start = time.time()
    out = Path(data_args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    args = policy_args
    policy_path = resolve_model(args.model_name_or_path)
    tokenizer = load_policy_tokenizer(policy_path)
    data = load_hh_data(data_args, load_policy_tokenizer(resolve_model(reward_args.reward_backbone)))

    # Step 1: the reward model and the judge, then loaded exactly as examples/hh_rlhf_lora.py loads a reward model
    reward_summaries = build_reward_models(data_args, reward_args, data)
    scorers = {
        name: load_reward_model(str(reward_models_dir(data_args) / folder), dtype=torch.float32)
        for name, folder in (("reward", "reward_model"), ("judge", "judge"))
    }

    # Step 2: DPPO on the policy part's prompts; the held-out prompts measure the policy before and after
    def prompts_of(part: Dataset) -> list[Messages]:
        return [p for p in part["prompt"] if _fits(tokenizer, p, args.max_prompt_length)]

    train_prompts = Dataset.from_dict({"prompt": prompts_of(data.splits.policy_train)})
    eval_prompts = prompts_of(data.splits.held_out)[: args.eval_prompts]
    sampling = (tokenizer, eval_prompts, args.eval_samples, args.max_completion_length, EVAL_SEED)

    def scores_of(replies: Replies) -> dict[str, list[list[float]]]:
        return {name: score_replies(model, tok, eval_prompts, replies) for name, (model, tok) in scorers.items()}

    base = AutoModelForCausalLM.from_pretrained(policy_path, dtype=torch.float32).eval()
    before = sample_replies(base, *sampling)
    del base
    before_scores = scores_of(before)
    before_measures = reply_measures(before, before_scores["reward"], before_scores["judge"])
    print(f"Policy before DPPO, {len(eval_prompts)} held-out prompts: {json.dumps(before_measures)}", flush=True)

    seeds: dict[str, Any] = {}
    sections = []
    for seed in args.seeds:
        policy, run = _train_policy(args, out, seed, policy_path, tokenizer, train_prompts, *scorers["reward"])
        after = sample_replies(policy, *sampling, kl_to_base=True)
        del policy
        after_scores = scores_of(after)
        run["held_out"] = {
            **reply_measures(after, after_scores["reward"], after_scores["judge"]),
            **judge_comparison(after_scores["judge"], before_scores["judge"]),
        }
        section, run["samples_shown"] = samples_section(
            f"Seed {seed}", eval_prompts, before, after, before_scores, after_scores, args.samples_shown
        )
        sections.append(section)
        seeds[str(seed)] = run
        print(f"Seed {seed}, held-out: {json.dumps(run['held_out'])}", flush=True)

    setting = f"beta {args.beta}, trust region {args.trust_region}, {args.max_steps} steps"
    (out / "samples.md").write_text(
        "\n\n".join([
            f"# HH-RLHF held-out replies before and after DPPO ({setting})",
            f"Prompts never trained on by the reward model, the judge or the policy. Per seed: the "
            f"{args.samples_shown} whose change in mean judge score is nearest the median change (typical), then the "
            "most improved and the most worsened by the judge. Each cell is the first of the "
            f"{args.eval_samples} sampled replies (temperature 1) and its scores.",
            *sections,
        ])
    )  # fmt: skip
    after_mean, after_sd = _mean_and_sd([run["held_out"] for run in seeds.values()])
    summary = {
        "command": command,
        "arguments": {**asdict(data_args), **asdict(reward_args), **asdict(policy_args)},
        "data": {
            "source": data.source,
            "rows_read": data.rows_read,
            "pairs_within_max_length": len(data.pairs),
            "splits": data.splits.sizes(),
            "policy_train_prompts": len(train_prompts),
            "held_out_eval_prompts": len(eval_prompts),
        },
        **{
            name: {**reward_summaries[name], "path": str(reward_models_dir(data_args) / name)}
            for name in REWARD_MODELS
        },
        "policy": {
            "eval_samples_per_prompt": args.eval_samples,
            # How alike the two scorers are, on the base model's held-out replies
            "reward_judge_correlation": statistics.correlation(
                [s for row in before_scores["reward"] for s in row], [s for row in before_scores["judge"] for s in row]
            ),
            "before": before_measures,
            "after_mean": after_mean,
            "after_sd": after_sd,
            "seeds": seeds,
        },
        "runtime_s": round(time.time() - start, 1),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"HH-RLHF pipeline done in {summary['runtime_s']:.0f} s: {out / 'summary.json'}", flush=True)
    return summary


def make_parser() -> HfArgumentParser:
    return HfArgumentParser((HHDataArguments, HHRewardArguments, HHPolicyArguments))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """``python -m trl_dppo.jobs.hh_pipeline [ARGS]``: both steps, every artefact in ``--output_dir``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    data_args, reward_args, policy_args = make_parser().parse_args_into_dataclasses(args=argv)
    command = shlex.join(["python", "-m", "trl_dppo.jobs.hh_pipeline", *argv])
    return run_pipeline(data_args, reward_args, policy_args, command=command)


def reward_model_main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Step 1 alone (``examples/hh_reward_model.py``), the reward model and the judge: the data and reward-model
    arguments of `main`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    data_args, reward_args = HfArgumentParser((HHDataArguments, HHRewardArguments)).parse_args_into_dataclasses(argv)
    return build_reward_models(data_args, reward_args)


if __name__ == "__main__":
    main()
