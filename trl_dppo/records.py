"""The sampler's records of one generation batch, kept in tensors and tied to tokens through TRL's float lists.

GRPOTrainer threads the sampler's per-token log-probabilities through its rollout code as Python floats in lists: it
stitches tool calls (`logprobs += [0.0] * tool_len + post_tool`), truncates with slices and finally pads them into the
float32 tensor `sampling_per_token_logps`. DPPO needs more per token (the sampler's top-K for the top-K divergence,
the untruncated log mu for truncated sampling), and one Python object per token costs hundreds of bytes and
microseconds. So the extra records live in one `SamplerRecords` per generation batch, as tensors built in one
vectorised pass per backend call, and each float handed to TRL carries its token's row in that store:

A sampled log-probability is a float32 value, so as a Python float (float64) the low 29 bits of its mantissa are zero.
`tag_logps` writes row + 1 into the low 28 of them. Rounding to float32 drops those bits exactly (they weigh less than
half a float32 unit in the last place, subnormals and 0.0 included, and NaN stays NaN), so `sampling_per_token_logps`
is bit for bit what it would be untagged, while the stitched and truncated lists still say which row each token came
from; 0 means none (tool-result tokens are 0.0, padding is absent). -inf cannot carry a row (its mantissa must stay
zero); such a token has no sampler probability and already leaves the loss.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import torch

__all__ = ["ROW_BITS", "VOID_ID", "SamplerRecords", "tag_logps", "tagged_rows"]

# A kept-set slot with no token (the sampled token is already among the top K, or the token has no record)
VOID_ID = -1
# Rows of one generation batch are tagged in the low ROW_BITS bits of a float64 mantissa (float32 leaves 29 free)
ROW_BITS = 28
_ROW_MASK = (1 << ROW_BITS) - 1


def tag_logps(logps: torch.Tensor, first_row: int) -> torch.Tensor:
    """float32 log-probabilities `(N,)` as float64 values carrying rows `first_row .. first_row + N - 1`."""
    if first_row + logps.numel() >= _ROW_MASK:
        raise RuntimeError(f"More than {_ROW_MASK - 1} sampled tokens in one generation batch cannot be tagged.")
    values = logps.detach().to(device="cpu", dtype=torch.float32).double()
    bits = values.view(torch.int64) | torch.arange(first_row + 1, first_row + 1 + values.numel(), dtype=torch.int64)
    return torch.where(torch.isinf(values), values, bits.view(torch.float64))


def tagged_rows(logprobs: list[list[float]], length: int) -> torch.Tensor:
    """The store rows `(B, length)` carried by TRL's per-completion float lists; -1 where a token carries none."""
    lengths = torch.tensor([len(row) for row in logprobs], dtype=torch.long)
    flat = list(itertools.chain.from_iterable(logprobs))
    try:
        values = torch.tensor(flat, dtype=torch.float64)
    except TypeError:  # vLLM reports a NaN log-prob as None; it carries no row
        values = torch.tensor([math.nan if v is None else v for v in flat], dtype=torch.float64)
    rows = torch.full((len(logprobs), length), -1, dtype=torch.long)
    rows[torch.arange(length) < lengths[:, None]] = (values.view(torch.int64) & _ROW_MASK) - 1
    return rows


@dataclass
class SamplerRecords:
    """What the sampler recorded for the tokens of one generation batch, beyond the float TRL keeps.

    Rows are appended per backend call (`add`) and read back per batch token through the tags (`batch_tensors`).

    - `top_ids` / `top_logps` `(N, K)`: the sampler's K most likely tokens and their log-probabilities (top-K only);
    - `base_logps` `(N,)`: log mu_base of the sampled token, log_softmax(logits / T) before any truncation or
      penalty, stored only when the sampler's chain did more than temperature (the trainer's pi is that
      distribution, so the divergence compares like with like). The top-K is then taken under mu_base too.

    `rollout_logprobs` holds GRPOTrainer's float lists after its tool-call stitching, for `batch_tensors`.
    """

    topk: int = 0
    rows: int = 0
    _sampled: list[torch.Tensor] = field(default_factory=list)
    _top_ids: list[torch.Tensor] = field(default_factory=list)
    _top_logps: list[torch.Tensor] = field(default_factory=list)
    _base: list[torch.Tensor | None] = field(default_factory=list)
    rollout_logprobs: list[list[float]] | None = None

    def add(
        self,
        sampled_logps: torch.Tensor,
        top_ids: torch.Tensor | None = None,
        top_logps: torch.Tensor | None = None,
        base_logps: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Store one backend call's records `(N, ...)`; returns the sampled log-probabilities tagged with rows."""
        tagged = tag_logps(sampled_logps, self.rows)
        self._sampled.append(sampled_logps.detach().float().cpu())
        if self.topk:
            self._top_ids.append(top_ids.detach().to(device="cpu", dtype=torch.int32))
            self._top_logps.append(top_logps.detach().float().cpu())
        self._base.append(None if base_logps is None else base_logps.detach().float().cpu())
        self.rows += sampled_logps.numel()
        return tagged

    @property
    def has_base(self) -> bool:
        return any(b is not None for b in self._base)

    @property
    def needed(self) -> bool:
        """Whether the batch needs anything beyond `sampling_per_token_logps` (else tokens need carry no row)."""
        return bool(self.topk) or self.has_base

    def batch_tensors(self, completion_ids: torch.Tensor, sampling_logps: torch.Tensor) -> dict[str, torch.Tensor]:
        """The batch keys for the trainer, aligned with `completion_ids` `(B, T)`.

        `sampler_kept_ids` `(B, T, K + 1)` long and `sampler_kept_logps` `(B, T, K + 1)` float32: the top-K, then the
        sampled token when it is not among them (else an empty slot, id -1 and log-prob -inf); `sampler_base_logps`
        `(B, T)` when mu_base was recorded. Tokens without a row (tool results, padding) get empty slots.
        """
        if not self.needed:
            return {}
        device = completion_ids.device
        if self.rows:  # else a custom rollout produced the batch: its floats carry no rows
            if self.rollout_logprobs is None:
                raise RuntimeError("The generation batch's log-probability lists were not kept; `_generate` does.")
            rows = tagged_rows(self.rollout_logprobs, completion_ids.size(1))
            if rows.max().item() >= self.rows:
                raise RuntimeError("A log-probability carries a row this generation batch never recorded.")
        else:
            rows = torch.full(completion_ids.shape, -1, dtype=torch.long)
        has_row = rows >= 0
        index = rows.clamp_min(0)
        out = {}
        if self.has_base:
            base = torch.cat([s if b is None else b for s, b in zip(self._sampled, self._base)])[index]
            base = torch.where(has_row, base, sampling_logps.cpu())
            out["sampler_base_logps"] = base.to(device)
            sampled_logps = base
        else:
            sampled_logps = sampling_logps.cpu()
        if self.topk:
            if self.rows:
                top_ids = torch.cat(self._top_ids)[index].long()
                top_logps = torch.cat(self._top_logps)[index]
            else:
                top_ids = torch.zeros(*rows.shape, self.topk, dtype=torch.long)
                top_logps = torch.zeros(*rows.shape, self.topk)
            top_ids.masked_fill_(~has_row[..., None], VOID_ID)
            top_logps.masked_fill_(~has_row[..., None], -math.inf)
            tokens = completion_ids.cpu()
            no_extra = (top_ids == tokens[..., None]).any(-1) | ~has_row
            extra_ids = tokens.masked_fill(no_extra, VOID_ID)
            extra_logps = sampled_logps.float().masked_fill(no_extra, -math.inf)
            out["sampler_kept_ids"] = torch.cat([top_ids, extra_ids[..., None]], -1).to(device)
            out["sampler_kept_logps"] = torch.cat([top_logps, extra_logps[..., None]], -1).to(device)
        return out
