"""Helpers shared by the example scripts: device-aware defaults, TRL-style parsing, and the run summary.

The summary is what a run leaves behind for later comparison and plotting: ``log_history.json`` (the Trainer's
``state.log_history``, one dict per logging step) and ``dppo_summary.json`` (mean reward over the first and the last
10% of logged steps, the mean DPPO masked fraction, and how the run was configured).
"""

from __future__ import annotations

import dataclasses
import gc
import importlib.util
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ..config import REMOVED_NAMES
from .default_model import DEFAULT_MODEL, resolve_model


__all__ = [
    "COMMON_DEFAULTS",
    "device_defaults",
    "format_summary",
    "parse_with_defaults",
    "quantization_config_for",
    "resolve_offline_default",
    "run_job",
    "with_model_init_kwargs",
    "summarize_log_history",
    "checkpoint_to_resume",
    "train_and_report",
    "use_hub_offline",
    "write_run_outputs",
]

SUMMARY_FILE = "dppo_summary.json"
# (set by the user, default to drop): GRPOConfig accepts only one of each pair
_EXCLUSIVE = (("generation_batch_size", "steps_per_generation"), ("steps_per_generation", "generation_batch_size"))
LOG_HISTORY_FILE = "log_history.json"


# Defaults both example scripts share: the offline default model with LoRA on all linear layers, 8 samples per prompt
# at temperature 1.0, a generation batch split into 4 micro-batches (so most updates are off-policy and the trust
# region has work to do), binary-TV DPPO at delta 0.15 (the paper's LoRA setting), a log line every step.
COMMON_DEFAULTS: dict[str, Any] = {
    "model_name_or_path": DEFAULT_MODEL,
    "use_peft": True,
    "lora_r": 16,
    "lora_alpha": 32,
    "lora_dropout": 0.0,
    "lora_target_modules": ["all-linear"],
    "per_device_train_batch_size": 8,
    "steps_per_generation": 4,
    "num_generations": 8,
    "temperature": 1.0,
    "logging_steps": 1,
    "report_to": "none",
    "seed": 0,
    "ddp_find_unused_parameters": False,
    "divergence": "binary_tv",
    "divergence_delta": 0.15,
}


def device_defaults() -> dict[str, Any]:
    """Trainer defaults that depend on the hardware: bf16 on CUDA, plain float32 on the CPU otherwise."""
    cuda = torch.cuda.is_available()
    return {"bf16": cuda, "use_cpu": not cuda}


def with_model_init_kwargs(training_args: Any, model_args: Any) -> Any:
    """A copy of the trainer's config that passes ModelConfig's loading options (dtype, attention, revision) on to the
    model, as TRL's scripts do; the parsed config itself is left as it is."""
    settings = {f.name: getattr(training_args, f.name) for f in dataclasses.fields(training_args) if f.init}
    settings.pop("generation_batch_size")  # derived from steps_per_generation, which is kept (GRPOConfig takes one)
    settings["model_init_kwargs"] = {
        "dtype": model_args.dtype,
        "attn_implementation": model_args.attn_implementation,
        "revision": model_args.model_revision,
        **(training_args.model_init_kwargs or {}),
    }
    return type(training_args)(**settings)


def quantization_config_for(model_args: Any) -> Any:
    """ModelConfig's ``--load_in_4bit`` / ``--load_in_8bit`` as a BitsAndBytesConfig (QLoRA), or ``None``.

    bitsandbytes quantizes on CUDA GPUs; on a machine without one the flags are refused here, before anything loads,
    rather than failing deep inside model loading.
    """
    if not (model_args.load_in_4bit or model_args.load_in_8bit):
        return None
    flag = "--load_in_4bit" if model_args.load_in_4bit else "--load_in_8bit"
    if not torch.cuda.is_available():
        raise ValueError(
            f"{flag} quantizes the policy with bitsandbytes, which needs a CUDA GPU; this machine has none. Drop "
            f"{flag} (LoRA then trains on the unquantized model) or run on a GPU."
        )
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ValueError(f"{flag} needs bitsandbytes: pip install bitsandbytes (or drop {flag}).")
    from trl import get_quantization_config

    return get_quantization_config(model_args)


def use_hub_offline() -> None:
    """Keep this process and its children (vLLM, dataloader workers) off the Hugging Face Hub.

    For runs that need nothing from the hub, such as the embedded default model, so that an unreachable hub costs no
    time-outs. huggingface_hub and datasets read HF_HUB_OFFLINE once, at import, hence their flags are set as well.
    """
    import datasets
    import huggingface_hub

    os.environ["HF_HUB_OFFLINE"] = "1"
    huggingface_hub.constants.HF_HUB_OFFLINE = True
    datasets.config.HF_HUB_OFFLINE = True


def resolve_offline_default(name_or_path: str) -> str:
    """`resolve_model`, and for the embedded default model the run goes off the hub (see `use_hub_offline`).

    Any other model (a hub id or a folder) leaves the hub settings as the user has them (HF_HUB_OFFLINE).
    """
    path = resolve_model(name_or_path)
    if path != name_or_path:
        use_hub_offline()
    return path


def parse_with_defaults(parser: Any, defaults: Mapping[str, Any], args: Sequence[str] | None = None) -> tuple:
    """Parse with TRL's ``TrlParser``, the script's defaults below a ``--config`` YAML file and the command line.

    Precedence, lowest first: the dataclasses' own defaults, ``defaults``, the YAML file, the command line. GRPOConfig
    refuses both ``generation_batch_size`` and ``steps_per_generation``, so a default for one is dropped when the
    user sets the other. ``trl.experimental.dppo``'s names that DPPOConfig does not take are refused with what to
    write instead.
    """
    args = list(sys.argv[1:] if args is None else args)
    given = {a[2:].split("=")[0].replace("-", "_") for a in args if a.startswith("--")}
    if "--config" in args:
        import yaml

        with open(args[args.index("--config") + 1]) as f:
            given |= set(yaml.safe_load(f) or {})
    removed = [f"--{old} is now --{new}" for old, new in REMOVED_NAMES.items() if old in given]
    if removed:
        raise ValueError(f"Arguments DPPOConfig no longer takes: {'; '.join(removed)}.")
    defaults = dict(defaults)
    for chosen, dropped in _EXCLUSIVE:
        if chosen in given:
            defaults.pop(dropped, None)
    unknown = parser.set_defaults_with_config(**defaults)
    if unknown:
        raise ValueError(f"Script defaults name unknown arguments: {unknown[::2]}")
    return parser.parse_args_and_config(args=args)


def _window_mean(values: Sequence[float], fraction: float, last: bool) -> float | None:
    if not values:
        return None
    n = max(1, math.ceil(len(values) * fraction))
    window = values[-n:] if last else values[:n]
    return sum(window) / len(window)


def _series(log_history: Iterable[Mapping[str, Any]], key: str) -> list[float]:
    return [float(entry[key]) for entry in log_history if isinstance(entry.get(key), (int, float))]


def summarize_log_history(log_history: Sequence[Mapping[str, Any]], fraction: float = 0.1) -> dict[str, Any]:
    """Reward at the start and the end of a run and the mean masked fraction, from a Trainer's log history.

    ``reward_first`` / ``reward_last`` average ``reward`` over the first / last ``fraction`` of the logged steps that
    carry it (at least one step each); ``None`` when nothing was logged.
    """
    rewards = _series(log_history, "reward")
    masked = _series(log_history, "trust_region/masked_fraction")
    return {
        "reward_first": _window_mean(rewards, fraction, last=False),
        "reward_last": _window_mean(rewards, fraction, last=True),
        "logged_steps": len(rewards),
        "masked_fraction_mean": sum(masked) / len(masked) if masked else None,
    }


def write_run_outputs(trainer: Any, extra: Mapping[str, Any], runtime_s: float) -> dict[str, Any] | None:
    """Write ``log_history.json`` and ``dppo_summary.json`` into the trainer's output_dir; return the summary.

    Only the main process writes and returns the summary; the others return ``None``.
    """
    if not trainer.is_world_process_zero():
        return None
    output_dir = Path(trainer.args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    history = trainer.state.log_history
    (output_dir / LOG_HISTORY_FILE).write_text(json.dumps(history, indent=1))
    summary = {
        **summarize_log_history(history),
        "steps": trainer.state.global_step,
        **extra,
        "seed": trainer.args.seed,
        "runtime_s": round(runtime_s, 1),
        "num_processes": trainer.accelerator.num_processes,
    }
    (output_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))
    return summary


def format_summary(summary: Mapping[str, Any]) -> str:
    """One readable line per summary field."""

    def fmt(value: Any) -> str:
        return f"{value:.4f}" if isinstance(value, float) else str(value)

    return "\n".join(f"  {key}: {fmt(value)}" for key, value in summary.items())


def _close_process_group() -> None:
    """End torch.distributed's default group, if this process has one, once every process got here.

    Every job ends with this (`run_job`): under `accelerate launch`, a gloo process that exits with its group alive
    can abort at interpreter shutdown ("terminate called without an active exception", pytorch/pytorch#190489) after
    a run that succeeded, and the launcher then reports the whole run as failed. Called only after a successful run:
    destroying the group while another process is still inside a collective would hang instead.
    """
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        gc.collect()  # the finished trainer's DDP wrapper holds the group too: freed now, the group ends with this call
        torch.distributed.barrier()
        # A colocated vLLM engine keeps its groups over this one in vLLM's module state, which outlives it: left there,
        # the next engine built in this process takes them as set up and fails on the destroyed group ("not
        # initialized in the world group map"). vLLM's own teardown ends them, and torch's group with them
        vllm_groups = sys.modules.get("vllm.distributed.parallel_state")
        if vllm_groups is not None:
            vllm_groups.destroy_model_parallel()
            vllm_groups.destroy_distributed_environment()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def run_job(main: Callable[..., Any], parser: Any, defaults: Mapping[str, Any], argv: Sequence[str] | None = None):
    """A job's command line: parse TRL-style arguments over `defaults` (`parse_with_defaults`), return what `main`
    returns on them, and end the process group once it has (`_close_process_group`)."""
    result = main(*parse_with_defaults(parser, defaults, argv))
    _close_process_group()
    return result


def checkpoint_to_resume(resume_from_checkpoint: str | None) -> str | bool | None:
    """`--resume_from_checkpoint` as `Trainer.train` takes it: `true` (any case) for the last checkpoint in
    `output_dir`, else the checkpoint folder named, else None."""
    if resume_from_checkpoint is not None and resume_from_checkpoint.lower() == "true":
        return True
    return resume_from_checkpoint


def train_and_report(
    trainer: Any, label: str, model: str, data: str, extra: Mapping[str, Any], start: float, model_note: str = ""
) -> dict[str, Any] | None:
    """Print the run's one-line header, train, save the model, write and print the summary (see `write_run_outputs`).

    Args:
        trainer: A ready DPPOTrainer.
        label: Name of the job in the printed lines, e.g. "DPPO math".
        model: The model as the user named it.
        data: The data, with its size.
        extra: Fields added to the summary (the learning rate, generations and trust region are added here).
        start: ``time.time()`` when the script started, for the summary's runtime.
        model_note: Printed after the model in the header, e.g. " | reward model: NAME".
    """
    args, accelerator = trainer.args, trainer.accelerator
    device = f"{accelerator.device.type} x{accelerator.num_processes}"
    if accelerator.num_processes > 1:
        device += f" ({accelerator.state.backend})"
    accelerator.print(
        f"{label} | model: {model}{model_note} | device: {device} | data: {data} | steps: {args.max_steps} | "
        f"output_dir: {args.output_dir}"
    )
    trainer.train(resume_from_checkpoint=checkpoint_to_resume(args.resume_from_checkpoint))
    trainer.save_model(args.output_dir)  # the LoRA adapter (a few MB) or the full model
    # TRL's model card (it names DPPO and cites the paper) in place of PEFT's blank template, as checkpoints get it
    trainer.create_model_card(model_name=args.hub_model_id or Path(args.output_dir).name)
    fields = {
        "model": model,
        "data": data,
        **extra,
        "learning_rate": args.learning_rate,
        "num_generations": args.num_generations,
        "divergence": args.divergence,
        "divergence_delta": args.divergence_delta,
    }
    summary = write_run_outputs(trainer, fields, runtime_s=time.time() - start)
    if summary is not None:
        print(f"{label} summary ({args.output_dir}):\n{format_summary(summary)}", flush=True)
    return summary
