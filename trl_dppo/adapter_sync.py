"""AsyncDPPOTrainer's adapter sync, checked: the adapter the vLLM server is told to load is the trainer's, exactly.

TRL's asynchronous trainer publishes each policy version of a LoRA adapter as files (`_sync_weight_lora`: saved to
`{lora_dir}/{lora_name}-v{N}`, then `load_lora_adapter` asks the server to load that folder under that name), and its
rollout worker asks the server for `{lora_name}-v{model_version}`. A sync that writes other tensors (under ZeRO-3 each
process's empty shards, a folder left from an earlier version, some modules' tensors old) or asks the server for
another folder makes the server sample from another policy than the trainer's, and mu describes that policy, silently.

`recording_adapter_loads` records what the server is asked to load during a sync; `adapter_sync_problems` then compares the
tensors in that folder with the trainer's, exactly, and the name with the version the rollout worker requests.

What this does not read is the server's memory: vLLM reads the folder when it is asked to, so what it serves is those
files unless it kept another adapter under the same name, which TRL avoids by naming each version anew.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch

from .rollout import replaced_attribute


__all__ = ["adapter_file_mismatches", "adapter_sync_problems", "recording_adapter_loads"]


def adapter_file_mismatches(adapter_dir: str, adapter: Mapping[str, torch.Tensor]) -> list[str]:
    """The names of the tensors in which the adapter saved in `adapter_dir` (PEFT's `adapter_model.safetensors`, read
    by PEFT's loader) differs from `adapter` (`peft.get_peft_model_state_dict`'s names): missing on either side, or
    not equal (shape, dtype or any element)."""
    from peft.utils import load_peft_weights

    saved = load_peft_weights(adapter_dir, device="cpu")

    def equal(name: str) -> bool:
        ours = adapter[name].detach().cpu()
        return saved[name].dtype == ours.dtype and torch.equal(saved[name], ours)

    names = sorted(saved.keys() | adapter.keys())
    return [name for name in names if name not in saved or name not in adapter or not equal(name)]


@contextmanager
def recording_adapter_loads(client) -> Iterator[list[tuple[str, str]]]:
    """Within the block, the adapters `client` (TRL's vLLM client) is asked to load, as (name, folder), in the list
    it yields; the client's `load_lora_adapter` is as it was after."""
    loaded: list[tuple[str, str]] = []
    load = client.load_lora_adapter

    def recorded(name, path, *args, **kwargs):
        result = load(name, path, *args, **kwargs)
        loaded.append((name, path))
        return result

    with replaced_attribute(client, "load_lora_adapter", recorded):
        yield loaded


def adapter_sync_problems(
    loaded: list[tuple[str, str]], adapter: Mapping[str, torch.Tensor], expected_name: str, requested_name: str | None
) -> tuple[list[str], int]:
    """What is wrong with one sync, in words (empty if nothing), and how many of the adapter's tensors its files get
    wrong. The sync must have asked the server to load exactly one adapter, named `expected_name`
    (`{lora_name}-v{version}`, the version it published), from files equal to the trainer's `adapter`, and the rollout
    worker must request that name (`requested_name`; None without TRL's worker)."""
    if len(loaded) != 1:
        return [f"the sync asked the server to load {len(loaded)} adapters ({loaded}), not one"], len(adapter)
    (name, folder), problems = loaded[0], []
    if name != expected_name:
        problems.append(f"the server was asked to load {name!r}, not this version's {expected_name!r}")
    if requested_name is not None and requested_name != expected_name:
        problems.append(f"the rollout worker requests {requested_name!r}, not {expected_name!r}")
    mismatched = adapter_file_mismatches(folder, adapter)
    if mismatched:
        shown = ", ".join(mismatched[:8]) + (f" and {len(mismatched) - 8} more" if len(mismatched) > 8 else "")
        problems.append(f"the files in {folder} that the server loads differ from the trainer's adapter in {shown}")
    return problems, len(mismatched)
