"""Resuming a run of several processes on the CPU (gloo): the optimizer state must load onto the process's device.

accelerate gives each process of a multi-process CPU launch the device `cpu:0` (`PartialState.set_device` indexes
every device type), and transformers loads the optimizer state of a run of several processes onto that device
(`Trainer._load_optimizer_and_scheduler`: `map_location=args.device`). torch's CPU deserializer takes the location
"cpu" only, so the resume fails: "don't know how to restore data location of torch.storage.UntypedStorage (tagged
with cpu:0)". On GPUs the device is `cuda:N`, which torch restores; nothing changes there.
"""

from __future__ import annotations

import torch


__all__ = ["accept_indexed_cpu_device"]

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
