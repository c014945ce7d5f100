"""What a checkpoint needs so that every process of a run resumes from it, beyond what transformers writes.

Optimizer state on several CPU processes (gloo): accelerate gives each process of a multi-process CPU launch the device
`cpu:0` (`PartialState.set_device` indexes every device type), and transformers loads the optimizer state of a run of
several processes onto that device (`Trainer._load_optimizer_and_scheduler`: `map_location=args.device`). torch's CPU
deserializer takes the location "cpu" only, so the resume fails: "don't know how to restore data location of
torch.storage.UntypedStorage (tagged with cpu:0)". On GPUs the device is `cuda:N`, which torch restores; nothing
changes there.

DeepSpeed checkpoints on machines without a shared filesystem (`save_on_each_node=True`): DeepSpeed names the
checkpoint to resume from in a `latest` file inside it, which only the global rank 0 writes
(`DeepSpeedEngine.save_checkpoint`). Every other machine's copy of the checkpoint lacks it, and transformers' resume
there fails: "[deepspeed] failed to resume from checkpoint". The main process of each of those machines writes it.
"""

from __future__ import annotations

import os

import torch


__all__ = ["accept_indexed_cpu_device", "complete_deepspeed_checkpoint_on_this_machine"]

_accepted = False


def _restore_on_indexed_cpu(storage, location: str):
    if location.startswith("cpu:"):  # the CPU has one memory: "cpu:N" is where "cpu" is
        return storage
    return None  # another device's location: torch's own deserializers restore it


def accept_indexed_cpu_device(device: torch.device) -> None:
    """Let `torch.load(..., map_location=device)` restore storages when `device` is a CPU with an index (`cpu:0`).

    Registers, once per process, a deserializer for "cpu:N" locations after torch's own (priority 10 is torch's CPU
    deserializer; a later one is asked only when the earlier ones decline). A no-op for every other device.
    """
    global _accepted
    if device.type != "cpu" or device.index is None or _accepted:
        return
    torch.serialization.register_package(11, lambda storage: None, _restore_on_indexed_cpu)
    _accepted = True


def complete_deepspeed_checkpoint_on_this_machine(checkpoint: str) -> None:
    """Write DeepSpeed's `latest` file into `checkpoint` where DeepSpeed did not (a machine other than the main
    process's, each machine saving into its own folder), naming the checkpoint's one `global_step*` folder, as DeepSpeed
    names it on the main machine. A no-op where `latest` exists."""
    latest = os.path.join(checkpoint, "latest")
    if os.path.exists(latest):
        return
    tags = [name for name in os.listdir(checkpoint) if name.startswith("global_step")]
    if len(tags) != 1:
        raise RuntimeError(
            f"DeepSpeed checkpoint {checkpoint} holds {len(tags)} global_step folders ({sorted(tags)}), one expected: "
            "cannot name the one to resume from. Remove the others, or resume from a checkpoint saved by this run."
        )
    with open(latest, "w") as file:
        file.write(tags[0])
