"""The main job on a benchmark's own task: examples/dppo_math_lora.py's arguments, defaults and outputs, with the
task's prompts and reward in place of the arithmetic ones.

- `--task rare_tokens` (benchmarks/rare_tokens.py): the main job's arithmetic prompts; the reward is 1.0 when the reply
  opens with `RARE_MARKER`, an opening SmolLM2-135M-Instruct samples rarely but not never (measured in
  benchmarks/results/rare_tokens/start.md). Learning it means raising tokens of sampler probability ~0.01-0.1.
- `--task fixed_set` (benchmarks/convergence.py): the problems of a JSON file (`--train_set`), trained epoch after
  epoch, with the main job's exact-answer reward: the reward of a generation batch is the training accuracy on its
  prompts.

    python benchmarks/task_job.py --task rare_tokens --max_steps 40 --output_dir runs/rare [main-job arguments]

Every main-job argument (DPPOConfig, ModelConfig) is accepted; the main job's own task arguments are not.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


# Read when torch loads (see examples/dppo_math_lora.py)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from datasets import Dataset  # noqa: E402
from trl import ModelConfig, TrlParser, get_peft_config  # noqa: E402

from trl_dppo import DPPOConfig, DPPOTrainer  # noqa: E402
from trl_dppo.jobs.arithmetic import arithmetic_dataset, exact_answer_reward  # noqa: E402
from trl_dppo.jobs.dppo_math_lora import cli_defaults  # noqa: E402
from trl_dppo.jobs.script_utils import (  # noqa: E402
    resolve_offline_default,
    run_job,
    set_model_init_kwargs,
    train_and_report,
)


# The reply's opening the rare-token reward asks for; its starting rate is in results/rare_tokens/start.md
RARE_MARKER = "This"
RARE_PROMPTS = dict(num_examples=2000, seed=0)  # the main job's prompts


def completion_text(completion: Any) -> str:
    """The text of a completion: a string, or the content of the last message of a conversational one."""
    return completion if isinstance(completion, str) else str(completion[-1].get("content") or "")


def marker_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """1.0 for each reply that opens with `RARE_MARKER` (after leading white space), else 0.0."""
    return [float(completion_text(c).lstrip().startswith(RARE_MARKER)) for c in completions]


@dataclass
class TaskArguments:
    task: str = field(
        default="rare_tokens",
        metadata={
            "help": "The benchmark task: 'rare_tokens' or 'fixed_set'.",
            "choices": ["rare_tokens", "fixed_set"],
        },
    )
    train_set: str | None = field(
        default=None,
        metadata={"help": "fixed_set: JSON file of the problems (written by benchmarks/convergence.py --select)."},
    )


def rare_tokens_task(args: TaskArguments) -> tuple[Dataset, Callable, str]:
    dataset = arithmetic_dataset(**RARE_PROMPTS)
    return dataset, marker_reward, f"arithmetic prompts x {len(dataset)}, reward: reply opens with {RARE_MARKER!r}"


def fixed_set_task(args: TaskArguments) -> tuple[Dataset, Callable, str]:
    if args.train_set is None:
        raise ValueError("--task fixed_set trains on a fixed set of problems: pass --train_set FILE.json.")
    problems = json.loads(Path(args.train_set).read_text())["problems"]
    dataset = Dataset.from_list([{"prompt": p["prompt"], "answer": p["answer"]} for p in problems])
    return dataset, exact_answer_reward, f"fixed set of {len(dataset)} arithmetic problems ({args.train_set})"


TASKS = {"rare_tokens": rare_tokens_task, "fixed_set": fixed_set_task}


def main(task_args: TaskArguments, training_args: DPPOConfig, model_args: ModelConfig) -> dict | None:
    start = time.time()
    model_path = resolve_offline_default(model_args.model_name_or_path)
    set_model_init_kwargs(training_args, model_args)
    dataset, reward, description = TASKS[task_args.task](task_args)
    trainer = DPPOTrainer(
        model=model_path,
        reward_funcs=reward,
        args=training_args,
        train_dataset=dataset,
        peft_config=get_peft_config(model_args),
    )
    return train_and_report(trainer, f"DPPO {task_args.task}", model_args.model_name_or_path, description, {}, start)


def cli(argv: Sequence[str] | None = None) -> dict | None:
    parser = TrlParser((TaskArguments, DPPOConfig, ModelConfig), prog="benchmarks/task_job.py")
    return run_job(main, parser, cli_defaults(), argv)


if __name__ == "__main__":
    cli()
