"""Trains DPPOTrainer for one optimizer step under whatever launched it (python, or `accelerate launch` with N
processes), on real generation, and saves what each process saw: tests/test_launch_matrix.py checks mu on every
process and compares the update with one process's on the same global batch.

    python tests/launch_worker.py SPEC_FILE OUT_FILE

SPEC_FILE (JSON) holds `model_dir`, `runs` (name -> DPPOConfig overrides: the generation backend, the divergence,
`max_steps`; `"lora"`: false for full fine-tuning, or LoraConfig fields over `LORA`'s) and, with `replay`, the path
of an earlier run's results: then
every run trains on that run's global generation batches in one process instead of generating
(`_generate_and_score_completions` returns them step by step), which is one process's update of the same batches.
The main process saves, per run: each process's (mu, pi, loss mask) from each step's loss, the global generation
batch of each step (the processes' rows in process order), the trainable parameters before training and the update
at the end of step `update_steps` (by default the last; under ZeRO-3, which partitions the parameters, both read
gathered). A replay trains up to that step.
With `count_gathers` (ZeRO-3), each run also reports the most parameter elements gathered at once while it trained.
With `expect_error`, each process instead saves the error its trainer raised at start (`OUT_FILE.rank<i>`); the
runs of `refused` (name -> settings, as `runs`) are started after `runs` and saved as each process's error.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys

import torch
from accelerate.utils import gather_object
from datasets import Dataset
from peft import LoraConfig
from transformers import TrainerCallback, set_seed

from tests.eager_engines import eager_engines
from trl_dppo import DPPOConfig, DPPOTrainer
from trl_dppo.jobs.default_model import smollm2_tokenizer


LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0}
GLOBAL_ROWS = 8  # completions per optimizer step over all processes: 2 prompts x 4 generations
# Prompts of one token length, so the processes' rows share one prompt width and stack without extra padding
PROMPTS = [[{"role": "user", "content": f"Count to {i} and stop."}] for i in range(10, 74)]
# Keys padded on the right along the completion (value: the padding), and on the left along the prompt
COMPLETION_PADDING = {
    "completion_ids": 0,
    "completion_mask": 0,
    "tool_mask": 0,
    "sampling_per_token_logps": 0.0,
    "sampler_base_logps": 0.0,
    "sampler_kept_ids": -1,
    "sampler_kept_logps": -float("inf"),
    "sampler_routes": -1,  # along the prompt and completion positions: prompts share one width, so on the right
}
PROMPT_KEYS = ("prompt_ids", "prompt_mask")


def length_reward(completions, **kwargs):
    return [float(len(c[0]["content"]) % 5) for c in completions]


def config(output_dir: str, world: int, settings: dict) -> DPPOConfig:
    return DPPOConfig(
        **{
            "output_dir": output_dir,
            "report_to": "none",
            "use_cpu": True,
            "bf16": False,
            "per_device_train_batch_size": GLOBAL_ROWS // world,
            "num_generations": 4,
            "max_completion_length": 12,
            "temperature": 0.7,
            "max_steps": 1,
            "logging_steps": 1,
            # SGD: the update is -lr x gradient, so any difference in the gradient's scale shows (Adam would hide it)
            "optim": "sgd",
            "learning_rate": 0.2,
            "lr_scheduler_type": "constant",
            "max_grad_norm": 0.0,
            "save_strategy": "no",
            "seed": 0,
            "divergence_topk": 5,
            **settings,
        }
    )


def stack_rows(batches: list[dict]) -> dict:
    """The processes' generation batches as one batch, rows in process order."""
    widths = {key: max(b[key].size(1) for b in batches) for key in COMPLETION_PADDING if key in batches[0]}
    stacked = {}
    for key, first in batches[0].items():
        if isinstance(first, list):  # a value per completion (true_divergence_fraction's distributions)
            stacked[key] = [value for b in batches for value in b[key]]
        elif not isinstance(first, torch.Tensor) or first.dim() == 0:
            stacked[key] = first  # num_items_in_batch: already the global count
        elif key in widths:
            pad = [
                torch.nn.functional.pad(
                    b[key],
                    (0, 0) * (b[key].dim() - 2) + (0, widths[key] - b[key].size(1)),
                    value=COMPLETION_PADDING[key],
                )
                for b in batches
            ]
            stacked[key] = torch.cat(pad)
        else:
            if key in PROMPT_KEYS and len({b[key].size(1) for b in batches}) > 1:
                raise ValueError("the processes' prompts differ in length: use prompts of one token length")
            stacked[key] = torch.cat([b[key] for b in batches])
    return stacked


def gathered(parameters: dict) -> contextlib.AbstractContextManager:
    """Under ZeRO-3 each process holds a shard of each parameter: gather them whole to read (no-op otherwise), past
    `GATHERS`' count (the test's reads are no part of training)."""
    if any(hasattr(p, "ds_id") for p in parameters.values()):
        import deepspeed

        return (GATHERS.uncounted or deepspeed.zero.GatheredParameters)(list(parameters.values()))
    return contextlib.nullcontext()


class GatherCount:
    """Under ZeRO-3: the most parameter elements held gathered at once by `deepspeed.zero.GatheredParameters`, which
    TRL's weight sync gathers through (`trl.distributed` looks it up at each call), and all it gathered, over one run."""

    def __init__(self):
        self.now = self.peak = self.total = 0
        self.uncounted = None  # DeepSpeed's own class, once installed

    def install(self) -> None:
        import deepspeed

        count, gathered_parameters = self, deepspeed.zero.GatheredParameters
        self.uncounted = gathered_parameters

        class Counted(gathered_parameters):
            def __init__(self, params, *args, **kwargs):
                listed = [params] if isinstance(params, torch.nn.Parameter) else list(params)  # may be a generator
                super().__init__(listed, *args, **kwargs)
                self.numel = sum(p.ds_numel for p in listed if hasattr(p, "ds_id"))

            def __enter__(self):
                count.now += self.numel
                count.total += self.numel
                count.peak = max(count.peak, count.now)
                return super().__enter__()

            def __exit__(self, *exc_info):
                count.now -= self.numel
                return super().__exit__(*exc_info)

        deepspeed.zero.GatheredParameters = Counted


GATHERS = GatherCount()


def largest_module(model: torch.nn.Module) -> int:
    """The most elements of one module's own parameters, a LoRA layer's counted with its base layer and adapters."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    def size(module):
        own = module.parameters(recurse=isinstance(module, BaseTunerLayer))
        return sum(getattr(p, "ds_numel", p.numel()) for p in own)

    return max(size(module) for module in model.modules())


class ReadUpdate(TrainerCallback):
    """The update (`p - before` per trainable tensor) at the end of optimizer step `step`, read on every process (under
    ZeRO-3 a gather is a collective); None before."""

    def __init__(self, trainable: dict, before: dict, step: int):
        self.trainable, self.before, self.step = trainable, before, step
        self.update = None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            with gathered(self.trainable):
                self.update = {n: p.detach() - self.before[n] for n, p in self.trainable.items()}


def peft_config(lora: bool | dict) -> LoraConfig | None:
    """A run's `"lora"` setting: false for full fine-tuning, else `LORA` with the setting's fields over it."""
    return None if lora is False else LoraConfig(**{**LORA, **(lora if isinstance(lora, dict) else {})})


def train(name: str, settings: dict, spec: dict, out_file: str) -> dict:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    set_seed(0)  # the LoRA initialisation
    settings = dict(settings)
    lora = settings.pop("lora", True)
    replay = spec.get("replay")
    if replay:  # no generation: one process trains the recorded global batches, up to the step the update is read at
        settings = {key: value for key, value in settings.items() if not key.startswith("vllm") and key != "use_vllm"}
        settings["max_steps"] = spec.get("update_steps", settings.get("max_steps", 1))
    trainer = DPPOTrainer(
        model=spec["model_dir"],
        reward_funcs=length_reward,
        args=config(f"{out_file}.runs/{name}", world, settings),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=smollm2_tokenizer(),
        peft_config=peft_config(lora),
    )
    assert trainer.accelerator.num_processes == world, f"{world} processes launched"
    generated = []
    if replay:
        batches = iter(torch.load(replay)[name]["batches"])
        trainer._generate_and_score_completions = lambda inputs: dict(next(batches))
    else:
        generate = trainer._generate_and_score_completions

        def recording(inputs):
            output = generate(inputs)
            generated.append({k: v.cpu().clone() if isinstance(v, torch.Tensor) else v for k, v in output.items()})
            return output

        trainer._generate_and_score_completions = recording
    seen = []
    set_advantages = trainer._set_trust_region_advantages

    def spy(context, trainer_logps, hidden):
        inputs = context.inputs
        mask = (inputs["completion_mask"] * inputs.get("tool_mask", 1)).bool()
        seen.append((inputs["sampling_per_token_logps"].clone(), trainer_logps.clone(), mask))
        return set_advantages(context, trainer_logps, hidden)

    trainer._set_trust_region_advantages = spy
    trainable = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
    with gathered(trainable):
        before = {n: p.detach().clone() for n, p in trainable.items()}
    read_update = ReadUpdate(trainable, before, spec.get("update_steps", trainer.args.max_steps))
    trainer.add_callback(read_update)
    GATHERS.peak = GATHERS.total = 0
    trainer.train()
    gathered_at_once, gathered_in_all = GATHERS.peak, GATHERS.total
    by_process = gather_object([{"seen": seen, "generated": generated}])
    steps = len(by_process[0]["generated"])
    return {
        "num_processes": trainer.accelerator.num_processes,
        "distributed_type": str(trainer.accelerator.distributed_type),
        # ZeRO-3: each process holds only its shard of every parameter, the LM head's too (read by top-K)
        "partitioned": all(hasattr(p, "ds_id") for p in trainer.model.parameters()),
        "lm_head_local_size": trainer.model.get_output_embeddings().weight.numel(),
        # the optimizer that stepped: under DeepSpeed, the one its engine wraps (with optimizer offload accelerate
        # hands it DeepSpeed's CPU Adam in place of the trainer's torch optimizer)
        "optimizer": type(getattr(trainer.model_wrapped, "basic_optimizer", trainer.optimizer)).__name__,
        # with `count_gathers`, under ZeRO-3: the peak elements gathered at once in training and all it gathered, the
        # largest module's (a LoRA layer's with its adapters) and all parameters' (whole, not this process's partition)
        "gathered_at_once": gathered_at_once,
        "gathered_in_all": gathered_in_all,
        "largest_module": largest_module(trainer.model),
        "all_parameters": sum(getattr(p, "ds_numel", p.numel()) for p in trainer.model.parameters()),
        "seen": [process["seen"] for process in by_process],
        "batches": None
        if replay
        else [stack_rows([process["generated"][step] for process in by_process]) for step in range(steps)],
        "before": before,
        "update": read_update.update,
        "logs": [entry for entry in trainer.state.log_history if "loss" in entry],
    }


def start_error(settings: dict, spec: dict, out_file: str) -> str:
    """The error the trainer raises at start on this process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    settings = dict(settings)
    lora = settings.pop("lora", False)
    try:
        DPPOTrainer(
            model=spec["model_dir"],
            reward_funcs=length_reward,
            args=config(f"{out_file}.runs/refused", world, settings),
            train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
            processing_class=smollm2_tokenizer(),
            peft_config=peft_config(lora),
        )
    except Exception as error:  # noqa: BLE001  (the test reads which error each process raised)
        return f"{type(error).__name__}: {error}"
    return "no error"


def skip_nccl_weight_transfer() -> None:
    """TRL's weight transfer to a server runs on NCCL and needs CUDA: only its two client calls are skipped (one
    optimizer step from one generation never needs the server to hold the updated weights), and with them
    DPPOTrainer's refusal of that transfer without CUDA."""
    from trl.generation.vllm_client import VLLMClient

    import trl_dppo.trainer

    def drain(self, metadata, named_params):  # walk the weights as the broadcast would (PEFT merges and unmerges)
        for _ in named_params:
            pass

    VLLMClient.init_communicator = lambda self, device=0: None
    VLLMClient.update_named_params = drain
    trl_dppo.trainer.refuse_weight_transfer_without_cuda = lambda device: None


def main(spec_file: str, out_file: str) -> None:
    torch.set_num_threads(1)
    with open(spec_file) as f:
        spec = json.load(f)
    if spec.get("server"):
        skip_nccl_weight_transfer()
    if spec.get("count_gathers"):
        GATHERS.install()
    rank = int(os.environ.get("RANK", "0"))
    if spec.get("expect_error"):
        with open(f"{out_file}.rank{rank}", "w") as f:
            f.write(start_error(spec["expect_error"], spec, out_file))
        return
    colocated = any(settings.get("vllm_mode") == "colocate" for settings in spec["runs"].values())
    # tests/eager_engines.py; a replay builds no engine (and runs without vLLM: tests/without_vllm.py)
    with eager_engines() if colocated and not spec.get("replay") else contextlib.nullcontext():
        results = {name: train(name, settings, spec, out_file) for name, settings in spec["runs"].items()}
    # Runs refused at start, beside the trained ones in the same launch: each process's error
    refused = {} if spec.get("replay") else spec.get("refused", {})
    refused = {name: start_error(settings, spec, out_file) for name, settings in refused.items()}
    results.update({name: {"errors": gather_object([error])} for name, error in refused.items()})
    if rank == 0:
        torch.save(results, out_file)
    # else gloo can abort at exit after a good run (pytorch/pytorch#190489); a colocated vLLM engine destroys the
    # process group itself when it shuts down at exit, and fails if it is gone already
    if torch.distributed.is_initialized() and not colocated:
        gc.collect()
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
