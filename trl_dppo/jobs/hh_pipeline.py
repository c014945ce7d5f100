"""HH-RLHF end to end on one machine: a reward model trained on preference pairs, then DPPO with LoRA against it.

    python -m trl_dppo.jobs.hh_pipeline --data_path ../shared/data/hh-rlhf/harmless-base-test.jsonl.gz \
        --output_dir runs/hh

(or ``--dataset_name Anthropic/hh-rlhf --num_rows N`` for hub data). The pairs are split once by ``--split_seed`` into
three disjoint parts (see `trl_dppo.jobs.hh_reward_model.split_hh_pairs`): the reward model trains on one, DPPO on the
prompts of another, and the held-out part is used only to measure: the reward model's pairwise accuracy (against the
untrained backbone's) and the policy's reward on its prompts before and after DPPO. Everything lands in
``--output_dir``:

- ``reward_model/``: the merged reward model and tokenizer (``examples/hh_rlhf_lora.py --reward_model_name_or_path``
  takes it), its training log and ``reward_summary.json``; a later run into the same folder reuses a finished one;
- ``seed<S>/``: each DPPO seed's LoRA adapter, ``log_history.json``, ``dppo_summary.json`` and ``plots/``;
- ``samples.md``: typical held-out replies before and after DPPO, side by side;
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
from .hh_reward_model import (
    HHSplits,
    load_hh_pairs,
    score_conversations,
    split_hh_pairs,
    train_hh_reward_model,
)
from .hh_rlhf import load_policy_tokenizer, load_reward_model
from .plots import plot_run
from .script_utils import write_run_outputs


__all__ = [
    "HHDataArguments",
    "HHPolicyArguments",
    "HHRewardArguments",
    "build_reward_model",
    "main",
    "reward_model_main",
    "run_pipeline",
]

Messages = list[dict[str, str]]
REWARD_SUMMARY = "reward_summary.json"  # written last into reward_model/, so it marks a finished reward model


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
    split_seed: int = field(default=0, metadata={"help": "Seed of the one split into held-out/policy/reward parts."})
    held_out_pairs: int = field(default=256, metadata={"help": "Pairs neither model trains on."})
    policy_pairs: int = field(default=384, metadata={"help": "Pairs whose prompts DPPO trains on."})
    reward_train_pairs: int | None = field(
        default=None, metadata={"help": "Reward-model training pairs; default: every pair left after the other two."}
    )


@dataclass
class HHRewardArguments:
    """The reward model: a LoRA sequence classifier trained with TRL's RewardTrainer."""

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
    divergence: str = field(default="binary_tv", metadata={"help": "DPPO divergence (see DPPOConfig)."})
    divergence_delta: float = field(
        default=0.15, metadata={"help": "DPPO trust-region threshold (DPPOConfig.divergence_delta)."}
    )
    eval_prompts: int = field(default=64, metadata={"help": "Held-out prompts the policy is scored on."})
    eval_samples: int = field(default=2, metadata={"help": "Sampled replies per held-out prompt (temperature 1)."})
    samples_shown: int = field(default=4, metadata={"help": "Typical before/after replies written to samples.md."})


def _fits(tokenizer: PreTrainedTokenizerBase, prompt: Messages, max_prompt_length: int) -> bool:
    ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False)
    return len(ids) <= max_prompt_length


@torch.no_grad()
def sample_replies(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Messages],
    num_samples: int,
    max_new_tokens: int,
    seed: int,
    batch_size: int = 16,
) -> list[list[str]]:
    """``num_samples`` replies per prompt, sampled as DPPO samples them (temperature 1, no top-k/top-p)."""
    torch.manual_seed(seed)
    replies: list[list[str]] = []
    for start in range(0, len(prompts), batch_size):
        inputs = tokenizer.apply_chat_template(
            list(prompts[start : start + batch_size]),
            add_generation_prompt=True,
            padding=True,
            return_tensors="pt",
            return_dict=True,
        ).to(model.device)
        output = model.generate(
            **inputs,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_new_tokens,
            num_return_sequences=num_samples,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        texts = tokenizer.batch_decode(output[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        replies += [texts[i : i + num_samples] for i in range(0, len(texts), num_samples)]
    return replies


def score_replies(
    reward_model: PreTrainedModel,
    reward_tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Messages],
    replies: Sequence[Sequence[str]],
) -> list[list[float]]:
    """The reward model's score of every reply, per prompt."""
    conversations = [
        p + [{"role": "assistant", "content": r}] for p, rs in zip(prompts, replies, strict=True) for r in rs
    ]
    flat = score_conversations(reward_model, reward_tokenizer, conversations)
    per_prompt, i = [], 0
    for rs in replies:
        per_prompt.append(flat[i : i + len(rs)])
        i += len(rs)
    return per_prompt


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


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
    extra = {"model": args.model_name_or_path, "prompts": len(prompts), "learning_rate": args.learning_rate}
    summary = write_run_outputs(trainer, extra, runtime_s=time.time() - start)
    plot_run(out)
    return trainer.model.eval(), summary


def _cell(text: str) -> str:
    return text.strip().replace("|", "\\|").replace("\n", "<br>") or "*(empty)*"


def write_samples(
    path: Path,
    prompts: Sequence[Messages],
    before: Sequence[Sequence[str]],
    after: Sequence[Sequence[str]],
    before_rewards: Sequence[Sequence[float]],
    after_rewards: Sequence[Sequence[float]],
    count: int,
    seed: int,
) -> list[int]:
    """Write the ``count`` prompts whose reward change is nearest the median change; return their indices."""
    changes = [_mean(a) - _mean(b) for a, b in zip(after_rewards, before_rewards, strict=True)]
    median = statistics.median(changes)
    chosen = sorted(range(len(prompts)), key=lambda i: abs(changes[i] - median))[:count]
    lines = [
        f"# HH-RLHF held-out replies before and after DPPO (seed {seed})",
        "",
        (
            f"The {count} held-out prompts (never trained on by the reward model or the policy) whose change in mean "
            f"reward is nearest the median change ({median:+.3f}): typical, not best. Each cell is the first sampled "
            "reply (temperature 1) and its reward-model score."
        ),
        "",
    ]
    for n, i in enumerate(chosen, 1):
        prompt = prompts[i]
        context = f" ({len(prompt) - 1} earlier turns)" if len(prompt) > 1 else ""
        lines += [
            f"## {n}. Prompt{context}",
            "",
            "> " + prompt[-1]["content"].strip().replace("\n", "\n> "),
            "",
            f"| before (reward {before_rewards[i][0]:+.2f}) | after (reward {after_rewards[i][0]:+.2f}) |",
            "|---|---|",
            f"| {_cell(before[i][0])} | {_cell(after[i][0])} |",
            "",
        ]
    path.write_text("\n".join(lines))
    return chosen


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
        pairs, data_args.held_out_pairs, data_args.policy_pairs, data_args.split_seed, data_args.reward_train_pairs
    )
    source = data_args.data_path or f"{data_args.dataset_name}/{data_args.dataset_subset}:{data_args.dataset_split}"
    print(f"HH-RLHF | data: {source}, {rows_read} rows, {len(pairs)} pairs within {data_args.max_length} tokens -> "
          f"{splits.sizes()} | output_dir: {data_args.output_dir}", flush=True)  # fmt: skip
    return HHData(source, rows_read, pairs, splits)


def build_reward_model(data_args: HHDataArguments, reward_args: HHRewardArguments, data: HHData | None = None) -> dict:
    """Step 1: train the reward model into ``OUTPUT_DIR/reward_model`` (a finished one there is reused).

    Returns its summary: held-out pairwise accuracy of the untrained backbone and of the trained model, steps, time.
    """
    folder = Path(data_args.output_dir) / "reward_model"
    done = folder / REWARD_SUMMARY
    # What the reward model and its held-out accuracy depend on: a reused one must match, or its split would leak
    made_with = {**asdict(data_args), **asdict(reward_args)}
    del made_with["output_dir"]
    if done.is_file():
        summary = json.loads(done.read_text())
        if summary.get("made_with") != made_with:
            raise ValueError(
                f"The reward model in {folder} was made with other data or reward arguments "
                f"({summary.get('made_with')}), so its held-out pairs may not be this run's. Pass the same arguments, "
                "or delete the folder (or choose another --output_dir) to train a new one."
            )
        print(f"Reusing the reward model in {folder} (delete the folder to retrain it).", flush=True)
        return summary
    backbone = resolve_model(reward_args.reward_backbone)
    if data is None:
        data = load_hh_data(data_args, load_policy_tokenizer(backbone))
    summary = train_hh_reward_model(
        backbone,
        data.splits.reward_train,
        folder,
        data.splits.held_out,
        max_length=data_args.max_length,
        seed=data_args.split_seed,
        learning_rate=reward_args.reward_learning_rate,
        batch_size=reward_args.reward_batch_size,
        num_train_epochs=reward_args.reward_epochs,
        max_steps=reward_args.reward_max_steps,
        lora_top_layers=reward_args.reward_lora_top_layers,
    )
    summary.update(backbone=reward_args.reward_backbone, made_with=made_with)
    done.write_text(json.dumps(summary, indent=2))
    print(f"Reward model ({folder}): {json.dumps(summary)}", flush=True)
    return summary


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

    # Step 1: the reward model, then loaded exactly as examples/hh_rlhf_lora.py loads it
    reward_summary = build_reward_model(data_args, reward_args, data)
    reward_model, reward_tokenizer = load_reward_model(str(out / "reward_model"), dtype=torch.float32)

    # Step 2: DPPO on the policy part's prompts; the held-out prompts measure the policy before and after
    def prompts_of(part: Dataset) -> list[Messages]:
        return [p for p in part["prompt"] if _fits(tokenizer, p, args.max_prompt_length)]

    train_prompts = Dataset.from_dict({"prompt": prompts_of(data.splits.policy_train)})
    eval_prompts = prompts_of(data.splits.held_out)[: args.eval_prompts]
    base = AutoModelForCausalLM.from_pretrained(policy_path, dtype=torch.float32).eval()
    eval_seed = 1234  # the same sampling noise before and after, so the change is the policy's
    before = sample_replies(base, tokenizer, eval_prompts, args.eval_samples, args.max_completion_length, eval_seed)
    before_rewards = score_replies(reward_model, reward_tokenizer, eval_prompts, before)
    held_out_before = _mean([r for rs in before_rewards for r in rs])
    del base
    print(f"Policy before DPPO: held-out reward {held_out_before:.3f} on {len(eval_prompts)} prompts", flush=True)

    seeds: dict[str, Any] = {}
    for n, seed in enumerate(args.seeds):
        policy, run = _train_policy(
            args, out, seed, policy_path, tokenizer, train_prompts, reward_model, reward_tokenizer
        )
        after = sample_replies(
            policy, tokenizer, eval_prompts, args.eval_samples, args.max_completion_length, eval_seed
        )
        after_rewards = score_replies(reward_model, reward_tokenizer, eval_prompts, after)
        run["held_out_reward_after"] = _mean([r for rs in after_rewards for r in rs])
        seeds[str(seed)] = run
        print(f"Seed {seed}: held-out reward {held_out_before:.3f} -> {run['held_out_reward_after']:.3f}", flush=True)
        if n == 0:
            run["samples_shown"] = write_samples(
                out / "samples.md",
                eval_prompts,
                before,
                after,
                before_rewards,
                after_rewards,
                args.samples_shown,
                seed,
            )
        del policy

    afters = [run["held_out_reward_after"] for run in seeds.values()]
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
        "reward_model": {**reward_summary, "path": "reward_model"},
        "policy": {
            "held_out_reward_before": held_out_before,
            "held_out_reward_after_mean": _mean(afters),
            "held_out_reward_after_std": statistics.stdev(afters) if len(afters) > 1 else None,
            "eval_samples_per_prompt": args.eval_samples,
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
    """Step 1 alone (``examples/hh_reward_model.py``): the data and reward-model arguments of `main`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    data_args, reward_args = HfArgumentParser((HHDataArguments, HHRewardArguments)).parse_args_into_dataclasses(argv)
    return build_reward_model(data_args, reward_args)


if __name__ == "__main__":
    main()
